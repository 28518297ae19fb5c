"""Sequence-level decisions from per-row statistics: sequence IS weights and sequence-scope
rejection rules.

Why it exists: sequence-level IS and sequence-scope RS need only the ``[B]`` per-row
statistics, never the ``[B, T]`` tensors, so both block kernels and the driver share this code
(the C kernel computes the statistics, the decisions are made here for both).

What it guarantees: float64 math; the log of a sequence weight is clamped to
±``LOG_RATIO_BOUND`` before ``exp``; sequences without valid tokens get weight 0 and always pass
the rules.
"""

from __future__ import annotations

import math

import torch

from correction._common import LOG_RATIO_BOUND
from correction.types import ISLevel, RejectionRule, RSOption

__all__ = ["seq_keep", "seq_stat", "seq_weights"]


def _k3_of(lr: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ℓ) − 1 − ℓ of a per-row ℓ (clamped to the bound)."""
    clamped = torch.clamp(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.expm1(clamped) - clamped


def seq_stat(option: RSOption, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[rows]`` the per-sequence statistic of a sequence-scope option (float64)."""
    length = rows["seq_len"].clamp(min=1.0)
    if option is RSOption.SEQ_MAX_K2:  # padding zeros never raise a max of a statistic >= 0
        lo, hi = rows["lr_min"], rows["lr_max"]
        return 0.5 * torch.maximum(lo * lo, hi * hi)
    if option is RSOption.SEQ_MAX_K3:  # k3 grows monotonically with |ℓ| on each side of 0
        return torch.maximum(_k3_of(rows["lr_min"]), _k3_of(rows["lr_max"]))
    if option.is_k1:
        total = -rows["seq_sum"]
    else:
        total = rows["k2_sum"] if option.value.endswith("k2") else rows["k3_sum"]
    return total if option.value.startswith("seq_sum") else total / length


def seq_keep(rule: RejectionRule, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[rows]`` bool: the sequence passes the rule (sequences without valid tokens pass)."""
    stat = seq_stat(rule.option, rows)
    if rule.option.is_k1:
        assert rule.lower is not None  # resolved in RejectionRule.__post_init__
        ok = (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
    else:
        ok = stat <= rule.upper
    return ok | (rows["seq_len"] == 0)


def seq_weights(
    level: ISLevel, threshold: float, seq_sum: torch.Tensor, seq_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows]`` float64 sequence-level IS weights and their truncation flags (bool)."""
    log_w = seq_sum / seq_len.clamp(min=1.0) if level is ISLevel.GEOMETRIC else seq_sum
    log_w = torch.clamp(log_w, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    seq_w = torch.where(seq_len > 0, torch.clamp(torch.exp(log_w), max=threshold), 0.0)
    return seq_w, (log_w > math.log(threshold)) & (seq_len > 0)
