"""Spawned worker processes for CPU-bound reward functions (``reward.executor: process``).

Why it exists: a grader that runs unit tests or symbolic math holds the GIL for seconds, and a
hung one cannot be stopped inside the trainer's process. Here each call runs in a worker
process that can be killed.

Guarantees:

- one call per worker at a time; an idle worker is reused, a dead one replaced;
- a call past its deadline SIGKILLs its worker (the next call starts a new one) and raises
  ``TimeoutError``; a call cancelled mid-way kills its worker too (its state is unknown);
- a function that raises answers :class:`WorkerCallError` with ``Type: message`` (user
  exceptions need not pickle) and keeps its worker;
- a killed worker's zombie is reaped without blocking the event loop; idle workers stop on
  :meth:`ProcessWorkers.close` (EOF, then SIGKILL after 5 s);
- workers are spawned, never forked: the parent runs threads (servers, torch) that a fork
  would copy mid-lock. Each uses one BLAS/OpenMP thread (``agentrl.threads``).

Functions travel by reference (pickle), so they must be module-level in an importable module;
:class:`~agentrl.rollout.rewards.RewardManager` checks that when it is built.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import os
from typing import Any

from agentrl.rollout.rewards.base import RewardFn, RewardResult
from agentrl.types import Task, Trajectory

__all__ = ["ProcessWorkers", "WorkerCallError"]

_WORKER_START_TIMEOUT_S = 120.0
"""Seconds a new process worker may take to start (not counted in a call's ``timeout_s``)."""


class WorkerCallError(Exception):
    """The reward function raised inside a worker process (message: ``Type: text``)."""


def _call_in_process(fn: RewardFn, traj: Trajectory, task: Task) -> RewardResult:
    """Runs in a worker process: call ``fn``, driving it to completion if it is async."""
    out = fn(traj, task)
    if inspect.isawaitable(out):

        async def _await() -> RewardResult:
            return await out

        return asyncio.run(_await())
    return out  # type: ignore[return-value]  # sync functions return the result itself


def _worker_main(conn: Any) -> None:
    """A process worker: one thread for BLAS/OpenMP, then calls from ``conn`` until EOF."""
    from agentrl.threads import ENV_THREADS, THREAD_ENV_VARS

    for name in THREAD_ENV_VARS:
        os.environ[name] = os.environ.get(ENV_THREADS) or "1"
    conn.send(("ready", None))
    while True:
        try:
            fn, traj, task = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", _call_in_process(fn, traj, task)))
        except Exception as exc:  # sent back as text: user exceptions need not pickle
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


async def _readable(fd: int, timeout: float | None) -> bool:
    """Wait until ``fd`` is readable (or at EOF); False at the deadline."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


class _ProcessWorker:
    """One spawned worker process and its pipe; killed when a call overruns."""

    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()

    async def ready(self) -> None:
        """Wait for the worker's hello; kill it and raise if it does not start in time."""
        if not await _readable(self.conn.fileno(), _WORKER_START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(
                f"a reward worker process did not start within {_WORKER_START_TIMEOUT_S:g} s"
            )
        self.conn.recv()

    async def call(self, fn: RewardFn, traj: Trajectory, task: Task, timeout: float) -> Any:
        """The result; raises TimeoutError (the caller kills), WorkerCallError (the function
        raised) or RuntimeError (the worker died)."""
        self.conn.send((fn, traj, task))
        if not await _readable(self.conn.fileno(), timeout):
            raise TimeoutError
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(
                f"the reward worker process died (exit code {self.process.exitcode})"
            ) from exc
        if kind == "error":
            raise WorkerCallError(value)
        return value

    def kill(self) -> None:
        """SIGKILL the worker; its zombie is reaped once it is gone (never blocks)."""
        self.process.kill()
        self.conn.close()
        loop = asyncio.get_running_loop()
        sentinel = self.process.sentinel

        def reap() -> None:
            """Join the killed process (non-blocking) once its sentinel is readable."""
            loop.remove_reader(sentinel)
            self.process.join(0)

        loop.add_reader(sentinel, reap)


class ProcessWorkers:
    """Spawn-started workers, one call each at a time; a call past its deadline kills its
    worker (and a new one is started for the next call). Not picklable state: create one per
    process (the executor does, lazily)."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: list[_ProcessWorker] = []
        self.killed = 0
        """Workers killed at a deadline since construction."""

    async def call(self, fn: RewardFn, traj: Trajectory, task: Task, timeout: float) -> Any:
        """``fn(traj, task)`` in a worker; TimeoutError after ``timeout`` (worker killed)."""
        worker = self._idle.pop() if self._idle else None
        if worker is None or not worker.process.is_alive():
            worker = _ProcessWorker(self._ctx)
            try:
                await worker.ready()
            except BaseException:
                worker.kill()
                raise
        try:
            result = await worker.call(fn, traj, task, timeout)
        except TimeoutError:
            self.killed += 1
            worker.kill()
            raise
        except WorkerCallError:
            self._idle.append(worker)  # the function raised; the worker is fine
            raise
        except BaseException:  # cancelled mid-call: the worker's state is unknown
            worker.kill()
            raise
        self._idle.append(worker)
        return result

    def close(self) -> None:
        """Stop the idle workers (EOF on their pipe; killed after 5 s)."""
        for worker in self._idle:
            worker.conn.close()  # EOF: the worker returns
            worker.process.join(5)
            if worker.process.is_alive():
                worker.process.kill()
        self._idle.clear()
