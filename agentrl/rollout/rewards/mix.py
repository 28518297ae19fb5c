"""Scoring a data source with several rewards at once (a ``{terms: ..., combine: ...}`` source).

Why it exists: a task is often scored by a rule and a model together (``numeric_match`` plus a
judge). The terms of a :class:`~agentrl.rollout.model_rewards.CombinedReward` run concurrently,
each where its kind runs (a function under a ``max_workers`` slot on the executor, a model
reward on the event loop under its own ``max_concurrency``) and each under ``timeout_s``; the
score is ``sum(weight * score)`` (:func:`~agentrl.rollout.model_rewards.combine_terms`) or the
user's ``combine(scores, traj, task)``, itself a reward call with a slot and a deadline.

Guarantees: a term that fails or times out cancels the others and fails the whole mix with an
error that names the term (the episode is then a counted drop, never a partial sum);
``reward_info["terms"]`` holds every term's score and ``reward_info[<term>]`` its own info.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any, cast

from agentrl.rollout.model_rewards import CombinedReward, combine_terms
from agentrl.rollout.rewards.base import RewardError, RewardFn, RewardTimeoutError, normalize_result
from agentrl.rollout.rewards.executor import RewardExecutor
from agentrl.rollout.rewards.sources import is_combined, is_model_call
from agentrl.types import Task, Trajectory

__all__ = ["call_reward", "score_mix"]


async def call_reward(
    fn: RewardFn, traj: Trajectory, task: Task, calls: RewardExecutor
) -> tuple[Any, bool]:
    """``(raw result, timed out)`` of any reward: a mix's terms here, anything else by
    ``calls`` (no slot taken: the caller holds the one it needs)."""
    if is_combined(fn):
        return await score_mix(cast(Any, fn), traj, task, calls), False
    return await calls.call(fn, traj, task)


async def score_mix(
    mix: CombinedReward, traj: Trajectory, task: Task, calls: RewardExecutor
) -> dict[str, Any]:
    """Every term of ``mix`` concurrently, then the weighted sum or ``mix.combine``; a result
    dict with ``score``, ``terms`` and each term's info."""
    results = await _run_terms(mix, traj, task, calls)
    if mix.combine is None:
        weights = {name: weight for name, _, weight in mix.terms}
        return combine_terms(results, weights, traj.num_turns)
    scores = {name: score for name, (score, _, _) in results.items()}
    async with calls.slot():
        out, timed_out = await calls.call(functools.partial(mix.combine, scores), traj, task)
    if timed_out:
        raise RewardTimeoutError(
            f"combine {mix.combine!r} timed out after {calls.timeout_s:g} s",
            source=task.data_source,
        )
    score, turn_rewards, info = normalize_result(out, traj)
    merged = {"terms": scores, **{n: i for n, (_, _, i) in results.items() if i}, **info}
    if turn_rewards is not None:
        merged["turn_rewards"] = turn_rewards
    return {**merged, "score": score}


async def _run_terms(
    mix: CombinedReward, traj: Trajectory, task: Task, calls: RewardExecutor
) -> dict[str, tuple[float, list[float] | None, dict[str, Any]]]:
    """``{term: normalized result}``; the first failure cancels the others and is raised."""

    async def term(name: str, fn: RewardFn) -> Any:
        """One term's normalized result; an unexpected failure names the term."""
        try:
            return await _call_term(fn, traj, task, name, calls)
        except (RewardError, ValueError):
            raise
        except Exception as exc:
            raise RuntimeError(f"term {name!r}: {type(exc).__name__}: {exc}") from exc

    tasks = [asyncio.ensure_future(term(name, fn)) for name, fn, _ in mix.terms]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:  # one term failed (or we were cancelled): stop the others
            t.cancel()
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise cast(BaseException, t.exception())
    return {name: t.result() for (name, _, _), t in zip(mix.terms, tasks, strict=True)}


async def _call_term(
    fn: RewardFn, traj: Trajectory, task: Task, name: str, calls: RewardExecutor
) -> tuple[float, list[float] | None, dict[str, Any]]:
    """One term of a mix: a function under a ``max_workers`` slot, a model reward under its
    own limit; each under ``timeout_s``. Failures name the term."""
    gate = contextlib.nullcontext() if is_model_call(fn) else calls.slot()
    async with gate:
        result, timed_out = await call_reward(fn, traj, task, calls)
    if timed_out:
        raise RewardTimeoutError(
            f"reward {name!r} (a term of data_source {task.data_source!r}) timed out after "
            f"{calls.timeout_s:g} s (reward.timeout_s)",
            source=task.data_source,
        )
    try:
        return normalize_result(result, traj)
    except ValueError as exc:
        raise ValueError(f"term {name!r}: {exc}") from exc
