"""The run's algorithm, decided once: typed estimator and loss variants, KL terms, correction.

Why it exists: a config names its algorithm by strings (``algorithm.advantage.name``,
``algorithm.loss.name``, ``algorithm.correction.preset``); this module turns them, in one place,
into objects whose properties say what the run needs — a critic, a reference model, π_old, a
greedy baseline — so no other module branches on a name, and adding an estimator or a loss is
one decorated function in ``agentrl.algos`` (its keyword options with defaults are its knobs).

Guarantees:

- every knob is validated against the variant's own signature (type and name), with the key
  path in the error (``algorithm.loss.clip_ratio_hgh: unknown knob of loss 'vanilla'; did you
  mean 'clip_ratio_high'?``); nothing is accepted and ignored;
- :func:`build_algorithm` fails before any server starts and never imports a server;
- bypass mode is a property of the correction: the loss anchors on π_rollout; a ratio loss gets
  no extra IS weight (the ratio already corrects; counting it twice is refused); the REINFORCE
  loss of ``loss_type: reinforce`` takes the IS weights.

Example::

    plan = build_algorithm(cfg.algorithm)
    plan.needs_critic, plan.needs_reference, plan.needs_old_log_probs
    adv, returns = plan.advantage(rewards, mask, index=uids)
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ConfigDict, ValidationError, create_model

import correction
from agentrl.algos import kl_penalty
from agentrl.algos.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGE_RESERVED
from agentrl.algos.kl import AdaptiveKLController, FixedKLController, KLController
from agentrl.algos.losses import LOSS_RESERVED, POLICY_LOSSES
from agentrl.algos.registry import flags, option_signature
from agentrl.registry import Registry, RegistryError, closest

__all__ = [
    "AdvantageVariant",
    "AlgorithmPlan",
    "KLInReward",
    "LossVariant",
    "build_algorithm",
    "build_variant",
]


def _validate_knobs(
    fn: Any, reserved: tuple[str, ...], knobs: Mapping[str, Any], *, key: str, what: str
) -> dict[str, Any]:
    """``knobs`` checked against ``fn``'s options: names, then types (pydantic, strict-ish)."""
    params = option_signature(fn, reserved)
    unknown = [k for k in knobs if k not in params]
    if unknown:
        lines = []
        for k in unknown:
            guess = closest(k, list(params))
            hint = (
                f"did you mean {guess!r}?"
                if guess
                else f"its knobs: {', '.join(params) or '(none)'}"
            )
            lines.append(f"{key}.{k}: unknown knob of {what}; {hint}")
        raise RegistryError("\n".join(lines))
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # a user function with unresolvable annotations: check names only
        hints = {}
    fields: dict[str, Any] = {name: (hints.get(name, Any), p.default) for name, p in params.items()}
    model = create_model(  # type: ignore[call-overload]  # dynamic fields
        f"{what}_knobs",
        __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True),
        **fields,
    )
    try:
        validated = model.model_validate(dict(knobs))
    except ValidationError as exc:
        lines = [
            f"{key}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']} (got {e.get('input')!r})"
            for e in exc.errors()
        ]
        raise RegistryError("\n".join(lines)) from None
    return {k: getattr(validated, k) for k in knobs}


@dataclass(frozen=True)
class _Variant:
    """A registered function chosen by name, with its validated knobs."""

    name: str
    fn: Any = field(repr=False)
    options: Mapping[str, Any] = field(default_factory=dict)

    def flag(self, name: str) -> bool:
        """A requirement flag of the registered function (False when not set)."""
        return bool(flags(self.fn).get(name, False))


