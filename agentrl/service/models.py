"""The rollout service's HTTP schemas (pydantic): requests, job status, pushes, sessions.

These models are the API contract: the OpenAPI document (``/openapi.json``) is generated from
them, the SDK (:mod:`agentrl.client`) parses responses with them, and every bound on a field
(``n``, list sizes, string lengths) is enforced here, so a malformed request is a 4xx that
names the field before any work starts. Numbers and booleans of requests are strict: ``"4"``
or ``true`` where an integer belongs is refused (400 naming the field), never read as 4 or 1.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)

from agentrl.types import StopReason, Task

__all__ = [
    "AckRequest",
    "AckResponse",
    "DatasetRef",
    "JobCounts",
    "JobStatus",
    "PathWeightsRequest",
    "RolloutRequest",
    "SamplingOverrides",
    "ServerPush",
    "SessionFinishRequest",
    "SessionFinishResponse",
    "SessionInfo",
    "SessionOpenRequest",
    "WeightPushResponse",
    "WeightsInfo",
]

NO_NUL = r"^[^\x00]*$"
"""A path may hold any character but NUL (which no filesystem call accepts)."""

JobState = Literal["admitted", "running", "finished", "cancelled", "failed"]
"""``admitted``: accepted, waiting to start; ``running``; then one terminal state."""
TERMINAL_STATES = ("finished", "cancelled", "failed")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingOverrides(_Model):
    """Per-job sampling settings; unset fields keep the service's ``inference`` config."""

    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=100.0)
    """Softmax temperature (0 = greedy). Verification always uses the config's temperature."""
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    """Nucleus mass (1 = off)."""
    top_k: StrictInt | None = Field(default=None, ge=-1, le=1_000_000)
    """Top-k (-1 = off)."""
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    """Most tokens per model turn."""


class DatasetRef(_Model):
    """Tasks from a file or from the service config's data, instead of inline tasks.

    Exactly one of ``split`` (``train``/``val``: the config's ``data`` files or generator) and
    ``path`` (a JSONL/Parquet task file under one of the service's ``--data-dir`` roots).
    """

    split: Literal["train", "val"] | None = None
    path: str | None = Field(default=None, max_length=4096, pattern=NO_NUL)
    offset: StrictInt = Field(default=0, ge=0, le=10**9)
    """First task (rows wrap around the end, as epochs do)."""
    limit: StrictInt | None = Field(default=None, ge=1, le=10**6)
    """How many tasks (default: all of them)."""

    @model_validator(mode="after")
    def _one_source(self) -> DatasetRef:
        if (self.split is None) == (self.path is None):
            raise ValueError("dataset needs exactly one of 'split' or 'path'")
        return self


class RolloutRequest(_Model):
    """``POST /v1/rollouts``: run every task ``n`` times and stream the scored trajectories."""

    tasks: list[Task] | None = Field(default=None, max_length=100_000)
    """Inline tasks (exactly one of ``tasks`` and ``dataset``)."""
    dataset: DatasetRef | None = None
    """Tasks from a dataset reference."""
    agent: str | None = Field(default=None, min_length=1, max_length=200)
    """Run every task with this registered agent (default: each task's own ``agent``)."""
    n: StrictInt = Field(default=1, ge=1, le=1024)
    """Samples per task (the GRPO group size)."""
    sampling: SamplingOverrides = Field(default_factory=SamplingOverrides)
    max_staleness: StrictInt | None = Field(default=None, ge=0, le=10**6)
    """Drop (and count) a trajectory whose oldest sampled token is more than this many weight
    versions behind the service's version when it finishes; None = keep all."""
    group: StrictBool = False
    """Deliver the ``n`` samples of a task together (consecutive cursors), or drop the whole
    group (reason ``group_incomplete``) when one of them is dropped."""
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)
    """Submitting again with the same key returns the same job (also the
    ``Idempotency-Key`` header)."""

    @model_validator(mode="after")
    def _one_source(self) -> RolloutRequest:
        if (self.tasks is None) == (self.dataset is None):
            raise ValueError("a rollout job needs exactly one of 'tasks' or 'dataset'")
        if self.tasks is not None and not self.tasks:
            raise ValueError("'tasks' is empty; send at least one task")
        return self


class JobCounts(_Model):
    """Episode accounting of a job: ``admitted == finished + dropped + running + queued``."""

    episodes: int
    """Tasks x n: every one ends as a trajectory or a counted drop."""
    queued: int
    """Not started yet."""
    running: int
    finished: int
    """Ended with a trajectory that was (or will be, for a group) delivered."""
    dropped: int
    dropped_by_reason: dict[str, int] = Field(default_factory=dict)
    """``cancelled``, ``stale``, ``reward_error``, ``group_incomplete``, ``error``, ..."""
    delivered: int
    """Trajectories given a cursor (deliverable)."""
    acked: int
    """The acknowledged cursor: trajectories 1..acked are never sent again."""
    pending_delivery: int
    """Stored and not acknowledged (survive a restart)."""


