"""Rollout jobs: run tasks x n episodes, store scored trajectories, stream them with a cursor.

Why it exists: an external trainer needs scored trajectories delivered exactly once, in a
form it can resume after a disconnect or a restart of the service, with every task accounted
for. The AgentLoopManager already runs and scores episodes; this module wraps one manager per
job with durable accounting (:mod:`agentrl.service.store`) and cursor-based delivery.

Invariants (what is always true):

- Every episode ``(task, sample)`` of a job ends as exactly one trajectory or one counted drop
  (``episodes == finished + dropped + running + queued`` in :class:`JobCounts`). Drop reasons:
  ``cancelled`` (DELETE), ``stale`` (``max_staleness``), ``reward_error`` (a reward that failed
  is never delivered as 0.0), ``group_incomplete`` (``group: true`` and a sibling was dropped),
  ``error`` (the episode could not even start, or the job failed).
- A trajectory gets its cursor (``seq``) in the transaction that stores it (with ``group:
  true``, a whole group at once, consecutively), and a cursor is delivered at most once per
  reading position: a stream from cursor ``c`` sends ``c+1, c+2, ...`` in order, each once.
- Acknowledged trajectories (``seq <= acked``) are never sent again; unacknowledged ones survive
  a restart of the service. After a restart, episodes that had not ended are run again (the
  first run's tokens were never stored, so nothing is duplicated).
- A global episode budget (``rollout.max_concurrency``) bounds running episodes across all
  jobs; jobs are admitted first come, first served.

Shutdown order (:meth:`JobManager.close`): stop admitting -> cancel running episodes without
recording them (they run again after a restart) -> wait for every job task -> close the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.rollout.manager import EpisodeKey
from agentrl.service.models import (
    TERMINAL_STATES,
    JobCounts,
    JobStatus,
    RolloutRequest,
)
from agentrl.service.serving import with_sampling
from agentrl.service.store import AsyncStore, JobRow, Store
from agentrl.types import Task, Trajectory

__all__ = ["EpisodeBudget", "JobError", "JobManager"]

logger = logging.getLogger(__name__)


class JobError(Exception):
    """A job request the service refuses (HTTP status + message naming the field)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class EpisodeBudget:
    """Running episodes across all jobs, bounded by ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """Wake the jobs waiting for a free episode slot."""
        self._changed.set()

    async def wait(self) -> None:
        """Wait for the next :meth:`changed`."""
        self._changed.clear()
        await self._changed.wait()


@dataclass
class _Job:
    """In-memory state of an active job (its durable state is in the store)."""

    id: str
    tasks: list[Task]
    n: int
    group: bool
    agent: str | None
    sampling: dict[str, Any]
    max_staleness: int | None
    running: int = 0
    cancel_requested: bool = False
    shutting_down: bool = False
    drops: list[EpisodeKey] = field(default_factory=list)
    episodes: list[tuple[int, int]] = field(default_factory=list)
    """``(task, sample)`` of the k-th episode given to the current manager."""
    manager: Any = None
    runner: asyncio.Task[None] | None = None
    _event: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        """Wake every stream waiting for news of this job."""
        self._event.set()
        self._event = asyncio.Event()

    def waiter(self) -> asyncio.Event:
        """The event the next :meth:`notify` sets."""
        return self._event


class _JobAdmission:
    """AdmissionController of one job's manager over the shared :class:`EpisodeBudget`."""

    def __init__(self, budget: EpisodeBudget, job: _Job) -> None:
        self.budget = budget
        self.job = job

    def may_start(self) -> bool:
        """A slot is free in the shared budget and the job is not being cancelled."""
        return self.budget.running < self.budget.limit and not self.job.cancel_requested

    async def wait_for_admission(self) -> None:
        """Wait until :meth:`may_start` is true."""
        while not self.may_start():
            await self.budget.wait()

    def on_admitted(self, key: EpisodeKey) -> None:
        """Count the episode in the budget and the job."""
        self.budget.running += 1
        self.job.running += 1

    def on_finished(self, key: EpisodeKey, traj: Trajectory | None) -> None:
        """Free the slot; remember a drop (unless the service is shutting down)."""
        self.budget.running -= 1
        self.job.running -= 1
        self.budget.changed()
        if traj is None and not self.job.shutting_down:
            self.job.drops.append(key)


