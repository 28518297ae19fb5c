"""Policy-gradient losses, registered by name (verl's names), each returning ``(loss, metrics)``.

Every loss is ``fn(old_log_prob [B, T], log_prob [B, T], advantages [B, T], response_mask
[B, T], *, loss_agg_mode, rollout_is_weights=None, global_tokens=None, global_seqs=None,
loss_scale_factor=None, **options) -> (scalar loss, dict[str, float])`` and is called through
:func:`policy_loss`. Guarantees for the built-in losses:

- math in float32 whatever the input dtype; the scalar is aggregated by
  :func:`agentrl.algos.agg_loss`, so global token/sequence counts make micro-batch losses add
  up to the mini-batch loss (gradient accumulation);
- log-ratios are clamped to [−20, 20] before ``exp`` (GSPO: ≤ 10), so gradients stay finite
  for any finite input;
- ``rollout_is_weights`` ``[B, T]`` (decoupled off-policy correction) multiplies the per-token
  loss and is always detached; the ``bypass`` loss refuses it (its ratio already is π_θ/π_rollout,
  a second weight would count the correction twice);
- metrics: ``pg_clipfrac`` (fraction of tokens where clipping is active), ``pg_clipfrac_lower``
  (dual-clip active), ``ppo_kl`` (masked mean of log π_old − log π_θ); 0.0 where not
  applicable, so every loss logs the same keys.

The PPO clip knobs (``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``)
are accepted by every built-in loss so one trainer config can drive them all; losses that do
not clip ignore them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agentrl.algos.aggregation import agg_loss
from agentrl.algos.registry import Registry, check_kwargs
from agentrl.algos.utils import masked_mean

__all__ = [
    "LOSS_RESERVED",
    "POLICY_LOSSES",
    "PolicyLossFn",
    "policy_loss",
    "register_policy_loss",
    "value_loss",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry(
    "policy loss",
    config_key="algorithm.loss.name",
    how_to_register="decorate a function with @register_policy_loss('name') in a module listed "
    "under `imports:`, or give 'module:function'",
)
LOSS_RESERVED = (
    "loss_agg_mode",
    "rollout_is_weights",
    "global_tokens",
    "global_seqs",
    "loss_scale_factor",
)
"""Keyword arguments the actor passes itself; every other keyword with a default is a knob."""

_LOG_RATIO_CLAMP = 20.0


def register_policy_loss(name: str, *aliases: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a user policy loss under ``name``.

    The function takes ``(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode,
    rollout_is_weights=None, global_tokens=None, global_seqs=None, loss_scale_factor=None,
    **your_options)`` and returns ``(loss, metrics)``; aggregate with
    :func:`agentrl.algos.agg_loss` and forward the global counts to stay correct under gradient
    accumulation.
    """
    return POLICY_LOSSES.register(name, *aliases)


