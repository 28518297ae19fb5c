"""The policy-loss registry and the one way a loss is called (:func:`policy_loss`).

Why it exists: the run names its loss in the config (``algorithm.loss.name``); this module
turns the name into a function, checks the options against that function's own knobs and the
tensors against one ``[B, T]`` shape, and calls it. Every built-in family registers itself here
when :mod:`agentrl.algos.losses` is imported; users add theirs with
:func:`register_policy_loss`.

What it guarantees: an unknown name raises an error listing the registered names; an option
the loss does not take raises ``ValueError`` naming it and the loss's options; tensors of
different shapes raise ``ValueError`` naming the shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agentrl.algos.registry import Registry, check_kwargs

__all__ = [
    "LOSS_RESERVED",
    "POLICY_LOSSES",
    "PolicyLossFn",
    "policy_loss",
    "register_policy_loss",
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
