"""Alternatives to PPO's hard ratio clip: CISPO clips the importance weight, DPPO masks by a
divergence of the token's probability, SAPO gates the ratio smoothly.

Why it exists: PPO's clip zeroes the gradient of exactly the tokens that moved most, often
rare, informative ones. These losses keep a gradient on every token (CISPO, SAPO) or decide
trust by the probability change rather than the ratio (DPPO), each a small change of the
per-token term; the aggregation, IS weights and metrics are the shared ones (:mod:`.common`).
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.algos.aggregation import agg_loss
from agentrl.algos.losses.common import (
    LOG_RATIO_CLAMP,
    aggregate,
    apply_is_weights,
    clamped_log_ratio,
    clip_range,
    loss_metrics,
)
from agentrl.algos.losses.registry import register_policy_loss
from agentrl.algos.utils import masked_mean

__all__ = ["cispo_loss", "dppo_kl_loss", "dppo_tv_loss", "sapo_loss"]


@register_policy_loss("cispo")
def cispo_loss(
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
    """CISPO (MiniMax-M1, arXiv:2506.13585): ℓ = −sg(clip(r, 1−ε_low, 1+ε_high)) · A · log π_θ.

    Clips the importance weight instead of the update, so every token (including the rare
    "reflection" tokens PPO would clip away) keeps a gradient. The paper sets no lower bound:
    default ε_low = 1.0 (weight ≥ 0) and ε_high = 0.28.
    """
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 1.0, 0.28)
    adv = advantages.float()
    lp = log_prob.float()
    log_ratio = (lp - old_log_prob.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - low, 1.0 + high)
    losses = -adv * weight * lp
    losses = apply_is_weights(losses, rollout_is_weights)
    loss = agg_loss(
        losses, response_mask, loss_agg_mode, global_tokens, global_seqs, loss_scale_factor
    )
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(
                ((ratio > 1.0 + high) | (ratio < 1.0 - low)).float(), response_mask
            ).item(),
            "pg_clipfrac_lower": 0.0,
            "ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        }
    return loss, metrics


def _dppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    valid: torch.Tensor,
    clip_ratio_c: float,
    agg: dict[str, Any],
) -> tuple[torch.Tensor, dict[str, float]]:
    """ℓ = −A · sg(min(ρ, C)) · log π_θ · M, with M the 0/1 trust-region mask ``valid``."""
    if clip_ratio_c <= 0:
        raise ValueError(
            f"clip_ratio_c (the truncated-IS bound C of DPPO) must be > 0, got {clip_ratio_c}; "
            "use a large value such as 20.0"
        )
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(max=clip_ratio_c) * valid
    losses = -advantages.float() * weight * log_prob.float()
    loss = aggregate(losses, response_mask, **agg)
    return loss, loss_metrics(response_mask, log_ratio, 1.0 - valid, (ratio > clip_ratio_c) * valid)


def _token_log_probs(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π_θ(y_t), log π_old(y_t)) in float32, detached, capped at 0 (probabilities ≤ 1)."""
    return log_prob.detach().float().clamp(max=0.0), old_log_prob.detach().float().clamp(max=0.0)


@register_policy_loss("dppo_tv")
def dppo_tv_loss(
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
    clip_ratio_c: float = 20.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV (Qi et al. 2026, Rethinking the Trust Region in LLM RL, arXiv:2602.04879).

    PPO's ratio clip is a noisy one-sample estimate of the policy divergence: it over-constrains
    rare tokens (a ratio of 2 on p = 0.001) and under-constrains likely ones. DPPO masks a token
    out when the *probability* moved too far in the direction the advantage pushes it, measured
    by the total variation of the binary (token vs rest) distribution, D = |π_θ(y) − π_old(y)|:

        M = 0 if A > 0 and π_θ − π_old > δ_high,  or  A ≤ 0 and π_old − π_θ > δ_low;  else 1
        ℓ = −A · sg(min(ρ, C)) · log π_θ · M

    whose gradient is PPO's unclipped −A∇ρ (truncated IS at C) inside the trust region and 0
    outside. The knobs keep verl's names but are TV thresholds δ: ``clip_ratio`` sets both,
    default δ = 0.15 (verl's DPPO example); ``clip_ratio_c`` = C = 20 (paper §5.4: large, to
    keep the truncation bias small). Metrics: ``pg_clipfrac`` = masked-out fraction,
    ``pg_clipfrac_lower`` = fraction where the truncation at C is active.
    """
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 0.15, 0.15)
    log_p, log_p_old = _token_log_probs(old_log_prob, log_prob)
    moved = torch.exp(log_p) - torch.exp(log_p_old)  # π_θ − π_old
    valid = torch.where(advantages > 0, moved <= high, moved >= -low).float()
    agg = dict(
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    return _dppo(old_log_prob, log_prob, advantages, response_mask, valid, clip_ratio_c, agg)


@register_policy_loss("dppo_kl")
def dppo_kl_loss(
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
    clip_ratio_c: float = 20.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL (Qi et al. 2026, arXiv:2602.04879): ``dppo_tv`` with a binary KL trust region.

    D = π_old log(π_old/π_θ) + (1 − π_old) log((1 − π_old)/(1 − π_θ)), the KL between the
    Bernoulli(π_old(y)) and Bernoulli(π_θ(y)) distributions of the sampled token (1e-8 guards
    the logs as in verl):

        M = 0 if A > 0, π_θ > π_old and D > δ_high,  or  A ≤ 0, π_θ < π_old and D > δ_low;  else 1
        ℓ = −A · sg(min(ρ, C)) · log π_θ · M

    Knobs as ``dppo_tv`` (KL thresholds δ under verl's clip names), default δ = 0.05 (verl's
    DPPO example), C = 20.
    """
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 0.05, 0.05)
    log_p, log_p_old = _token_log_probs(old_log_prob, log_prob)
    p, p_old = torch.exp(log_p), torch.exp(log_p_old)
    binary_kl = p_old * (log_p_old - log_p) + (1.0 - p_old) * torch.log(
        (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
    )
    up_ok = (binary_kl <= high) | (p <= p_old)
    down_ok = (binary_kl <= low) | (p >= p_old)
    valid = torch.where(advantages > 0, up_ok, down_ok).float()
    agg = dict(
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    return _dppo(old_log_prob, log_prob, advantages, response_mask, valid, clip_ratio_c, agg)


@register_policy_loss("sapo")
def sapo_loss(
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
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (Qwen team 2025, Soft Adaptive Policy Optimization, arXiv:2511.20347).

    Replaces the hard clip by a smooth gate of the ratio, ℓ = −f_τ(ρ) · A with

        f_τ(ρ) = σ(τ (ρ − 1)) · 4/τ,    τ = ``tau_pos`` if A > 0 else ``tau_neg``

    so dℓ/dlog π_θ = −A · 4σ(1 − σ) · ρ: exactly the policy gradient −A at ρ = 1, fading
    smoothly (never to a cliff) as ρ leaves 1. A larger τ fades faster; ``tau_neg`` > ``tau_pos``
    damps negative updates more, which the paper finds stabilizes training. Defaults τ+ = 1.0,
    τ− = 1.05 (verl's). verl forces ``seq-mean-token-mean`` for SAPO; we honour the
    ``loss_agg_mode`` you pass (use that mode to match). Clip metrics are 0.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    adv = advantages.float()
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    losses = -gate * adv
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
