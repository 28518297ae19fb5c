"""Bearer-token auth and request-size limits, as plain ASGI middleware.

Why plain ASGI and not FastAPI dependencies: the checks must run before a body is read (a
413 is decided from ``Content-Length`` and from the bytes as they stream in, never after a
multi-gigabyte body sits in memory) and must cover every route, including the OpenAPI docs and
routes added later, without each route remembering to ask.

Guarantees:

- :class:`BearerAuth` with a key: every path except the public ones (``/health``) needs
  ``Authorization: Bearer <key>``; anything else is a 401 with ``WWW-Authenticate: Bearer``.
  The key is compared in constant time. Without a key, only loopback clients (127.0.0.0/8,
  ::1) are served on non-public paths; others get a 403 that says to set a key. This is the
  control-plane rule of DESIGN section 10, shared by the rollout service and the recording proxy.
- :class:`BodyLimit`: a request whose ``Content-Length`` exceeds its limit is answered 413
  before the body is read; a body that streams past the limit without a length (chunked) is
  cut off with a 413 as soon as it crosses it. Limits are per path prefix.
- Error bodies have the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
from collections.abc import Iterable, Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "API_KEY_ENV",
    "BearerAuth",
    "BodyLimit",
    "error_body",
    "is_loopback_host",
    "resolve_api_key",
    "warn_if_exposed",
]

logger = logging.getLogger(__name__)

API_KEY_ENV = "AGENTRL_API_KEY"
"""Environment variable holding the bearer token (used when no key is passed explicitly)."""


def error_body(status: int, message: str, *, kind: str, param: str | None = None) -> bytes:
    """An OpenAI-style error body as JSON bytes."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    ).encode()


async def _respond(
    send: Send, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def resolve_api_key(explicit: str | None) -> str | None:
    """``explicit`` if given (an empty string means "no key"), else ``$AGENTRL_API_KEY``."""
    key = explicit if explicit is not None else os.environ.get(API_KEY_ENV)
    return key or None


def is_loopback_host(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost`` (what a default bind is reachable from)."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, api_key: str | None, what: str) -> bool:
    """Log a loud warning when ``host`` is not loopback and no key is set; True if warned."""
    if is_loopback_host(host) or api_key:
        return False
    banner = "!" * 78
    logger.warning(
        "\n%s\n%s binds %s WITHOUT an API key. Only loopback clients will be served on its\n"
        "protected routes, but the port is reachable from other machines. Set --api-key or\n"
        "$%s to serve remote clients safely.\n%s",
        banner,
        what,
        host,
        API_KEY_ENV,
        banner,
    )
    return True


class BearerAuth:
    """ASGI middleware: bearer token on every non-public path (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        public_paths: Iterable[str] = ("/health",),
    ) -> None:
        self.app = app
        self.api_key = api_key
        self._key = api_key.encode() if api_key else None
        self.public_paths = frozenset(public_paths)

    def _authorized(self, scope: Scope) -> tuple[bool, int, str]:
        if self._key is None:
            client = scope.get("client")
            host = client[0] if client else None
            if is_loopback_host(host):
                return True, 0, ""
            return (
                False,
                403,
                "this server has no API key and serves loopback clients only; start it with "
                f"--api-key (or ${API_KEY_ENV}) to accept remote clients",
            )
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False, 401, "missing bearer token: send 'Authorization: Bearer <api key>'"
        if not hmac.compare_digest(token.strip(), self._key):
            return False, 401, "invalid API key"
        return True, 0, ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.public_paths:
            await self.app(scope, receive, send)
            return
        ok, status, message = self._authorized(scope)
        if ok:
            await self.app(scope, receive, send)
            return
        kind = "authentication_error" if status == 401 else "permission_error"
        headers = [(b"www-authenticate", b"Bearer")] if status == 401 else []
        await _respond(send, status, error_body(status, message, kind=kind), headers)


class BodyLimit:
    """ASGI middleware: 413 for bodies over the limit of their path (module docstring).

    ``limits`` maps path prefixes to byte limits; the longest matching prefix wins, and
    ``default`` applies elsewhere. A body with ``Content-Length`` streams through untouched
    (the HTTP server enforces the declared length); a chunked body is read here up to the
    limit and replayed, so nothing past the limit is ever buffered.
    """

    def __init__(self, app: ASGIApp, *, default: int, limits: Mapping[str, int] | None = None):
        self.app = app
        self.default = default
        self.limits = sorted((limits or {}).items(), key=lambda kv: -len(kv[0]))

    def limit_for(self, path: str) -> int:
        """The body limit of ``path``: the longest matching prefix's, else the default."""
        for prefix, limit in self.limits:
            if path.startswith(prefix):
                return limit
        return self.default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope.get("path", ""))
        declared: int | None = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
        if declared is not None:
            if declared < 0:
                body = error_body(400, "malformed Content-Length", kind="invalid_request_error")
                await _respond(send, 400, body)
            elif declared > limit:
                await self._too_large(send, declared, limit)
            else:
                await self.app(scope, receive, send)
            return
        if scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(send, size, limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive() -> Message:
            """The buffered body first, then the app's further ``receive`` calls."""
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)

    @staticmethod
    async def _too_large(send: Send, size: int, limit: int) -> None:
        message = (
            f"request body of {size} bytes or more exceeds this route's limit of {limit} bytes"
        )
        await _respond(
            send,
            413,
            error_body(413, message, kind="request_too_large"),
            [(b"connection", b"close")],
        )
