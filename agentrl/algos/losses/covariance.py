"""Entropy-preserving losses: Clip-Cov and KL-Cov (Cui et al. 2025, arXiv:2505.22617).

Why it exists: entropy collapses when the policy raises tokens whose log-probability and
advantage covary; a few high-covariance tokens drive it. Both losses find those tokens with
the same centered product C_t and treat them apart: Clip-Cov cuts the gradient of a random few,
KL-Cov puts a KL penalty on the top few. They pick tokens within each call (a micro-batch, as
verl does), so, unlike the other losses, micro-batch losses do not add up exactly to the
mini-batch loss.
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.algos.losses.common import (
    aggregate,
    clamped_log_ratio,
    clip_range,
    fraction,
    loss_metrics,
)
from agentrl.algos.losses.registry import register_policy_loss
from agentrl.algos.utils import masked_mean

__all__ = ["clip_cov_loss", "kl_cov_loss"]


def _centered_product(
    advantages: torch.Tensor, log_prob: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Per-token Cov term (A − mean A)(log π − mean log π) over the ``valid`` tokens (detached)."""
    adv = advantages.detach().float()
    lp = log_prob.detach().float()
    return (adv - masked_mean(adv, valid)) * (lp - masked_mean(lp, valid))


@register_policy_loss("clip_cov")
def clip_cov_loss(
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
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs, arXiv:2505.22617).

    Entropy falls when the policy raises tokens whose log-probability and advantage covary; a
    few tokens with a large covariance drive the collapse. Clip-Cov takes PPO's clipped loss
    (no dual clip) and cuts the gradient of a random few of them:

        C_t = (A_t − mean A)(log π_θ(y_t) − mean log π_θ)          (means over sampled tokens)
        ℓ_t = max(−Aρ, −A clip(ρ, 1−ε_low, 1+ε_high)) · (1 − D_t)

    D_t = 1 for ⌊r·N⌋ (at least 1) tokens drawn uniformly (torch's global RNG) among those not
    already ratio-clipped with ``clip_cov_lb`` < C_t < ``clip_cov_ub``; r = ``clip_cov_ratio``,
    N the sampled tokens of this call (a micro-batch, as in verl). Defaults verl's: ε = 0.2,
    r = 2e-4, bounds (1, 5). ``pg_clipfrac`` = ratio-clipped fraction; ``cov_fraction`` = the
    fraction cut by covariance (what verl logs as ``pg_clipfrac``).
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 0.2, 0.2)
    adv = advantages.float()
    valid = response_mask > 0
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    ratio_clipped = (loss_clipped > loss_unclipped) & valid
    with torch.no_grad():
        cov = _centered_product(adv, log_prob, valid.float())
        candidates = (valid & ~ratio_clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)).nonzero()
        n_cut = max(int(clip_cov_ratio * int(valid.sum().item())), 1)
        picked = candidates[torch.randperm(len(candidates), device=candidates.device)[:n_cut]]
        cut = torch.zeros_like(adv)
        cut[picked[:, 0], picked[:, 1]] = 1.0
    losses = torch.maximum(loss_unclipped, loss_clipped) * (1.0 - cut)
    loss = aggregate(
        losses,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    metrics = loss_metrics(response_mask, log_ratio, ratio_clipped)
    metrics["cov_fraction"] = fraction(cut, response_mask)
    return loss, metrics


@register_policy_loss("kl_cov")
def kl_cov_loss(
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
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617): a KL penalty on the highest-covariance tokens.

    With C_t as in ``clip_cov``, the ⌊r·N⌋ (at least 1) sampled tokens of largest C_t get a
    penalty on their log-ratio; every other token keeps the plain, unclipped surrogate:

        ℓ_t = −A ρ + k · |log ρ| · P_t,    P_t = 1 on the top-r covariance tokens

    r = ``kl_cov_ratio`` (default 2e-4), k = ``ppo_kl_coef`` (default 0.1; verl's config
    defaults). N counts the sampled tokens of this call (a micro-batch, as in verl). No clip
    metrics; ``cov_fraction`` = the penalized fraction. ``ppo_kl`` is the signed mean of
    log π_old − log π_θ like every loss (verl logs the mean of |log ρ| here).
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    adv = advantages.float()
    valid = response_mask > 0
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)
    with torch.no_grad():
        penalized = torch.zeros_like(adv)
        n_valid = int(valid.sum().item())
        if n_valid:
            cov = _centered_product(adv, log_prob, valid.float())[valid]
            top = torch.topk(cov, max(int(n_valid * kl_cov_ratio), 1)).indices
            rows, cols = valid.nonzero(as_tuple=True)
            penalized[rows[top], cols[top]] = 1.0
    losses = -adv * torch.exp(log_ratio) + ppo_kl_coef * log_ratio.abs() * penalized
    loss = aggregate(
        losses,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    metrics = loss_metrics(response_mask, log_ratio)
    metrics["cov_fraction"] = fraction(penalized, response_mask)
    return loss, metrics
