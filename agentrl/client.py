"""The rollout service SDK: submit jobs, read trajectories (with reconnect), push weights.

Why it exists: a trainer outside agentrl (TRL, verl, a research loop) should need a URL and a
key, not our internals. :class:`RolloutClient` (sync) and :class:`AsyncRolloutClient` (asyncio)
speak the API of docs/service.md over httpx and give back :class:`agentrl.types.Trajectory`.

Guarantees of :meth:`AsyncRolloutClient.trajectories` (and the sync twin):

- each trajectory is yielded once, in cursor order, even across dropped connections and
  restarts of the service: a reconnect resumes from the cursor of the last trajectory yielded,
  which the service takes as the acknowledgement of everything up to it;
- with ``ack="auto"`` (default) the client also acknowledges explicitly (``POST .../ack``)
  every ``ack_every`` trajectories and when the stream ends, so the service can free them;
  with ``ack="manual"`` nothing is acknowledged until you call :meth:`ack` (a crash of *your*
  process then replays everything after your last ack);
- reconnects back off exponentially and give up after ``reconnect_timeout_s`` without progress.

Helpers: :func:`to_batch` (the trainer's TensorDict, :func:`agentrl.batch.trajectories_to_batch`)
and :func:`to_parquet` / :func:`to_columns` (prompt ids, response ids, loss mask, rollout
logprobs, reward, versions: the columns TRL and verl read).

Example::

    from agentrl.client import RolloutClient

    with RolloutClient("http://127.0.0.1:8400", api_key="s3cret") as client:
        job = client.submit(dataset={"split": "train", "limit": 8}, n=4, group=True)
        for group in client.groups(job.id):          # lists of n trajectories, one task each
            print([t.reward for t in group])
        report = client.push_weights(model.state_dict())   # verified on every server
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from agentrl.types import Task, Trajectory

__all__ = [
    "AsyncRolloutClient",
    "RolloutClient",
    "ServiceError",
    "WeightPushFailed",
    "to_batch",
    "to_columns",
    "to_parquet",
]

AckMode = Literal["auto", "manual"]
_RETRYABLE = (httpx.TransportError,)


class ServiceError(RuntimeError):
    """The service answered an error; ``status`` and ``body`` carry its answer."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.body = body


class WeightPushFailed(ServiceError):
    """A weight push failed on at least one server; ``report`` is the service's push report."""

    def __init__(self, status: int, report: Any) -> None:
        servers = report.get("servers", {}) if isinstance(report, dict) else {}
        errors = {u: s.get("error") for u, s in servers.items() if s.get("error")}
        super().__init__(status, f"weight push failed: {errors or report}", report)
        self.report = report


@dataclass(frozen=True)
class Job:
    """What the service said about a job (see ``JobStatus`` in docs/service.md)."""

    id: str
    status: str
    counts: dict[str, Any]
    cursor: int
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        """A :class:`Job` from the service's ``JobStatus`` JSON (kept whole in ``raw``)."""
        return cls(
            id=data["id"],
            status=data["status"],
            counts=data["counts"],
            cursor=data["cursor"],
            raw=data,
        )

    @property
    def done(self) -> bool:
        """The job reached a final status (``finished``, ``cancelled`` or ``failed``)."""
        return self.status in ("finished", "cancelled", "failed")


@dataclass(frozen=True)
class Session:
    """An open recording session: give ``base_url`` and ``api_key`` to any OpenAI client."""

    id: str
    base_url: str
    api_key: str


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        body = resp.json()
        message = body.get("error", {}).get("message") or resp.text
    except (ValueError, AttributeError):
        body, message = resp.text, resp.text
    raise ServiceError(resp.status_code, str(message)[:2000], body)


