"""Masked tensor statistics and group bookkeeping shared by the algorithms.

Every function here treats ``mask`` as 0/1 weights over the same shape as the values and
computes in float32 (bf16 statistics drift), so callers can pass model-dtype tensors.
Empty masks never produce NaN: a masked mean over nothing is 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "group_ids",
    "group_stats",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values * mask`` over ``dim`` (all dims when None), in float32."""
    prod = values.float() * mask.float()
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1, over ``dim`` (all dims when None); 0 if empty."""
    m = mask.float()
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(values, m, dim) / count.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries (scalar). Bessel-corrected when ``unbiased`` and count > 1."""
    m = mask.float()
    mean = masked_mean(values, m)
    var = masked_mean((values.float() - mean) ** 2, m)
    count = m.sum()
    if unbiased and count > 1:
        var = var * count / (count - 1)
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean/var over the masked entries; zero where mask is 0.

    Args:
        values: ``[B, T]`` values to whiten.
        mask: ``[B, T]`` 0/1; statistics use only entries where it is 1.
        shift_mean: when False the mean is added back (scale-only whitening).
    """
    m = mask.float()
    mean = masked_mean(values, m)
    var = masked_var(values, m)
    out = (values.float() - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def group_ids(index: Sequence[object] | torch.Tensor, batch_size: int) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids to dense ints.

    Args:
        index: length-B sequence of group ids (strings, ints, a numpy array or a tensor).
        batch_size: B, checked against ``len(index)``.

    Returns:
        ``(ids [B] long, num_groups)`` with ids in ``[0, num_groups)`` in first-seen order.
    """
    items = index.tolist() if hasattr(index, "tolist") else list(index)  # pyright: ignore[reportAttributeAccessIssue] -- numpy arrays and tensors both have tolist()
    if len(items) != batch_size:
        raise ValueError(
            f"index has {len(items)} group ids but the batch has {batch_size} rows; "
            "pass one group id (e.g. the batch's `uid`) per sequence"
        )
    dense: dict[object, int] = {}
    ids = [dense.setdefault(item, len(dense)) for item in items]
    return torch.tensor(ids, dtype=torch.long), len(dense)


def group_stats(
    scores: torch.Tensor, ids: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group size, group mean and unbiased group std of ``scores`` ``[B]``.

    Returns three ``[B]`` float64 tensors (each row gets its group's statistic). Float64 because
    these are B numbers and ``s − mean`` of a group of equal scores must be exactly 0 before it
    is divided by a std of 0 + ε. The std of a group of one is 0 (callers give such groups
    advantage 0 anyway).
    """
    s = scores.double()
    ids = ids.to(s.device)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=s.device)
    count = zeros.clone().index_add_(0, ids, torch.ones_like(s))
    mean = zeros.clone().index_add_(0, ids, s) / count
    sq = zeros.clone().index_add_(0, ids, (s - mean[ids]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1.0))
    return count[ids], mean[ids], std[ids]
