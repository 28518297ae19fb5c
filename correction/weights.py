"""Truncated importance-sampling weights (TIS) at token, sequence or geometric level.

Reference: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS,
2025); Liu, Li et al., "When Speed Kills Stability" (2025) for the sequence/geometric levels.

With ℓ_t = log π_train − log π_rollout and threshold C (the upper truncation):
- token:     w_t = min(exp ℓ_t, C)
- sequence:  w   = min(exp Σ_t m_t ℓ_t, C), shared by every token of the sequence
- geometric: w   = min(exp(Σ_t m_t ℓ_t / Σ_t m_t), C)
Weights are detached and exactly 0 on padding. Optional batch normalization divides by the masked
mean token weight (token level) or the mean sequence weight (sequence levels), so that mean is 1.
"""

from __future__ import annotations

import math
from enum import Enum

import torch

from correction._common import LOG_RATIO_BOUND, _Stats, metrics_to_floats

__all__ = ["ISLevel", "is_weights"]


class ISLevel(str, Enum):
    """At which granularity an IS weight is computed."""

    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"


def as_is_level(level: ISLevel | str, field: str = "level") -> ISLevel:
    if isinstance(level, ISLevel):
        return level
    try:
        return ISLevel(level)
    except ValueError:
        raise ValueError(
            f"{field}={level!r} is not an IS level; use one of {[lv.value for lv in ISLevel]}"
        ) from None


def check_threshold(threshold: float, field: str = "threshold") -> float:
    value = float(threshold)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{field} must be a finite number > 0 (e.g. 2.0), got {threshold!r}")
    return value


def is_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    level: ISLevel | str = "token",
    threshold: float = 2.0,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights for off-policy tokens.

    Args:
        log_ratio: ``[B, T]`` ℓ = log π_train − log π_rollout (π_old in decoupled mode, π_θ.detach()
            in bypass mode). Any values at padding are ignored; non-finite values on response
            tokens raise ``ValueError``.
        response_mask: ``[B, T]`` 0/1 (any dtype).
        level: ``token``, ``sequence`` or ``geometric``.
        threshold: C, the upper truncation (> 0).
        batch_normalize: divide by the batch mean weight so it becomes 1 (the weights may then
            exceed C).

    Returns:
        ``(weights [B, T], metrics)``; weights are detached, in the compute dtype (float32 unless
        the input is float64) and 0 on padding. Metrics (see docs/correction.md): ``is_weight_mean``,
        ``is_weight_max``, ``is_weight_min``, ``is_weight_std``, ``is_frac_truncated``, ``is_ess``,
        and ``is_batch_norm_factor`` when normalizing.
    """
    stats = _Stats(log_ratio, response_mask)
    weights, metrics = is_weights_from_stats(
        stats, as_is_level(level), check_threshold(threshold), batch_normalize
    )
    return weights, metrics_to_floats(metrics)


def _masked_min_weight(stats: _Stats, em1_min: torch.Tensor, threshold: float) -> torch.Tensor:
    """min over valid tokens of min(1 + em1, C), with the padding zeros of ``em1`` excluded.

    ``em1`` is 0 on padding, so its global min is a valid token's value whenever it is negative or
    there is no padding; only otherwise is a masked pass needed.
    """
    if stats.n_tok_int == 0:
        return torch.zeros((), dtype=torch.float64)
    if stats.has_padding and float(em1_min) >= 0.0:
        em1_min = torch.where(stats.mask, stats.em1, torch.inf).min()
    return torch.clamp(em1_min.to(torch.float64) + 1.0, max=threshold)


def is_weights_from_stats(
    stats: _Stats, level: ISLevel, threshold: float, batch_normalize: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """The work of :func:`is_weights` on precomputed statistics; metrics stay tensors."""
    metrics: dict[str, torch.Tensor | float] = {}
    dtype = stats.lr.dtype
    if level is ISLevel.TOKEN:
        em1 = stats.em1
        if threshold >= 1.0:
            # min(1 + em1, C) on valid tokens and 0 on padding (where em1 == 0 and the mask adds 0).
            weights = torch.clamp(em1, max=threshold - 1.0).add_(stats.mask)
            n_trunc = torch.count_nonzero(em1 > threshold - 1.0)
        else:
            weights = torch.clamp(em1 + 1.0, max=threshold).mul_(stats.mask)
            n_trunc = torch.count_nonzero((em1 > threshold - 1.0) & stats.mask)
        flat = weights.view(-1)
        w_sum = flat.sum().to(torch.float64)
        w_sq = torch.dot(flat, flat).to(torch.float64)
        n = stats.n_tok
        em1_min, em1_max = torch.aminmax(em1) if em1.numel() else (torch.zeros(()), torch.zeros(()))
        w_max = torch.clamp(em1_max.to(torch.float64) + 1.0, max=threshold)
        w_max = torch.where(n > 0, w_max, 0.0)
        w_min = _masked_min_weight(stats, em1_min, threshold)
    else:
        log_w = stats.seq_sum if level is ISLevel.SEQUENCE else stats.seq_mean
        raw = torch.clamp(log_w, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        valid = stats.seq_valid
        seq_w = torch.where(valid, torch.clamp(torch.exp(raw), max=threshold), 0.0)  # [B]
        n = stats.n_seq
        n_trunc = torch.count_nonzero((raw > math.log(threshold)) & valid)
        w_sum = seq_w.sum()
        w_sq = torch.dot(seq_w, seq_w)
        w_max = seq_w.max() if seq_w.numel() else torch.zeros((), dtype=torch.float64)
        w_min = torch.where(valid, seq_w, torch.inf).min() if seq_w.numel() else w_max
        w_min = torch.where(n > 0, w_min, 0.0)
        weights = seq_w.to(dtype).unsqueeze(-1) * stats.mask
    n_safe = n.clamp(min=1.0)
    mean = w_sum / n_safe
    var = torch.clamp(w_sq / n_safe - mean * mean, min=0.0)
    metrics["is_weight_mean"] = mean
    metrics["is_weight_max"] = w_max
    metrics["is_weight_min"] = w_min
    metrics["is_weight_std"] = torch.sqrt(var)
    metrics["is_frac_truncated"] = n_trunc.to(torch.float64) / n_safe
    # ESS = 1 / E[(w / E w)^2] = (Σw)² / (n Σw²), a fraction in (0, 1].
    metrics["is_ess"] = torch.where(w_sq > 0, w_sum * w_sum / (n_safe * w_sq), 0.0)
    if batch_normalize:
        factor = torch.where(mean > 0, mean, 1.0)
        weights = weights.div_(factor.to(dtype))
        metrics["is_batch_norm_factor"] = factor
    return weights, metrics