def _submit_body(
    tasks: Sequence[Task | Mapping[str, Any]] | None,
    dataset: Mapping[str, Any] | None,
    **fields: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
    if tasks is not None:
        body["tasks"] = [
            t.model_dump(mode="json") if isinstance(t, Task) else dict(t) for t in tasks
        ]
    if dataset is not None:
        body["dataset"] = dict(dataset)
    return body


def _weights_request(weights: Any, version: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """httpx request kwargs for a push of a state dict, safetensors bytes or a shared path."""
    params = {} if version is None else {"version": version}
    if isinstance(weights, (str, Path)):
        body: dict[str, Any] = {"path": str(weights)}
        if version is not None:
            body["version"] = version
        return {"json": body}, {}
    if isinstance(weights, (bytes, bytearray, memoryview)):
        data = bytes(weights)
    else:
        from safetensors.torch import save

        data = save(_dedup_tensors(weights), metadata={"format": "pt"})
    headers = {"content-type": "application/octet-stream", "content-length": str(len(data))}
    return {"content": data, "headers": headers}, params


def _dedup_tensors(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Contiguous CPU tensors, tied weights once (safetensors refuses shared storage)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, tensor in state_dict.items():
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


class _SSEParser:
    """Incremental Server-Sent-Events parser: feed lines, get ``(event, id, data)`` tuples."""

    def __init__(self) -> None:
        self.event = ""
        self.id: str | None = None
        self.data: list[str] = []

    def feed(self, line: str) -> tuple[str, str | None, str] | None:
        """The ``(event, id, data)`` a blank ``line`` completes, else None (comments ignored)."""
        if line == "":
            if not self.data and not self.event:
                return None
            out = (self.event or "message", self.id, "\n".join(self.data))
            self.event, self.id, self.data = "", None, []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        elif name == "id":
            self.id = value
        return None


class _Reader:
    """Cursor, ack and reconnect bookkeeping shared by the sync and async readers."""

    def __init__(
        self, job_id: str, cursor: int | None, ack: AckMode, ack_every: int, timeout: float
    ) -> None:
        self.job_id = job_id
        self.cursor = cursor
        self.acked = cursor or 0
        self.ack_mode = ack
        self.ack_every = ack_every
        self.reconnect_timeout_s = timeout
        self.end: dict[str, Any] | None = None
        self._last_progress = time.monotonic()
        self._failures = 0

    def params(self) -> dict[str, Any]:
        """Query parameters of the next (re)connect: ``after`` = where to resume."""
        # In manual mode a reconnect must not acknowledge what the user has not acked.
        after = self.cursor if self.ack_mode == "auto" else self.acked
        return {} if after is None else {"after": after}

    def handle(self, event: tuple[str, str | None, str]) -> Trajectory | None:
        """The trajectory an SSE event carries (None for other events, replays); records ``end``."""
        kind, _, data = event
        if kind == "end":
            self.end = json.loads(data)
            return None
        if kind != "trajectory":
            return None
        payload = json.loads(data)
        seq = int(payload["seq"])
        if self.cursor is not None and seq <= self.cursor:
            return None  # already yielded before a reconnect (manual-ack replay)
        self.cursor = seq
        self._last_progress = time.monotonic()
        self._failures = 0
        return Trajectory.model_validate(payload["trajectory"])

    def want_ack(self) -> bool:
        """In auto mode: ``ack_every`` trajectories were yielded since the last ack."""
        return (
            self.ack_mode == "auto"
            and self.cursor is not None
            and self.cursor - self.acked >= self.ack_every
        )

    def backoff(self, exc: BaseException) -> float:
        """Seconds to wait before reconnecting; raises when there was no progress for too long."""
        if time.monotonic() - self._last_progress > self.reconnect_timeout_s:
            raise ServiceError(
                503,
                f"no progress on job {self.job_id} for {self.reconnect_timeout_s:.0f} s of "
                f"reconnects; last error: {type(exc).__name__}: {exc}",
            ) from exc
        self._failures += 1
        return min(0.1 * 2 ** (self._failures - 1), 2.0)


def _is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, _RETRYABLE):
        return True
    return isinstance(exc, ServiceError) and exc.status in (502, 503, 504)


def _headers(api_key: str | None) -> dict[str, str]:
    key = api_key if api_key is not None else os.environ.get("AGENTRL_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else {}


class AsyncRolloutClient:
    """asyncio client of the rollout service (see the module docstring for guarantees)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("AGENTRL_API_KEY")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=_headers(self.api_key),
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            transport=transport,
        )

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = await self._http.request(method, path, **kwargs)
        _raise_for(resp)
        return resp.json() if resp.content else None

    # ---- jobs ------------------------------------------------------------------------------
    async def submit(
        self,
        tasks: Sequence[Task | Mapping[str, Any]] | None = None,
        *,
        dataset: Mapping[str, Any] | None = None,
        n: int = 1,
        agent: str | None = None,
        sampling: Mapping[str, Any] | None = None,
        max_staleness: int | None = None,
        group: bool = False,
        idempotency_key: str | None = None,
    ) -> Job:
        """Start a rollout job (``tasks`` inline, or ``dataset={"split"|"path", ...}``)."""
        body = _submit_body(
            tasks,
            dataset,
            n=n,
            agent=agent,
            sampling=dict(sampling) if sampling else None,
            max_staleness=max_staleness,
            group=group,
            idempotency_key=idempotency_key,
        )
        return Job.from_json(await self._json("POST", "/v1/rollouts", json=body))

    async def job(self, job_id: str) -> Job:
        """The job's current status and counts."""
        return Job.from_json(await self._json("GET", f"/v1/rollouts/{job_id}"))

    async def cancel(self, job_id: str) -> Job:
        """Cancel the job (its running episodes are dropped); returns its status."""
        return Job.from_json(await self._json("DELETE", f"/v1/rollouts/{job_id}"))

    async def ack(self, job_id: str, cursor: int) -> int:
        """Acknowledge every trajectory up to ``cursor``; returns the acked cursor."""
        out = await self._json("POST", f"/v1/rollouts/{job_id}/ack", json={"cursor": cursor})
        return int(out["acked"])

    async def trajectories(
        self,
        job_id: str,
        *,
        cursor: int | None = None,
        ack: AckMode = "auto",
        ack_every: int = 32,
        reconnect_timeout_s: float = 120.0,
    ) -> AsyncIterator[Trajectory]:
        """Every trajectory of the job from ``cursor`` (default: after the acked cursor)."""
        reader = _Reader(job_id, cursor, ack, ack_every, reconnect_timeout_s)
        while reader.end is None:
            try:
                async for traj in self._read_once(reader):
                    yield traj
                    if reader.want_ack():
                        reader.acked = await self.ack(job_id, reader.cursor or 0)
            except Exception as exc:
                if not _is_retryable(exc):
                    raise
                await asyncio.sleep(reader.backoff(exc))
        if ack == "auto" and reader.cursor is not None and reader.cursor > reader.acked:
            reader.acked = await self.ack(job_id, reader.cursor)

    async def _read_once(self, reader: _Reader) -> AsyncIterator[Trajectory]:
        parser = _SSEParser()
        async with self._http.stream(
            "GET",
            f"/v1/rollouts/{reader.job_id}/trajectories",
            params=reader.params(),
            timeout=httpx.Timeout(None, connect=10.0),
        ) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _raise_for(resp)
            async for line in resp.aiter_lines():
                event = parser.feed(line)
                if event is None:
                    continue
                traj = reader.handle(event)
                if traj is not None:
                    yield traj
                if reader.end is not None:
                    return
        raise httpx.ReadError("the stream ended before the job's end event")

    async def collect(self, job_id: str, **kwargs: Any) -> list[Trajectory]:
        """Read the whole job (until its end event) into a list."""
        return [t async for t in self.trajectories(job_id, **kwargs)]

    async def groups(self, job_id: str, **kwargs: Any) -> AsyncIterator[list[Trajectory]]:
        """Trajectories grouped by task (``uid``); complete groups need ``group=True`` jobs."""
        current: list[Trajectory] = []
        async for traj in self.trajectories(job_id, **kwargs):
            if current and traj.uid != current[0].uid:
                yield current
                current = []
            current.append(traj)
        if current:
            yield current

    # ---- weights, status -------------------------------------------------------------------
    async def push_weights(self, weights: Any, version: int | None = None) -> dict[str, Any]:
        """Push a state dict, safetensors bytes, or a shared path; returns the push report.

        Raises :class:`WeightPushFailed` (with the report) when any server failed.
        """
        kwargs, params = _weights_request(weights, version)
        resp = await self._http.post("/v1/weights", params=params, **kwargs)
        if resp.status_code == 502:
            raise WeightPushFailed(502, resp.json())
        _raise_for(resp)
        return resp.json()

    async def weights(self) -> dict[str, Any]:
        """The service's weight version and each server's (``GET /v1/weights``)."""
        return await self._json("GET", "/v1/weights")

    async def status(self) -> dict[str, Any]:
        """Servers, versions, jobs, sessions, pushes and the store (``GET /v1/status``)."""
        return await self._json("GET", "/v1/status")

    async def health(self) -> bool:
        """True when the service answers ``/health`` (False when it cannot be reached)."""
        try:
            return (await self._http.get("/health", timeout=5.0)).status_code == 200
        except httpx.TransportError:
            return False

    # ---- sessions --------------------------------------------------------------------------
    async def open_session(
        self, task: Task | Mapping[str, Any], *, ttl_s: float | None = None
    ) -> Session:
        """Open a recording session for ``task``: point an OpenAI client at its ``base_url``."""
        body: dict[str, Any] = {
            "task": task.model_dump(mode="json") if isinstance(task, Task) else dict(task)
        }
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        info = await self._json("POST", "/v1/sessions", json=body)
        return Session(info["id"], self.base_url + info["base_url"], self.api_key or "none")

    async def finish_session(self, session_id: str) -> list[Trajectory]:
        """End the session: its scored trajectories (one per segment)."""
        out = await self._json("POST", f"/v1/sessions/{session_id}/finish", json={})
        return [Trajectory.model_validate(t) for t in out["trajectories"]]


class RolloutClient:
    """Synchronous client of the rollout service; same methods as :class:`AsyncRolloutClient`."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 600.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("AGENTRL_API_KEY")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=_headers(self.api_key),
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            transport=transport,
        )

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = self._http.request(method, path, **kwargs)
        _raise_for(resp)
        return resp.json() if resp.content else None

    def submit(
        self,
        tasks: Sequence[Task | Mapping[str, Any]] | None = None,
        *,
        dataset: Mapping[str, Any] | None = None,
        n: int = 1,
        agent: str | None = None,
        sampling: Mapping[str, Any] | None = None,
        max_staleness: int | None = None,
        group: bool = False,
        idempotency_key: str | None = None,
    ) -> Job:
        """See :meth:`AsyncRolloutClient.submit`."""
        body = _submit_body(
            tasks,
            dataset,
            n=n,
            agent=agent,
            sampling=dict(sampling) if sampling else None,
            max_staleness=max_staleness,
            group=group,
            idempotency_key=idempotency_key,
        )
        return Job.from_json(self._json("POST", "/v1/rollouts", json=body))

    def job(self, job_id: str) -> Job:
        """See :meth:`AsyncRolloutClient.job`."""
        return Job.from_json(self._json("GET", f"/v1/rollouts/{job_id}"))

    def cancel(self, job_id: str) -> Job:
        """See :meth:`AsyncRolloutClient.cancel`."""
        return Job.from_json(self._json("DELETE", f"/v1/rollouts/{job_id}"))

    def ack(self, job_id: str, cursor: int) -> int:
        """See :meth:`AsyncRolloutClient.ack`."""
        return int(
            self._json("POST", f"/v1/rollouts/{job_id}/ack", json={"cursor": cursor})["acked"]
        )

    def trajectories(
        self,
        job_id: str,
        *,
        cursor: int | None = None,
        ack: AckMode = "auto",
        ack_every: int = 32,
        reconnect_timeout_s: float = 120.0,
    ) -> Iterator[Trajectory]:
        """See :meth:`AsyncRolloutClient.trajectories`."""
        reader = _Reader(job_id, cursor, ack, ack_every, reconnect_timeout_s)
        while reader.end is None:
            try:
                for traj in self._read_once(reader):
                    yield traj
                    if reader.want_ack():
                        reader.acked = self.ack(job_id, reader.cursor or 0)
            except Exception as exc:
                if not _is_retryable(exc):
                    raise
                time.sleep(reader.backoff(exc))
        if ack == "auto" and reader.cursor is not None and reader.cursor > reader.acked:
            reader.acked = self.ack(job_id, reader.cursor)

    def _read_once(self, reader: _Reader) -> Iterator[Trajectory]:
        parser = _SSEParser()
        with self._http.stream(
            "GET",
            f"/v1/rollouts/{reader.job_id}/trajectories",
            params=reader.params(),
            timeout=httpx.Timeout(None, connect=10.0),
        ) as resp:
            if resp.status_code >= 400:
                resp.read()
                _raise_for(resp)
            for line in resp.iter_lines():
                event = parser.feed(line)
                if event is None:
                    continue
                traj = reader.handle(event)
                if traj is not None:
                    yield traj
                if reader.end is not None:
                    return
        raise httpx.ReadError("the stream ended before the job's end event")

    def collect(self, job_id: str, **kwargs: Any) -> list[Trajectory]:
        """See :meth:`AsyncRolloutClient.collect`."""
        return list(self.trajectories(job_id, **kwargs))

    def groups(self, job_id: str, **kwargs: Any) -> Iterator[list[Trajectory]]:
        """See :meth:`AsyncRolloutClient.groups`."""
        current: list[Trajectory] = []
        for traj in self.trajectories(job_id, **kwargs):
            if current and traj.uid != current[0].uid:
                yield current
                current = []
            current.append(traj)
        if current:
            yield current

    def push_weights(self, weights: Any, version: int | None = None) -> dict[str, Any]:
        """See :meth:`AsyncRolloutClient.push_weights`."""
        kwargs, params = _weights_request(weights, version)
        resp = self._http.post("/v1/weights", params=params, **kwargs)
        if resp.status_code == 502:
            raise WeightPushFailed(502, resp.json())
        _raise_for(resp)
        return resp.json()

    def weights(self) -> dict[str, Any]:
        """See :meth:`AsyncRolloutClient.weights`."""
        return self._json("GET", "/v1/weights")

    def status(self) -> dict[str, Any]:
        """See :meth:`AsyncRolloutClient.status`."""
        return self._json("GET", "/v1/status")

    def health(self) -> bool:
        """See :meth:`AsyncRolloutClient.health`."""
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    def open_session(
        self, task: Task | Mapping[str, Any], *, ttl_s: float | None = None
    ) -> Session:
        """See :meth:`AsyncRolloutClient.open_session`."""
        body: dict[str, Any] = {
            "task": task.model_dump(mode="json") if isinstance(task, Task) else dict(task)
        }
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        info = self._json("POST", "/v1/sessions", json=body)
        return Session(info["id"], self.base_url + info["base_url"], self.api_key or "none")

    def finish_session(self, session_id: str) -> list[Trajectory]:
        """See :meth:`AsyncRolloutClient.finish_session`."""
        out = self._json("POST", f"/v1/sessions/{session_id}/finish", json={})
        return [Trajectory.model_validate(t) for t in out["trajectories"]]


# ---- export helpers ---------------------------------------------------------------------------
def to_batch(trajectories: Sequence[Trajectory], pad_token_id: int, **kwargs: Any) -> Any:
    """The trainer's padded TensorDict (:func:`agentrl.batch.trajectories_to_batch`)."""
    from agentrl.batch import trajectories_to_batch

    return trajectories_to_batch(trajectories, pad_token_id=pad_token_id, **kwargs)


def to_columns(trajectories: Sequence[Trajectory]) -> dict[str, list[Any]]:
    """One list per column, one row per trajectory (the Parquet layout of :func:`to_parquet`)."""
    cols: dict[str, list[Any]] = {
        k: []
        for k in (
            "uid",
            "index",
            "task_id",
            "data_source",
            "agent",
            "prompt_ids",
            "response_ids",
            "loss_mask",
            "rollout_logprobs",
            "policy_version",
            "reward",
            "turn_rewards",
            "stop_reason",
            "num_turns",
            "min_version",
            "max_version",
        )
    }
    for t in trajectories:
        cols["uid"].append(t.uid)
        cols["index"].append(t.index)
        cols["task_id"].append(t.task_id)
        cols["data_source"].append(t.data_source)
        cols["agent"].append(t.agent)
        cols["prompt_ids"].append(list(t.prompt_ids))
        cols["response_ids"].append(list(t.response_ids))
        cols["loss_mask"].append(list(t.loss_mask))
        cols["rollout_logprobs"].append(list(t.rollout_logprobs))
        cols["policy_version"].append(list(t.policy_version))
        cols["reward"].append(float(t.reward))
        cols["turn_rewards"].append(list(t.turn_rewards))
        cols["stop_reason"].append(t.stop_reason.value)
        cols["num_turns"].append(t.num_turns)
        cols["min_version"].append(t.min_version)
        cols["max_version"].append(t.max_version)
    return cols


def to_parquet(trajectories: Sequence[Trajectory], path: str | Path) -> Path:
    """Write trajectories as Parquet (logprobs as float64: exact) and return the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = to_columns(trajectories)
    types = {
        "index": pa.int64(),
        "prompt_ids": pa.list_(pa.int64()),
        "response_ids": pa.list_(pa.int64()),
        "loss_mask": pa.list_(pa.int8()),
        "rollout_logprobs": pa.list_(pa.float64()),
        "policy_version": pa.list_(pa.int64()),
        "reward": pa.float64(),
        "turn_rewards": pa.list_(pa.float64()),
        "num_turns": pa.int64(),
        "min_version": pa.int64(),
        "max_version": pa.int64(),
    }
    table = pa.table({k: pa.array(v, type=types.get(k, pa.string())) for k, v in cols.items()})
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    return out
