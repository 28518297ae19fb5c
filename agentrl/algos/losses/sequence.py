"""Sequence-level ratios: GSPO (the length-normalized sequence ratio) and GMPO (``geo_mean``,
the geometric mean of clipped token ratios).

Why it exists: token ratios are noisy one-sample estimates, and one outlier token can dominate
a sequence's update; both losses move the ratio (and its clip) to the sequence. Aggregate with
``seq-mean-token-mean`` to match the papers (verl forces it; we honour ``loss_agg_mode``).
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.algos.aggregation import agg_loss
from agentrl.algos.losses.common import (
    LOG_RATIO_CLAMP,
    apply_is_weights,
    clamped_log_ratio,
    clip_range,
    loss_metrics,
)
from agentrl.algos.losses.registry import register_policy_loss
from agentrl.algos.utils import masked_mean

__all__ = ["geo_mean_loss", "gspo_loss"]


@register_policy_loss("gspo")
def gspo_loss(
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071), token form.

    s_i = exp(mean_t log(π_θ/π_old)) is the length-normalized *sequence* ratio; per token
    s_{i,t} = sg(s_i) · π_θ(y_t)/sg(π_θ(y_t)) has the value of s_i and the gradient of GSPO.
    ℓ = max(−A s, −A clip(s, 1−ε_low, 1+ε_high)). The paper's ranges are tiny (defaults
    ε_low = 3e-4, ε_high = 4e-4) and it aggregates with ``seq-mean-token-mean`` (pass that as
    ``loss_agg_mode`` to match the paper; verl forces it).
    """
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 3e-4, 4e-4)
    adv = advantages.float()
    lp = log_prob.float()
    mask = response_mask.float()
    log_ratio = (lp - old_log_prob.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    log_s = lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(log_s.clamp(max=10.0))
    loss_unclipped = -adv * s
    loss_clipped = -adv * s.clamp(1.0 - low, 1.0 + high)
    losses = torch.maximum(loss_unclipped, loss_clipped)
    losses = apply_is_weights(losses, rollout_is_weights)
    loss = agg_loss(
        losses, response_mask, loss_agg_mode, global_tokens, global_seqs, loss_scale_factor
    )
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).item(),
            "pg_clipfrac_lower": 0.0,
            "ppo_kl": masked_mean(-log_ratio, mask).item(),
        }
    return loss, metrics


@register_policy_loss("geo_mean")
def geo_mean_loss(
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (Zhao et al. 2025, Geometric-Mean Policy Optimization, arXiv:2507.20673).

    GRPO averages token ratios arithmetically, so one outlier ratio dominates; GMPO takes their
    geometric mean, clipping each token's log-ratio pessimistically first:

        x̃_t = sign(A) · min(sign(A) · x_t, sign(A) · clip(x_t, −ε_low, ε_high)),  x_t = log ρ_t
        ℓ_i = −Ā_i · exp(mean_t m_t x̃_t),   Ā_i = mean_t m_t A_t (a sequence advantage)

    The range is in log space and wide: default ε_low = ε_high = 0.4 (paper; verl's example).
    ℓ_i is written on every token of sequence i and aggregated with ``loss_agg_mode``: use
    ``seq-mean-token-mean`` to get the paper's mean over sequences (verl always does that;
    ``token-mean`` weights sequences by length). ``rollout_is_weights`` enter per sequence, as
    their geometric mean (as in verl). ``pg_clipfrac`` / ``pg_clipfrac_lower``: fraction of
    tokens whose clip is active with A > 0 / A < 0.
    """
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 0.4, 0.4)
    mask = response_mask.float()
    adv = advantages.float()
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)
    sign = torch.sign(adv)
    clipped_lr = log_ratio.clamp(-low, high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped_lr)
    lengths = mask.sum(dim=-1).clamp(min=1.0)
    seq_ratio = torch.exp((pessimistic * mask).sum(dim=-1) / lengths)
    seq_adv = (adv * mask).sum(dim=-1) / lengths
    seq_loss = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        if rollout_is_weights.shape != mask.shape:
            raise ValueError(
                f"rollout_is_weights {tuple(rollout_is_weights.shape)} must match the [B, T] "
                f"mask shape {tuple(mask.shape)}"
            )
        log_w = torch.log(rollout_is_weights.detach().float() + 1e-10)
        seq_loss = seq_loss * torch.exp((log_w * mask).sum(dim=-1) / lengths)
    losses = seq_loss.unsqueeze(-1).expand_as(mask)
    loss = agg_loss(
        losses, response_mask, loss_agg_mode, global_tokens, global_seqs, loss_scale_factor
    )
    active = (pessimistic != log_ratio).float()
    return loss, loss_metrics(response_mask, log_ratio, active * (adv > 0), active * (adv < 0))