@dataclass(frozen=True)
class AdvantageVariant(_Variant):
    """An advantage estimator: ``variant(rewards [B, T], mask [B, T], ...) -> (adv, returns)``."""

    @property
    def needs_critic(self) -> bool:
        """True when the estimator needs ``values`` from a value model (GAE)."""
        return self.flag("needs_critic")

    @property
    def needs_index(self) -> bool:
        """True when the estimator compares samples of one prompt group."""
        return self.flag("needs_index")

    @property
    def needs_greedy_baseline(self) -> bool:
        """True when the estimator needs one greedy response's reward per prompt (ReMax)."""
        return self.flag("needs_greedy_baseline")

    @property
    def needs_reward_info(self) -> bool:
        """True when the estimator reads the rows' ``reward_info`` (reward components, GDPO)."""
        return self.flag("needs_reward_info")

    @property
    def needs_sum_pi_squared(self) -> bool:
        """True when the estimator needs Σπ² and π_old of every position (optimal token baseline)."""
        return self.flag("needs_sum_pi_squared")

    def __call__(
        self, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **inputs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimator on ``[B, T]`` rewards; ``inputs`` are the run-provided keywords it takes
        (``index``, ``values``, ``reward_baselines``, ``reward_info``, ``old_log_probs``,
        ``sum_pi_squared``, ``rollout_is_weights``); None values are not passed."""
        extra = {k: v for k, v in inputs.items() if v is not None}
        return self.fn(token_level_rewards, response_mask, **extra, **self.options)


@dataclass(frozen=True)
class LossVariant(_Variant):
    """A policy loss: ``variant(old_lp, lp, adv, mask, **framework) -> (loss, metrics)``."""

    takes_is_weights: bool = True
    """False in bypass mode with a ratio loss: the ratio π_θ/π_rollout is the correction."""

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        **framework: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if not self.takes_is_weights:
            framework.pop("rollout_is_weights", None)
        return self.fn(
            old_log_prob, log_prob, advantages, response_mask, **framework, **self.options
        )


@dataclass(frozen=True)
class KLInReward:
    """KL(π_old || π_ref) as a reward penalty: r_t = s_t − β·KL_t, β from a controller."""

    estimator: str
    controller: KLController = field(compare=False)

    def apply(
        self,
        scores: torch.Tensor,
        old_log_prob: torch.Tensor,
        ref_log_prob: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """verl's ``apply_kl_penalty``: penalized rewards and ``actor/reward_kl_penalty(_coeff)``."""
        from agentrl.algos import apply_kl_penalty

        rewards, m = apply_kl_penalty(
            scores, old_log_prob, ref_log_prob, response_mask, self.controller, self.estimator
        )
        return rewards, {f"actor/{k}": v for k, v in m.items()}


@dataclass(frozen=True)
class AlgorithmPlan:
    """Everything the train step needs to know about the algorithm (see the module docstring)."""

    advantage: AdvantageVariant
    loss: LossVariant
    correction: correction.CorrectionConfig
    loss_agg_mode: str
    entropy_coeff: float
    kl_loss_coef: float | None
    """β of the KL loss term (None = no KL loss)."""
    kl_loss_type: str
    kl_in_reward: KLInReward | None
    mask_truncated: bool = False
    """Zero the response mask of episodes that stopped on a length budget (before the update)."""
    teacher_coef: float | None = None
    """Weight of the teacher's reverse KL in the advantages (``teacher.mode: advantage``); None =
    not in the advantages (no teacher, or mode ``reward``)."""

    @property
    def needs_critic(self) -> bool:
        """A value model is trained (the estimator needs values)."""
        return self.advantage.needs_critic

    @property
    def needs_reference(self) -> bool:
        """A frozen reference policy runs (a KL loss or a KL reward penalty)."""
        return self.kl_loss_coef is not None or self.kl_in_reward is not None

    @property
    def needs_old_log_probs(self) -> bool:
        """π_old is recomputed before the update (decoupled mode; bypass anchors on π_rollout)."""
        return self.correction.needs_old_log_probs

    @property
    def needs_train_log_probs(self) -> bool:
        """Some correction (IS weights or a mask) needs π_train before the update."""
        return self.correction.needs_train_log_probs

    def describe(self) -> dict[str, Any]:
        """Plain data for logs and MLflow."""
        return {
            "advantage": {"name": self.advantage.name, **self.advantage.options},
            "loss": {"name": self.loss.name, **self.loss.options},
            "bypass": self.correction.bypass,
            "needs_critic": self.needs_critic,
            "needs_reference": self.needs_reference,
            "needs_old_log_probs": self.needs_old_log_probs,
        }


def build_variant(
    registry: Registry[Any],
    spec: Any,
    *,
    key: str,
    reserved: tuple[str, ...],
    base_dir: str | None = None,
) -> tuple[str, Any, dict[str, Any]]:
    """(name, function, validated knobs) of a ``{name, **knobs}`` config section."""
    name = spec.name
    fn = registry.get(name, key=f"{key}.name", base_dir=base_dir)
    knobs = _validate_knobs(fn, reserved, spec.knobs(), key=key, what=f"{registry.kind} {name!r}")
    return name, fn, knobs


def build_algorithm(cfg: Any, *, base_dir: str | None = None) -> AlgorithmPlan:
    """The :class:`AlgorithmPlan` of an ``algorithm`` config section (``AlgorithmConfig``)."""
    corr = cfg.correction.to_correction_config()
    adv_name, adv_fn, adv_knobs = build_variant(
        ADVANTAGE_ESTIMATORS,
        cfg.advantage,
        key="algorithm.advantage",
        reserved=ADVANTAGE_RESERVED,
        base_dir=base_dir,
    )
    loss_spec = cfg.loss
    if corr.bypass and corr.loss_type.value == "reinforce":
        # `loss_type: reinforce` (e.g. preset bypass_pg_is) *is* the choice of loss.
        if "loss" in cfg.model_fields_set and loss_spec.name != "reinforce":
            raise RegistryError(
                f"algorithm.loss.name={loss_spec.name!r} conflicts with algorithm.correction "
                "loss_type 'reinforce' (bypass policy gradient); drop algorithm.loss or use "
                "loss_type ppo_clip"
            )
        loss_spec = type(loss_spec)(name="reinforce")
    loss_name, loss_fn, loss_knobs = build_variant(
        POLICY_LOSSES, loss_spec, key="algorithm.loss", reserved=LOSS_RESERVED, base_dir=base_dir
    )
    # A ratio loss in bypass mode is PPO against π_rollout: its ratio is the correction.
    takes_is = not (corr.bypass and corr.loss_type.value == "ppo_clip")
    kl_in_reward = None
    if cfg.use_kl_in_reward:
        ctrl = cfg.kl_ctrl
        controller: KLController = (
            AdaptiveKLController(ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
            if ctrl.type == "adaptive"
            else FixedKLController(ctrl.kl_coef)
        )
        kl_penalty(torch.zeros(1), torch.zeros(1), cfg.kl_penalty)  # fails now on a bad name
        kl_in_reward = KLInReward(cfg.kl_penalty, controller)
    return AlgorithmPlan(
        advantage=AdvantageVariant(adv_name, adv_fn, dict(adv_knobs)),
        loss=LossVariant(loss_name, loss_fn, dict(loss_knobs), takes_is),
        correction=corr,
        loss_agg_mode=cfg.loss_agg_mode,
        entropy_coeff=cfg.entropy_coeff,
        kl_loss_coef=cfg.kl_loss_coef if cfg.use_kl_loss else None,
        kl_loss_type=cfg.kl_loss_type,
        kl_in_reward=kl_in_reward,
        mask_truncated=cfg.mask_truncated,
    )
