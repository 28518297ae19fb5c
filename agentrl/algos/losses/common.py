"""What the built-in policy losses share: the clip range, the log-ratio, the IS weights, the
aggregation and the three metrics every loss logs.

Why it exists: each family computes a different per-token loss, but they must agree on the
rest, or the same knob would mean two things: ε defaults resolve the same way
(:func:`clip_range`), log-ratios are clamped the same way before ``exp``
(:func:`clamped_log_ratio`), IS weights are checked and detached the same way
(:func:`apply_is_weights`), and every loss logs ``pg_clipfrac``, ``pg_clipfrac_lower`` and
``ppo_kl`` (:func:`loss_metrics`).

Pure tensor functions; math in float32 whatever the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.algos.aggregation import agg_loss
from agentrl.algos.utils import masked_mean

__all__ = [
    "LOG_RATIO_CLAMP",
    "aggregate",
    "apply_is_weights",
    "clamped_log_ratio",
    "clip_range",
    "fraction",
    "loss_metrics",
]

LOG_RATIO_CLAMP = 20.0
"""log(π_θ/π_old) is clamped to [−20, 20] before ``exp``: finite gradients for finite input."""


def clip_range(
    clip_ratio: float | None,
    clip_ratio_low: float | None,
    clip_ratio_high: float | None,
    default_low: float,
    default_high: float,
) -> tuple[float, float]:
    """(ε_low, ε_high): the side's own knob, else ``clip_ratio``, else the loss's default."""
    low = clip_ratio_low if clip_ratio_low is not None else clip_ratio
    high = clip_ratio_high if clip_ratio_high is not None else clip_ratio
    low = default_low if low is None else low
    high = default_high if high is None else high
    if low < 0 or high < 0:
        raise ValueError(f"clip_ratio_low/high must be >= 0, got {low}, {high}")
    return low, high


def apply_is_weights(losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token ``losses`` ``[B, T]`` times the detached ``rollout_is_weights`` (same shape)."""
    if rollout_is_weights is None:
        return losses
    if rollout_is_weights.shape != losses.shape:
        raise ValueError(
            f"rollout_is_weights {tuple(rollout_is_weights.shape)} must match the [B, T] loss "
            f"shape {tuple(losses.shape)}"
        )
    return losses * rollout_is_weights.detach().float()


def clamped_log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    """log(π_θ/π_old) in float32, clamped to [−20, 20] so ``exp`` stays finite."""
    return (log_prob.float() - old_log_prob.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def aggregate(
    losses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
    global_tokens: Any,
    global_seqs: Any,
    loss_scale_factor: Any,
) -> torch.Tensor:
    """IS-weight the per-token losses ``[B, T]`` and aggregate them (see module docstring)."""
    losses = apply_is_weights(losses, rollout_is_weights)
    return agg_loss(
        losses, response_mask, loss_agg_mode, global_tokens, global_seqs, loss_scale_factor
    )


def loss_metrics(
    response_mask: torch.Tensor,
    log_ratio: torch.Tensor,
    clipped: torch.Tensor | None = None,
    clipped_lower: torch.Tensor | None = None,
) -> dict[str, float]:
    """The three keys every loss logs; ``clipped*`` are 0/1 ``[B, T]`` masks (None = 0.0)."""
    with torch.no_grad():
        return {
            "pg_clipfrac": fraction(clipped, response_mask),
            "pg_clipfrac_lower": fraction(clipped_lower, response_mask),
            "ppo_kl": masked_mean(-log_ratio.float(), response_mask).item(),
        }


def fraction(flags: torch.Tensor | None, response_mask: torch.Tensor) -> float:
    """Share of sampled tokens where ``flags`` (0/1 ``[B, T]``) is set; 0.0 for None."""
    return 0.0 if flags is None else masked_mean(flags.float(), response_mask).item()
