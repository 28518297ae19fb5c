"""The rollout service's HTTP app: routes over jobs, weights, sessions and status.

Why one module of thin routes: each route validates its input (pydantic models of
:mod:`agentrl.service.models`), calls one method of :class:`RolloutService` and turns the
service's typed errors into OpenAI-style 4xx bodies; the logic lives in ``jobs``, ``weights``
and ``sessions``.

Guarantees (with :func:`create_app`'s middleware):

- every route but ``/health`` needs the bearer token (or a loopback client when the service
  has no key); the OpenAPI document and ``/docs`` too;
- bodies over ``max_body_bytes`` (``max_weights_bytes`` for ``POST /v1/weights``) are a 413
  before they are read;
- a client error is a 4xx naming the field; a 5xx means a bug or a failed upstream (a weight
  push that failed on a server is a 502 carrying the push report).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentrl.auth import BearerAuth, BodyLimit
from agentrl.http_limits import BodyDeadline
from agentrl.rollout.proxy import ChatCompletionRequest, ProxyError
from agentrl.service.jobs import JobError, JobManager, resolve_tasks_for
from agentrl.service.models import (
    AckRequest,
    AckResponse,
    JobStatus,
    PathWeightsRequest,
    RolloutRequest,
    SessionFinishRequest,
    SessionFinishResponse,
    SessionInfo,
    SessionOpenRequest,
    WeightPushResponse,
    WeightsInfo,
)
from agentrl.service.sessions import SessionService
from agentrl.service.store import Store
from agentrl.service.weights import WeightError, WeightService
from agentrl.serving.supervisor import ServerSupervisor

__all__ = ["RolloutService", "ServiceSettings", "create_app", "run_service"]

logger = logging.getLogger(__name__)

MiB = 1 << 20


class ServiceSettings(BaseModel):
    """Settings of ``agentrl serve`` (the proposed ``service:`` config section)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    """Bind address; anything but loopback without an API key is warned about loudly."""
    port: int = Field(default=8400, ge=0, le=65535)
    api_key: str | None = None
    """Bearer token for every route but /health (default: $AGENTRL_API_KEY)."""
    store: str | None = None
    """SQLite file of jobs and undelivered trajectories (default: output_dir/service.sqlite)."""
    durable: bool = False
    """SQLite synchronous=FULL (survives power loss, not only a crash), at some write cost."""
    max_body_bytes: int = Field(default=32 * MiB, ge=1024)
    """Largest JSON request body (413 above)."""
    max_weights_bytes: int = Field(default=64 * 1024 * MiB, ge=1024)
    """Largest uploaded safetensors body of POST /v1/weights (413 above)."""
    max_active_jobs: int = Field(default=64, ge=1)
    """Jobs queued or running at once (429 above)."""
    max_episodes_per_job: int = Field(default=100_000, ge=1)
    """Tasks x n of one job (400 above)."""
    session_ttl_s: float = Field(default=3600.0, gt=0)
    """Idle time after which a proxy session is evicted."""
    max_sessions: int = Field(default=10_000, ge=1)
    """Open proxy sessions at once (429 above)."""
    weights_dirs: list[str] = Field(default_factory=list)
    """Directories a path push may read from (empty: path pushes are refused, 403)."""
    data_dirs: list[str] = Field(default_factory=list)
    """Directories a dataset.path may read from (empty: refused, 403)."""
    heartbeat_s: float = Field(default=15.0, gt=0)
    """Idle SSE streams get a comment line this often."""
    retention_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    """Finished jobs (and their unacknowledged trajectories) are purged after this long."""
    max_server_restarts: int | None = Field(default=None, ge=0)
    """Restarts of each inference server the service launched, once it dies (0: never;
    None: the config's ``inference.max_server_restarts``)."""


