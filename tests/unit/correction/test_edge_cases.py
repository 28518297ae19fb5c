"""Edge cases: empty batches, all-padding rows, non-finite inputs, extreme ratios."""

from __future__ import annotations

import math

import pytest
import torch

import correction
from correction import CorrectionConfig, RejectionRule, RSOption, apply_correction, check_finite

ALL_RULES = tuple(RejectionRule(o, 2.0 if o.is_k1 else 0.5) for o in RSOption)
FULL = CorrectionConfig(is_level="token", rs_rules=ALL_RULES)  # type: ignore[arg-type]  # str converts


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_empty_batch(shape: tuple[int, int], level: str) -> None:
    lr = torch.zeros(shape)
    mask = torch.zeros(shape)
    cfg = CorrectionConfig(is_level=level, rs_rules=ALL_RULES)  # type: ignore[arg-type]  # str converts
    out = apply_correction(cfg, lr, mask, rollout_log_probs=lr)
    assert out.weights is not None and out.weights.shape == shape
    assert out.response_mask.shape == shape
    assert all(v == 0.0 for v in out.metrics.values()), out.metrics


def test_rows_without_valid_tokens_get_zero_weight_and_do_not_count() -> None:
    lr = torch.tensor([[0.5, 0.1], [3.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    for level in ("token", "sequence", "geometric"):
        w, m = correction.is_weights(lr, mask, level, threshold=10.0)
        assert (w[1] == 0).all()
        ref, _ = correction.is_weights(lr[:1], mask[:1], level, threshold=10.0)
        torch.testing.assert_close(w[:1], ref)
        assert m["is_weight_min"] > 0
    _, m = correction.rejection_mask(lr, mask, ALL_RULES)
    assert 0.0 <= m["rs_masked_frac_seq"] <= 1.0
    diag = correction.offpolicy_metrics(lr, torch.zeros_like(lr), mask)
    one = correction.offpolicy_metrics(lr[:1], torch.zeros(1, 2), mask[:1])
    assert diag == pytest.approx(one)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_on_a_response_token_names_tensor_and_position(bad: float) -> None:
    lr = torch.zeros(4, 6)
    lr[2, 3] = bad
    with pytest.raises(
        ValueError, match=r"log_ratio has a non-finite value .* at \[b, t\] = \[2, 3\]"
    ):
        apply_correction(FULL, lr, torch.ones(4, 6))


@pytest.mark.usefixtures("block_size")
def test_position_is_global_when_blocked() -> None:
    lr = torch.zeros(6, 4)
    lr[5, 1] = math.nan
    with pytest.raises(ValueError, match=r"\[b, t\] = \[5, 1\]"):
        correction.is_weights(lr, torch.ones(6, 4))


@pytest.mark.usefixtures("block_size")
def test_nonfinite_values_in_padding_are_ignored() -> None:
    lr = torch.tensor([[0.1, -0.2, math.nan], [0.3, -math.inf, math.inf]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    clean = torch.where(mask > 0, lr, 0.0)
    rollout = torch.where(mask > 0, torch.full_like(lr, -1.0), math.nan)
    got = apply_correction(FULL, lr, mask, rollout_log_probs=rollout)
    ref = apply_correction(FULL, clean, mask, rollout_log_probs=torch.full_like(lr, -1.0))
    assert got.weights is not None and ref.weights is not None
    torch.testing.assert_close(got.weights, ref.weights)
    torch.testing.assert_close(got.response_mask, ref.response_mask)
    assert got.metrics == pytest.approx(ref.metrics)


def test_extreme_ratios_stay_finite() -> None:
    lr = torch.tensor([[50.0, -50.0, 1e4, -1e4], [30.0, 30.0, 30.0, 30.0]])
    mask = torch.ones(2, 4)
    for level in ("token", "sequence", "geometric"):
        cfg = CorrectionConfig(is_level=level, is_batch_normalize=True, rs_rules=ALL_RULES)  # type: ignore[arg-type]  # str converts
        out = apply_correction(cfg, lr, mask, rollout_log_probs=torch.full_like(lr, -2.0))
        assert out.weights is not None and torch.isfinite(out.weights).all()
        assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics
    w, m = correction.is_weights(lr, mask, "token", threshold=2.0)
    assert w[0, 1].item() == pytest.approx(math.exp(-20.0), rel=1e-4)  # clamped at −20, still > 0
    assert m["is_weight_max"] == 2.0


def test_check_finite_public_helper() -> None:
    t = torch.tensor([[0.0, math.nan], [1.0, 2.0]])
    check_finite("x", t, torch.tensor([[1, 0], [1, 1]]))  # NaN only where mask is 0
    with pytest.raises(
        ValueError, match=r"x has a non-finite value \(nan\) at \[b, t\] = \[0, 1\]"
    ):
        check_finite("x", t)


def test_shape_mismatch_is_reported() -> None:
    with pytest.raises(
        ValueError, match=r"log_ratio has shape \(2, 3\) and response_mask \(2, 4\)"
    ):
        correction.is_weights(torch.zeros(2, 3), torch.zeros(2, 4))


@pytest.mark.usefixtures("block_size")
def test_scratch_reuse_across_shapes_dtypes_and_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from . import reference
    from .conftest import make_batch

    cases = [
        make_batch(batch=b, length=t, seed=s) for s, (b, t) in enumerate([(3, 5), (9, 40), (2, 3)])
    ]

    def run(case: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
        train, rollout, mask = (x.to(dtype) for x in case)
        w, _ = correction.is_weights(train - rollout, mask, "token", threshold=1.5)
        expected = reference.is_weights(train.double() - rollout.double(), mask, "token", 1.5)
        torch.testing.assert_close(w.double(), expected, rtol=1e-5, atol=1e-6)

    for dtype in (torch.float32, torch.float64, torch.float32):
        for case in cases:
            run(case, dtype)
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(run, case, torch.float32) for case in cases * 4]
        for future in futures:
            future.result(timeout=60)
