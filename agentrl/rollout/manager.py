"""AgentLoopManager: run tasks x n samples across workers and stream scored trajectories.

Why it exists: the trainer wants finished, scored episodes as soon as they exist (so slow
episodes never block fast ones), a bound on how many run at once, and a hook to stop admitting
new episodes when the rollouts would run too far ahead of the weights (the staleness budget).
The manager owns the bookkeeping of every episode; what one episode does is the worker's
(:mod:`agentrl.rollout.worker`), when one may start is the admission's
(:mod:`agentrl.rollout.admission`).

Invariants (what is always true):

- Every admitted episode ends as exactly one trajectory or one counted drop:
  ``admitted == finished + dropped + running`` at every await point. A trajectory is yielded by
  the stream, or, if the stream is closed before it is read, counted as ``undelivered``.
- An agent that raises ends as a trajectory with ``stop_reason=error`` (what it recorded before the
  error, the message in ``Trajectory.error``), counted and logged; an episode that runs past
  ``episode_timeout_s`` ends as ``stop_reason=aborted`` with the tokens recorded so far. Neither
  hangs the stream. A drop happens only on cancellation, when the worker drops the episode
  (:class:`~agentrl.types.EpisodeDropped`: a failed reward, an overlong prompt; counted
  ``dropped/<reason>``), when not even the prompt can be rendered (logged), or when the
  episode's worker failed twice (below).
- A worker that fails (its ``run_episode`` raises anything but a cancellation or
  :class:`~agentrl.types.EpisodeDropped`: e.g. the Ray actor running it died) does not lose the
  episode: it is re-dispatched once (``max_redispatches``), to another available worker when
  there is one, as the same admitted episode (same key, ``on_admitted``/``on_finished`` still
  once each, ``running`` meanwhile), counted ``redispatched``. Only the re-dispatched run can
  deliver a trajectory (the failed one returned none), so nothing is trained twice; a second
  failure is a counted drop (``worker_errors`` counts every failure). A worker whose
  ``available`` attribute is false (gone for good) gets no new episode while another is
  available.
- Admission is atomic: an episode starts only when ``admission.may_start()`` is true, and
  ``on_admitted`` is called in the same event-loop step, so a rule like AReaL's
  ``(η + v + 1) · batch_size > accepted + running`` is never overshot. ``on_admitted`` is called
  exactly once per admitted episode and ``on_finished`` exactly once after it (with the
  trajectory, or ``None`` for a drop).
- A trajectory is yielded only after it is scored (when a reward manager is given); a reward
  that fails drops its episode (counted ``dropped/reward_error``), never a 0.0 trained on.
- All samples of one task share a ``uid``; ``index`` is the sample number; every turn of an
  episode uses the session id ``"{uid}/{index}"`` (sticky routing to one server's prefix cache).

Shutdown order (``stream.aclose()``, leaving ``async with``, or ``manager.cancel()``): stop
admitting -> cancel running episodes (each agent's tool episode releases its tools on the way
out) -> count each as a drop and call ``on_finished(key, None)`` -> close the stream.

Workers: ``num_workers`` :class:`~agentrl.rollout.worker.AgentLoopWorker` objects, each a plain
class whose state pickles (policy, tokenizer, tools, reward, config); in one process they run as
asyncio tasks, and the manager sends each episode to the worker with the fewest episodes in
flight. Placing workers in Ray actors needs only ``run_episode`` as a remote method
(:class:`~agentrl.rollout.worker.EpisodeRunner`).

The agent loop's names are all importable from here (``AgentLoopManager``, ``AgentLoopWorker``,
``WorkerConfig``, ``StalenessAdmission``, ``EpisodeKey``, ...).

Example::

    manager = AgentLoopManager(policy, tokenizer, tools=toolset, reward=rewards,
                               config=WorkerConfig(limits=AgentLimits(max_turns=4)),
                               max_concurrency=64)
    async with manager.stream(tasks, n_samples=4) as stream:
        async for traj in stream:        # in completion order, scored
            buffer.add(traj)
    batch = await manager.generate(tasks, n_samples=4)   # whole batch, in task order
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.config import RolloutConfig
from agentrl.rollout.admission import (
    AdmissionController,
    AlwaysAdmit,
    EpisodeKey,
    StalenessAdmission,
)
from agentrl.rollout.worker import AgentLoopWorker, EpisodeRunner, Scorer, WorkerConfig
from agentrl.types import EpisodeDropped, Policy, Task, Trajectory
from tools import ToolSet

__all__ = [
    "AdmissionController",
    "AgentLoopManager",
    "AgentLoopWorker",
    "AlwaysAdmit",
    "EpisodeKey",
    "EpisodeRunner",
    "Scorer",
    "StalenessAdmission",
    "TrajectoryStream",
    "WorkerConfig",
]

logger = logging.getLogger(__name__)

ALWAYS_COUNTED = (
    "admitted",
    "finished",
    "dropped",
    "cancelled",
    "errors",
    "timeouts",
    "worker_errors",
    "dropped/reward_error",
    "dropped/prompt_too_long",
)
"""Counters :meth:`AgentLoopManager.stats` reports from the start, 0 until something is counted
(a metric that appears only after its first event cannot be plotted or alerted on)."""

_ROLLOUT_DEFAULTS = RolloutConfig()
"""The config's defaults (``agentrl.config`` is their only home)."""


