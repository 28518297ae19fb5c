"""Time and connection bounds for every HTTP server of agentrl (inference, service, proxy).

Why it exists: uvicorn bounds the idle time between requests (keep-alive) but not the time a
client takes to send its request: 1,200 connections that each sent half a request line stayed
open forever, and a body that trickles in one byte a second held its route (and whatever lock
the route held) as long as the client liked. The three servers share one set of bounds from here.

Guarantees (with :func:`uvicorn_limits` in the server's ``uvicorn.Config`` and
:class:`BodyDeadline` around its app):

- a connection must send a complete request head (request line and headers) within
  :data:`HEADER_TIMEOUT_S` of opening or of its previous response, else it is closed (with a 408
  when it had sent part of a request); trickling bytes does not extend this deadline;
- a request body must arrive within ``BODY_TIMEOUT_S + size / MIN_BODY_RATE`` seconds (size:
  ``Content-Length``, or the bytes received so far for a chunked body), else the request is
  answered 408 with ``Connection: close`` and the app sees a disconnect;
- a request head may be at most :data:`MAX_HEAD_BYTES` (h11 answers 400 past it);
- at most :data:`LIMIT_CONCURRENCY` connections or requests at once (uvicorn answers 503 past
  it, instead of running out of file descriptors), and the process's open-file limit is raised to
  its hard limit so that bound, not the descriptor table, is what a flood meets.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "BODY_TIMEOUT_S",
    "HEADER_TIMEOUT_S",
    "LIMIT_CONCURRENCY",
    "MAX_HEAD_BYTES",
    "MIN_BODY_RATE",
    "BodyDeadline",
    "header_deadline_protocol",
    "raise_open_file_limit",
    "uvicorn_limits",
]

HEADER_TIMEOUT_S = 10.0
"""Longest a connection may take to send a request head (from open, or from its last answer)."""
BODY_TIMEOUT_S = 30.0
"""Base time a request body may take to arrive (plus its size over :data:`MIN_BODY_RATE`)."""
MIN_BODY_RATE = 1 << 20
"""Slowest body upload served, in bytes per second (a 1 GiB upload gets 30 s + 1024 s)."""
LIMIT_CONCURRENCY = 4096
"""Most connections or requests at once; past it uvicorn answers 503."""
MAX_HEAD_BYTES = 64 * 1024
"""Largest request line + headers (h11's incomplete-event limit; 400 past it)."""
KEEP_ALIVE_S = 5
"""Idle time after which a keep-alive connection is closed."""

_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def header_deadline_protocol(header_timeout_s: float = HEADER_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request-head deadline of ``header_timeout_s`` (module doc)."""

    class HeaderDeadlineH11Protocol(H11Protocol):
        """Closes a connection that has not sent a whole request head in time."""

        _head_timer: asyncio.TimerHandle | None = None

        def _waiting_for_head(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is None or cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or not self._waiting_for_head():
                return
            partial, _closed = self.conn.trailing_data
            if partial:  # part of a request arrived: say why the connection ends
                with contextlib.suppress(Exception):
                    self.transport.write(_REQUEST_TIMEOUT)
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._waiting_for_head():
                self._disarm()  # a request is running: its body has BodyDeadline

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._waiting_for_head():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineH11Protocol


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def uvicorn_limits(header_timeout_s: float = HEADER_TIMEOUT_S) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.Config`` that apply these bounds (and raise the open-file
    limit of the calling process)."""
    raise_open_file_limit()
    return {
        "http": header_deadline_protocol(header_timeout_s),
        "timeout_keep_alive": KEEP_ALIVE_S,
        "limit_concurrency": LIMIT_CONCURRENCY,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }


class BodyDeadline:
    """ASGI middleware: a request body must arrive within ``base_s + size / min_rate`` seconds,
    else the request is answered 408 (``Connection: close``) and the app sees a disconnect."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        base_s: float = BODY_TIMEOUT_S,
        min_rate: float = MIN_BODY_RATE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.base_s = base_s
        self.min_rate = min_rate
        self.clock = clock
        self.state = getattr(app, "state", None)  # keep app.state reachable through the wrapper

    def _declared(self, scope: Scope) -> int:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                with contextlib.suppress(ValueError):
                    return max(int(value), 0)
        return 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, declared = self.clock(), self._declared(scope)
        state = {"received": 0, "done": False, "timed_out": False, "started": False}

        async def bounded_receive() -> Message:
            """The next body message, or a disconnect once the body's deadline has passed."""
            if state["done"] or state["timed_out"]:
                return await receive() if state["done"] else {"type": "http.disconnect"}
            size = max(declared, state["received"])
            remaining = start + self.base_s + size / self.min_rate - self.clock()
            try:
                message = await asyncio.wait_for(receive(), max(remaining, 0.0))
            except TimeoutError:
                state["timed_out"] = True
                if not state["started"]:
                    await _request_timeout(send, self.base_s + size / self.min_rate)
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                state["done"] = not message.get("more_body", False)
            else:
                state["done"] = True
            return message

        async def guarded_send(message: Message) -> None:
            """The app's answer, unless a 408 already went out."""
            if state["timed_out"] and not state["started"]:
                return
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        await self.app(scope, bounded_receive, guarded_send)


async def _request_timeout(send: Send, allowed_s: float) -> None:
    from agentrl.auth import error_body

    message = (
        f"the request body did not arrive within {allowed_s:.0f} s; send it faster "
        f"(at least {MIN_BODY_RATE} bytes/s)"
    )
    body = error_body(408, message, kind="request_timeout")
    await send(
        {
            "type": "http.response.start",
            "status": 408,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