def policy_loss(
    name: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    **cfg: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Compute the policy loss registered as ``name``.

    Args:
        name: ``vanilla``, ``gspo``, ``cispo``, ``bypass``, ``reinforce`` (alias ``gpg``) or your own.
        old_log_prob: ``[B, T]`` the anchor policy's logprobs: π_old recomputed by the trainer
            (decoupled mode) or π_rollout from the inference server (``bypass``).
        log_prob: ``[B, T]`` current policy logprobs π_θ (carries the gradient).
        advantages: ``[B, T]``.
        response_mask: ``[B, T]`` 0/1 (after any rejection-sampling mask).
        loss_agg_mode: an aggregation mode of :func:`agentrl.algos.agg_loss`.
        **cfg: clip knobs, ``rollout_is_weights`` ``[B, T]``, ``global_tokens``,
            ``global_seqs``, ``loss_scale_factor``; unknown options raise ``ValueError``.
    """
    fn = POLICY_LOSSES.get(name)
    check_kwargs("policy loss", name, fn, cfg)
    shapes = {tuple(t.shape) for t in (old_log_prob, log_prob, advantages, response_mask)}
    if len(shapes) != 1:
        raise ValueError(
            "old_log_prob, log_prob, advantages and response_mask must share one [B, T] shape; "
            f"got {sorted(shapes)}"
        )
    return fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode, **cfg)


def _clip_range(
    clip_ratio: float | None,
    clip_ratio_low: float | None,
    clip_ratio_high: float | None,
    default_low: float,
    default_high: float,
) -> tuple[float, float]:
    low = clip_ratio_low if clip_ratio_low is not None else clip_ratio
    high = clip_ratio_high if clip_ratio_high is not None else clip_ratio
    low = default_low if low is None else low
    high = default_high if high is None else high
    if low < 0 or high < 0:
        raise ValueError(f"clip_ratio_low/high must be >= 0, got {low}, {high}")
    return low, high


def _apply_is_weights(
    losses: torch.Tensor, rollout_is_weights: torch.Tensor | None
) -> torch.Tensor:
    if rollout_is_weights is None:
        return losses
    if rollout_is_weights.shape != losses.shape:
        raise ValueError(
            f"rollout_is_weights {tuple(rollout_is_weights.shape)} must match the [B, T] loss "
            f"shape {tuple(losses.shape)}"
        )
    return losses * rollout_is_weights.detach().float()


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
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 0.2, 0.2)
    adv = advantages.float()
    log_ratio = (log_prob.float() - old_log_prob.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    # Dual clip (Ye et al. 2020, arXiv:1912.09729): for A < 0 bound the loss by −A·c, so a huge
    # ratio on a bad token cannot blow up the update.
    loss_dual = torch.minimum(loss_ppo, -adv * clip_ratio_c)
    losses = torch.where(adv < 0, loss_dual, loss_ppo)
    losses = _apply_is_weights(losses, rollout_is_weights)
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


@register_policy_loss("vanilla")
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


@register_policy_loss("bypass")
def bypass_loss(
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
    """Bypass mode: PPO clip of r = π_θ/π_rollout, anchored on the *rollout* logprobs.

    Pass the inference server's logprobs as ``old_log_prob``; the trainer skips the π_old
    forward pass. The clipped ratio already corrects for the policy gap, so no extra IS weight
    is applied (``rollout_is_weights`` is refused); rejection sampling still applies through
    ``response_mask``.
    """
    if rollout_is_weights is not None:
        raise ValueError(
            "policy loss 'bypass' already uses π_θ/π_rollout as its ratio; do not pass "
            "rollout_is_weights (it would apply the correction twice). Use 'vanilla' for "
            "decoupled mode with IS weights."
        )
    return _ppo_clip(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=None,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )


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
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071), token form.

    s_i = exp(mean_t log(π_θ/π_old)) is the length-normalized *sequence* ratio; per token
    s_{i,t} = sg(s_i) · π_θ(y_t)/sg(π_θ(y_t)) has the value of s_i and the gradient of GSPO.
    ℓ = max(−A s, −A clip(s, 1−ε_low, 1+ε_high)). The paper's ranges are tiny (defaults
    ε_low = 3e-4, ε_high = 4e-4) and it aggregates with ``seq-mean-token-mean`` (pass that as
    ``loss_agg_mode`` to match the paper; verl forces it). ``clip_ratio_c`` is ignored.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 3e-4, 4e-4)
    adv = advantages.float()
    lp = log_prob.float()
    mask = response_mask.float()
    log_ratio = (lp - old_log_prob.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    log_s = lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(log_s.clamp(max=10.0))
    loss_unclipped = -adv * s
    loss_clipped = -adv * s.clamp(1.0 - low, 1.0 + high)
    losses = torch.maximum(loss_unclipped, loss_clipped)
    losses = _apply_is_weights(losses, rollout_is_weights)
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
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): ℓ = −sg(clip(r, 1−ε_low, 1+ε_high)) · A · log π_θ.

    Clips the importance weight instead of the update, so every token (including the rare
    "reflection" tokens PPO would clip away) keeps a gradient. The paper sets no lower bound:
    default ε_low = 1.0 (weight ≥ 0) and ε_high = 0.28. ``clip_ratio_c`` is ignored.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 1.0, 0.28)
    adv = advantages.float()
    lp = log_prob.float()
    log_ratio = (lp - old_log_prob.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - low, 1.0 + high)
    losses = -adv * weight * lp
    losses = _apply_is_weights(losses, rollout_is_weights)
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
    clip_ratio: float | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE (Williams 1992): ℓ = −A · log π_θ · sg(w), with w = ``rollout_is_weights`` or 1.

    No ratio and no clipping. With truncated IS weights of π_θ/π_rollout it is the bypass
    policy-gradient loss (``bypass_pg_is``); with group advantages it is GPG's loss (verl's
    ``gpg`` loss mode, registered here as an alias). ``old_log_prob`` only feeds the
    ``ppo_kl`` metric; the clip knobs are ignored.
    """
    lp = log_prob.float()
    losses = -advantages.float() * lp
    losses = _apply_is_weights(losses, rollout_is_weights)
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


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    global_tokens: Any = None,
    global_seqs: Any = None,
    loss_scale_factor: Any = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped critic loss of PPO (for ``gae``): ½ · agg(max((V − R)², (V_clip − R)²)).

    Args:
        vpreds: ``[B, T]`` current critic predictions (carry the gradient).
        returns: ``[B, T]`` targets from :func:`agentrl.algos.compute_advantage` (``gae``).
        values: ``[B, T]`` the critic's predictions when the batch was collected.
        response_mask: ``[B, T]`` 0/1.
        cliprange_value: V_clip = values + clip(vpreds − values, ±cliprange_value).

    Returns:
        ``(loss, {"vf_clipfrac": fraction of tokens where the clipped term is larger})``.
    """
    v = vpreds.float()
    old = values.float()
    ret = returns.float()
    v_clipped = old + (v - old).clamp(-cliprange_value, cliprange_value)
    unclipped = (v - ret) ** 2
    clipped = (v_clipped - ret) ** 2
    losses = 0.5 * torch.maximum(unclipped, clipped)
    loss = agg_loss(
        losses, response_mask, loss_agg_mode, global_tokens, global_seqs, loss_scale_factor
    )
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), response_mask).item()
    return loss, {"vf_clipfrac": clipfrac}
