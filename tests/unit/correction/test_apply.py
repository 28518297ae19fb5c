"""apply_correction: composition of IS, RS and diagnostics from a config; every preset runs."""

from __future__ import annotations

import math

import pytest
import torch

import correction
from correction import PRESETS, CorrectionConfig, RejectionRule, apply_correction

from . import reference
from .conftest import make_batch


@pytest.mark.usefixtures("block_size")
def test_combines_is_rs_and_diagnostics_like_the_parts() -> None:
    train, rollout, mask = make_batch(batch=8, length=10, scale=0.4, seed=7)
    lr = train - rollout
    rules = (RejectionRule("token_k1", 2.0), RejectionRule("seq_mean_k3", 0.05))
    cfg = CorrectionConfig(is_level="token", is_threshold=1.5, rs_rules=rules)  # type: ignore[arg-type]  # str converts
    out = apply_correction(cfg, lr, mask, rollout_log_probs=rollout)

    keep = mask.clone()
    for rule in rules:
        keep = keep * reference.rs_keep(lr, mask, rule.option.value, rule.upper, rule.lower)
    torch.testing.assert_close(out.response_mask, keep)
    w_ref = reference.is_weights(lr, mask, "token", 1.5) * keep  # zero where rejected
    assert out.weights is not None
    torch.testing.assert_close(out.weights, w_ref)

    _, is_m = correction.is_weights(lr, mask, "token", 1.5)
    _, rs_m = correction.rejection_mask(lr, mask, rules)
    diag = correction.offpolicy_metrics(train, rollout, mask)
    for part in (is_m, rs_m, diag):
        for key, value in part.items():
            assert out.metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_metric_names_are_stable() -> None:
    train, rollout, mask = make_batch(seed=8)
    cfg = correction.preset("decoupled_seq_is_rs")
    out = apply_correction(cfg, train - rollout, mask, rollout_log_probs=rollout)
    expected = {
        "is_weight_mean",
        "is_weight_max",
        "is_weight_min",
        "is_weight_std",
        "is_frac_truncated",
        "is_ess",
        "rs_masked_frac_token/seq_sum_k1",
        "rs_masked_frac_seq/seq_sum_k1",
        "rs_masked_frac_token",
        "rs_masked_frac_seq",
        *correction.DIAGNOSTIC_NAMES,
    }
    assert set(out.metrics) == expected
    assert all(isinstance(v, float) for v in out.metrics.values())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_runs(name: str) -> None:
    train, rollout, mask = make_batch(seed=9)
    cfg = correction.preset(name)
    staleness = torch.arange(mask.shape[0]) % 4  # used by the staleness-adaptive presets
    out = apply_correction(
        cfg, train - rollout, mask, rollout_log_probs=rollout, staleness=staleness
    )
    assert (out.weights is None) == (cfg.is_level is None)
    assert out.response_mask.shape == mask.shape
    assert (out.response_mask <= mask).all()
    if out.weights is not None:
        assert (out.weights[out.response_mask == 0] == 0).all()
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_disabled_returns_the_mask_untouched() -> None:
    train, rollout, mask = make_batch(seed=10)
    out = apply_correction(correction.preset("disabled"), train - rollout, mask)
    assert out.response_mask is mask and out.weights is None
    assert out.metrics == {"rs_masked_frac_token": 0.0, "rs_masked_frac_seq": 0.0}


def test_mask_dtype_is_preserved() -> None:
    train, rollout, mask = make_batch(seed=11)
    for dtype in (torch.bool, torch.int64, torch.float32):
        out = apply_correction(correction.preset("icepop"), train - rollout, mask.to(dtype))
        assert out.response_mask.dtype == dtype


@pytest.mark.usefixtures("block_size")
def test_fused_log_prob_inputs_match_the_log_ratio_path() -> None:
    train, rollout, mask = make_batch(batch=8, length=10, scale=0.4, seed=12)
    cfg = correction.preset("decoupled_seq_is_rs")
    fused = apply_correction(cfg, None, mask, rollout_log_probs=rollout, train_log_probs=train)
    plain = apply_correction(cfg, train - rollout, mask, rollout_log_probs=rollout)
    assert fused.weights is not None and plain.weights is not None
    torch.testing.assert_close(fused.weights, plain.weights)
    torch.testing.assert_close(fused.response_mask, plain.response_mask)
    assert fused.metrics == pytest.approx(plain.metrics)


def test_fused_path_names_the_bad_input_and_needs_both_tensors() -> None:
    train, rollout, mask = make_batch(seed=13)
    cfg = correction.preset("icepop")
    bad = train.clone()
    bad[4, 0] = math.nan
    with pytest.raises(ValueError, match=r"train_log_probs .*\[b, t\] = \[4, 0\]"):
        apply_correction(cfg, None, mask, rollout_log_probs=rollout, train_log_probs=bad)
    with pytest.raises(ValueError, match="both train_log_probs and rollout_log_probs"):
        apply_correction(cfg, None, mask, rollout_log_probs=rollout)
