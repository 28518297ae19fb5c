"""Policy gradients without a ratio: REINFORCE (also the bypass and GPG loss) and DRO.

Why it exists: with no ratio there is nothing to clip. ``reinforce`` is −A · log π_θ, weighted
by truncated IS weights in bypass mode (π_θ/π_rollout computed by ``correction``, the
``bypass_pg_is`` loss) and registered as ``gpg`` too; ``dro`` adds a quadratic proximal
penalty on the log-ratio instead of a clip (a soft trust region).
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.algos.aggregation import agg_loss
from agentrl.algos.losses.common import aggregate, apply_is_weights, loss_metrics
from agentrl.algos.losses.registry import register_policy_loss
from agentrl.algos.utils import masked_mean

__all__ = ["dro_loss", "reinforce_loss"]


@register_policy_loss("reinforce", "gpg")
def reinforce_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    global_tokens: Any = None,
    global_seqs: Any = None,
    loss_scale_factor: Any = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE (Williams 1992): ℓ = −A · log π_θ · sg(w), with w = ``rollout_is_weights`` or 1.

    No ratio and no clipping. With truncated IS weights of π_θ/π_rollout it is the bypass
    policy-gradient loss (``bypass_pg_is``); with group advantages it is GPG's loss (verl's
    ``gpg`` loss mode, registered here as an alias). ``old_log_prob`` only feeds the
    ``ppo_kl`` metric. It has no knobs.
    """
    lp = log_prob.float()
    losses = -advantages.float() * lp
    losses = apply_is_weights(losses, rollout_is_weights)
    loss = agg_loss(
        losses, response_mask, loss_agg_mode, global_tokens, global_seqs, loss_scale_factor
    )
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": 0.0,
            "pg_clipfrac_lower": 0.0,
            "ppo_kl": masked_mean(old_log_prob.float() - lp, response_mask).item(),
        }
    return loss, metrics


@register_policy_loss("dro")
def dro_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    global_tokens: Any = None,
    global_seqs: Any = None,
    loss_scale_factor: Any = None,
    dro_beta: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO (Richemond et al. 2024, Direct Reward Optimization, arXiv:2405.19107; Kimi k1.5).

    A policy gradient with a quadratic proximal penalty instead of a clip:

        ℓ = −(A · log π_θ − ½ β (log π_θ − log π_old)²)

    so dℓ/dlog π_θ = −(A − β · log ρ): each token's log-probability is pulled toward
    log ρ* = A/β and no further, a soft trust region whose width is set by β (``dro_beta``,
    which must be > 0). Works off-policy (π_old may be a stale or the rollout policy). verl
    requires ``dro_beta`` to be set; our default 1.0 puts log ρ* at the scale of whitened
    advantages (|A| ≈ 1); raise it for a tighter region. The log-ratio is not clamped (the
    penalty must keep pulling back however far it went). Clip metrics are 0.
    """
    if dro_beta <= 0:
        raise ValueError(
            f"dro_beta must be > 0 (the weight of the quadratic log-ratio penalty), got {dro_beta}"
        )
    lp = log_prob.float()
    log_ratio = lp - old_log_prob.float()
    losses = -(advantages.float() * lp - 0.5 * dro_beta * log_ratio.square())
    loss = aggregate(
        losses,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, loss_metrics(response_mask, log_ratio)
