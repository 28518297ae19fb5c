"""One training step as plain functions: π_old -> correction -> reference -> rewards -> values ->
advantages -> (OPSM) -> update; with ``mask_truncated`` the rows of length-cut episodes are masked
first. The staleness-aware corrections (:mod:`agentrl.training.offpolicy`)
read the trainer's ``version``.

When the update is one optimizer step on the batch and nothing needs π_old before it
(:func:`fuses_old_log_probs`), π_old is the update's own first forward (detached) and the
correction's row-local IS weights are formed per micro-batch inside it: one forward pass less
per step, the same numbers (TRL does the same when it takes one step per generation).

Why it exists: the step is where the RL math meets the models, and it must be readable and
testable without servers. Each stage is a small function of a TensorDict batch; :func:`train_step`
chains them in a dozen lines. The models are anything with the :class:`Policies` methods, so
unit tests drive every path (decoupled and bypass correction, KL loss and KL reward, critic,
ReMax baselines) with a scripted fake policy in seconds (``tests/unit/training/test_step.py``).

Batch keys (declared in :data:`agentrl.batch.BATCH_SCHEMA`; the models check what they
receive): ``old_log_probs`` is π_old (decoupled) or π_rollout (bypass);
``rollout_is_weights`` and the RS-masked ``response_mask`` come from the correction;
``token_level_rewards`` = ``token_level_scores`` − β·KL when KL is in the reward.

Example::

    out = await train_step(trajs, Policies(actor, ref, critic), plan, pad_token_id=0)
    out.metrics["actor/pg_loss"], out.batch["advantages"]
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tensordict import TensorDict

import correction
from agentrl.batch import non_tensor_list, trajectories_to_batch
from agentrl.training.algorithm import AlgorithmPlan
from agentrl.training.offpolicy import (
    apply_opsm,
    loglinear_diagnostics,
    masked_totals,
    prepare_loglinear,
    row_staleness,
)
from agentrl.types import StopReason, Trajectory

__all__ = [
    "Policies",
    "PolicyModel",
    "StepOutput",
    "anchor_log_probs",
    "apply_teacher",
    "compute_advantages",
    "compute_rewards",
    "expand_turn_samples",
    "fuses_old_log_probs",
    "mask_truncated",
    "run_correction",
    "token_version_metrics",
    "train_step",
    "trajectory_metrics",
]


class PolicyModel(Protocol):
    """What the step needs of the actor (and, with ``compute_log_probs`` only, the reference)."""

    def compute_log_probs(self, batch: TensorDict) -> torch.Tensor: ...

    def update_with_log_probs(self, batch: TensorDict) -> tuple[dict[str, float], torch.Tensor]: ...


@dataclass
class Policies:
    """The models of a run: the actor, and the reference and critic when the plan needs them."""

    actor: Any
    reference: Any | None = None
    critic: Any | None = None


@dataclass
class StepOutput:
    """The batch as trained on (every intermediate key filled in) and the step's metrics."""

    batch: TensorDict
    metrics: dict[str, float] = field(default_factory=dict)


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run model work in a thread, so the event loop keeps serving rollouts meanwhile."""
    return await asyncio.to_thread(fn, *args)


async def anchor_log_probs(
    batch: TensorDict, actor: Any, plan: AlgorithmPlan, m: dict[str, float]
) -> torch.Tensor | None:
    """Fill ``old_log_probs`` (π_old, or π_rollout in bypass mode) and return π_train when the
    plan computes it before the update (decoupled mode, or bypass with IS/RS rules)."""
    t0 = time.perf_counter()
    train_lp: torch.Tensor | None = None
    if plan.advantage.needs_sum_pi_squared:
        lp, batch["sum_pi_squared"] = await _off_loop(
            actor.compute_log_probs_and_sum_pi_squared, batch
        )
        batch["train_log_probs"] = lp  # the π the baseline's Σπ² belongs to (also in bypass)
        train_lp = lp if (plan.needs_old_log_probs or plan.needs_train_log_probs) else None
        batch["old_log_probs"] = (
            lp if plan.needs_old_log_probs else batch["rollout_log_probs"].clone()
        )
        m["timing_s/old_log_prob"] = time.perf_counter() - t0
        return train_lp
    if plan.needs_old_log_probs or plan.needs_train_log_probs:
        train_lp = await _off_loop(actor.compute_log_probs, batch)
    batch["old_log_probs"] = (
        train_lp if plan.needs_old_log_probs else batch["rollout_log_probs"].clone()
    )
    m["timing_s/old_log_prob"] = time.perf_counter() - t0
    return train_lp


def expand_turn_samples(
    trajs: Sequence[Trajectory], reward_baselines: torch.Tensor | None, m: dict[str, float]
) -> list[Trajectory]:
    """The rows to train: each episode as it is, or (``agent.history: per_turn``) one row per
    model turn, with the turn's own prompt, sharing the episode's reward, ``uid`` (its group for
    advantages) and stop reason. Logs ``rollout/turn_samples`` (rows made from per-turn
    episodes)."""
    rows = [row for t in trajs for row in t.per_turn_samples()]
    if any(t.turn_samples for t in trajs):
        if reward_baselines is not None:
            raise ValueError(
                "agent.history: per_turn trains one row per model turn, but ReMax's greedy "
                "baselines are one per episode; use another advantage estimator or "
                "agent.history: concat"
            )
        m["rollout/turn_samples"] = float(sum(len(t.turn_samples) for t in trajs))
    return rows


def mask_truncated(batch: TensorDict, trajs: Sequence[Trajectory], m: dict[str, float]) -> None:
    """Zero the ``response_mask`` rows of episodes cut by a length budget (``stop_reason``
    ``length``): they train nothing, but their scores stay in the batch, so they still count in
    their group's statistics (TRL's ``mask_truncated_completions``). Logs
    ``actor/masked_truncated_frac`` (share of rows masked)."""
    cut = torch.tensor([t.stop_reason is StopReason.LENGTH for t in trajs], dtype=torch.bool)
    mask = batch["response_mask"]
    batch["response_mask"] = mask * (~cut).to(mask.dtype).unsqueeze(1)
    m["actor/masked_truncated_frac"] = float(cut.float().mean())


def run_correction(
    batch: TensorDict,
    train_lp: torch.Tensor,
    plan: AlgorithmPlan,
    m: dict[str, float],
    staleness: torch.Tensor | None = None,
) -> None:
    """IS weights, RS/M2PO/staleness masks and the off-policy diagnostics (``rollout_corr/``) of
    the batch (``staleness`` ``[B]``: needed by the staleness-adaptive bound only)."""
    out = correction.apply_correction(
        plan.correction,
        None,
        batch["response_mask"].float(),
        rollout_log_probs=batch["rollout_log_probs"],
        train_log_probs=train_lp,
        staleness=staleness,
    )
    if out.weights is not None:
        batch["rollout_is_weights"] = out.weights
    batch["response_mask"] = out.response_mask.to(batch["response_mask"].dtype)
    m.update({f"rollout_corr/{k}": v for k, v in out.metrics.items()})


def compute_rewards(batch: TensorDict, plan: AlgorithmPlan, m: dict[str, float]) -> None:
    """``token_level_rewards``: the scores, minus β·KL(π_old || π_ref) when KL is in the reward."""
    scores = batch["token_level_scores"]
    if plan.kl_in_reward is None:
        batch["token_level_rewards"] = scores
        return
    rewards, kl_metrics = plan.kl_in_reward.apply(
        scores, batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"]
    )
    batch["token_level_rewards"] = rewards
    m.update(kl_metrics)


def compute_advantages(
    batch: TensorDict,
    plan: AlgorithmPlan,
    reward_baselines: torch.Tensor | None = None,
    reward_info: Sequence[dict[str, Any]] | None = None,
) -> None:
    """``advantages`` and ``returns`` by the plan's estimator, given what it says it needs
    (group ids, values, greedy baselines, reward components, Σπ² with π_old)."""
    est = plan.advantage
    adv, returns = est(
        batch["token_level_rewards"],
        batch["response_mask"].float(),
        index=non_tensor_list(batch, "uid") if est.needs_index else None,
        values=batch.get("values") if est.needs_critic else None,
        reward_baselines=reward_baselines if est.needs_greedy_baseline else None,
        reward_info=list(reward_info) if est.needs_reward_info and reward_info else None,
        old_log_probs=batch.get("train_log_probs") if est.needs_sum_pi_squared else None,
        sum_pi_squared=batch.get("sum_pi_squared") if est.needs_sum_pi_squared else None,
        rollout_is_weights=batch.get("rollout_is_weights") if est.needs_sum_pi_squared else None,
    )
    batch["advantages"] = adv
    batch["returns"] = returns


def apply_teacher(
    batch: TensorDict, trajs: Sequence[Trajectory], plan: AlgorithmPlan, m: dict[str, float]
) -> None:
    """The distillation term: ``advantages -= teacher_coef * (log π_rollout - log π_teacher)``
    on sampled tokens when the plan puts it in the advantages (``teacher.mode: advantage``);
    logs ``teacher/reverse_kl_mean`` and ``teacher/score_seconds`` (mean per episode) in both
    modes. The student side is π_rollout, the policy that sampled the tokens
    (:mod:`agentrl.rollout.teacher` says why)."""
    from agentrl.algos.distill import add_teacher_advantage

    adv, metrics = add_teacher_advantage(
        batch["advantages"],
        batch["rollout_log_probs"],
        batch["teacher_log_probs"],
        batch["response_mask"],
        plan.teacher_coef or 0.0,
    )
    if plan.teacher_coef is not None:
        batch["advantages"] = adv
    m.update(metrics)
    m["teacher/score_seconds"] = _mean([t.timings.get("teacher", 0.0) for t in trajs])


def fuses_old_log_probs(plan: AlgorithmPlan, actor: Any, num_rows: int) -> bool:
    """True when π_old can come from the update's own first forward instead of a pass of its
    own: decoupled mode, the update is one optimizer step (:meth:`Actor.fuses_old_log_probs`),
    and nothing needs π_old before it: no mask (RS rules, M2PO, OPSM, staleness RS: they change
    the mask the advantages and the loss normalizer see), no batch-normalized IS, no KL in the
    reward, no Σπ² baseline."""
    c = plan.correction
    fusable = getattr(actor, "fuses_old_log_probs", None)
    return (
        plan.needs_old_log_probs
        and not c.masks_before_update
        and not c.is_batch_normalize
        and plan.kl_in_reward is None
        and not plan.advantage.needs_sum_pi_squared
        and fusable is not None
        and bool(fusable(num_rows))
    )


async def _update_models(
    batch: TensorDict,
    policies: Policies,
    train_actor: bool,
    m: dict[str, float],
    anchor: correction.CorrectionConfig | None = None,
) -> torch.Tensor | None:
    """Critic update (when there is one), then the actor's; returns the actor's first-pass π_θ."""
    if policies.critic is not None:
        from agentrl.training.metrics import value_metrics

        m.update(value_metrics(batch["values"], batch["returns"], batch["response_mask"]))
        t0 = time.perf_counter()
        m.update(await _off_loop(policies.critic.update, batch))
        m["timing_s/update_critic"] = time.perf_counter() - t0
        m["actor/frozen"] = float(not train_actor)
    if not train_actor:
        return None
    t0 = time.perf_counter()
    update = policies.actor.update_with_log_probs
    if anchor is not None:
        update = functools.partial(update, anchor=anchor)
    actor_metrics, first_lp = await _off_loop(update, batch)
    m["timing_s/update_actor"] = time.perf_counter() - t0
    m.update(actor_metrics)
    return first_lp


async def train_step(
    trajs: Sequence[Trajectory],
    policies: Policies,
    plan: AlgorithmPlan,
    *,
    pad_token_id: int,
    train_actor: bool = True,
    reward_baselines: torch.Tensor | None = None,
    version: int | None = None,
) -> StepOutput:
    """One optimizer step on ``trajs`` (see the module docstring for the stages); ``version`` is
    the version of the weights being trained (needed by the staleness-aware corrections)."""
    m: dict[str, float] = {}
    trajs = expand_turn_samples(trajs, reward_baselines, m)
    batch = trajectories_to_batch(list(trajs), pad_token_id=pad_token_id)
    if plan.mask_truncated:
        mask_truncated(batch, trajs, m)
    mask_before = batch["response_mask"].clone()
    corr = plan.correction
    loglinear = corr.proximal is correction.ProximalMethod.LOGLINEAR
    fused = train_actor and fuses_old_log_probs(plan, policies.actor, len(trajs))
    train_lp = None if fused else await anchor_log_probs(batch, policies.actor, plan, m)
    if loglinear:
        m.update(prepare_loglinear(batch, version))
    if train_lp is not None:
        stale = row_staleness(batch, version) if corr.stale_rs_multiplier is not None else None
        run_correction(batch, train_lp, plan, m, stale)
    if policies.reference is not None:
        batch["ref_log_prob"] = await _off_loop(policies.reference.compute_log_probs, batch)
    compute_rewards(batch, plan, m)
    if policies.critic is not None:
        t0 = time.perf_counter()
        batch["values"] = await _off_loop(policies.critic.compute_values, batch)
        m["timing_s/values"] = time.perf_counter() - t0
    compute_advantages(batch, plan, reward_baselines, [t.reward_info for t in trajs])
    if batch.get("teacher_log_probs") is not None:
        apply_teacher(batch, trajs, plan, m)
    if corr.opsm_threshold is not None:
        assert train_lp is not None  # OPSM needs π_train before the update (the plan says so)
        m.update(apply_opsm(batch, train_lp, corr))
    anchor = corr if fused or loglinear else None
    first_lp = await _update_models(batch, policies, train_actor, m, anchor)
    if loglinear:
        theta = first_lp
        if theta is None:
            theta = await _off_loop(policies.actor.compute_log_probs, batch)
        m.update(loglinear_diagnostics(batch, theta, corr))
    elif fused:
        # π_old was the update's first forward: the batch and the diagnostics get the same
        # numbers the separate pass would have given (row-local IS: the weights are equal).
        assert first_lp is not None
        batch["old_log_probs"] = first_lp
        run_correction(batch, first_lp, plan, m)
        m["actor/old_log_prob_fused"] = 1.0
    elif train_lp is None:
        # Bypass without IS/RS: the diagnostics come from the update's first pass (π_θ before
        # the step), or, while the actor is frozen, from one forward pass of the policy.
        theta = first_lp
        if theta is None:
            theta = await _off_loop(policies.actor.compute_log_probs, batch)
        diag = correction.offpolicy_metrics(
            theta, batch["rollout_log_probs"], batch["response_mask"].float()
        )
        m.update({f"rollout_corr/{k}": v for k, v in diag.items()})
    m.update(masked_totals(mask_before, batch["response_mask"]))
    return StepOutput(batch, m)


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def is_correct(t: Trajectory) -> bool:
    """``reward_info["correct"]`` when the reward says so, else reward > 0.5."""
    correct = t.reward_info.get("correct")
    return bool(correct) if correct is not None else t.reward > 0.5


def token_version_metrics(trajs: Sequence[Trajectory], version: int) -> dict[str, float]:
    """Per-token staleness: ``async/token_staleness_mean`` (``version`` − each sampled token's
    own ``policy_version``, averaged over the sampled tokens) and
    ``async/mixed_version_episodes`` (episodes whose sampled tokens span several versions: a
    partial rollout resumed, or kept, across a weight push)."""
    sampled = [[v for v, m in zip(t.policy_version, t.loss_mask, strict=True) if m] for t in trajs]
    ages = [version - v for vs in sampled for v in vs]
    mixed = sum(len(set(vs)) > 1 for vs in sampled)
    return {
        "async/token_staleness_mean": _mean([float(a) for a in ages]),
        "async/mixed_version_episodes": float(mixed),
    }


def trajectory_metrics(
    trajs: Sequence[Trajectory], version: int, batch: TensorDict | None = None
) -> dict[str, float]:
    """``reward/``, ``async/`` staleness and ``rollout/`` metrics of the trained trajectories."""
    rewards = [t.reward for t in trajs]
    staleness = [t.staleness(version) for t in trajs]
    m = {
        "reward/mean": _mean(rewards),
        "reward/max": max(rewards),
        "reward/min": min(rewards),
        "reward/accuracy": _mean([float(is_correct(t)) for t in trajs]),
        "async/staleness_mean": _mean([float(s) for s in staleness]),
        "async/staleness_max": float(max(staleness)),
        **token_version_metrics(trajs, version),
        "rollout/response_length_mean": _mean([float(len(t.response_ids)) for t in trajs]),
        "rollout/num_turns_mean": _mean([float(t.num_turns) for t in trajs]),
        "rollout/tool_calls_mean": _mean([float(sum(t.tool_calls.values())) for t in trajs]),
    }
    # the stop policy's counters are always logged (0 when no episode counted one)
    episode_counts: dict[str, float] = {
        k: 0.0 for k in ("tool_calls_malformed", "tool_calls_unrun", "abort_resumes")
    }
    for t in trajs:
        for key, value in t.metrics.items():
            # e.g. tool_calls_malformed, tool_calls_unrun, abort_resumes
            episode_counts[key] = episode_counts.get(key, 0.0) + value
    for key, value in episode_counts.items():
        m[f"rollout/{key}"] = float(value)
    for reason, n in Counter(t.stop_reason.value for t in trajs).items():
        m[f"rollout/stop_reason/{reason}"] = float(n) / len(trajs)
    m["rollout/error_episodes"] = float(sum(t.stop_reason is StopReason.ERROR for t in trajs))
    if batch is not None:
        mask = batch["response_mask"].float()
        adv = batch["advantages"]
        m["critic/advantages_mean"] = float((adv * mask).sum() / mask.sum().clamp(min=1))
        m["critic/advantages_abs_max"] = float(adv.abs().max())
    return m