class JobStatus(_Model):
    """``GET /v1/rollouts/{id}``."""

    id: str
    status: JobState
    error: str | None = None
    created: float
    finished: float | None = None
    tasks: int
    n: int
    group: bool
    counts: JobCounts
    cursor: int
    """Highest cursor handed out so far (``seq`` of the newest deliverable trajectory)."""


class AckRequest(_Model):
    """``POST /v1/rollouts/{id}/ack``: everything with ``seq <= cursor`` was processed."""

    cursor: StrictInt = Field(ge=0, le=2**62)


class AckResponse(_Model):
    """The cursor acknowledged now (everything up to it may be freed)."""

    acked: int


class PathWeightsRequest(_Model):
    """``POST /v1/weights`` (JSON): load a safetensors file/directory from a shared path."""

    path: str = Field(min_length=1, max_length=4096, pattern=NO_NUL)
    """A ``.safetensors`` file, or a directory holding ``model.safetensors``, under one of the
    service's ``--weights-dir`` roots."""
    version: StrictInt | None = Field(default=None, ge=0, le=2**62)
    """The new version (must exceed the current one; default current + 1)."""


class ServerPush(_Model):
    """Where one inference server stands after a push."""

    version: int | None
    """Version the server reports (None: unreachable)."""
    paused: bool
    stage: str
    error: str | None
    verify_max_abs_diff: float | None
    seconds: float
    digest: str | None = None
    """The server's content digest of the weights it serves after the push."""


class WeightPushResponse(_Model):
    """The CheckpointEngine's PushReport for one push, plus what the service checked."""

    version: int
    ok: bool
    verified: bool
    """Every server's probe logprobs were compared with the pushed weights' own."""
    servers: dict[str, ServerPush]
    """The live servers the push reached."""
    ejected: dict[str, str] = Field(default_factory=dict)
    """Servers out of the pool (dead, or restarting), by URL, with the reason: not failures;
    each rejoins at the current version (docs/operations.md)."""
    persisted: bool = False
    """The push was saved as the service's latest weights (reloaded when it restarts)."""
    num_bytes: int
    sha256: str
    """Of the safetensors bytes received: compare with yours to rule out a corrupted upload."""
    max_abs_diff: float | None
    stage_seconds: float
    verify_seconds: float
    total_seconds: float
    transport: str


class WeightsInfo(_Model):
    """``GET /v1/weights``: the service's version and each server's."""

    version: int
    sha256: str | None = None
    """Of the saved safetensors bytes of ``version`` (None: the launch weights of model.path)."""
    digest: str | None = None
    """The servers' content digest of ``version`` (their ``/weight_info`` digest)."""
    servers: dict[str, int | None]
    ejected: dict[str, str] = Field(default_factory=dict)
    """Servers out of the pool, with the reason."""
    last_push: WeightPushResponse | None = None


class SessionOpenRequest(_Model):
    """``POST /v1/sessions``: open a recording session for a black-box OpenAI-client agent."""

    task: Task
    """What the agent works on: scoring uses its ``data_source`` and ``reward_spec``; the
    trajectories carry its ``id``."""
    ttl_s: StrictFloat | None = Field(default=None, gt=0, le=7 * 24 * 3600)
    """Idle time after which the session is evicted (default: the service's)."""
    sampling: SamplingOverrides = Field(default_factory=SamplingOverrides)


class SessionInfo(_Model):
    """``GET /v1/sessions/{id}`` (and the answer to opening one)."""

    id: str
    base_url: str
    """Give this to ``OpenAI(base_url=...)`` (with the service's API key as ``api_key``)."""
    task_id: str
    expires_in_s: float
    turns: int = 0
    segments: int = 0


class SessionFinishRequest(_Model):
    """``POST /v1/sessions/{id}/finish``."""

    stop_reason: StopReason | None = None
    """Override the stop reason derived from the last generation."""


class SessionFinishResponse(_Model):
    """The scored trajectories of a finished session, and the dropped segments."""

    trajectories: list[dict[str, Any]]
    """Scored trajectories (``agentrl.types.Trajectory`` JSON), one per segment."""
    dropped: list[dict[str, Any]] = Field(default_factory=list)
    """Segments whose reward failed: ``{"segment", "reason", "error"}`` (never scored 0.0)."""
