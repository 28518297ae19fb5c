"""M2PO: a second-moment trust region that masks only the most off-policy tokens of a batch.

Reference: Zheng, Zhao and Chen, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with
Stale Data on LLMs?" (M2PO, arXiv 2510.01161), in the form AReaL implements it
(``areal/trainer/ppo/actor.py``: ``_apply_m2po_masking`` and ``_get_m2po_loss_mask``, option
``actor.m2_threshold``; 0.04 in its GSM8K example).

With ℓ_t the log-ratio of the N valid tokens of the batch, the second moment is
M̂₂ = (1/N) Σ_t ℓ_t². M2PO keeps the batch's M̂₂ under a bound τ by masking the tokens with the
largest ℓ², fewest first: sort the ℓ² in descending order and mask the first k, with k the smallest
number for which the mean of the remaining N − k values is < τ (k = 0 when M̂₂ < τ already). If no
such k < N exists (every single ℓ² is ≥ τ) the smallest one is kept, as in AReaL: M2PO alone never
masks a whole batch. Ties are broken by position (a stable sort), so the mask is deterministic.

Unlike a fixed per-token bound, this masks only as much as the batch's own spread requires: a few
extreme outliers of a stale batch go, the bulk of it stays. AReaL applies the mask per micro-batch
with ℓ = log π_prox − log π_behave; here it is computed over the whole training batch (so it does
not depend on micro-batching) with the correction's ℓ (log π_old − log π_rollout in decoupled mode,
log π_θ − log π_rollout in bypass mode).
"""

from __future__ import annotations

import math

import torch

from correction._common import check_finite, check_pair

__all__ = ["m2po_mask"]


def _check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, int | float):
        raise ValueError(f"m2po threshold must be a number > 0 (e.g. 0.04), got {threshold!r}")
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"m2po threshold must be finite and > 0 (e.g. 0.04), got {threshold!r}")
    return float(threshold)


def _kept_in_sorted_order(sorted_sq: torch.Tensor, threshold: float) -> int:
    """How many of the largest values (``sorted_sq`` descending) are masked."""
    n = sorted_sq.numel()
    suffix_sums = sorted_sq.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, dtype=sorted_sq.dtype, device=sorted_sq.device)
    below = torch.nonzero(suffix_sums / counts < threshold)
    return int(below[0]) if below.numel() else n - 1


def m2po_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, threshold: float = 0.04
) -> tuple[torch.Tensor, dict[str, float]]:
    """The M2PO token mask of a batch (see the module docstring).

    Args:
        log_ratio: ``[B, T]`` ℓ (padding values are ignored; a non-finite value on a response
            token raises ``ValueError`` naming the position).
        response_mask: ``[B, T]`` 0/1.
        threshold: τ, the bound on the mean ℓ² of the kept tokens (> 0).

    Returns:
        ``(mask, metrics)``: ``mask`` ``[B, T]`` in ``response_mask``'s dtype, 1 where a token is
        kept (a subset of ``response_mask``). Metrics: ``m2po_m2`` (M̂₂ of the valid tokens),
        ``m2po_m2_kept`` (of the kept ones), ``m2po_masked_frac_token`` (fraction of valid tokens
        masked) and ``m2po_masked_frac_seq`` (fraction of valid sequences that lost ≥ 1 token).

    Example::

        keep, m = m2po_mask(old_lp - rollout_lp, response_mask, threshold=0.04)
    """
    check_pair("log_ratio", log_ratio, response_mask)
    tau = _check_threshold(threshold)
    valid = response_mask > 0
    check_finite("log_ratio", log_ratio, valid)
    sq = log_ratio.detach().to(torch.float64)[valid].square()
    n = sq.numel()
    if n == 0:
        zeros = ("m2po_m2", "m2po_m2_kept", "m2po_masked_frac_token", "m2po_masked_frac_seq")
        return response_mask.clone(), dict.fromkeys(zeros, 0.0)
    sorted_sq, order = torch.sort(sq, descending=True, stable=True)
    k = _kept_in_sorted_order(sorted_sq, tau)
    keep_sorted = torch.arange(n, device=sq.device) >= k
    keep_flat = torch.empty_like(keep_sorted)
    keep_flat[order] = keep_sorted
    keep = torch.zeros_like(valid)
    keep[valid] = keep_flat
    rows = valid.any(dim=1)
    lost = (valid & ~keep).any(dim=1)
    metrics = {
        "m2po_m2": float(sq.mean()),
        "m2po_m2_kept": float(sorted_sq[k:].mean()),
        "m2po_masked_frac_token": k / n,
        "m2po_masked_frac_seq": float(lost.sum()) / max(int(rows.sum()), 1),
    }
    return keep.to(response_mask.dtype), metrics
