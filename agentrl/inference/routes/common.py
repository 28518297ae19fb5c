"""What every router of the embedded server shares: its state, its errors, its safety nets.

Why it exists: the routes are split by concern (generation, control, weights, metrics); the
pieces they all need live here once:

- :class:`ServerState` holds the engine, tokenizer, names, request log and limits;
- :class:`APIError` is answered with OpenAI's ``{"error": {"message", "type", "param",
  "code"}}`` body; every answer >= 500 carries ``Connection: close`` so a client never reuses
  a connection the server may drop (after a 500 the next request must not fail with a
  ``ReadError``);
- :func:`install_error_handlers` maps validation errors to 400 (naming the field) and catches
  anything unexpected *inside* the app, so no exception ever reaches uvicorn (which would close
  a kept-alive connection behind the client's back);
- :func:`until_disconnect` runs a handler's work and cancels it when the client goes away, so
  a client that gave up (a pool timeout) never gets its generation finished behind its back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "APIError",
    "ClientGone",
    "RequestLog",
    "ServerState",
    "check_lease",
    "error_response",
    "install_error_handlers",
    "until_disconnect",
]

logger = logging.getLogger("agentrl.inference.server")
T = TypeVar("T")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    411: "LengthRequiredError",
    413: "RequestTooLargeError",
    422: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str | None = None,
        code: int | str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _ERROR_TYPES.get(status, "BadRequestError")
        self.code = code if code is not None else status
        self.headers = headers or {}


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nothing is sent."""


class _SafeJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message that quotes a lone
    surrogate from the request still encodes (Starlette's UTF-8 encoding would raise)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode("ascii")


def error_response(err: APIError) -> JSONResponse:
    """OpenAI's error body for ``err`` (``Connection: close`` when the status is >= 500)."""
    body = {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }
    headers = dict(err.headers)
    if err.status >= 500:
        headers["Connection"] = "close"
    return _SafeJSONResponse(body, status_code=err.status, headers=headers)


class RequestLog:
    """Appends one JSON line per generation request; thread-safe, flushed per line.

    The file is created with mode 0600 (it holds every prompt and output).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")

    def write(
        self,
        *,
        request_id: str,
        session_id: str | None,
        prompt_ids: list[int],
        output_ids: list[int],
        weight_version: int,
        finish_reason: str = "stop",
    ) -> None:
        """Append one line (thread-safe, flushed)."""
        line = json.dumps(
            {
                "request_id": request_id,
                "session_id": session_id,
                "prompt_ids": prompt_ids,
                "output_ids": output_ids,
                "weight_version": weight_version,
                "finish_reason": finish_reason,
                "t": time.time(),
            },
            ensure_ascii=True,
        )
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()


@dataclass
class ServerState:
    """Everything the routes share (one per app; ``app.state.server``)."""

    engine: Any
    tokenizer: Any
    model_name: str
    log_sink: RequestLog | None = None
    api_key: str | None = None
    trust_request_chat_template: bool = False
    render_timeout_s: float = 10.0
    """Longest a chat template (or a string prompt's tokenization) may take."""
    max_renders: int = 8
    """Most renders within their deadline at once; a render past its deadline gives its slot
    back (its thread runs on, counted in :attr:`max_abandoned_renders`)."""
    max_abandoned_renders: int = 32
    """Most renders past their deadline whose threads still run (503 for new renders above)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    _renders: int = 0
    _abandoned: int = 0
    _renders_lock: threading.Lock = field(default_factory=threading.Lock)

    async def off_loop(self, fn: Callable[[], T], *, what: str, param: str) -> T:
        """Run ``fn()`` in a daemon thread, never on the event loop, with
        :attr:`render_timeout_s`; a timeout is a 400 naming ``param`` and frees the render slot
        at once. The thread cannot be killed: it finishes on its own (counted as abandoned until
        then), and being a daemon it never holds up a shutdown."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        with self._renders_lock:
            if self._renders >= self.max_renders:
                raise APIError(503, f"{self.max_renders} renders are already running; retry later")
            if self._abandoned >= self.max_abandoned_renders:
                raise APIError(
                    503, f"{self._abandoned} renders past their deadline still run; retry later"
                )
            self._renders += 1
        slot = {"abandoned": False, "finished": False}

        def deliver(result: Any, error: BaseException | None) -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        def target() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as e:  # handed to the awaiting request, whatever it is
                error = e
            finally:
                with self._renders_lock:
                    slot["finished"] = True
                    if slot["abandoned"]:
                        self._abandoned -= 1
                    else:
                        self._renders -= 1
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
                loop.call_soon_threadsafe(deliver, result, error)

        threading.Thread(target=target, name="agentrl-render", daemon=True).start()
        try:
            return await asyncio.wait_for(fut, self.render_timeout_s)
        except TimeoutError as e:
            with self._renders_lock:
                if not slot["finished"]:  # still running: free its slot, count it abandoned
                    slot["abandoned"] = True
                    self._renders -= 1
                    self._abandoned += 1
            raise APIError(
                400, f"{what} took longer than {self.render_timeout_s:g} s; refused", param=param
            ) from e


# ---- error handling ------------------------------------------------------------------------------
class _CatchAll:
    """Pure ASGI middleware: an exception no handler took becomes a 500 (``Connection: close``)
    here, inside the app, instead of reaching uvicorn (which would close the kept-alive
    connection after answering). Also swallows :class:`ClientGone`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientGone:
            return
        except Exception as exc:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                return
            err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
            await error_response(err)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Map every error to OpenAI's body: APIError as is, validation errors to 400 naming the
    field, HTTP errors (404, 405) with their status, anything else to 500."""

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            param = None
        else:
            param = ".".join(loc) or None
            msg = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
            if "input" in first and first.get("type") != "missing":
                msg += f" (got {first['input']!r:.100})"
        return error_response(APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    app.add_middleware(_CatchAll)


# ---- client disconnects ------------------------------------------------------------------------
async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise :class:`ClientGone`.

    Call it once the body has been read (the listener consumes the receive channel).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception as exc:  # the work failed while being cancelled: the client is gone anyway
        logger.debug("work of a disconnected client ended with %r", exc)
    raise ClientGone


def check_lease(st: ServerState, request: Request) -> None:
    """409 unless no push lease is held or the request carries its token (``x-push-lease``):
    every route that changes weights or the weight group calls it."""
    from agentrl.inference.engine import VersionConflict

    try:
        st.engine.weights.lease.check(request.headers.get("x-push-lease"))
    except VersionConflict as e:
        raise APIError(409, str(e), param="x-push-lease") from e