def _episode_number(uid: str) -> int:
    """The position of an episode in the task stream given to its manager.

    The manager names the k-th task of a stream ``"{task.id}#{k}"`` (one sample per task
    here), so the service can keep the user's task ids untouched (reward functions and agents
    see the real task) and still know which ``(task, sample)`` an episode was.
    """
    _, sep, tail = uid.rpartition("#")
    if not sep or not tail.isdigit():
        raise RuntimeError(
            f"unexpected episode uid {uid!r} from AgentLoopManager (expected 'task_id#k'); "
            "the service's episode accounting depends on that format"
        )
    return int(tail)


def request_hash(req: RolloutRequest) -> str:
    """What identifies a request for idempotency (everything but the key itself)."""
    # exclude_unset: defaults (e.g. a task id drawn at random) must not make a retry differ
    body = req.model_dump(mode="json", exclude={"idempotency_key"}, exclude_unset=True)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class JobManager:
    """Submits, runs, cancels, counts and streams rollout jobs (module docstring).

    Args:
        serving: what ``build_serving`` yields (``make_manager``, ``rewards``).
        store: the durable store.
        resolve_tasks: ``(RolloutRequest) -> list[Task]`` (inline tasks or a dataset
            reference); raises :class:`JobError` for a bad reference. Called in a thread.
        version: the service's current weight version (staleness of finished episodes).
        max_concurrency: episodes running at once across all jobs.
        max_active_jobs: jobs queued or running at once (more is a 429).
        max_episodes_per_job: tasks x n bound (more is a 400).
        heartbeat_s: a comment line on idle streams this often (keeps proxies from closing them).
    """

    def __init__(
        self,
        serving: Any,
        store: Store,
        *,
        resolve_tasks: Callable[[RolloutRequest], list[Task]],
        version: Callable[[], int],
        max_concurrency: int = 64,
        max_active_jobs: int = 64,
        max_episodes_per_job: int = 100_000,
        heartbeat_s: float = 15.0,
        retention_s: float = 7 * 24 * 3600.0,
    ) -> None:
        self.serving = serving
        self.store = store
        self.db = AsyncStore(store)
        self.resolve_tasks = resolve_tasks
        self.version = version
        self.budget = EpisodeBudget(max_concurrency)
        self.max_active_jobs = max_active_jobs
        self.max_episodes_per_job = max_episodes_per_job
        self.heartbeat_s = heartbeat_s
        self.retention_s = retention_s
        self.counters = {"submitted": 0, "trajectories": 0, "dropped": 0, "streams": 0}
        self._jobs: dict[str, _Job] = {}
        self._closing = False

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Purge jobs past retention, then resume every job that had not finished."""
        purged = await self.db.call(
            self.store.delete_jobs_finished_before, time.time() - self.retention_s
        )
        if purged:
            logger.info("purged %d rollout jobs older than %.0f s", purged, self.retention_s)
        for row in await self.db.call(self.store.jobs, ("admitted", "running")):
            logger.info("resuming rollout job %s after a restart", row.id)
            await self._launch(row)

    def begin_shutdown(self) -> None:
        """Refuse new jobs and end open streams (readers reconnect to the next instance)."""
        self._closing = True
        for job in self._jobs.values():
            job.notify()

    async def close(self) -> None:
        """Stop every job without recording its running episodes (module docstring)."""
        self.begin_shutdown()
        runners = []
        for job in self._jobs.values():
            job.shutting_down = True
            if job.manager is not None:
                job.manager.cancel()
            if job.runner is not None:
                job.runner.cancel()
                runners.append(job.runner)
            job.notify()
        await asyncio.gather(*runners, return_exceptions=True)
        self.db.close()

    # ---- submit ---------------------------------------------------------------------------
    async def submit(
        self, req: RolloutRequest, idempotency_key: str | None = None
    ) -> tuple[JobStatus, bool]:
        """Create (or, for a known idempotency key, return) a job; True when created."""
        key = req.idempotency_key or idempotency_key
        digest = request_hash(req)
        if key is not None:
            existing = await self.db.call(self.store.job_by_key, key)
            if existing is not None:
                return await self._same_request(existing, digest, key), False
        if self._closing:
            raise JobError(503, "the service is shutting down; retry on the next instance")
        active = sum(1 for j in self._jobs.values() if j.runner and not j.runner.done())
        if active >= self.max_active_jobs:
            raise JobError(
                429,
                f"{active} jobs are queued or running (--max-active-jobs {self.max_active_jobs}); "
                "wait for one to finish or cancel one",
            )
        tasks = await asyncio.to_thread(self.resolve_tasks, req)
        if len(tasks) * req.n > self.max_episodes_per_job:
            raise JobError(
                400,
                f"{len(tasks)} tasks x n={req.n} = {len(tasks) * req.n} episodes; this service "
                f"runs at most {self.max_episodes_per_job} per job (--max-episodes-per-job)",
                "n",
            )
        self._validate_tasks(tasks, req.agent)
        spec = {
            "num_tasks": len(tasks),
            "n": req.n,
            "group": req.group,
            "agent": req.agent,
            "sampling": req.sampling.model_dump(exclude_none=True),
            "max_staleness": req.max_staleness,
        }
        job_id = "job-" + secrets.token_hex(12)
        row = await self.db.call(
            self.store.create_job,
            job_id,
            spec,
            request_hash=digest,
            idempotency_key=key,
            tasks=[t.model_dump(mode="json") for t in tasks],
        )
        if row.id != job_id:  # lost a race with the same key
            return await self._same_request(row, digest, key or ""), False
        self.counters["submitted"] += 1
        await self._launch(row)
        return await self.status(job_id), True

    async def _same_request(self, row: JobRow, digest: str, key: str) -> JobStatus:
        if row.request_hash != digest:
            raise JobError(
                409,
                f"idempotency key {key[:200]!r} was used by job {row.id} with a different "
                "request; use a new key for a new job",
                "idempotency_key",
            )
        return await self.status(row.id)

    def _validate_tasks(self, tasks: list[Task], agent: str | None) -> None:
        from agentrl.training import default_agent
        from agents import get_agent_class

        default = default_agent(self.serving.cfg)
        for name in {agent} if agent else {t.agent or default for t in tasks}:
            try:
                get_agent_class(name, base_dir=self.serving.cfg.base_dir)
            except ValueError as exc:
                raise JobError(400, str(exc), "agent") from None
        for source in {t.data_source for t in tasks}:
            try:
                self.serving.rewards.reward_fn_for(source)
            except ValueError as exc:
                raise JobError(400, str(exc), "tasks.data_source") from None

    # ---- running --------------------------------------------------------------------------
    async def _launch(self, row: JobRow) -> None:
        spec = row.spec
        tasks = await self.db.call(self.store.tasks, row.id)
        job = _Job(
            id=row.id,
            tasks=[Task.model_validate(t) for t in tasks],
            n=int(spec["n"]),
            group=bool(spec["group"]),
            agent=spec.get("agent"),
            sampling=dict(spec.get("sampling") or {}),
            max_staleness=spec.get("max_staleness"),
        )
        self._jobs[job.id] = job
        job.runner = asyncio.get_running_loop().create_task(self._run(job), name=job.id)

    async def _run(self, job: _Job) -> None:
        status, error = "finished", None
        try:
            await self._run_episodes(job)
        except asyncio.CancelledError:
            if job.shutting_down:
                raise
            status = "cancelled"
        except Exception as exc:  # the job fails; its unfinished episodes become counted drops
            logger.exception("rollout job %s failed", job.id)
            status, error = "failed", f"{type(exc).__name__}: {exc}"
        if job.cancel_requested:
            status = "cancelled"
        reason = {"cancelled": "cancelled", "failed": "error"}.get(status)
        try:
            await self._flush_drops(job)
            if reason is not None:
                await self._drop_unrecorded(job, reason)
            await self.db.call(self.store.set_status, job.id, status, error)
        finally:
            job.notify()
            self._jobs.pop(job.id, None)

    async def _run_episodes(self, job: _Job) -> None:
        recorded = await self.db.call(self.store.recorded, job.id)
        pending = [
            (ti, si)
            for ti in range(len(job.tasks))
            for si in range(job.n)
            if (ti, si) not in recorded
        ]
        await self.db.call(self.store.set_status, job.id, "running")
        job.notify()
        if not pending:
            return
        manager = self.serving.make_manager(admission=_JobAdmission(self.budget, job))
        with_sampling(manager, **job.sampling)
        job.manager = manager
        job.episodes = pending

        def episodes() -> Any:
            """The pending episodes' tasks (with the job's agent, when it names one)."""
            for ti, _ in pending:
                task = job.tasks[ti]
                yield task.model_copy(update={"agent": job.agent}) if job.agent else task

        async with manager.stream(episodes(), n_samples=1) as stream:
            async for traj in stream:
                await self._record(job, traj)
                if job.drops:
                    await self._flush_drops(job)

    async def _record(self, job: _Job, traj: Trajectory) -> None:
        ti, si = job.episodes[_episode_number(traj.uid)]
        traj = traj.model_copy(update={"uid": f"{job.id}/{ti}", "index": si})
        reason = None
        if traj.reward_info.get("error"):
            reason = "reward_error"
        elif job.max_staleness is not None and traj.staleness(self.version()) > job.max_staleness:
            reason = "stale"
        if reason is not None:
            await self.db.call(self.store.record_dropped, job.id, ti, si, reason)
            self.counters["dropped"] += 1
        else:
            seq = await self.db.call(
                self.store.record_done,
                job.id,
                ti,
                si,
                traj.model_dump_json(),
                deliver=not job.group,
            )
            if seq == -1:
                logger.error("job %s: episode %d.%d recorded twice; kept the first", job.id, ti, si)
            self.counters["trajectories"] += 1
        if job.group:
            await self.db.call(self.store.settle_group, job.id, ti, job.n)
        job.notify()

    async def _flush_drops(self, job: _Job) -> None:
        drops, job.drops = job.drops, []
        for key in drops:
            reason = "cancelled" if job.cancel_requested else "error"
            if job.manager is not None:
                reason = job.manager.drop_reason(key) or reason
            ti, si = job.episodes[_episode_number(key.uid)]
            if await self.db.call(self.store.record_dropped, job.id, ti, si, reason):
                self.counters["dropped"] += 1
            if job.group:
                await self.db.call(self.store.settle_group, job.id, ti, job.n)
        if drops:
            job.notify()

    async def _drop_unrecorded(self, job: _Job, reason: str) -> None:
        recorded = await self.db.call(self.store.recorded, job.id)
        for ti in range(len(job.tasks)):
            for si in range(job.n):
                if (ti, si) not in recorded:
                    await self.db.call(self.store.record_dropped, job.id, ti, si, reason)
                    self.counters["dropped"] += 1
            if job.group:
                await self.db.call(self.store.settle_group, job.id, ti, job.n)

    # ---- queries and control --------------------------------------------------------------
    async def _row(self, job_id: str) -> JobRow:
        row = await self.db.call(self.store.job, job_id)
        if row is None:
            raise JobError(404, f"no rollout job {job_id[:100]!r}", "job_id")
        return row

    async def status(self, job_id: str) -> JobStatus:
        """The job's ``JobStatus``: state, counts and cursor (404 when unknown)."""
        row = await self._row(job_id)
        counts = await self.db.call(self.store.counts, job_id)
        job = self._jobs.get(job_id)
        running = job.running if job else 0
        spec = row.spec
        episodes = int(spec["num_tasks"]) * int(spec["n"])
        dropped = sum(counts["dropped"].values())
        return JobStatus(
            id=row.id,
            status=row.status,  # type: ignore[arg-type]  # the store holds only JobState values
            error=row.error,
            created=row.created,
            finished=row.finished,
            tasks=int(spec["num_tasks"]),
            n=int(spec["n"]),
            group=bool(spec["group"]),
            counts=JobCounts(
                episodes=episodes,
                queued=max(0, episodes - counts["done"] - dropped - running),
                running=running,
                finished=counts["done"],
                dropped=dropped,
                dropped_by_reason=counts["dropped"],
                delivered=counts["deliverable"],
                acked=row.acked,
                pending_delivery=counts["pending_delivery"],
            ),
            cursor=row.last_seq,
        )

    async def all_jobs(self) -> list[JobStatus]:
        """The status of every job the store holds."""
        rows = await self.db.call(self.store.jobs)
        return [await self.status(r.id) for r in rows]

    async def cancel(self, job_id: str) -> JobStatus:
        """Cancel a job: running episodes end as counted drops (tools released)."""
        await self._row(job_id)
        job = self._jobs.get(job_id)
        if job is not None and not job.cancel_requested:
            job.cancel_requested = True
            self.budget.changed()
            if job.manager is not None:
                job.manager.cancel()
            elif job.runner is not None:
                job.runner.cancel()
            if job.runner is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(job.runner)
        return await self.status(job_id)

    async def ack(self, job_id: str, cursor: int) -> int:
        """Acknowledge the job's trajectories up to ``cursor`` (409 when ahead of the job)."""
        row = await self._row(job_id)
        if cursor > row.last_seq:
            raise JobError(
                409,
                f"cursor {cursor} is ahead of the job's last cursor {row.last_seq}; acknowledge "
                "only cursors you received",
                "cursor",
            )
        acked = await self.db.call(self.store.ack, job_id, cursor)
        job = self._jobs.get(job_id)
        if job is not None:
            job.notify()
        return acked

    async def open_stream(self, job_id: str, after: int | None) -> int:
        """Validate a stream request and return its starting cursor (resuming acks ``after``)."""
        row = await self._row(job_id)
        if after is None:
            return row.acked
        if after > row.last_seq:
            raise JobError(
                409,
                f"cursor {after} is ahead of the job's last cursor {row.last_seq} (a different "
                "store, or a cursor of another job?)",
                "after",
            )
        return await self.ack(job_id, after)

    async def events(self, job_id: str, cursor: int) -> AsyncIterator[str]:
        """The SSE stream from ``cursor``: ``trajectory`` events, heartbeats, then ``end``."""
        self.counters["streams"] += 1
        yield "retry: 1000\n\n"
        while True:
            job = self._jobs.get(job_id)
            waiter = job.waiter() if job else None
            rows = await self.db.call(self.store.read, job_id, cursor, 64)
            for r in rows:
                data = (
                    f'{{"seq":{r.seq},"task_index":{r.task},"sample":{r.sample},'
                    f'"trajectory":{r.data}}}'
                )
                yield f"id: {r.seq}\nevent: trajectory\ndata: {data}\n\n"
                cursor = r.seq
            if rows:
                continue
            row = await self.db.call(self.store.job, job_id)
            if row is None:
                yield 'event: end\ndata: {"status": "deleted"}\n\n'
                return
            cursor = max(cursor, row.acked)
            if row.status in TERMINAL_STATES and job_id not in self._jobs:
                if cursor >= row.last_seq:
                    status = await self.status(job_id)
                    yield f"event: end\ndata: {status.model_dump_json()}\n\n"
                    return
                continue
            if waiter is None or self._closing:
                if self._closing:
                    return
                await asyncio.sleep(0.05)
                continue
            try:
                await asyncio.wait_for(waiter.wait(), self.heartbeat_s)
            except TimeoutError:
                yield ": keep-alive\n\n"
            if self._closing:
                return

    def stats(self) -> dict[str, float]:
        """Counters for /status and /metrics."""
        return {
            "jobs_active": float(len(self._jobs)),
            "episodes_running": float(self.budget.running),
            "episode_budget": float(self.budget.limit),
            **{k: float(v) for k, v in self.counters.items()},
        }