class TrajectoryStream:
    """Async iterator of finished, scored trajectories; also an async context manager.

    Leaving ``async with`` (or ``aclose()``) before the end cancels the episodes still running.
    """

    def __init__(self, gen: AsyncGenerator[Trajectory, None]) -> None:
        self._gen = gen

    def __aiter__(self) -> TrajectoryStream:
        return self

    async def __anext__(self) -> Trajectory:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        """Stop the stream: cancel the episodes still running (counted drops)."""
        await self._gen.aclose()

    async def __aenter__(self) -> TrajectoryStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AgentLoopManager:
    """Runs tasks x ``n_samples`` episodes on ``num_workers`` workers, at most ``max_concurrency`` at once.

    Args:
        policy: what generates tokens (``PolicyClient``, ``ServerPool``, a fake).
        tokenizer: the model's tokenizer (chat template included).
        tools: the tools every episode may call (a ToolSet, or a factory that builds one).
        reward: a scorer (``RewardManager``); ``None`` = trajectories are not scored.
        config: sampling, limits, parser, system prompt, episode timeout, agent kwargs.
        num_workers: how many :class:`AgentLoopWorker` share the episodes.
        max_concurrency: most episodes in flight across all workers.
        admission: the trainer's admission hook (default: :class:`AlwaysAdmit`).
        workers: ready-made workers (instead of building ``num_workers`` from the above):
            :class:`AgentLoopWorker` s, or stand-ins for workers elsewhere (:class:`EpisodeRunner`).
        max_redispatches: how often an episode whose worker failed is sent to a worker again
            (module docstring); 0 = a failed worker's episode is a counted drop at once.
    """

    def __init__(
        self,
        policy: Policy | None = None,
        tokenizer: Any = None,
        *,
        tools: ToolSet | Callable[[], ToolSet] | None = None,
        reward: Scorer | None = None,
        config: WorkerConfig | None = None,
        num_workers: int = _ROLLOUT_DEFAULTS.num_workers,
        max_concurrency: int = _ROLLOUT_DEFAULTS.max_concurrency,
        admission: AdmissionController | None = None,
        workers: Sequence[EpisodeRunner] | None = None,
        max_redispatches: int = 1,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"rollout.max_concurrency must be >= 1, got {max_concurrency}")
        if workers is None:
            if policy is None or tokenizer is None:
                raise ValueError("AgentLoopManager needs policy= and tokenizer= (or workers=)")
            if num_workers < 1:
                raise ValueError(f"rollout.num_workers must be >= 1, got {num_workers}")
            workers = [
                AgentLoopWorker(
                    policy, tokenizer, tools=tools, reward=reward, config=config, worker_id=i
                )
                for i in range(num_workers)
            ]
        if not workers:
            raise ValueError("AgentLoopManager needs at least one worker")
        self.workers: list[EpisodeRunner] = list(workers)
        self.max_concurrency = max_concurrency
        self.admission: AdmissionController = admission or AlwaysAdmit()
        if max_redispatches < 0:
            raise ValueError(f"max_redispatches must be >= 0, got {max_redispatches}")
        self.max_redispatches = max_redispatches
        self._outstanding = [0] * len(self.workers)
        self._groups = itertools.count()
        self._counts: dict[str, int] = {}
        self._running = 0
        self._streaming = False
        self._cancel: asyncio.Event | None = None
        self._drop_reasons: dict[EpisodeKey, str] = {}
        self.failures: list[tuple[str, str]] = []
        """The first dropped episodes' (reason, message), for a run that must stop with them."""

    # ---- public API ------------------------------------------------------------------------
    def stream(self, tasks: Iterable[Task], n_samples: int = 1) -> TrajectoryStream:
        """Yield each trajectory as soon as it is finished and scored (completion order)."""
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        return TrajectoryStream(self._stream(tasks, n_samples))

    async def generate(self, tasks: Iterable[Task], n_samples: int = 1) -> list[Trajectory]:
        """Run everything and return the trajectories in task order, then sample index."""
        order: dict[str, int] = {}
        out: list[Trajectory] = []
        async with self.stream(tasks, n_samples) as stream:
            async for traj in stream:
                order.setdefault(traj.uid, len(order))
                out.append(traj)
        group_rank = {uid: self._group_number(uid) for uid in order}
        return sorted(out, key=lambda t: (group_rank[t.uid], t.index))

    def cancel(self) -> None:
        """Stop admitting and cancel the running episodes of the current stream (counted drops)."""
        if self._cancel is not None:
            self._cancel.set()

    @property
    def running(self) -> int:
        """Episodes in flight now."""
        return self._running

    def stats(self) -> dict[str, float]:
        """Counters since construction, under ``rollout/`` (admitted, finished, dropped, ...;
        ``stop_reason_total/<reason>`` counts finished episodes by stop reason, apart from the
        per-batch fractions ``rollout/stop_reason/<reason>`` of the training step)."""
        counts: dict[str, int] = {k: 0 for k in ALWAYS_COUNTED} | self._counts
        for w in self.workers:
            for k, v in w.counts.items():
                counts[k] = counts.get(k, 0) + v
        out = {f"rollout/{k}": float(v) for k, v in sorted(counts.items())}
        out["rollout/running"] = float(self._running)
        return out

    # ---- internals -------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        self._counts[key] = self._counts.get(key, 0) + n

    def drop_reason(self, key: EpisodeKey) -> str | None:
        """Why episode ``key`` ended without a trajectory (``reward_error``, ...); None for a
        cancellation or an unknown key. Each reason is returned once (popped)."""
        return self._drop_reasons.pop(key, None)

    def _note_failure(self, reason: str, message: str) -> None:
        if len(self.failures) < 16:  # the first ones are what a user needs; all are counted
            self.failures.append((reason, message))

    @staticmethod
    def _group_number(uid: str) -> int:
        return int(uid.rsplit("#", 1)[1])

    def _hook(self, name: str, *args: Any) -> None:
        try:
            getattr(self.admission, name)(*args)
        except Exception:
            self._count("hook_errors")
            logger.exception("admission hook %s raised", name)

    async def _stream(
        self, tasks: Iterable[Task], n_samples: int
    ) -> AsyncGenerator[Trajectory, None]:
        """The stream's generator: admit in the background, yield trajectories as they end."""
        if self._streaming:
            raise RuntimeError("this AgentLoopManager is already streaming; one stream at a time")
        self._streaming = True
        self._cancel = asyncio.Event()
        run = _StreamRun(self._cancel, asyncio.Semaphore(self.max_concurrency))
        producer = asyncio.create_task(self._produce(run, tasks, n_samples))
        watcher = asyncio.create_task(self._watch_cancel(run, producer))
        ended = 0  # episodes delivered or dropped
        produced = False
        try:
            while not (produced and ended == run.admitted):
                kind, value = await run.events.get()
                if kind == "produced":
                    produced = True
                elif kind == "error":
                    raise value
                else:
                    ended += 1
                    if kind == "traj":
                        self._count("delivered")
                        yield value
        finally:
            await self._close_stream(run, producer, watcher)

    async def _produce(self, run: _StreamRun, tasks: Iterable[Task], n_samples: int) -> None:
        """Admit every sample of every task, in order, as slots and the admission hook allow;
        end with a ``produced`` event (or an ``error`` event carrying what the tasks raised)."""
        try:
            for task in tasks:
                uid = f"{task.id}#{next(self._groups)}"
                for i in range(n_samples):
                    await self._wait_for_admission(run)
                    # No await between may_start() and on_admitted(): admission is atomic.
                    self._start_episode(run, EpisodeKey(uid=uid, index=i, task_id=task.id), task)
            run.events.put_nowait(("produced", None))
        except asyncio.CancelledError:
            run.events.put_nowait(("produced", None))
            raise
        except Exception as exc:
            run.events.put_nowait(("error", exc))

    async def _wait_for_admission(self, run: _StreamRun) -> None:
        """Return holding a concurrency slot, at a moment when ``admission.may_start()`` is true."""
        await run.slots.acquire()
        try:
            await self.admission.wait_for_admission()
            while not self.admission.may_start():
                await self.admission.wait_for_admission()
        except BaseException:
            run.slots.release()
            raise

    def _start_episode(self, run: _StreamRun, key: EpisodeKey, task: Task) -> None:
        """Count episode ``key`` as admitted and start it on the least-busy worker."""
        self._hook("on_admitted", key)
        run.admitted += 1
        self._count("admitted")
        self._running += 1
        self._dispatch(run, key, task, attempt=0, avoid=None)

    def _pick_worker(self, avoid: int | None) -> int:
        """The least-busy available worker, other than ``avoid`` when another one is available
        (any worker when none is: its failure is then counted like any other)."""
        ids = range(len(self.workers))
        usable = [w for w in ids if getattr(self.workers[w], "available", True)] or list(ids)
        others = [w for w in usable if w != avoid] or usable
        return min(others, key=self._outstanding.__getitem__)

    def _dispatch(
        self, run: _StreamRun, key: EpisodeKey, task: Task, *, attempt: int, avoid: int | None
    ) -> None:
        """Run (attempt ``attempt`` of) episode ``key`` on a worker."""
        w = self._pick_worker(avoid)
        self._outstanding[w] += 1
        ep = asyncio.create_task(self.workers[w].run_episode(task, key.uid, key.index))
        run.episodes.add(ep)
        ep.add_done_callback(functools.partial(self._on_episode_done, run, w, key, task, attempt))

    def _on_episode_done(
        self,
        run: _StreamRun,
        w: int,
        key: EpisodeKey,
        task: Task,
        attempt: int,
        ep: asyncio.Task[Trajectory | None],
    ) -> None:
        """Account for a finished episode: free its slot, count it, call ``on_finished`` and
        queue its trajectory (or a drop) for the stream; or re-dispatch it once if its worker
        failed.

        A done-callback, not a ``finally``: a task cancelled before its first step never runs its
        body, and every admitted episode must still be accounted for.
        """
        run.episodes.discard(ep)
        self._outstanding[w] -= 1
        if self._redispatch(run, w, key, task, attempt, ep):
            return
        traj = self._episode_result(w, key, ep)
        self._running -= 1
        run.slots.release()
        if traj is None:
            self._count("dropped")
        else:
            self._count("finished")
            self._count(f"stop_reason_total/{traj.stop_reason.value}")
        self._hook("on_finished", key, traj)
        run.events.put_nowait(("drop", None) if traj is None else ("traj", traj))

    def _redispatch(
        self,
        run: _StreamRun,
        w: int,
        key: EpisodeKey,
        task: Task,
        attempt: int,
        ep: asyncio.Task[Trajectory | None],
    ) -> bool:
        """If worker ``w`` failed this episode and it may be tried again (not cancelled, not
        stopping, ``max_redispatches`` not used up), send it to a worker again; True if so."""
        if ep.cancelled() or run.cancel.is_set() or attempt >= self.max_redispatches:
            return False
        exc = ep.exception()
        if exc is None or isinstance(exc, EpisodeDropped):
            return False
        self._count("worker_errors")
        self._count("redispatched")
        logger.warning(
            "worker %d failed on episode %s/%d (%s: %s); re-dispatching it (attempt %d of %d)",
            w,
            key.uid,
            key.index,
            type(exc).__name__,
            exc,
            attempt + 2,
            self.max_redispatches + 1,
        )
        self._dispatch(run, key, task, attempt=attempt + 1, avoid=w)
        return True

    def _episode_result(
        self, w: int, key: EpisodeKey, ep: asyncio.Task[Trajectory | None]
    ) -> Trajectory | None:
        """The episode's trajectory, or None after counting and logging why there is none
        (cancelled, dropped, or the worker failed)."""
        if ep.cancelled():
            self._count("cancelled")
            return None
        exc = ep.exception()
        if isinstance(exc, EpisodeDropped):
            self._count(f"dropped/{exc.reason}")
            self._note_failure(exc.reason, str(exc))
            self._drop_reasons[key] = exc.reason
            if len(self._drop_reasons) > 10_000:  # consumers pop theirs; bound the rest
                self._drop_reasons.pop(next(iter(self._drop_reasons)))
            logger.warning("episode %s/%d dropped: %s", key.uid, key.index, exc)
            return None
        if exc is not None:
            self._count("worker_errors")
            self._note_failure("worker_error", f"{type(exc).__name__}: {exc}")
            logger.error("worker %d failed on episode %s/%d", w, key.uid, key.index, exc_info=exc)
            return None
        return ep.result()

    @staticmethod
    async def _watch_cancel(run: _StreamRun, producer: asyncio.Task[None]) -> None:
        """On ``cancel()``: stop admitting and cancel every running episode."""
        await run.cancel.wait()
        producer.cancel()
        for ep in list(run.episodes):
            ep.cancel()

    async def _close_stream(
        self, run: _StreamRun, producer: asyncio.Task[None], watcher: asyncio.Task[None]
    ) -> None:
        """The shutdown order: stop admitting, cancel and await every episode (each counted by
        its done-callback), count the trajectories nobody read as ``undelivered``."""
        run.cancel.set()
        watcher.cancel()
        pending = [producer, watcher, *run.episodes]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        while not run.events.empty():
            kind, _ = run.events.get_nowait()
            if kind == "traj":
                self._count("undelivered")
        self._streaming = False
        self._cancel = None


@dataclass
class _StreamRun:
    """The bookkeeping of one stream (one call of ``AgentLoopManager.stream``)."""

    cancel: asyncio.Event
    slots: asyncio.Semaphore
    """One permit per episode that may be in flight (``max_concurrency``)."""
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    """``("traj", Trajectory) | ("drop", None) | ("produced", None) | ("error", exc)``."""
    episodes: set[asyncio.Task[Trajectory | None]] = field(default_factory=set)
    admitted: int = 0
