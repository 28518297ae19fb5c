"""Policy-gradient losses, registered by name (verl's names), each returning ``(loss, metrics)``.

Every loss is ``fn(old_log_prob [B, T], log_prob [B, T], advantages [B, T], response_mask
[B, T], *, loss_agg_mode, rollout_is_weights=None, global_tokens=None, global_seqs=None,
loss_scale_factor=None, **options) -> (scalar loss, dict[str, float])`` and is called through
:func:`policy_loss`. Guarantees for the built-in losses:

- math in float32 whatever the input dtype; the scalar is aggregated by
  :func:`agentrl.algos.agg_loss`, so global token/sequence counts make micro-batch losses add
  up to the mini-batch loss (gradient accumulation) — except ``clip_cov`` and ``kl_cov``, which
  pick their tokens within each call (a micro-batch), as verl does;
- log-ratios are clamped to [−20, 20] before ``exp`` (GSPO: ≤ 10), so gradients stay finite
  for any finite input (``dro`` has no ``exp`` and keeps the raw log-ratio in its penalty);
- ``rollout_is_weights`` ``[B, T]`` (decoupled off-policy correction) multiplies the per-token
  loss and is always detached (``geo_mean``: their per-sequence geometric mean); in bypass mode
  the run passes none to a ratio loss (its ratio already is π_θ/π_rollout: a second weight
  would count the correction twice; ``agentrl.training.algorithm``);
- metrics: ``pg_clipfrac`` (fraction of tokens where clipping or the trust-region mask is
  active), ``pg_clipfrac_lower`` (dual clip, or DPPO's IS truncation, active), ``ppo_kl``
  (masked mean of log π_old − log π_θ); 0.0 where not applicable, so every loss logs these keys
  (``clip_cov`` and ``kl_cov`` add ``cov_fraction``).

Each loss's knobs are its keyword options with defaults and nothing else (the typed config
variant is built from the signature, so a knob a loss does not use is an error, never ignored):
``vanilla`` (alias ``ppo_clip``) has ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
``clip_ratio_c``; ``gspo`` and ``cispo`` the first three; ``reinforce`` none; ``dppo_tv``/``dppo_kl`` read the first three as
divergence thresholds, as verl does; ``geo_mean`` and ``clip_cov`` clip with the first three;
``sapo`` (``tau_pos``, ``tau_neg``), ``dro`` (``dro_beta``) and ``kl_cov`` (``kl_cov_ratio``,
``ppo_kl_coef``) have their own.
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
        name: ``vanilla`` (alias ``ppo_clip``), ``gspo``, ``cispo``, ``reinforce`` (alias ``gpg``),
            ``dppo_tv``, ``dppo_kl``, ``sapo``, ``geo_mean``, ``dro``, ``clip_cov``,
            ``kl_cov`` or your own.
        old_log_prob: ``[B, T]`` the anchor policy's logprobs: π_old recomputed by the trainer
            (decoupled mode) or π_rollout from the inference server (bypass mode).
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): ℓ = −sg(clip(r, 1−ε_low, 1+ε_high)) · A · log π_θ.

    Clips the importance weight instead of the update, so every token (including the rare
    "reflection" tokens PPO would clip away) keeps a gradient. The paper sets no lower bound:
    default ε_low = 1.0 (weight ≥ 0) and ε_high = 0.28.
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE (Williams 1992): ℓ = −A · log π_θ · sg(w), with w = ``rollout_is_weights`` or 1.

    No ratio and no clipping. With truncated IS weights of π_θ/π_rollout it is the bypass
    policy-gradient loss (``bypass_pg_is``); with group advantages it is GPG's loss (verl's
    ``gpg`` loss mode, registered here as an alias). ``old_log_prob`` only feeds the
    ``ppo_kl`` metric. It has no knobs.
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


# ---------------------------------------------------------------------------------------------
# Trust-region variants (verl's loss modes): shared plumbing
# ---------------------------------------------------------------------------------------------


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    """log(π_θ/π_old) in float32, clamped to [−20, 20] so ``exp`` stays finite."""
    return (log_prob.float() - old_log_prob.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _aggregate(
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
    losses = _apply_is_weights(losses, rollout_is_weights)
    return agg_loss(
        losses, response_mask, loss_agg_mode, global_tokens, global_seqs, loss_scale_factor
    )


def _metrics(
    response_mask: torch.Tensor,
    log_ratio: torch.Tensor,
    clipped: torch.Tensor | None = None,
    clipped_lower: torch.Tensor | None = None,
) -> dict[str, float]:
    """The three keys every loss logs; ``clipped*`` are 0/1 ``[B, T]`` masks (None = 0.0)."""
    with torch.no_grad():
        return {
            "pg_clipfrac": _fraction(clipped, response_mask),
            "pg_clipfrac_lower": _fraction(clipped_lower, response_mask),
            "ppo_kl": masked_mean(-log_ratio.float(), response_mask).item(),
        }


def _fraction(flags: torch.Tensor | None, response_mask: torch.Tensor) -> float:
    """Share of sampled tokens where ``flags`` (0/1 ``[B, T]``) is set; 0.0 for None."""
    return 0.0 if flags is None else masked_mean(flags.float(), response_mask).item()


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
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(max=clip_ratio_c) * valid
    losses = -advantages.float() * weight * log_prob.float()
    loss = _aggregate(losses, response_mask, **agg)
    return loss, _metrics(response_mask, log_ratio, 1.0 - valid, (ratio > clip_ratio_c) * valid)


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
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 0.15, 0.15)
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
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 0.05, 0.05)
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
    log_ratio = _log_ratio(old_log_prob, log_prob)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    losses = -gate * adv
    loss = _aggregate(
        losses,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, _metrics(response_mask, log_ratio)


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
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 0.4, 0.4)
    mask = response_mask.float()
    adv = advantages.float()
    log_ratio = _log_ratio(old_log_prob, log_prob)
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
    return loss, _metrics(response_mask, log_ratio, active * (adv > 0), active * (adv < 0))


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
    loss = _aggregate(
        losses,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, _metrics(response_mask, log_ratio)


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
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, 0.2, 0.2)
    adv = advantages.float()
    valid = response_mask > 0
    log_ratio = _log_ratio(old_log_prob, log_prob)
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
    loss = _aggregate(
        losses,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    metrics = _metrics(response_mask, log_ratio, ratio_clipped)
    metrics["cov_fraction"] = _fraction(cut, response_mask)
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
    log_ratio = _log_ratio(old_log_prob, log_prob)
    with torch.no_grad():
        penalized = torch.zeros_like(adv)
        n_valid = int(valid.sum().item())
        if n_valid:
            cov = _centered_product(adv, log_prob, valid.float())[valid]
            top = torch.topk(cov, max(int(n_valid * kl_cov_ratio), 1)).indices
            rows, cols = valid.nonzero(as_tuple=True)
            penalized[rows[top], cols[top]] = 1.0
    losses = -adv * torch.exp(log_ratio) + ppo_kl_coef * log_ratio.abs() * penalized
    loss = _aggregate(
        losses,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    metrics = _metrics(response_mask, log_ratio)
    metrics["cov_fraction"] = _fraction(penalized, response_mask)
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