def resolve_tasks_for(cfg: Any, data_dirs: list[Path]) -> Callable[[RolloutRequest], list[Task]]:
    """The task resolver of a service: inline tasks, the config's splits, or files under roots."""
    cache: dict[str, list[Task]] = {}

    def split_tasks(split: str) -> list[Task]:
        """The tasks of config split ``split`` (built once, cached)."""
        if split not in cache:
            from agentrl.training import build_tasks

            try:
                cache[split] = build_tasks(cfg, split=split)
            except ValueError as exc:
                raise JobError(400, f"dataset.split={split!r}: {exc}", "dataset.split") from None
        return cache[split]

    def file_tasks(raw: str) -> list[Task]:
        """The tasks of file ``raw``, which must lie under a ``--data-dir`` root."""
        from agentrl.rollout.datasets import load_tasks

        if not data_dirs:
            raise JobError(
                403,
                "dataset.path is off: start the service with --data-dir DIR to allow task files "
                "under DIR (or send tasks inline, or use dataset.split)",
                "dataset.path",
            )
        path = Path(raw).resolve()
        if not any(root == path or root in path.parents for root in data_dirs):
            raise JobError(403, "dataset.path is outside the --data-dir roots", "dataset.path")
        try:
            return load_tasks(path)
        except (OSError, ValueError) as exc:
            raise JobError(400, f"dataset.path: {exc}", "dataset.path") from None

    def resolve(req: RolloutRequest) -> list[Task]:
        """The tasks of a request: inline, or ``limit`` tasks of a dataset from ``offset``."""
        if req.tasks is not None:
            return list(req.tasks)
        ref = req.dataset
        assert ref is not None
        pool = split_tasks(ref.split) if ref.split else file_tasks(ref.path or "")
        if not pool:
            raise JobError(400, "the dataset has no tasks", "dataset")
        count = ref.limit if ref.limit is not None else len(pool)
        return [pool[(ref.offset + i) % len(pool)] for i in range(count)]

    return resolve
