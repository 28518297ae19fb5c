"""A sequence bound that widens with the sample's measured staleness (staleness-adaptive RS).

Why it exists: a fixed bound serves one gap only. The geometric RS bound [0.999, 1.001] is right
for a training/inference kernel mismatch but, under staleness, rejected half the sequences at
staleness 1 and 85-93 % beyond (docs/training.md, the staleness ablation): the run learned from
almost nothing. A bound loose enough for staleness 8 does nothing against a mismatch. Here each
sequence's bound is set from its own staleness and from the drift measured in the same batch.

With d_i = |Σ_t m_t ℓ_t / Σ_t m_t| (the magnitude of the log geometric-mean ratio, the statistic of
geometric RS; ℓ clamped to ±20) and s_i the sequence's staleness (trainer version − the oldest
version among its sampled tokens):

- the drift per version of staleness is measured as κ = the lower median of d_i / s_i over the
  valid sequences with s_i ≥ 1 (0 when there are none);
- sequence i is kept iff d_i ≤ floor + multiplier · κ · s_i.

So fresh samples (s = 0) face the ``floor`` (a mismatch bound, like geometric RS), and a sample s
versions old is rejected only when it drifted more than ``multiplier`` times the batch's typical
drift for its age: the rule removes outliers, not the stale samples as such, and the fraction it
rejects does not grow with staleness. (Our own design; no peer ships it. The ablation in
docs/training.md measures it next to the peers' variants.)
"""

from __future__ import annotations

import math

import torch

from correction._common import LOG_RATIO_BOUND, check_finite, check_pair

__all__ = ["staleness_bound_mask"]


def _check(name: str, value: float, *, positive: bool) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        need = "> 0" if positive else ">= 0"
        raise ValueError(f"staleness bound {name} must be a finite number {need}, got {value!r}")
    return float(value)


def staleness_bound_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    staleness: torch.Tensor,
    *,
    floor: float = 0.001,
    multiplier: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The staleness-adaptive sequence mask (see the module docstring).

    Args:
        log_ratio: ``[B, T]`` ℓ (padding ignored; non-finite on response tokens raises).
        response_mask: ``[B, T]`` 0/1.
        staleness: ``[B]`` integer staleness s_i ≥ 0 of each sequence.
        floor: the bound on d_i at staleness 0 (log space; 0.001 ≈ a ratio in [0.999, 1.001]).
        multiplier: how many times the measured drift per version a sequence may drift (> 0).

    Returns:
        ``(mask, metrics)``: ``mask`` ``[B, T]`` in ``response_mask``'s dtype (a subset of it;
        whole sequences). Metrics: ``stale_rs_masked_frac_seq`` and
        ``stale_rs_masked_frac_token`` (of valid sequences / tokens),
        ``stale_rs_drift_per_version`` (κ), ``stale_rs_bound_mean`` (mean bound over valid
        sequences) and ``stale_rs_staleness_mean``.

    Example::

        keep, m = staleness_bound_mask(old_lp - rollout_lp, mask, staleness, multiplier=2.0)
    """
    check_pair("log_ratio", log_ratio, response_mask)
    floor = _check("floor", floor, positive=False)
    multiplier = _check("multiplier", multiplier, positive=True)
    if staleness.dim() != 1 or staleness.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"staleness has shape {tuple(staleness.shape)}; it must be [B] with "
            f"B = {response_mask.shape[0]} (one staleness per sequence)"
        )
    valid = response_mask > 0
    check_finite("log_ratio", log_ratio, valid)
    m = valid.to(torch.float64)
    ell = torch.where(valid, log_ratio.detach().to(torch.float64), 0.0)
    ell = ell.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    lengths = m.sum(dim=1)
    rows = lengths > 0
    drift = ((ell * m).sum(dim=1) / lengths.clamp(min=1.0)).abs()
    s = staleness.detach().to(device=drift.device, dtype=torch.float64).clamp(min=0.0)
    stale = rows & (s >= 1)
    kappa = float((drift[stale] / s[stale]).median()) if bool(stale.any()) else 0.0
    bound = floor + multiplier * kappa * s
    drop_rows = rows & (drift > bound)
    keep = valid & ~drop_rows.unsqueeze(1)
    n_rows = max(int(rows.sum()), 1)
    metrics = {
        "stale_rs_masked_frac_seq": float(drop_rows.sum()) / n_rows,
        "stale_rs_masked_frac_token": float((valid & ~keep).sum()) / max(int(valid.sum()), 1),
        "stale_rs_drift_per_version": kappa,
        "stale_rs_bound_mean": float(bound[rows].mean()) if bool(rows.any()) else 0.0,
        "stale_rs_staleness_mean": float(s[rows].mean()) if bool(rows.any()) else 0.0,
    }
    return keep.to(response_mask.dtype), metrics