class RolloutService:
    """Jobs, weights and sessions over one ``build_serving`` result (see the package doc)."""

    def __init__(self, serving: Any, cfg: Any, settings: ServiceSettings) -> None:
        self.serving = serving
        self.cfg = cfg
        self.settings = settings
        self.started = time.time()
        store_path = settings.store or str(Path(cfg.trainer.output_dir) / "service.sqlite")
        self.store = Store(store_path, durable=settings.durable)
        self.servers = ServerSupervisor(
            serving,
            max_restarts=(
                cfg.inference.max_server_restarts
                if settings.max_server_restarts is None
                else settings.max_server_restarts
            ),
            interval_s=cfg.inference.health_check_interval_s,
        )
        self.weights = WeightService(
            serving,
            temperature=cfg.inference.temperature or 1.0,
            weights_dirs=[Path(d) for d in settings.weights_dirs],
            servers=self.servers,
            state_dir=weights_state_dir(store_path),
        )
        self.jobs = JobManager(
            serving,
            self.store,
            resolve_tasks=resolve_tasks_for(cfg, [Path(d).resolve() for d in settings.data_dirs]),
            version=lambda: self.weights.version,
            max_concurrency=cfg.rollout.max_concurrency,
            max_active_jobs=settings.max_active_jobs,
            max_episodes_per_job=settings.max_episodes_per_job,
            heartbeat_s=settings.heartbeat_s,
            retention_s=settings.retention_s,
        )
        self.sessions = SessionService(
            serving,
            cfg,
            session_ttl_s=settings.session_ttl_s,
            max_sessions=settings.max_sessions,
        )

    async def start(self) -> None:
        """Restore the saved weights (:meth:`WeightService.restore`), watch the servers, then
        purge old jobs and resume the unfinished ones (:meth:`JobManager.start`): a resumed
        episode samples from the weights the service had when it stopped."""
        await self.weights.restore()
        self.servers.start(self.weights.catch_up)
        await self.jobs.start()

    async def close(self) -> None:
        """Stop every job and close the store (:meth:`JobManager.close`), then stop watching
        the servers (and stop the ones the supervisor restarted)."""
        await self.jobs.close()
        await self.servers.aclose()

    def health(self) -> dict[str, Any]:
        """``ok``, or ``degraded`` with every server out of the pool (which, why, since when)."""
        degraded = self.servers.degraded()
        if not degraded:
            return {"status": "ok"}
        return {"status": "degraded", "servers": degraded}

    async def status(self) -> dict[str, Any]:
        """Servers and health, versions, jobs, sessions, pushes and the store."""
        pool = self.serving.pool
        stats = pool.stats()
        servers = []
        for slot in self.servers.slots:
            s = stats.get(slot.url)
            servers.append(
                {
                    **slot.describe(),
                    "alive": bool(s and s.alive and slot.state == "serving"),
                    "outstanding": s.outstanding if s else 0,
                    "completed": s.completed if s else 0,
                    "failures": s.failures if s else 0,
                    "sessions": s.sessions if s else 0,
                }
            )
        pending = await self.jobs.db.call(self.store.pending_total)
        return {
            "version": self.weights.version,
            "health": self.health(),
            "uptime_s": time.time() - self.started,
            "servers": servers,
            "server_counts": dict(self.servers.counts),
            "jobs": self.jobs.stats(),
            "sessions": self.sessions.stats(),
            "weights": self.weights.describe(),
            "rewards": self.serving.rewards.metrics(),
            "store": {"path": Path(self.store.path).name, "pending_trajectories": pending},
        }


def weights_state_dir(store_path: str) -> Path:
    """Where the service saves its latest verified weights: ``<store stem>-weights/`` next to
    its SQLite store (a restart on the same store resumes jobs and weights together)."""
    store = Path(store_path)
    return store.with_name(f"{store.stem}-weights")


@contextlib.asynccontextmanager
async def run_service(cfg: Any, settings: ServiceSettings) -> AsyncIterator[RolloutService]:
    """Build the servers (``build_serving``) and a started :class:`RolloutService` on them."""
    from agentrl.service.serving import build_serving

    async with build_serving(cfg) as serving:
        service = RolloutService(serving, cfg, settings)
        await service.start()
        try:
            yield service
        finally:
            await service.close()


