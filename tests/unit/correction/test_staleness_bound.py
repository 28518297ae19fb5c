"""The staleness-adaptive sequence bound against a loop written from its definition."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import correction
from tests.unit.correction.conftest import make_batch


def reference(
    log_ratio: torch.Tensor, mask: torch.Tensor, staleness: list[int], floor: float, c: float
) -> tuple[torch.Tensor, float]:
    drift, rows = {}, []
    for b in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[b, t] > 0]
        if ts:
            drift[b] = abs(sum(float(log_ratio[b, t]) for t in ts) / len(ts))
            rows.append(b)
    ratios = [drift[b] / staleness[b] for b in rows if staleness[b] >= 1]
    kappa = statistics.median_low(ratios) if ratios else 0.0
    keep = mask.clone()
    for b in rows:
        if drift[b] > floor + c * kappa * staleness[b]:
            keep[b] = 0
    return keep, kappa


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("multiplier", [0.5, 2.0])
def test_matches_the_reference(seed: int, multiplier: float) -> None:
    train, rollout, mask = make_batch(batch=9, length=7, scale=0.3, seed=seed)
    stale = [
        int(s) for s in torch.randint(0, 9, (9,), generator=torch.Generator().manual_seed(seed))
    ]
    ratio = train - rollout
    keep, m = correction.staleness_bound_mask(
        ratio, mask, torch.tensor(stale), floor=0.001, multiplier=multiplier
    )
    expected, kappa = reference(ratio, mask, stale, 0.001, multiplier)
    assert torch.equal(keep, expected)
    assert m["stale_rs_drift_per_version"] == pytest.approx(kappa)


def test_the_bound_grows_with_staleness_so_stale_samples_are_kept() -> None:
    """Drift proportional to staleness: a fixed geometric bound drops them all, this keeps them."""
    s = torch.arange(1, 9)
    mask = torch.ones(8, 5)
    ratio = (0.01 * s.float()).unsqueeze(1).expand(8, 5).clone()
    keep, m = correction.staleness_bound_mask(ratio, mask, s, floor=0.001, multiplier=2.0)
    assert torch.equal(keep, mask) and m["stale_rs_masked_frac_seq"] == 0.0
    geo = correction.RejectionRule("seq_mean_k1", upper=1.001, lower=0.999)
    assert correction.rejection_mask(ratio, mask, geo)[0].sum() == 0
    ratio[3] = 0.5  # an outlier for its staleness (4): 12x the typical drift
    keep, m = correction.staleness_bound_mask(ratio, mask, s, floor=0.001, multiplier=2.0)
    assert keep[3].sum() == 0 and keep.sum() == 35
    assert m["stale_rs_drift_per_version"] == pytest.approx(0.01)


def test_fresh_samples_face_the_floor_and_inputs_are_checked() -> None:
    mask = torch.ones(2, 3)
    ratio = torch.tensor([[0.0005] * 3, [0.002] * 3])
    keep, _ = correction.staleness_bound_mask(ratio, mask, torch.zeros(2, dtype=torch.long))
    assert keep.tolist() == [[1.0] * 3, [0.0] * 3]
    with pytest.raises(ValueError, match=r"staleness has shape \(3,\)"):
        correction.staleness_bound_mask(ratio, mask, torch.zeros(3))
    with pytest.raises(ValueError, match="multiplier must be a finite number > 0"):
        correction.staleness_bound_mask(ratio, mask, torch.zeros(2), multiplier=math.inf)


def test_apply_correction_needs_the_staleness() -> None:
    cfg = correction.preset("decoupled_token_is_stale_rs")
    with pytest.raises(ValueError, match="pass staleness="):
        correction.apply_correction(cfg, torch.zeros(2, 3), torch.ones(2, 3))
    out = correction.apply_correction(
        cfg, torch.zeros(2, 3), torch.ones(2, 3), staleness=torch.tensor([0, 3])
    )
    assert out.metrics["stale_rs_masked_frac_seq"] == 0.0 and out.weights is not None
