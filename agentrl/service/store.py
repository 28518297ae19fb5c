"""The rollout service's durable store: jobs, episode outcomes and undelivered trajectories.

Why SQLite (stdlib ``sqlite3``, WAL journal): a job's finished-but-unacknowledged trajectories
must survive a crash or restart of the service, and an embedded, transactional store is the
boring right tool for that (no second server, no home-made file format).

Schema (one file):

- ``jobs``: one row per rollout job: its settings (JSON, small), status, error, the next
  sequence number to hand out and the acknowledged cursor; ``job_tasks``: its resolved tasks
  (JSON, read once when the job starts, so status queries never parse them).
- ``episodes``: one row per *recorded* episode ``(job, task, sample)``: ``done`` with its
  trajectory (JSON) and, once deliverable, a per-job sequence number ``seq``; or ``dropped``
  with a reason. An episode with no row has not ended yet (after a restart it is run again).

Guarantees:

- each ``(job, task, sample)`` is recorded at most once (primary key; a second record is
  ignored and reported), so an episode is never delivered twice;
- ``seq`` numbers of a job are 1, 2, 3, ... in delivery order, assigned in the same transaction
  that makes trajectories deliverable (a GRPO group gets consecutive numbers at once);
- :meth:`Store.ack` frees the payload of every trajectory with ``seq <= cursor`` and never
  moves the cursor back; an acknowledged trajectory is never returned by :meth:`Store.read`;
- every method commits before it returns (``synchronous=NORMAL`` in WAL mode: a killed process
  loses nothing committed; ``durable=True`` selects ``FULL`` for power-loss safety too).

Thread model: one connection, used from one thread at a time (the service runs every call on a
single-thread executor, :class:`AsyncStore`), so calls never block the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["AsyncStore", "JobRow", "Store", "StoredTrajectory"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    idempotency_key TEXT UNIQUE,
    request_hash TEXT NOT NULL,
    spec TEXT NOT NULL,
    status TEXT NOT NULL,
    error TEXT,
    created REAL NOT NULL,
    finished REAL,
    next_seq INTEGER NOT NULL DEFAULT 1,
    acked INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS episodes (
    job TEXT NOT NULL,
    task INTEGER NOT NULL,
    sample INTEGER NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    seq INTEGER,
    data TEXT,
    PRIMARY KEY (job, task, sample)
);
CREATE INDEX IF NOT EXISTS episodes_seq ON episodes (job, seq);
CREATE TABLE IF NOT EXISTS job_tasks (
    job TEXT PRIMARY KEY,
    tasks TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class JobRow:
    """A job as stored."""

    id: str
    idempotency_key: str | None
    request_hash: str
    spec: dict[str, Any]
    status: str
    error: str | None
    created: float
    finished: float | None
    next_seq: int
    acked: int

    @property
    def last_seq(self) -> int:
        """The highest sequence number handed out so far (0 if none)."""
        return self.next_seq - 1


@dataclass(frozen=True)
class StoredTrajectory:
    """One deliverable trajectory: its sequence number, position in the job and JSON."""

    seq: int
    task: int
    sample: int
    data: str


class Store:
    """Synchronous SQLite access (see the module docstring); use one thread at a time."""

    def __init__(self, path: str | Path, *, durable: bool = False) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        if str(path) != ":memory:":
            self.path.chmod(0o600)  # trajectories and requests are the user's data

    def close(self) -> None:
        """Close the database."""
        self._db.close()

    def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            out = fn(self._db)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return out

    # ---- jobs ----------------------------------------------------------------------------
    def create_job(
        self,
        job_id: str,
        spec: dict[str, Any],
        *,
        request_hash: str,
        idempotency_key: str | None = None,
        tasks: list[dict[str, Any]] | None = None,
    ) -> JobRow:
        """Insert a job in status ``admitted``, or return the job that owns the idempotency key."""

        def go(db: sqlite3.Connection) -> JobRow:
            if idempotency_key is not None:
                existing = self._job_by_key(db, idempotency_key)
                if existing is not None:
                    return existing
            db.execute(
                "INSERT INTO jobs (id, idempotency_key, request_hash, spec, status, created) "
                "VALUES (?, ?, ?, ?, 'admitted', ?)",
                (job_id, idempotency_key, request_hash, json.dumps(spec), time.time()),
            )
            db.execute(
                "INSERT INTO job_tasks (job, tasks) VALUES (?, ?)",
                (job_id, json.dumps(tasks or [])),
            )
            row = self._job(db, job_id)
            assert row is not None
            return row

        return self._tx(go)

    @staticmethod
    def _row_to_job(r: Sequence[Any]) -> JobRow:
        return JobRow(
            id=r[0],
            idempotency_key=r[1],
            request_hash=r[2],
            spec=json.loads(r[3]),
            status=r[4],
            error=r[5],
            created=r[6],
            finished=r[7],
            next_seq=r[8],
            acked=r[9],
        )

    _JOB_COLUMNS = (
        "id, idempotency_key, request_hash, spec, status, error, created, finished, next_seq, acked"
    )

    def _job(self, db: sqlite3.Connection, job_id: str) -> JobRow | None:
        r = db.execute(f"SELECT {self._JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return self._row_to_job(r) if r else None

    def _job_by_key(self, db: sqlite3.Connection, key: str) -> JobRow | None:
        r = db.execute(
            f"SELECT {self._JOB_COLUMNS} FROM jobs WHERE idempotency_key = ?", (key,)
        ).fetchone()
        return self._row_to_job(r) if r else None

    def job(self, job_id: str) -> JobRow | None:
        """The job ``job_id``, or None."""
        return self._job(self._db, job_id)

    def tasks(self, job_id: str) -> list[dict[str, Any]]:
        """The resolved tasks of a job (as given at creation)."""
        r = self._db.execute("SELECT tasks FROM job_tasks WHERE job = ?", (job_id,)).fetchone()
        return json.loads(r[0]) if r else []

    def job_by_key(self, key: str) -> JobRow | None:
        """The job created with idempotency key ``key``, if any."""
        return self._job_by_key(self._db, key)

    def jobs(self, statuses: Iterable[str] | None = None) -> list[JobRow]:
        """Jobs, oldest first, optionally only those in ``statuses``."""
        rows = self._db.execute(
            f"SELECT {self._JOB_COLUMNS} FROM jobs ORDER BY created, id"
        ).fetchall()
        wanted = set(statuses) if statuses is not None else None
        return [j for j in map(self._row_to_job, rows) if wanted is None or j.status in wanted]

    def set_status(self, job_id: str, status: str, error: str | None = None) -> None:
        """Set a job's status; terminal statuses also stamp ``finished``."""
        finished = time.time() if status in ("finished", "cancelled", "failed") else None
        self._db.execute(
            "UPDATE jobs SET status = ?, error = COALESCE(?, error), "
            "finished = COALESCE(?, finished) WHERE id = ?",
            (status, error, finished, job_id),
        )

    def delete_jobs_finished_before(self, t: float) -> int:
        """Remove terminal jobs (and their episodes) that finished before ``t``."""

        def go(db: sqlite3.Connection) -> int:
            ids = [
                r[0]
                for r in db.execute(
                    "SELECT id FROM jobs WHERE finished IS NOT NULL AND finished < ?", (t,)
                )
            ]
            for job_id in ids:
                db.execute("DELETE FROM episodes WHERE job = ?", (job_id,))
                db.execute("DELETE FROM job_tasks WHERE job = ?", (job_id,))
                db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            return len(ids)

        return self._tx(go)

    # ---- episodes ------------------------------------------------------------------------
    def recorded(self, job_id: str) -> set[tuple[int, int]]:
        """``(task, sample)`` of every recorded episode of the job."""
        rows = self._db.execute("SELECT task, sample FROM episodes WHERE job = ?", (job_id,))
        return {(int(t), int(s)) for t, s in rows}

    def record_done(
        self, job_id: str, task: int, sample: int, data: str, *, deliver: bool
    ) -> int | None:
        """Record a finished episode; with ``deliver`` give it the next ``seq`` at once.

        Returns the ``seq`` (None when not delivered yet); returns -1 if the episode was
        already recorded (nothing changes).
        """

        def go(db: sqlite3.Connection) -> int | None:
            cur = db.execute(
                "INSERT OR IGNORE INTO episodes (job, task, sample, state, data) "
                "VALUES (?, ?, ?, 'done', ?)",
                (job_id, task, sample, data),
            )
            if cur.rowcount == 0:
                return -1
            if not deliver:
                return None
            (seq,) = self._assign(db, job_id, [(task, sample)])
            return seq

        return self._tx(go)

    def record_dropped(self, job_id: str, task: int, sample: int, reason: str) -> bool:
        """Record an episode that ended without a trajectory; False if already recorded."""
        cur = self._db.execute(
            "INSERT OR IGNORE INTO episodes (job, task, sample, state, reason) "
            "VALUES (?, ?, ?, 'dropped', ?)",
            (job_id, task, sample, reason),
        )
        return cur.rowcount > 0

    @staticmethod
    def _assign(
        db: sqlite3.Connection, job_id: str, members: Sequence[tuple[int, int]]
    ) -> list[int]:
        (next_seq,) = db.execute("SELECT next_seq FROM jobs WHERE id = ?", (job_id,)).fetchone()
        seqs = list(range(next_seq, next_seq + len(members)))
        for seq, (task, sample) in zip(seqs, members, strict=True):
            db.execute(
                "UPDATE episodes SET seq = ? WHERE job = ? AND task = ? AND sample = ?",
                (seq, job_id, task, sample),
            )
        db.execute("UPDATE jobs SET next_seq = ? WHERE id = ?", (next_seq + len(members), job_id))
        return seqs

    def group_state(self, job_id: str, task: int) -> list[tuple[int, str, int | None]]:
        """``(sample, state, seq)`` of the recorded members of one task's group."""
        rows = self._db.execute(
            "SELECT sample, state, seq FROM episodes WHERE job = ? AND task = ? ORDER BY sample",
            (job_id, task),
        )
        return [(int(s), str(st), q) for s, st, q in rows]

    def settle_group(self, job_id: str, task: int, size: int) -> str | None:
        """Once all ``size`` members of a group are recorded, deliver or drop it atomically.

        A complete group (all ``done``) gets consecutive ``seq`` numbers (``"delivered"``); a
        group with a dropped member has its finished members dropped with reason
        ``group_incomplete`` (``"dropped"``). Returns None while members are still running or
        when the group was settled before.
        """

        def go(db: sqlite3.Connection) -> str | None:
            members = db.execute(
                "SELECT sample, state, seq FROM episodes WHERE job = ? AND task = ? "
                "ORDER BY sample",
                (job_id, task),
            ).fetchall()
            if len(members) < size:
                return None
            if any(state == "done" and seq is not None for _, state, seq in members):
                return None
            done = [(task, int(s)) for s, state, _ in members if state == "done"]
            if len(done) == size:
                self._assign(db, job_id, done)
                return "delivered"
            db.execute(
                "UPDATE episodes SET state = 'dropped', reason = 'group_incomplete', data = NULL "
                "WHERE job = ? AND task = ? AND state = 'done'",
                (job_id, task),
            )
            return "dropped"

        return self._tx(go)

    def read(self, job_id: str, after: int, limit: int = 64) -> list[StoredTrajectory]:
        """Deliverable, unacknowledged trajectories with ``seq > after``, in ``seq`` order."""
        rows = self._db.execute(
            "SELECT e.seq, e.task, e.sample, e.data FROM episodes e JOIN jobs j ON j.id = e.job "
            "WHERE e.job = ? AND e.seq > ? AND e.seq > j.acked AND e.data IS NOT NULL "
            "ORDER BY e.seq LIMIT ?",
            (job_id, after, limit),
        ).fetchall()
        return [StoredTrajectory(int(q), int(t), int(s), d) for q, t, s, d in rows]

    def ack(self, job_id: str, cursor: int) -> int:
        """Acknowledge every trajectory with ``seq <= cursor``; returns the new cursor."""

        def go(db: sqlite3.Connection) -> int:
            (acked,) = db.execute("SELECT acked FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if cursor <= acked:
                return int(acked)
            db.execute(
                "UPDATE episodes SET data = NULL WHERE job = ? AND seq IS NOT NULL AND seq <= ?",
                (job_id, cursor),
            )
            db.execute("UPDATE jobs SET acked = ? WHERE id = ?", (cursor, job_id))
            return cursor

        return self._tx(go)

    def counts(self, job_id: str) -> dict[str, Any]:
        """``done``, ``delivered``, ``pending_delivery`` (stored, not acked) and drops by reason."""
        job = self.job(job_id)
        acked = job.acked if job else 0
        done = delivered = pending = 0
        dropped: dict[str, int] = {}
        rows = self._db.execute(
            "SELECT state, reason, seq, data IS NOT NULL FROM episodes WHERE job = ?", (job_id,)
        )
        for state, reason, seq, has_data in rows:
            if state == "done":
                done += 1
                if seq is not None:
                    delivered += 1
                    if has_data and seq > acked:
                        pending += 1
            else:
                dropped[reason or "unknown"] = dropped.get(reason or "unknown", 0) + 1
        return {
            "done": done,
            "deliverable": delivered,
            "pending_delivery": pending,
            "dropped": dropped,
        }

    def pending_total(self) -> int:
        """Trajectories stored and not yet acknowledged, over all jobs."""
        (n,) = self._db.execute(
            "SELECT COUNT(*) FROM episodes e JOIN jobs j ON j.id = e.job "
            "WHERE e.data IS NOT NULL AND e.seq IS NOT NULL AND e.seq > j.acked"
        ).fetchone()
        return int(n)


class AsyncStore:
    """A :class:`Store` whose calls run on one dedicated thread (the event loop never blocks)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="agentrl-store"
        )

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` (a bound :class:`Store` method) on the store thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        """Finish the queued calls, then close the store."""
        self._pool.shutdown(wait=True)
        self.store.close()
