"""PPO's clipped surrogate (``vanilla``, alias ``ppo_clip``), with dual clip and clip-higher.

Why it exists: the reference loss every other family is compared against (Schulman et al.
2017, arXiv:1707.06347): r = π_θ/π_old, ℓ = max(−A r, −A clip(r, 1−ε_low, 1+ε_high)), and for
A < 0 the dual clip ℓ = min(ℓ, −A c) (Ye et al. 2020, arXiv:1912.09729) so a huge ratio on a
bad token cannot blow up the update. Knobs: ``clip_ratio``, ``clip_ratio_low``,
``clip_ratio_high`` (ε, default 0.2), ``clip_ratio_c`` (c > 1, default 3.0).
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.algos.aggregation import agg_loss
from agentrl.algos.losses.common import LOG_RATIO_CLAMP, apply_is_weights, clip_range
from agentrl.algos.losses.registry import register_policy_loss
from agentrl.algos.utils import masked_mean

__all__ = ["vanilla_loss"]


def _ppo_clip(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
    global_tokens: Any,
    global_seqs: Any,
    loss_scale_factor: Any,
    clip_ratio: float | None,
    clip_ratio_low: float | None,
    clip_ratio_high: float | None,
    clip_ratio_c: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1.0, got {clip_ratio_c}")
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 0.2, 0.2)
    adv = advantages.float()
    log_ratio = (log_prob.float() - old_log_prob.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    # Dual clip (Ye et al. 2020, arXiv:1912.09729): for A < 0 bound the loss by −A·c, so a huge
    # ratio on a bad token cannot blow up the update.
    loss_dual = torch.minimum(loss_ppo, -adv * clip_ratio_c)
    losses = torch.where(adv < 0, loss_dual, loss_ppo)
    losses = apply_is_weights(losses, rollout_is_weights)
    loss = agg_loss(
        losses, response_mask, loss_agg_mode, global_tokens, global_seqs, loss_scale_factor
    )
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(
                (loss_clipped > loss_unclipped).float(), response_mask
            ).item(),
            "pg_clipfrac_lower": masked_mean(
                ((loss_ppo > -adv * clip_ratio_c) & (adv < 0)).float(), response_mask
            ).item(),
            "ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        }
    return loss, metrics


@register_policy_loss("vanilla", "ppo_clip")
def vanilla_loss(
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
    clip_ratio: float | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clip (Schulman et al. 2017, arXiv:1707.06347) with dual clip (arXiv:1912.09729).

    r = π_θ/π_old; ℓ = max(−A r, −A clip(r, 1−ε_low, 1+ε_high)); for A < 0, ℓ = min(ℓ, −A c).
    Asymmetric ε (``clip_ratio_high`` > ``clip_ratio_low``) is DAPO's clip-higher. Defaults:
    ε = 0.2, c = 3.0.
    """
    return _ppo_clip(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )
