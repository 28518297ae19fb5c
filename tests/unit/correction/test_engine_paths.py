"""Paths of the blocked pass that the formula tests do not single out: the float32 exp (exp2 of
−ℓ·(−log2 e)), the truncation count skipped in blocks where no ρ can exceed C, and the fused
rollout/log-ratio formation from log-probs vs from a caller-made log-ratio."""

from __future__ import annotations

import math

import pytest
import torch

from correction import CorrectionConfig, RejectionRule, RSOption, apply_correction, is_weights

from . import reference

CONFIG = CorrectionConfig(
    is_level="token",  # type: ignore[arg-type]  # str converts
    is_threshold=2.0,
    rs_rules=(
        RejectionRule(RSOption.TOKEN_K1, upper=2.0),
        RejectionRule(RSOption.SEQ_MEAN_K3, upper=0.01),
    ),
)


def _batch(batch: int = 12, length: int = 40, scale: float = 0.4, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3.0
    train = rollout + torch.randn(batch, length, generator=gen, dtype=torch.float64) * scale
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return train, rollout, mask


@pytest.mark.usefixtures("block_size")
def test_float32_pass_matches_float64_within_exp_rounding() -> None:
    train, rollout, mask = _batch()
    train[0, 0] = rollout[0, 0] + 25.0  # beyond the bound: clamped before exp
    mask[0, 0] = 1.0
    exact = apply_correction(CONFIG, None, mask, rollout_log_probs=rollout, train_log_probs=train)
    f32 = apply_correction(
        CONFIG,
        None,
        mask.float(),
        rollout_log_probs=rollout.float(),
        train_log_probs=train.float(),
    )
    assert exact.weights is not None and f32.weights is not None
    # ρ = exp2(−ℓ·(−log2 e)) in float32: relative error ≤ |ℓ|·6e-8 + 1 ulp
    torch.testing.assert_close(f32.weights.double(), exact.weights, rtol=3e-6, atol=1e-7)
    torch.testing.assert_close(f32.response_mask.double(), exact.response_mask)
    for key, value in exact.metrics.items():
        assert f32.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_float32_on_policy_is_exactly_neutral() -> None:
    _, rollout, mask = _batch()
    out = apply_correction(
        CONFIG,
        None,
        mask.float(),
        rollout_log_probs=rollout.float(),
        train_log_probs=rollout.float(),
    )
    assert out.weights is not None
    torch.testing.assert_close(out.weights, mask.float(), rtol=0, atol=0)
    for key in (
        "kl",
        "k3_kl",
        "chi2_token",
        "chi2_seq",
        "is_frac_truncated",
        "rs_masked_frac_token",
    ):
        assert out.metrics[key] == 0.0, key
    assert out.metrics["is_weight_mean"] == 1.0


@pytest.mark.usefixtures("block_size")
@pytest.mark.parametrize("threshold", [0.8, 1.0, 2.0])
def test_truncation_count_with_and_without_the_skip(threshold: float) -> None:
    # rows 0-3 far below log C (their blocks skip the count), the rest with ratios above C
    train, rollout, mask = _batch(batch=16, length=8, scale=0.05)
    train[:4] = rollout[:4] - 1.0
    train[8:, 0] = rollout[8:, 0] + 1.5
    mask[8:, 0] = 1.0
    lr = (train - rollout).float()
    w, m = is_weights(lr, mask.float(), "token", threshold=threshold)
    valid = [x for row in reference.rows(lr.double(), mask) for x in row]
    expected = sum(math.exp(x) > threshold for x in valid) / len(valid)
    assert m["is_frac_truncated"] == pytest.approx(expected, abs=1e-12)
    expected_w = reference.is_weights(lr.double(), mask, "token", threshold)
    torch.testing.assert_close(w.double(), expected_w, rtol=3e-6, atol=1e-7)


@pytest.mark.usefixtures("block_size")
def test_log_probs_and_log_ratio_inputs_agree() -> None:
    train, rollout, mask = _batch()
    from_log_probs = apply_correction(
        CONFIG, None, mask, rollout_log_probs=rollout, train_log_probs=train
    )
    from_ratio = apply_correction(CONFIG, train - rollout, mask, rollout_log_probs=rollout)
    assert from_log_probs.weights is not None and from_ratio.weights is not None
    torch.testing.assert_close(from_log_probs.weights, from_ratio.weights, rtol=0, atol=0)
    torch.testing.assert_close(from_log_probs.response_mask, from_ratio.response_mask)
    assert from_log_probs.metrics == pytest.approx(from_ratio.metrics, rel=1e-12, abs=1e-15)
