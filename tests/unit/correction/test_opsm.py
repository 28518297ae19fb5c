"""OPSM's mask against a loop written from DeepSeek-V3.2's equation 9 (slime's and TRL's form)."""

from __future__ import annotations

import math

import pytest
import torch

import correction
from tests.unit.correction.conftest import make_batch


def reference_opsm(
    log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, delta: float
) -> torch.Tensor:
    """M_{i,t} = 0 iff A_{i,t} < 0 and (1/|o_i|) Σ_t log(π_rollout/π_train) > δ."""
    keep = mask.clone()
    for b in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[b, t] > 0]
        if not ts:
            continue
        kl = sum(-float(log_ratio[b, t]) for t in ts) / len(ts)
        for t in ts:
            if float(adv[b, t]) < 0 and kl > delta:
                keep[b, t] = 0
    return keep


def _advantages(shape: tuple[int, int], seed: int, per_token: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if per_token:
        return torch.randn(shape, generator=gen, dtype=torch.float64)
    return torch.randn(shape[0], 1, generator=gen, dtype=torch.float64).expand(shape).clone()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("delta", [0.0, 0.02, 0.1])
@pytest.mark.parametrize("per_token", [False, True], ids=["per-sequence-A", "per-token-A"])
def test_matches_the_reference(seed: int, delta: float, per_token: bool) -> None:
    train, rollout, mask = make_batch(batch=7, length=8, scale=0.4, seed=seed)
    ratio = train - rollout
    adv = _advantages(tuple(mask.shape), seed, per_token)
    keep, metrics = correction.opsm_mask(ratio, adv, mask, delta)
    assert torch.equal(keep, reference_opsm(ratio, adv, mask, delta))
    dropped = (mask > 0) & (keep == 0)
    assert metrics["opsm_masked_frac_token"] == pytest.approx(float(dropped.sum() / mask.sum()))
    assert not bool(dropped[adv >= 0].any())  # a non-negative advantage is never masked


def test_per_sequence_advantages_in_any_shape_and_padding() -> None:
    train, rollout, mask = make_batch(batch=6, length=5, scale=0.6, seed=2)
    ratio = train - rollout
    adv_row = torch.tensor([-1.0, 1.0, -0.5, -2.0, 0.0, -1.0], dtype=torch.float64)
    full, _ = correction.opsm_mask(ratio, adv_row.unsqueeze(1).expand_as(mask), mask, 0.01)
    for shaped in (adv_row, adv_row.unsqueeze(1)):
        assert torch.equal(correction.opsm_mask(ratio, shaped, mask, 0.01)[0], full)
    dirty = ratio.masked_fill(mask == 0, math.nan)
    assert torch.equal(correction.opsm_mask(dirty, adv_row, mask, 0.01)[0], full)
    # whole rows go: a sequence keeps all of its tokens or none
    assert all(
        bool((full[b][mask[b] > 0] == full[b][mask[b] > 0][0]).all())
        for b in range(6)
        if mask[b].any()
    )


def test_threshold_and_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="opsm threshold must be finite and >= 0"):
        correction.opsm_mask(torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), -0.1)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        correction.opsm_mask(torch.zeros(2, 2), torch.zeros(3), torch.ones(2, 2), 0.1)
