"""RewardManager: score each episode the moment it ends, under a deadline, counted.

Why it exists: the rollout workers hand every finished episode to one object that knows which
reward scores its data source, runs it without blocking the other episodes, and says what went
wrong when it fails. :class:`RewardManager` is that object; it composes the resolution of the
config (:class:`~agentrl.rollout.rewards.sources.RewardSources`), where calls run
(:class:`~agentrl.rollout.rewards.executor.RewardExecutor`), mixes
(:mod:`agentrl.rollout.rewards.mix`) and the counters
(:class:`~agentrl.rollout.rewards.counters.RewardCounts`).

Guarantees:

- every reward call has a deadline (``timeout_s``, config ``reward.timeout_s``) that holds
  whatever the function does (the executor's module docstring says how);
- a reward function that raises, times out or returns something malformed makes
  :meth:`RewardManager.score` raise :class:`~agentrl.rollout.rewards.base.RewardError`
  (:class:`~agentrl.rollout.rewards.base.RewardTimeoutError` for a timeout) naming the
  function and the data source, after it is logged and counted per data source
  (``reward/<source>/errors``, ``timeouts``, ``abandoned``, ``killed``); the caller decides
  what happens to the trajectory (it is never silently scored 0.0 here);
- at most ``max_workers`` function calls run at once (a semaphore), whatever the executor;
  model rewards run on the event loop and take no slot (a mix's function terms take one each);
- ``score`` returns a copy of the trajectory; the manager pickles (pools, semaphores and HTTP
  clients are recreated in the process and event loop that use it).

With a distillation teacher (:attr:`RewardManager.teacher`, set by the builder), every scored
episode is then scored by it too (:meth:`agentrl.rollout.teacher.Teacher.apply`); a teacher that
fails is a :class:`~agentrl.rollout.rewards.base.RewardError` like a failed reward.

Shutdown: :meth:`RewardManager.close` stops the thread pool (never waiting for a hung thread)
and the worker processes; :meth:`RewardManager.aclose` also closes the model rewards' clients.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agentrl.rollout.model_rewards import ModelReward
from agentrl.rollout.rewards.base import (
    RewardError,
    RewardFn,
    RewardTimeoutError,
    normalize_result,
)
from agentrl.rollout.rewards.counters import RewardCounts
from agentrl.rollout.rewards.executor import Executor, RewardExecutor
from agentrl.rollout.rewards.mix import call_reward
from agentrl.rollout.rewards.processes import WorkerCallError
from agentrl.rollout.rewards.rules import tool_format
from agentrl.rollout.rewards.sources import RewardSources, is_combined, is_model_call, reward_name
from agentrl.types import Task, Trajectory

__all__ = ["RewardManager"]

logger = logging.getLogger(__name__)

_Scored = tuple[float, list[float] | None, dict[str, Any], RewardError | None]
"""``(score, turn_rewards, info, failure)`` of one call."""


class RewardManager:
    """Scores trajectories per ``data_source`` as they finish, with bounded concurrency.

    Args:
        sources: ``data_source -> reward`` (a built-in name, ``module:function`` or callable).
        default: reward for data sources not in ``sources``. When None, a data source that is
            itself a built-in name (e.g. ``calculator``) uses that built-in; any other is an error.
        executor: ``"async"`` (event loop), ``"thread"`` or ``"process"`` (see
            :mod:`agentrl.rollout.rewards.executor`).
        max_workers: most reward calls in flight (and the pool size).
        timeout_s: per-call deadline (> 0). Past it the call is abandoned (async and thread:
            cancelled, its thread left to finish) or its worker process killed, and
            :class:`~agentrl.rollout.rewards.base.RewardTimeoutError` is raised.
        format_weight: adds ``format_weight * tool_format(traj, task)`` to every successful
            score (``reward_info["tool_format"]`` reports the term); 0 = off.
        base_dir: the folder ``path/file.py:function`` specs resolve against.
        models: named model rewards (``reward.models``: a reward model or an LLM judge, see
            :mod:`agentrl.rollout.model_rewards`), usable by name in ``sources``/``default``;
            they score once :meth:`connect_models` has given them their servers.

    A ``sources`` value may also be a mix ``{"terms": {name: weight} | [names], "combine":
    "module:function" | None}``: the terms run concurrently (each under its own executor and
    deadline) and their scores are summed with the weights, or handed to ``combine``. Model
    rewards always run on the event loop; only function rewards take a ``max_workers`` slot.

    ``score(traj, task)`` raises :class:`~agentrl.rollout.rewards.base.RewardError`
    (``RewardTimeoutError`` for a timeout) when the reward function fails, after counting it,
    and :class:`~agentrl.rollout.rewards.base.RewardConfigError` for a data source with no
    reward configured.
    """

    def __init__(
        self,
        sources: Mapping[str, str | RewardFn] | None = None,
        default: str | RewardFn | None = None,
        executor: Executor = "async",
        max_workers: int = 4,
        timeout_s: float = 60.0,
        format_weight: float = 0.0,
        base_dir: Any = None,
        models: Mapping[str, Any] | None = None,
    ) -> None:
        self._counts = RewardCounts()
        self._calls = RewardExecutor(executor, max_workers, timeout_s, self._counts)
        self.executor: Executor = executor
        self.max_workers = max_workers
        self.timeout_s = self._calls.timeout_s
        self.format_weight = format_weight
        self._sources = RewardSources(
            sources,
            default,
            models=models,
            timeout_s=self.timeout_s,
            base_dir=base_dir,
            check_pickle=executor == "process",
        )
        self.models: dict[str, ModelReward] = self._sources.models
        """Model rewards by name (``reward.models``)."""
        self.teacher: Any = None
        """The distillation :class:`~agentrl.rollout.teacher.Teacher` (``teacher``), or None."""

    @classmethod
    def from_config(
        cls, cfg: Any, *, base_dir: Any = None, extra_sources: Mapping[str, Any] | None = None
    ) -> RewardManager:
        """Build from the ``reward`` config section (``sources``, ``default``, ``executor``,
        ``max_workers``, ``timeout_s``, ``format_weight``, ``models``; any object with those
        attributes); path specs resolve against ``base_dir`` (the config file's folder).
        ``extra_sources`` (e.g. an environment's reward) score data sources the section does
        not name."""
        return cls(
            base_dir=base_dir,
            sources={**dict(extra_sources or {}), **dict(cfg.sources)},
            default=cfg.default,
            executor=cfg.executor,
            max_workers=cfg.max_workers,
            timeout_s=cfg.timeout_s,
            format_weight=cfg.format_weight,
            models=dict(cfg.models),
        )

    def connect_models(self, urls: Mapping[str, Sequence[str]], api_key: str | None = None) -> None:
        """Give each model reward its servers (``{name: base URLs}``, from the builder) and the
        key they want (an entry's own ``api_key`` wins)."""
        self._sources.connect_models(urls, api_key)

    def model_servers(self) -> tuple[dict[str, list[str]], str | None]:
        """``({name: urls}, api_key)`` as given to :meth:`connect_models`: what a manager in
        another process (a Ray reward actor) needs to reach the same servers."""
        return self._sources.model_servers()

    def reward_fn_for(self, data_source: str) -> RewardFn:
        """The reward function that scores tasks of ``data_source``."""
        return self._sources.reward_fn_for(data_source)

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        """A copy of ``traj`` with ``reward``, ``turn_rewards``, ``reward_info`` and
        ``timings["reward"]`` set. A reward function that raises, returns something malformed
        or runs past ``timeout_s`` raises :class:`~agentrl.rollout.rewards.base.RewardError`
        (counted per data source)."""
        fn = self.reward_fn_for(task.data_source)
        # Model rewards and mixes take no slot here: their function terms take one each.
        gate = self._calls.slot() if not (is_model_call(fn) or is_combined(fn)) else None
        async with gate or contextlib.nullcontext():
            self._counts.in_flight += 1
            start = time.perf_counter()
            try:
                score, turn_rewards, info, failure = await self._score_once(fn, traj, task)
            finally:
                self._counts.in_flight -= 1
            elapsed = time.perf_counter() - start
        self._counts.observe(elapsed)
        if failure is not None:
            raise failure
        scored = traj.model_copy(
            update={
                "reward": score,
                "turn_rewards": turn_rewards if turn_rewards is not None else traj.turn_rewards,
                "reward_info": {**traj.reward_info, **info},
                "timings": {**traj.timings, "reward": elapsed},
            }
        )
        return scored if self.teacher is None else await self._teach(scored, task)

    async def _teach(self, traj: Trajectory, task: Task) -> Trajectory:
        """``traj`` scored by the teacher; its failure is counted and raised as a RewardError."""
        from agentrl.rollout.teacher import TeacherError

        try:
            return await self.teacher.apply(traj)
        except TeacherError as exc:
            self._counts.count(task.data_source, "errors")
            raise self._failure(exc, "teacher", traj, task) from exc

    async def _score_once(self, fn: RewardFn, traj: Trajectory, task: Task) -> _Scored:
        """One bounded call, normalized and counted; failures returned as a RewardError."""
        source = task.data_source
        name = reward_name(fn)
        try:
            result, timed_out = await call_reward(fn, traj, task, self._calls)
            if timed_out:
                raise RewardTimeoutError(
                    f"reward function {name!r} for data_source {source!r} timed out after "
                    f"{self.timeout_s:g} s (reward.timeout_s)",
                    source=source,
                )
            score, turn_rewards, info = normalize_result(result, traj)
            if self.format_weight:
                fmt = float(tool_format(traj, task)["score"])
                info["tool_format"] = fmt
                score += self.format_weight * fmt
        except RewardTimeoutError as exc:
            self._counts.count(source, "timeouts", "errors")
            logger.warning("trajectory %s (task %s): %s", traj.uid, task.id, exc)
            return 0.0, None, {}, exc
        except Exception as exc:
            self._counts.count(source, "errors")
            return 0.0, None, {}, self._failure(exc, name, traj, task)
        self._counts.count(source, "scored")
        return score, turn_rewards, info, None

    @staticmethod
    def _failure(exc: Exception, name: str, traj: Trajectory, task: Task) -> RewardError:
        """The :class:`RewardError` for ``exc`` (logged), naming the function and data source."""
        detail = str(exc) if isinstance(exc, WorkerCallError) else f"{type(exc).__name__}: {exc}"
        error = RewardError(
            f"reward function {name!r} for data_source {task.data_source!r} failed: {detail}",
            source=task.data_source,
        )
        error.__cause__ = exc
        logger.warning("trajectory %s (task %s): %s", traj.uid, task.id, error)
        return error

    def metrics(self) -> dict[str, float]:
        """Cumulative counters since construction (``reward/`` family).

        Totals ``reward/scored``, ``errors`` (timeouts included), ``timeouts``, and per data
        source ``reward/<source>/scored``, ``errors``, ``timeouts``, ``abandoned`` (timed-out
        calls still running ``1 s`` later: an async function ignoring cancellation, or a thread
        that cannot be stopped), ``killed`` (process workers killed at the deadline); plus
        ``reward/in_flight``, ``reward/threads_busy`` and the latency of every call; and per
        model reward ``reward/models/<name>/requests``, ``scored``, ``errors``, ``unparsed``,
        ``latency_mean_s``, ``latency_max_s``.
        """
        return {
            **self._counts.metrics(threads_busy=self._calls.threads_busy),
            **{k: v for model in self.models.values() for k, v in model.metrics().items()},
        }

    def close(self) -> None:
        """Stop the workers (idempotent); never waits for a hung thread."""
        self._calls.close()

    async def aclose(self) -> None:
        """:meth:`close`, and close the model rewards' HTTP clients."""
        self.close()
        for model in self.models.values():
            await model.aclose()
        if self.teacher is not None:
            await self.teacher.aclose()

    async def __aenter__(self) -> RewardManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
