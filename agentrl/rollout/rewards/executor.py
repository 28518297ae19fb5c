"""Where a reward call runs, and the deadline that holds whatever the function does.

Why it exists: reward functions are user code. A judge does I/O, a grader burns CPU, and any of
them may hang; the episode that waits for its score must still end on time, and a hung call
must not stop the run from exiting. :class:`RewardExecutor` runs one call
(:meth:`RewardExecutor.call`) where ``executor`` says:

| ``executor`` | async functions | sync functions |
|---|---|---|
| ``async`` | awaited on the event loop | the built-in rules inline; any other on the thread pool |
| ``thread`` | awaited on the event loop | a bounded pool of daemon threads |
| ``process`` | run to completion in a worker process | spawned worker processes |

A model reward's ``score`` always runs on the event loop.

Guarantees:

- every call returns by ``timeout_s``: an async function is cancelled and abandoned (even one
  that swallows ``CancelledError``), a sync function's thread is abandoned (threads cannot be
  killed; the pool is bounded, separate from the loop's default executor, and its daemon threads
  never keep the process from exiting), a process worker is SIGKILLed and replaced
  (:mod:`agentrl.rollout.rewards.processes`);
- a timed-out call still running ``1 s`` later is counted ``abandoned``, a killed worker
  ``killed`` (per data source, :class:`~agentrl.rollout.rewards.counters.RewardCounts`);
- :meth:`RewardExecutor.slot` is the ``max_workers`` semaphore the manager holds around a
  function call (model rewards take none: they have their own ``max_concurrency``).

Pools and the semaphore are per process and event loop: created on first use, dropped when the
executor is pickled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import logging
from typing import Any, Literal

from agentrl.rollout.rewards.base import RewardConfigError, RewardFn
from agentrl.rollout.rewards.counters import RewardCounts
from agentrl.rollout.rewards.processes import ProcessWorkers
from agentrl.rollout.rewards.rules import calculator_reward, exact_match, numeric_match, tool_format
from agentrl.rollout.rewards.sources import is_model_call
from agentrl.types import Task, Trajectory
from tools.executor import DaemonThreadPool

__all__ = ["Executor", "RewardExecutor"]

logger = logging.getLogger(__name__)

Executor = Literal["async", "thread", "process"]
"""Where sync reward functions run (``reward.executor``)."""

_ABANDON_GRACE_S = 1.0
"""Seconds a timed-out reward call has to stop before it counts as abandoned."""
_INLINE_RULES = (exact_match, numeric_match, calculator_reward, tool_format)
"""The sync functions the ``async`` executor runs on the event loop: bounded, pure, ours."""


class RewardExecutor:
    """Runs reward calls on the event loop, a daemon thread pool or worker processes, each
    under ``timeout_s``; ``max_workers`` bounds the pools and :meth:`slot`.

    ``counts`` receives ``abandoned`` and ``killed`` per data source.
    """

    def __init__(
        self, executor: Executor, max_workers: int, timeout_s: float, counts: RewardCounts
    ) -> None:
        if executor not in ("async", "thread", "process"):
            raise RewardConfigError(
                f"reward executor {executor!r}: use 'async', 'thread' or 'process'"
            )
        if max_workers < 1:
            raise RewardConfigError(f"reward max_workers = {max_workers}; it must be >= 1")
        if timeout_s is None or not timeout_s > 0:
            raise RewardConfigError(
                f"reward timeout_s = {timeout_s!r}; it must be a number of seconds > 0 "
                "(every reward call needs a deadline)"
            )
        self.executor: Executor = executor
        self.max_workers = max_workers
        self.timeout_s = float(timeout_s)
        self.counts = counts
        self._threads: DaemonThreadPool | None = None
        self._processes: ProcessWorkers | None = None
        self._semaphore: asyncio.Semaphore | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_threads=None, _processes=None, _semaphore=None)
        return state

    @property
    def threads_busy(self) -> int:
        """Pool threads running a call now (abandoned ones included)."""
        return self._threads.busy if self._threads is not None else 0

    def slot(self) -> asyncio.Semaphore:
        """The ``max_workers`` semaphore (created in the running loop)."""
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_workers)
        return self._semaphore

    async def call(self, fn: RewardFn, traj: Trajectory, task: Task) -> tuple[Any, bool]:
        """``fn(traj, task)`` under ``timeout_s``: (result, False), or (None, True) when the
        deadline passed (the call is then abandoned or its worker killed, and counted).
        Exceptions of the function propagate (from a worker process as ``WorkerCallError``)."""
        if self.executor == "process" and not is_model_call(fn):
            return await self._call_in_process(fn, traj, task)
        thread: concurrent.futures.Future[Any] | None = None
        if inspect.iscoroutinefunction(fn):
            work: asyncio.Future[Any] = asyncio.ensure_future(fn(traj, task))
        elif self._runs_inline(fn):
            return fn(traj, task), False
        else:
            future = self._thread_pool().submit(contextvars.copy_context().run, fn, traj, task)
            thread, work = future, asyncio.wrap_future(future)
        try:
            done, _ = await asyncio.wait({work}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            work.cancel()
            raise
        if not done:
            work.cancel()
            if thread is not None and self._threads is not None:
                self._threads.detach(thread)  # its worker goes back to healthy calls
            self._check_abandoned(task.data_source, work, thread)
            return None, True
        out = work.result()
        return (await out if inspect.isawaitable(out) else out), False

    async def _call_in_process(
        self, fn: RewardFn, traj: Trajectory, task: Task
    ) -> tuple[Any, bool]:
        if self._processes is None:
            self._processes = ProcessWorkers()
        try:
            return await self._processes.call(fn, traj, task, self.timeout_s), False
        except TimeoutError:
            self.counts.count(task.data_source, "killed")
            return None, True

    def _thread_pool(self) -> DaemonThreadPool:
        if self._threads is None:
            self._threads = DaemonThreadPool(self.max_workers, name="agentrl-reward")
        return self._threads

    def _runs_inline(self, fn: RewardFn) -> bool:
        """Sync functions run on the event loop only when they are the built-in rules (bounded,
        ours); user code always runs where a deadline can be enforced."""
        return self.executor == "async" and any(fn is rule for rule in _INLINE_RULES)

    def _check_abandoned(
        self,
        source: str,
        work: asyncio.Future[Any],
        thread: concurrent.futures.Future[Any] | None,
    ) -> None:
        """Count the timed-out call as abandoned if it still runs ``_ABANDON_GRACE_S`` later."""
        work.add_done_callback(lambda f: f.cancelled() or f.exception())

        def check() -> None:
            """Count the call as abandoned (and warn) if it is still running."""
            if not work.done() or (thread is not None and not thread.done()):
                self.counts.count(source, "abandoned")
                logger.warning(
                    "a reward call for data_source %r still runs %.0f s after its deadline "
                    "(it ignores cancellation, or its thread cannot be stopped)",
                    source,
                    _ABANDON_GRACE_S,
                )

        asyncio.get_running_loop().call_later(_ABANDON_GRACE_S, check)

    def close(self) -> None:
        """Stop the workers (idempotent); never waits for a hung thread."""
        if self._threads is not None:
            self._threads.shutdown(cancel_futures=True)
            self._threads = None
        if self._processes is not None:
            self._processes.close()
            self._processes = None
