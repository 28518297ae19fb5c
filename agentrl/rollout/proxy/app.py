"""The proxy's HTTP app: OpenAI's chat-completions routes per session, over a recorder.

Why it exists: an agent written against ``AsyncOpenAI(base_url=...)`` needs the proxy at a URL.
This module maps ``/sessions/{sid}/v1/...`` onto a
:class:`~agentrl.rollout.proxy.recorder.ProxyRecorder` and nothing else: every decision is the
recorder's.

Guarantees:

- every error, request validation included, is an OpenAI-style body
  (:meth:`~agentrl.rollout.proxy.protocol.ProxyError.body`) with its status; a validation error is
  a 400 naming the field;
- with an API key every route but ``/health`` needs ``Authorization: Bearer <key>`` (the
  ``api_key`` of the OpenAI client); without one only loopback clients are served;
- a body over :data:`MAX_BODY_BYTES` is a 413 before it is read; a body that does not arrive in
  time is a 408 (:mod:`agentrl.http_limits`);
- the recorder stays reachable as ``app.state.recorder`` behind the auth wrapper.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from agentrl.auth import BearerAuth, BodyLimit, resolve_api_key
from agentrl.http_limits import BodyDeadline
from agentrl.rollout.proxy.protocol import ChatCompletionRequest, ProxyError
from agentrl.rollout.proxy.recorder import ProxyRecorder
from agentrl.types import Policy

__all__ = [
    "MAX_BODY_BYTES",
    "add_proxy_error_handlers",
    "build_app",
    "create_proxy_app",
    "with_auth",
]

MAX_BODY_BYTES = 32 << 20
"""Largest chat-completions body the proxy reads (413 past it, before it is buffered)."""


def add_proxy_error_handlers(app: FastAPI) -> None:
    """OpenAI-style error bodies for :class:`ProxyError` and request validation (400)."""

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(
            ProxyError(400, f"invalid request: {param}: {first.get('msg')}", param or None).body(),
            status_code=400,
        )


def build_app(recorder: ProxyRecorder) -> FastAPI:
    """The FastAPI app serving ``recorder`` (no auth: see :func:`with_auth`)."""
    app = FastAPI(title="agentrl recording proxy")
    app.state.recorder = recorder
    add_proxy_error_handlers(app)

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, req: ChatCompletionRequest) -> JSONResponse:
        """Record one turn of the session; returns an OpenAI ``ChatCompletion``."""
        return JSONResponse(await recorder.chat(session_id, req))

    @app.get("/sessions/{session_id}/v1/models")
    async def models(session_id: str) -> dict[str, Any]:
        """The one model this proxy serves (404 for an unknown session)."""
        recorder.task_of(session_id)  # 404 for an unknown session
        return {
            "object": "list",
            "data": [
                {"id": recorder.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}
            ],
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: ``{"status": "ok"}`` (no auth needed)."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> dict[str, float]:
        """The recorder's ``proxy/...`` counters."""
        return recorder.metrics()

    return app


def create_proxy_app(
    policy: Policy, tokenizer: Any, *, api_key: str | None = None, **options: Any
) -> Any:
    """An ASGI app serving ``/sessions/{sid}/v1/chat/completions`` for ``policy``.

    ``options`` go to :class:`ProxyRecorder`; the recorder is ``app.state.recorder`` (open
    sessions with its ``open_session()``, collect trajectories with ``finish(sid)``).
    ``api_key`` (default ``$AGENTRL_API_KEY``): every route but ``/health`` needs
    ``Authorization: Bearer <key>``; without a key only loopback clients are served.
    """
    app = build_app(ProxyRecorder(policy, tokenizer, **options))
    return with_auth(app, api_key)


def with_auth(app: FastAPI, api_key: str | None, max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    """``app`` behind bearer auth (``api_key``, default ``$AGENTRL_API_KEY``), a body limit
    (413 past ``max_body_bytes``) and a body deadline (408), keeping its state."""
    limited = BodyLimit(app, default=max_body_bytes)
    secured = BodyDeadline(BearerAuth(limited, api_key=resolve_api_key(api_key)))
    secured.state = app.state  # callers reach the recorder here
    return secured
