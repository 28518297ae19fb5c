"""M2PO's mask against a loop written from the paper's rule (and AReaL's form of it)."""

from __future__ import annotations

import math

import pytest
import torch

import correction
from tests.unit.correction.conftest import make_batch


def reference_m2po(log_ratio: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """Mask the largest ℓ² (ties: earlier position first) until the rest's mean is < τ; keep at
    least one token."""
    cells = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t] > 0]
    sq = [float(log_ratio[b, t]) ** 2 for b, t in cells]
    order = sorted(range(len(cells)), key=lambda i: (-sq[i], i))
    k = len(cells) - 1
    for j in range(len(cells)):
        rest = [sq[i] for i in order[j:]]
        if sum(rest) / len(rest) < tau:
            k = j
            break
    keep = mask.clone()
    for i in order[:k]:
        keep[cells[i]] = 0
    return keep


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tau", [0.005, 0.04, 0.3])
def test_matches_the_reference(seed: int, tau: float) -> None:
    train, rollout, mask = make_batch(batch=6, length=9, scale=0.3, seed=seed)
    ratio = train - rollout
    keep, metrics = correction.m2po_mask(ratio, mask, tau)
    expected = reference_m2po(ratio, mask, tau)
    assert torch.equal(keep, expected)
    kept = ratio[keep > 0]
    n_valid = int(mask.sum())
    assert metrics["m2po_masked_frac_token"] == pytest.approx(1 - kept.numel() / n_valid)
    assert metrics["m2po_m2"] == pytest.approx(float(ratio[mask > 0].square().mean()))
    assert metrics["m2po_m2_kept"] == pytest.approx(float(kept.square().mean()))


def test_masks_the_fewest_tokens_that_bring_the_second_moment_under_the_bound() -> None:
    train, rollout, mask = make_batch(batch=8, length=12, scale=0.5, seed=3)
    ratio = train - rollout
    keep, m = correction.m2po_mask(ratio, mask, 0.04)
    assert 0 < m["m2po_masked_frac_token"] < 1
    assert m["m2po_m2_kept"] < 0.04 <= m["m2po_m2"]
    # the masked tokens are exactly the largest ℓ²; unmasking the smallest of them breaks the bound
    masked = ratio[(mask > 0) & (keep == 0)].square()
    kept = ratio[keep > 0].square()
    assert masked.min() >= kept.max()
    with_one_more = torch.cat([kept, masked.min().reshape(1)])
    assert with_one_more.mean() >= 0.04


def test_a_batch_under_the_bound_is_untouched_and_extreme_batches_keep_one_token() -> None:
    mask = torch.ones(3, 4)
    small = torch.full((3, 4), 0.01)
    keep, m = correction.m2po_mask(small, mask, 0.04)
    assert torch.equal(keep, mask) and m["m2po_masked_frac_token"] == 0.0
    huge = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 5.0
    keep, m = correction.m2po_mask(huge, mask, 0.04)
    assert int(keep.sum()) == 1 and keep[0, 0] == 1  # the smallest ℓ² survives
    assert m["m2po_masked_frac_seq"] == pytest.approx(1.0)


def test_padding_is_ignored_and_bad_values_are_named() -> None:
    train, rollout, mask = make_batch(seed=1)
    ratio = train - rollout
    dirty = ratio.masked_fill(mask == 0, math.nan)
    assert torch.equal(correction.m2po_mask(dirty, mask)[0], correction.m2po_mask(ratio, mask)[0])
    ratio[0, 0] = math.inf
    with pytest.raises(
        ValueError, match=r"log_ratio has a non-finite value \(inf\) at \[b, t\] = \[0, 0\]"
    ):
        correction.m2po_mask(ratio, mask)
    with pytest.raises(ValueError, match="m2po threshold must be finite and > 0"):
        correction.m2po_mask(torch.zeros(1, 1), torch.ones(1, 1), 0.0)
    keep, m = correction.m2po_mask(torch.zeros(2, 3), torch.zeros(2, 3))
    assert keep.sum() == 0 and set(m.values()) == {0.0}


def test_apply_correction_ands_it_with_the_rules_and_zeroes_the_weights() -> None:
    train, rollout, mask = make_batch(batch=8, length=12, scale=0.5, seed=4)
    cfg = correction.CorrectionConfig(
        is_level="token", m2po_threshold=0.04, rs_rules=(correction.RejectionRule("token_k1", 3.0),)
    )
    out = correction.apply_correction(cfg, train - rollout, mask, rollout)
    m2po, _ = correction.m2po_mask(train - rollout, mask, 0.04)
    rules = correction.apply_correction(
        correction.CorrectionConfig(rs_rules=cfg.rs_rules), train - rollout, mask
    ).response_mask
    assert torch.equal(out.response_mask, m2po * rules)
    assert out.weights is not None and bool((out.weights[out.response_mask == 0] == 0).all())
    assert out.metrics["m2po_masked_frac_token"] > 0
    fused = correction.apply_correction(
        cfg, None, mask, rollout_log_probs=rollout, train_log_probs=train
    )
    assert torch.equal(fused.response_mask, out.response_mask)