# ---- the app ---------------------------------------------------------------------------------
def _error(status: int, message: str, param: str | None = None, kind: str = "") -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status_code=status,
    )


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(JobError)
    async def _job_error(_r: Request, exc: JobError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(WeightError)
    async def _weight_error(_r: Request, exc: WeightError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(ProxyError)
    async def _proxy_error(_r: Request, exc: ProxyError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_r: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {first.get('msg', '')}")
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_r: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _server_error(_r: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the rollout service")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


def _add_rollout_routes(app: FastAPI, service: RolloutService) -> None:
    jobs = service.jobs

    @app.post("/v1/rollouts", response_model=JobStatus, status_code=201, tags=["rollouts"])
    async def submit(
        req: RolloutRequest, idempotency_key: str | None = Header(default=None, max_length=200)
    ) -> JSONResponse:
        """Start a rollout job (201), or return the job of a known idempotency key (200)."""
        status, created = await jobs.submit(req, idempotency_key)
        return JSONResponse(status.model_dump(mode="json"), status_code=201 if created else 200)

    @app.get("/v1/rollouts", response_model=list[JobStatus], tags=["rollouts"])
    async def list_jobs() -> list[JobStatus]:
        """Every stored job, oldest first."""
        return await jobs.all_jobs()

    @app.get("/v1/rollouts/{job_id}", response_model=JobStatus, tags=["rollouts"])
    async def get_job(job_id: str) -> JobStatus:
        """Progress: queued / running / finished / dropped by reason, cursors."""
        return await jobs.status(job_id)

    @app.delete("/v1/rollouts/{job_id}", response_model=JobStatus, tags=["rollouts"])
    async def cancel_job(job_id: str) -> JobStatus:
        """Cancel: running episodes end as counted drops; stored trajectories stay readable."""
        return await jobs.cancel(job_id)

    @app.post("/v1/rollouts/{job_id}/ack", response_model=AckResponse, tags=["rollouts"])
    async def ack(job_id: str, req: AckRequest) -> AckResponse:
        """Acknowledge every trajectory up to ``cursor`` (never sent again, storage freed)."""
        return AckResponse(acked=await jobs.ack(job_id, req.cursor))

    @app.get(
        "/v1/rollouts/{job_id}/trajectories",
        tags=["rollouts"],
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def trajectories(
        job_id: str,
        after: int | None = Query(default=None, ge=0, le=2**62),
        last_event_id: str | None = Header(default=None, max_length=32),
    ) -> StreamingResponse:
        """Server-Sent Events: one ``trajectory`` event per scored trajectory (``id`` = its
        cursor), ``: keep-alive`` comments while idle, and a final ``end`` event with the job's
        status. Resume with ``?after=CURSOR`` or the ``Last-Event-ID`` header: resuming from a
        cursor acknowledges it. Without either, the stream starts after the acknowledged cursor."""
        if after is None and last_event_id is not None:
            try:
                after = int(last_event_id)
            except ValueError:
                raise JobError(
                    400, "Last-Event-ID must be an integer cursor", "Last-Event-ID"
                ) from None
            if not 0 <= after <= 2**62:
                raise JobError(400, "Last-Event-ID is out of range", "Last-Event-ID")
        cursor = await jobs.open_stream(job_id, after)
        return StreamingResponse(
            jobs.events(job_id, cursor),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )


def _add_weight_routes(app: FastAPI, service: RolloutService) -> None:
    weights = service.weights
    body_schema = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": PathWeightsRequest.model_json_schema()},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        }
    }

    @app.post(
        "/v1/weights",
        response_model=WeightPushResponse,
        tags=["weights"],
        openapi_extra=body_schema,
        responses={502: {"model": WeightPushResponse}},
    )
    async def push(
        request: Request,
        version: int | None = Query(default=None, ge=0, le=2**62),
    ) -> JSONResponse:
        """Push a new weight version to every server, verified. Send the safetensors bytes
        (``application/octet-stream``, ``?version=N``), or JSON ``{"path", "version"}`` for a
        file on a shared filesystem under ``--weights-dir``. 502 (with the report) when any
        server failed."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "application/json":
            try:
                req = PathWeightsRequest.model_validate_json(await request.body())
            except ValueError as exc:
                raise WeightError(400, f"invalid JSON push request: {exc}") from None
            path = weights.resolve_path(req.path)
            report, ok = await weights.push_file(path, req.version)
        elif ctype == "application/octet-stream":
            fd, name = weights.spool_file()
            try:
                with os.fdopen(fd, "wb") as f:
                    async for chunk in request.stream():
                        f.write(chunk)
                report, ok = await weights.push_file(Path(name), version)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(name)
        else:
            raise WeightError(
                415 if ctype else 400,
                f"content-type {ctype or '(none)'!r}: send application/octet-stream (safetensors "
                "bytes) or application/json ({'path': ...})",
                "content-type",
            )
        return JSONResponse(report.model_dump(mode="json"), status_code=200 if ok else 502)

    @app.get("/v1/weights", response_model=WeightsInfo, tags=["weights"])
    async def get_weights() -> WeightsInfo:
        """The service's version, each server's version and the last push report."""
        return await weights.info()


def _add_session_routes(app: FastAPI, service: RolloutService) -> None:
    sessions = service.sessions

    @app.post("/v1/sessions", response_model=SessionInfo, status_code=201, tags=["sessions"])
    async def open_session(req: SessionOpenRequest) -> SessionInfo:
        """Open a recording session bound to a task; point an OpenAI client at ``base_url``."""
        return sessions.open(req)

    @app.get("/v1/sessions/{session_id}", response_model=SessionInfo, tags=["sessions"])
    async def session_info(session_id: str) -> SessionInfo:
        """A session's URL, task, expiry and recorded turns."""
        return sessions.info(session_id)

    @app.delete("/v1/sessions/{session_id}", status_code=204, tags=["sessions"])
    async def discard_session(session_id: str) -> None:
        """Forget a session without scoring it."""
        sessions.discard(session_id)

    @app.post(
        "/v1/sessions/{session_id}/finish", response_model=SessionFinishResponse, tags=["sessions"]
    )
    async def finish_session(
        session_id: str, req: SessionFinishRequest | None = None
    ) -> SessionFinishResponse:
        """End the session: its trajectories (one per segment), scored against its task."""
        return await sessions.finish(session_id, req.stop_reason if req else None)

    @app.post("/v1/sessions/{session_id}/v1/chat/completions", tags=["sessions"])
    async def chat(session_id: str, req: ChatCompletionRequest) -> JSONResponse:
        """OpenAI chat completions, recorded token-exact (see docs/proxy.md)."""
        return JSONResponse(await sessions.chat(session_id, req))

    @app.get("/v1/sessions/{session_id}/v1/models", tags=["sessions"])
    async def models(session_id: str) -> dict[str, Any]:
        """The one model a session serves (for OpenAI clients that list models)."""
        return sessions.models(session_id)


def _metrics_text(status: dict[str, Any]) -> bytes:
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()

    def gauge(name: str, doc: str, value: float, **labels: str) -> None:
        """Set one gauge (with labels when given)."""
        g = Gauge(f"agentrl_service_{name}", doc, list(labels), registry=registry)
        (g.labels(**labels) if labels else g).set(value)

    gauge("weight_version", "The service's weight version", status["version"])
    gauge("uptime_seconds", "Seconds since start", status["uptime_s"])
    gauge(
        "store_pending_trajectories",
        "Stored, unacknowledged",
        status["store"]["pending_trajectories"],
    )
    alive = Gauge(
        "agentrl_service_server_alive", "1 if the server is alive", ["url"], registry=registry
    )
    for s in status["servers"]:
        alive.labels(url=s["url"]).set(float(s["alive"]))
    for k, v in status["jobs"].items():
        gauge(f"jobs_{k}", f"Rollout jobs: {k}", v)
    for k, v in status["sessions"].items():
        gauge(k, f"Proxy sessions: {k}", v)
    pushes = Gauge(
        "agentrl_service_weight_pushes", "Weight pushes by outcome", ["outcome"], registry=registry
    )
    for k in ("ok", "failed", "refused"):
        pushes.labels(outcome=k).set(status["weights"][k])
    gauge(
        "degraded",
        "1 while any inference server is out of the pool",
        float(status["health"]["status"] != "ok"),
    )
    gauge(
        "server_restarts",
        "Restarts of inference servers the service launched",
        status["server_counts"]["restarts"],
    )
    gauge(
        "server_ejections",
        "Inference servers taken out of the pool",
        status["server_counts"]["ejected"],
    )
    return generate_latest(registry)


def create_app(service: RolloutService) -> Any:
    """The ASGI app of ``service`` with auth and body limits (module docstring)."""
    app = FastAPI(
        title="agentrl rollout service",
        description="Scored multi-turn rollouts, black-box agent sessions and verified weight "
        "pushes over HTTP (docs/service.md).",
        version="1",
    )
    app.state.service = service
    _add_error_handlers(app)

    @app.get("/health", tags=["operations"])
    async def health() -> dict[str, Any]:
        """Liveness (no auth): ``ok``, or ``degraded`` (still 200: the service serves) with
        the servers out of the pool, why and since when."""
        return service.health()

    @app.get("/v1/status", tags=["operations"])
    async def status() -> dict[str, Any]:
        """Servers and health, versions, jobs, sessions, pushes and the store."""
        return await service.status()

    @app.get("/metrics", tags=["operations"], response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus text format."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(
            _metrics_text(await service.status()), media_type=CONTENT_TYPE_LATEST
        )

    _add_rollout_routes(app, service)
    _add_weight_routes(app, service)
    _add_session_routes(app, service)
    s = service.settings
    limited = BodyLimit(app, default=s.max_body_bytes, limits={"/v1/weights": s.max_weights_bytes})
    secured = BodyDeadline(BearerAuth(limited, api_key=s.api_key))
    secured.state = app.state  # tests reach the service here
    return secured
