"""KL penalties against a reference policy: per-token estimators and KL controllers.

The estimators approximate KL(π_θ ‖ π_ref) from one sample per token (Schulman 2020,
"Approximating KL divergence", http://joschu.net/blog/kl-approx.html). With
δ = log π_θ − log π_ref:

- ``k1`` / ``kl``: δ — unbiased, high variance, can be negative;
- ``k2`` / ``mse``: ½ δ² — biased, low variance, its gradient is the exact KL gradient
  in expectation when used as a loss;
- ``k3`` / ``low_var_kl``: e^{−δ} − 1 + δ — unbiased, ≥ 0, low variance; clamped to [−10, 10]
  (δ itself clamped to [−20, 20] first) for numerical safety;
- ``abs``: |δ|.

A ``+`` suffix (``k3+``, ``low_var_kl+``, ``k1+`` ...) gives the *value* of the named estimator
with the *gradient* of k2 (straight-through): log and report the k3 value, but push the policy
with k2's unbiased gradient (as a loss term, k3's own gradient is biased).

Controllers set the coefficient β of a KL *reward* penalty: :class:`FixedKLController` keeps it
constant, :class:`AdaptiveKLController` follows Ziegler et al. 2019 (arXiv:1909.08593).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from agentrl.algos.registry import Registry
from agentrl.algos.utils import masked_mean

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "apply_kl_penalty",
    "kl_estimator_names",
    "kl_penalty",
]

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator", config_key="algorithm.kl_loss_type")


@KL_ESTIMATORS.register("k1", "kl")
def _k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("k2", "mse")
def _k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    neg = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (torch.exp(neg) - neg - 1.0).clamp(-10.0, 10.0)


@KL_ESTIMATORS.register("abs")
def _abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


def kl_estimator_names() -> list[str]:
    """Every valid ``estimator`` for :func:`kl_penalty`, ``+`` variants included."""
    base = KL_ESTIMATORS.names()
    return base + [f"{n}+" for n in base]


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` (float32) of π_θ against π_ref.

    Args:
        log_prob: ``[B, T]`` logprobs of the sampled tokens under π_θ (or π_old).
        ref_log_prob: ``[B, T]`` logprobs of the same tokens under the reference policy.
        estimator: ``k1``/``kl``, ``k2``/``mse``, ``k3``/``low_var_kl``, ``abs``, or any of
            them with a ``+`` suffix (value of that estimator, gradient of k2).

    Padding is not masked here: multiply by the response mask or aggregate with
    :func:`agentrl.algos.agg_loss`.
    """
    straight_through = estimator.endswith("+")
    base = estimator[:-1] if straight_through else estimator
    if base not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; valid names: {', '.join(kl_estimator_names())}"
        )
    lp = log_prob.float()
    ref = ref_log_prob.float()
    value = KL_ESTIMATORS.get(base)(lp, ref)
    if not straight_through:
        return value
    k2 = _k2(lp, ref)
    return k2 - k2.detach() + value.detach()


class KLController(Protocol):
    """Anything with a coefficient ``value`` and ``update(current_kl, n_steps)``."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """A constant KL coefficient β = ``coef``; ``update`` does nothing."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""
        del current_kl, n_steps

    def __repr__(self) -> str:
        return f"FixedKLController(coef={self.value})"


class AdaptiveKLController:
    """Adaptive β from Ziegler et al. 2019 (arXiv:1909.08593), as in PPO-RLHF and verl.

    After each batch: e = clip(KL / target − 1, −0.2, 0.2) and β ← β · (1 + e · n_steps / horizon).
    β grows while the measured KL is above ``target_kl`` and shrinks while it is below, at most
    20% per ``horizon`` steps.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0 (steps), got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β toward keeping ``current_kl`` at the target (``n_steps``: samples in the batch)."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value}, target_kl={self.target}, "
            f"horizon={self.horizon})"
        )


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    controller: KLController,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL as a reward penalty: ``rewards = scores − β · KL_t · mask``, then update the controller.

    Args:
        token_level_scores: ``[B, T]`` task rewards.
        log_prob: ``[B, T]`` π_old logprobs of the sampled tokens.
        ref_log_prob: ``[B, T]`` reference-policy logprobs.
        response_mask: ``[B, T]`` 0/1.
        controller: supplies β (read *before* its update) and is updated with the batch's mean
            per-sequence KL and ``n_steps = B``, as in verl.
        estimator: any name :func:`kl_penalty` accepts.

    Returns:
        ``(token_level_rewards [B, T] float32, {"reward_kl_penalty": mean KL,
        "reward_kl_penalty_coeff": β})``.
    """
    mask = response_mask.float()
    kld = kl_penalty(log_prob, ref_log_prob, estimator) * mask
    beta = controller.value
    rewards = token_level_scores.float() - beta * kld
    current_kl = masked_mean(kld, mask, dim=-1).mean().item()
    controller.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"reward_kl_penalty": current_kl, "reward_kl_penalty_coeff": beta}
