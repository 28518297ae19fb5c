"""Who may call what on the embedded server: bearer-token auth and the loopback rule.

Why it exists: anyone who reaches an inference server's port could otherwise pause it, abort
its requests, swap its weights while keeping the version label, set any version, or probe the
server's filesystem through weight paths. The rule (DESIGN section 10, "Control plane"):

- with an API key (``--api-key`` or ``AGENTRL_API_KEY``, as vLLM's ``--api-key``), every route
  except :data:`PUBLIC_PATHS` (health, metrics, the OpenAPI docs) needs
  ``Authorization: Bearer <key>``; otherwise 401 with OpenAI's error body;
- without a key, the control routes (:data:`CONTROL_PATHS`: pause, resume, abort, prefix cache,
  probe, weights, version, collective_rpc, weight_group) answer loopback callers only; anyone else gets 403.
  Generation and read-only routes stay open, as on vLLM without a key;
- JSON request bodies must declare their size (``Content-Length``) and stay under
  :data:`MAX_JSON_BODY_BYTES` (411 / 413 otherwise); only the weight upload is larger.

The key is compared in constant time over its SHA-256 digest (so its length does not leak).
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from agentrl.inference.routes.common import APIError, error_response

__all__ = ["CONTROL_PATHS", "MAX_JSON_BODY_BYTES", "PUBLIC_PATHS", "AccessControl", "is_loopback"]

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/redoc"})
"""Answered without a key, from anywhere."""
CONTROL_PATHS = frozenset(
    {
        "/pause",
        "/resume",
        "/sleep",
        "/wake_up",
        "/abort_requests",
        "/reset_prefix_cache",
        "/probe",
        "/update_weights",
        "/update_weights_from_path",
        "/update_weights_from_url",
        "/update_weight_version",
        "/collective_rpc",
        "/weight_group/join",
        "/weight_group/receive",
        "/weight_group/leave",
    }
)
"""Change the server's state: a key, or a loopback caller when the server has no key."""
STREAMED_PATHS = frozenset({"/update_weights"})
"""Bodies that are streamed (the weights), exempt from the JSON body limit."""
MAX_JSON_BODY_BYTES = 32 * 1024 * 1024


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and a missing peer address (a unix socket, an in-process app)."""
    if host is None:
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


class AccessControl:
    """Pure ASGI middleware enforcing the module's rule before any route runs."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if self._digest is None or scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.strip().encode()).digest(), self._digest)

    def _refusal(self, scope: Scope, headers: Headers) -> APIError | None:
        path = scope.get("path", "")
        if path in PUBLIC_PATHS or scope.get("method") == "OPTIONS":
            return None
        if self._digest is not None:
            if not self._authorized(headers):
                return APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' with the key "
                    "the server was started with (--api-key / AGENTRL_API_KEY)",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        elif path in CONTROL_PATHS:
            client = scope.get("client")
            if not is_loopback(client[0] if client else None):
                return APIError(
                    403,
                    f"{path} answers loopback callers only on a server without an API key; "
                    "start the server with --api-key (or AGENTRL_API_KEY) and send it",
                )
        if scope.get("method") in ("POST", "PUT", "PATCH") and path not in STREAMED_PATHS:
            length = headers.get("content-length")
            if length is None and "chunked" in headers.get("transfer-encoding", "").lower():
                return APIError(411, "send the JSON body with a Content-Length header")
            if length is not None and (not length.isdigit() or int(length) > MAX_JSON_BODY_BYTES):
                return APIError(
                    413,
                    f"the body is larger than {MAX_JSON_BODY_BYTES} bytes (or its length is invalid)",
                )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope, Headers(scope=scope))
            if refusal is not None:
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)
