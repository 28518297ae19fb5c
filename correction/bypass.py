"""Bypass-mode policy losses: π_rollout is the anchor, no π_old forward pass.

Reference: the "bypass mode" of verl's rollout correction (Liu, Li et al., 2025), and PPO (Schulman et
al., 2017) for the clipped surrogate.

- ``bypass_ppo_clip_loss``: PPO clip of r = π_θ / π_rollout. The ratio itself is the importance
  correction, so no extra IS weight multiplies it (that would count the correction twice); RS still
  acts through ``response_mask``.
- ``bypass_reinforce_loss``: −A · log π_θ · stopgrad(w), with w the IS weight of the rollout sample.

Both clamp log r to ±20 before exp (so log-ratios of ±50 give finite losses and gradients), ignore
padding values entirely (NaN there cannot leak), and aggregate with :func:`correction.agg_loss`.
"""

from __future__ import annotations

import torch

from correction._agg import LossAggMode, agg_loss
from correction._common import LOG_RATIO_BOUND, check_finite, check_pair
from correction._common import metrics_to_floats as _to_floats

__all__ = ["bypass_ppo_clip_loss", "bypass_reinforce_loss"]


def _masked_log_ratio(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``[B, T]`` log π_θ − log π_rollout with 0 on padding (gradient flows through log_prob)."""
    log_ratio = torch.where(mask, log_prob - rollout_log_prob.detach(), 0.0)
    if not bool(torch.isfinite(log_ratio.detach().sum())):
        check_finite("log_prob", log_prob, mask)
        check_finite("rollout_log_prob", rollout_log_prob, mask)
    return log_ratio


def _check_inputs(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    for name, tensor in (
        ("log_prob", log_prob),
        ("rollout_log_prob", rollout_log_prob),
        ("advantages", advantages),
    ):
        check_pair(name, tensor, response_mask)
    mask = response_mask.bool()
    if not bool(torch.isfinite(torch.where(mask, advantages.detach(), 0.0).sum())):
        check_finite("advantages", advantages, mask)
    return mask


def bypass_ppo_clip_loss(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str | LossAggMode = "token-mean",
    global_tokens: float | int | torch.Tensor | None = None,
    global_seqs: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with π_rollout as the old policy.

    Args:
        log_prob: ``[B, T]`` log π_θ (requires grad).
        rollout_log_prob: ``[B, T]`` log π_rollout (treated as data).
        advantages: ``[B, T]``.
        response_mask: ``[B, T]`` 0/1, after RS.
        clip_ratio_low, clip_ratio_high: r is clipped to ``[1 − low, 1 + high]``.
        loss_agg_mode, global_tokens, global_seqs: see :func:`correction.agg_loss`.

    Returns:
        ``(loss, metrics)`` with metrics ``pg_loss``, ``pg_clipfrac`` (fraction of valid tokens where
        the clipped term is active), ``ppo_kl`` (masked mean of log π_rollout − log π_θ).
    """
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip_ratio_low/high must be >= 0, got {clip_ratio_low} / {clip_ratio_high}"
        )
    mask = _check_inputs(log_prob, rollout_log_prob, advantages, response_mask)
    log_ratio = _masked_log_ratio(log_prob, rollout_log_prob, mask)
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    adv = torch.where(mask, advantages.detach(), 0.0)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    loss = agg_loss(loss_mat, mask, loss_agg_mode, global_tokens, global_seqs)
    n_tok = mask.sum().clamp(min=1).to(torch.float64)
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": ((clipped > unclipped) & mask).sum().to(torch.float64) / n_tok,
        "ppo_kl": -log_ratio.detach().sum().to(torch.float64) / n_tok,
    }
    return loss, _to_floats(metrics)


def bypass_reinforce_loss(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    loss_agg_mode: str | LossAggMode = "token-mean",
    global_tokens: float | int | torch.Tensor | None = None,
    global_seqs: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE on rollout samples: loss_t = −A_t · log π_θ(y_t) · stopgrad(w_t).

    Args:
        log_prob: ``[B, T]`` log π_θ (requires grad).
        rollout_log_prob: ``[B, T]`` log π_rollout (for the ``ppo_kl`` metric only).
        advantages: ``[B, T]``.
        response_mask: ``[B, T]`` 0/1, after RS.
        weights: ``[B, T]`` IS weights (e.g. from :func:`correction.is_weights` on
            log π_θ.detach() − log π_rollout), or None for w = 1.
        loss_agg_mode, global_tokens, global_seqs: see :func:`correction.agg_loss`.

    Returns:
        ``(loss, metrics)`` with ``pg_loss``, ``ppo_kl`` and ``is_weight_mean`` (1.0 without weights).
    """
    mask = _check_inputs(log_prob, rollout_log_prob, advantages, response_mask)
    log_ratio = _masked_log_ratio(log_prob, rollout_log_prob, mask)
    safe_log_prob = torch.where(mask, log_prob, 0.0)
    adv = torch.where(mask, advantages.detach(), 0.0)
    n_tok = mask.sum().clamp(min=1).to(torch.float64)
    if weights is None:
        loss_mat = -adv * safe_log_prob
        weight_mean: torch.Tensor | float = 1.0
    else:
        check_pair("weights", weights, response_mask)
        w = torch.where(mask, weights.detach(), 0.0)
        if not bool(torch.isfinite(w.sum())):
            check_finite("weights", weights, mask)
        loss_mat = -adv * safe_log_prob * w
        weight_mean = w.sum().to(torch.float64) / n_tok
    loss = agg_loss(loss_mat, mask, loss_agg_mode, global_tokens, global_seqs)
    metrics = {
        "pg_loss": loss.detach(),
        "ppo_kl": -log_ratio.detach().sum().to(torch.float64) / n_tok,
        "is_weight_mean": weight_mean,
    }
    return loss, _to_floats(metrics)
