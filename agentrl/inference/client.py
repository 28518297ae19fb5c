"""PolicyClient: one async HTTP client for the embedded server and for vLLM.

Agents call :meth:`PolicyClient.generate` (token ids in; token ids, per-token logprobs and the
weight version out); the CheckpointEngine calls the control methods (pause, resume, weight
updates, versions). Both servers speak the same subset of vLLM's OpenAI-compatible API
(DESIGN section 3), so the only backend-specific parts are small and live here:

- **Weight version of a generation.** The embedded server puts ``weight_version`` in every
  completion body and the version of each token in its choice's ``token_versions`` (a request
  that a ``keep`` pause carried across a push spans two; :attr:`Generation.token_versions`
  keeps them). vLLM 0.32's ``/v1/completions`` does not (its per-token
  ``weight_versions`` spans only exist on the separate ``--enable-scale-out``
  ``/inference/v1/generate`` endpoint). For vLLM the client reads ``GET /weight_info`` right
  before and right after the request. Guarantee: if both reads agree (the normal case: weights
  change only while the server is paused, and the version is set before resuming), every token
  of the generation was produced by that version. If they differ, the request straddled a
  weight update (a ``keep``-mode pause resumed it with new weights); the client then reports
  the *older* version, so staleness is over-estimated, never under-estimated, and counts the
  event in :attr:`PolicyClient.version_straddles`.
- **Version type.** vLLM stores the version as a string (``"default"`` at start-up); the
  client writes ``str(int)`` and reads ``"default"`` as version 0. Any other non-integer string
  is an error that names the fix (set a version through :meth:`set_weight_version`).

- **Auth.** ``api_key`` (default: ``$AGENTRL_API_KEY``) is sent as ``Authorization: Bearer`` on
  every request, as vLLM's ``--api-key`` and the embedded server expect.
- **Deadlines.** Every generation carries ``x-request-timeout-s`` (the client's own timeout): the
  embedded server aborts the request once the client has given up, so a timed-out request is
  never finished behind the client's back (vLLM ignores the header; it aborts on disconnect).

Failure handling: connection errors, dropped connections, timeouts and 5xx answers are retried
with jittered exponential backoff (``max_retries`` times), then raise
:class:`InferenceServerError`; a 4xx is never retried and raises :class:`InferenceRequestError`
carrying the server's own message. Weight loads are never retried (not idempotent in time).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import httpx

from agentrl.inference.weights import SafetensorsPayload
from agentrl.types import Generation, SamplingParams

__all__ = [
    "ENV_API_KEY",
    "InferenceError",
    "InferenceRequestError",
    "InferenceServerError",
    "PauseMode",
    "PolicyClient",
    "parse_completion",
    "parse_token_versions",
    "parse_weight_version",
]

logger = logging.getLogger(__name__)

ENV_API_KEY = "AGENTRL_API_KEY"
_TIMEOUT_GRACE_S = 1.0
"""The client waits this much longer than the deadline it gives the server, so a request the
server finishes in time is never also given up on by the client."""

PauseMode = Literal["keep", "wait", "abort"]
"""How a pause treats in-flight requests: ``keep`` parks them (they continue after resume),
``wait`` lets them finish first, ``abort`` ends them at once with ``finish_reason="abort"``."""

Backend = Literal["auto", "embedded", "vllm"]


class InferenceError(RuntimeError):
    """Base class of every error the client raises."""


class InferenceRequestError(InferenceError):
    """The server rejected the request (HTTP 4xx); retrying the same request cannot help."""

    def __init__(self, url: str, status_code: int, message: str) -> None:
        super().__init__(f"{url} rejected the request (HTTP {status_code}): {message}")
        self.url = url
        self.status_code = status_code
        self.message = message


class InferenceServerError(InferenceError):
    """The server failed or could not be reached (connection error, dropped connection, 5xx).

    ``connection_failed`` is True when the server was unreachable or the connection dropped
    (the server is probably gone), False for an HTTP 5xx answer (the server is up).
    """

    def __init__(
        self, url: str, message: str, *, status_code: int | None = None, connection_failed: bool
    ) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status_code = status_code
        self.connection_failed = connection_failed


def _error_message(response: httpx.Response) -> str:
    """The server's own error text: OpenAI-style ``{"error": {"message"}}``, FastAPI's
    ``{"detail"}``, vLLM's ``{"error": "..."}`` or the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:2000] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "detail" in body:
            return str(body["detail"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:2000]


def parse_token_versions(body: dict[str, Any], n_tokens: int, url: str = "") -> list[int] | None:
    """The per-token ``token_versions`` of a ``/v1/completions`` body's first choice (the
    embedded server's extension), or None when the server sent none (vLLM)."""
    raw = body["choices"][0].get("token_versions")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != n_tokens:
        raise InferenceError(
            f"{url}: completion has {n_tokens} tokens but token_versions {str(raw)[:200]}"
        )
    return [parse_weight_version(v, url) for v in raw]


def parse_weight_version(value: Any, url: str = "") -> int:
    """Turn a server's weight version (int, ``"7"``, or vLLM's initial ``"default"``) into an int."""
    if isinstance(value, bool):
        raise InferenceError(f"{url}: weight_version {value!r} is not a version number")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if value == "default":
            return 0
        try:
            return int(value)
        except ValueError:
            pass
    raise InferenceError(
        f"{url}: server reports weight_version {value!r}, which is not an integer; agentrl "
        "numbers versions 0, 1, 2, ...: set one with PolicyClient.set_weight_version(v)"
    )


FinishReason = Literal["stop", "length", "abort"]


def parse_completion(
    body: dict[str, Any], url: str = ""
) -> tuple[list[int], list[float], FinishReason]:
    """Token ids, their logprobs and the finish reason from a ``/v1/completions`` body.

    Token ids come from ``logprobs.tokens`` (``"token_id:123"`` strings, as written with
    ``return_tokens_as_token_ids``); a choice-level ``token_ids`` list is preferred when present.
    """
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise InferenceError(f"{url}: completion response has no choices: {str(body)[:500]}")
    choice = choices[0]
    logprobs = choice.get("logprobs") or {}
    token_logprobs = logprobs.get("token_logprobs") or []
    token_ids = choice.get("token_ids")
    if not isinstance(token_ids, list):
        token_ids = []
        for tok in logprobs.get("tokens") or []:
            if not (isinstance(tok, str) and tok.startswith("token_id:")):
                raise InferenceError(
                    f"{url}: logprobs.tokens entry {tok!r} is not 'token_id:N'; the request must "
                    "set return_tokens_as_token_ids=true"
                )
            token_ids.append(int(tok.removeprefix("token_id:")))
    lps = [float(x) if x is not None else 0.0 for x in token_logprobs]
    if len(lps) != len(token_ids):
        raise InferenceError(
            f"{url}: completion has {len(token_ids)} tokens but {len(lps)} logprobs; the request "
            "must set logprobs=0"
        )
    finish = choice.get("finish_reason") or "stop"
    if finish not in ("stop", "length", "abort"):
        # vLLM reports e.g. "error" for an internal failure of one request.
        raise InferenceServerError(
            url, f"generation ended with finish_reason={finish!r}", connection_failed=False
        )
    return [int(t) for t in token_ids], lps, cast(FinishReason, finish)


class PolicyClient:
    """Async client for one inference server (embedded or vLLM), by base URL.

    Example::

        async with PolicyClient("http://127.0.0.1:8000") as client:
            gen = await client.generate([1, 2, 3], SamplingParams(max_tokens=8), session_id="ep-1")
            gen.token_ids, gen.logprobs, gen.weight_version
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        backend: Backend = "auto",
        timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        max_retries: int = 3,
        backoff_s: float = 0.25,
        max_backoff_s: float = 4.0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        """``backend="auto"`` learns from the first ``/weight_info`` answer whether the server
        reports versions in completion bodies (embedded, int versions) or not (vLLM, string
        versions). ``transport`` lets tests pass an in-process ASGI app. ``api_key`` (default
        ``$AGENTRL_API_KEY``) is sent as a bearer token."""
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._connect_s = connect_timeout_s
        key = api_key if api_key is not None else os.environ.get(ENV_API_KEY)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.model = model
        self.backend: Backend = backend
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._probe_lock = asyncio.Lock()  # one model/backend probe, however many callers
        self.version_straddles = 0
        """Generations whose weight version changed while they ran (vLLM only; see module doc)."""
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            transport=transport,
            headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    # ---- lifecycle ----------------------------------------------------------------------
    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> PolicyClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"PolicyClient({self.base_url!r}, backend={self.backend!r})"

    # ---- transport ----------------------------------------------------------------------
    async def _request(
        self,
        method: str,
        path: str,
        *,
        retries: int | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One HTTP call with retries on connection errors and 502/503/504; raises on >= 400."""
        retries = self.max_retries if retries is None else retries
        url = self.base_url + path
        attempt = 0
        while True:
            try:
                response = await self._http.request(method, path, **kwargs)
            except (httpx.TransportError, httpx.StreamError) as exc:
                # Connection refused/reset or dropped mid-response: the server is probably gone.
                # A read timeout is different: the server may still be working on it.
                slow = isinstance(exc, httpx.TimeoutException) and not isinstance(
                    exc, httpx.ConnectTimeout
                )
                error: InferenceServerError = InferenceServerError(
                    url, f"{type(exc).__name__}: {exc}", connection_failed=not slow
                )
                error.__cause__ = exc
            else:
                if response.status_code < 400:
                    return response
                message = _error_message(response)
                if response.status_code < 500:
                    raise InferenceRequestError(url, response.status_code, message)
                error = InferenceServerError(
                    url,
                    f"HTTP {response.status_code}: {message}",
                    status_code=response.status_code,
                    connection_failed=False,
                )
            if attempt >= retries:
                raise error
            delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
            delay *= 0.5 + random.random() / 2  # jitter: retries from many agents don't align
            logger.debug("retrying %s %s in %.2fs after: %s", method, url, delay, error)
            await asyncio.sleep(delay)
            attempt += 1

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self._request(method, path, **kwargs)
        if not response.content:
            return {}
        try:
            return response.json()
        except ValueError as exc:
            raise InferenceError(
                f"{self.base_url}{path}: expected JSON, got {response.text[:200]!r}"
            ) from exc

    # ---- generation ---------------------------------------------------------------------
    async def _model_name(self) -> str:
        if self.model is None:
            async with self._probe_lock:
                if self.model is None:
                    body = await self._json("GET", "/v1/models")
                    data = body.get("data") or []
                    if not data:
                        raise InferenceError(f"{self.base_url}/v1/models lists no model")
                    self.model = str(data[0]["id"])
        return self.model

    async def resolve_backend(self) -> Backend:
        """``"embedded"`` or ``"vllm"`` (asks the server once, then remembers)."""
        return await self._resolve_backend()

    async def _resolve_backend(self) -> Backend:
        if self.backend == "auto":
            async with self._probe_lock:
                if self.backend == "auto":
                    raw = (await self._json("GET", "/weight_info")).get("weight_version")
                    # The embedded server numbers versions with ints; vLLM stores a string.
                    self.backend = "embedded" if isinstance(raw, int) else "vllm"
        return self.backend

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        session_id: str | None = None,
        *,
        request_id: str | None = None,
        extra_body: dict[str, Any] | None = None,
        model: str | None = None,
    ) -> Generation:
        """Sample a continuation of ``prompt_ids``; see the module doc for the version guarantee.

        ``session_id`` travels as the ``x-session-id`` header (the embedded server logs it; vLLM
        ignores it); ``request_id`` as ``x-request-id`` (both servers use it as the request id).
        ``extra_body`` adds backend-specific request fields (e.g. vLLM's ``ignore_eos``).
        ``model`` overrides the served model name (e.g. a vLLM LoRA adapter's name).
        """
        model = model or await self._model_name()
        backend = await self._resolve_backend()
        payload: dict[str, Any] = {
            "model": model,
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        if sampling.top_k > 0:
            payload["top_k"] = sampling.top_k
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        if sampling.stop_token_ids:
            payload["stop_token_ids"] = list(sampling.stop_token_ids)
        payload.update(extra_body or {})
        headers = {"x-request-timeout-s": f"{self.timeout_s:g}"}
        if session_id is not None:
            headers["x-session-id"] = session_id
        if request_id is not None:
            headers["x-request-id"] = request_id

        before = await self.weight_version() if backend == "vllm" else None
        response = await self._request(
            "POST",
            "/v1/completions",
            json=payload,
            headers=headers,
            timeout=httpx.Timeout(self.timeout_s + _TIMEOUT_GRACE_S, connect=self._connect_s),
        )
        body = response.json()
        token_ids, logprobs, finish = parse_completion(body, self.base_url)
        if "weight_version" in body:
            version = parse_weight_version(body["weight_version"], self.base_url)
        elif before is not None:
            after = await self.weight_version()
            if after != before:
                self.version_straddles += 1
                logger.warning(
                    "%s: generation straddled weight versions %d -> %d; reporting %d",
                    self.base_url,
                    before,
                    after,
                    before,
                )
            version = before
        else:
            raise InferenceError(
                f"{self.base_url}/v1/completions returned no weight_version; pass "
                "backend='vllm' to read it from /weight_info instead"
            )
        token_versions = parse_token_versions(body, len(token_ids), self.base_url)
        if token_versions:
            version = min(token_versions)
        return Generation(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish,
            weight_version=version,
            server=self.base_url,
            token_versions=token_versions,
        )

    # ---- control ------------------------------------------------------------------------
    async def health(self, timeout_s: float = 10.0) -> bool:
        """True when ``GET /health`` answers 200; never raises (one try, no retries)."""
        try:
            response = await self._http.get("/health", timeout=timeout_s)
        except (httpx.TransportError, httpx.StreamError):
            return False
        return response.status_code == 200

    async def pause(self, mode: PauseMode = "keep", *, timeout_s: float | None = None) -> None:
        """Stop scheduling generation; ``mode`` says what happens to in-flight requests.

        ``timeout_s``: the embedded server resumes by itself after that long (a controller
        that dies never leaves it paused); vLLM ignores it."""
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause mode must be 'keep', 'wait' or 'abort', got {mode!r}")
        params: dict[str, Any] = {"mode": mode}
        if timeout_s is not None:
            params["timeout_s"] = f"{timeout_s:g}"
        await self._request("POST", "/pause", params=params, json=params)

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._json("GET", "/is_paused"))["is_paused"])

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Release the KV cache (level 1) and the weights too (level 2) until :meth:`wake_up`
        (colocated mode; vLLM needs ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``).
        The embedded server answers what it freed; vLLM answers nothing (``{}``)."""
        body = await self._json("POST", "/sleep", params={"level": int(level)})
        return body if isinstance(body, dict) else {}

    async def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Re-allocate what :meth:`sleep` released (``tags``: vLLM's ``weights`` /
        ``kv_cache``, default both) and generate again."""
        params = [("tags", t) for t in tags] if tags else None
        body = await self._json("POST", "/wake_up", params=params)
        return body if isinstance(body, dict) else {}

    async def is_sleeping(self) -> bool:
        """True while the server sleeps (``GET /is_sleeping``)."""
        return bool((await self._json("GET", "/is_sleeping"))["is_sleeping"])

    async def abort_requests(self) -> int | None:
        """Abort every in-flight request (they finish with ``finish_reason="abort"``).

        Returns how many were aborted when the server says so."""
        body = await self._json("POST", "/abort_requests", json={})
        n = body.get("aborted") if isinstance(body, dict) else None
        return int(n) if isinstance(n, int) else None

    async def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes (do it after a weight update). False when the server could not
        (vLLM refuses while running requests hold cache blocks; pause first)."""
        body = await self._json("POST", "/reset_prefix_cache")
        return bool(body.get("success", True)) if isinstance(body, dict) else True

    async def weight_info(self, *, checksum: bool = False) -> dict[str, Any]:
        """The server's ``/weight_info`` body with ``weight_version`` normalized to an int
        (``checksum=True``: the embedded server adds a sha256 of every weight)."""
        params = {"checksum": "true"} if checksum else None
        body = dict(await self._json("GET", "/weight_info", params=params))
        body["weight_version"] = parse_weight_version(body.get("weight_version"), self.base_url)
        return body

    async def weight_version(self) -> int:
        """The version of the weights the server holds now."""
        return (await self.weight_info())["weight_version"]

    async def set_weight_version(self, version: int) -> None:
        """Label the server's current weights with ``version``."""
        backend = await self._resolve_backend()
        body: dict[str, Any] = (
            {"version": int(version)} if backend == "embedded" else {"new_version": str(version)}
        )
        await self._request("POST", "/update_weight_version", json=body)

    async def take_push_lease(self, holder: str, ttl_s: float, writer: str = "") -> str | None:
        """Take the server's push lease (embedded server) and send its token with every later
        request until :meth:`release_push_lease`; None where the server has no lease (vLLM, or
        an embedded server older than the lease). ``writer`` names the pushing process: a
        writer new to the server may start its versions below the served one.
        Raises :class:`InferenceRequestError` (409) while another push holds it."""
        if await self._resolve_backend() != "embedded":
            return None
        try:
            body = await self._json(
                "POST",
                "/push_lease",
                json={"holder": holder, "ttl_s": float(ttl_s), "writer": writer},
                retries=0,
            )
        except InferenceRequestError as exc:
            if exc.status_code == 404:  # a server without leases (older than issue 21)
                return None
            raise
        token = str(body["lease"])
        self._http.headers["x-push-lease"] = token
        return token

    async def release_push_lease(self) -> None:
        """Release the lease taken by :meth:`take_push_lease` (no-op without one)."""
        if self._http.headers.get("x-push-lease") is None:
            return
        try:
            await self._request("DELETE", "/push_lease", retries=0)
        finally:
            self._http.headers.pop("x-push-lease", None)

    async def mark_verified(self, version: int) -> str:
        """Keep the served weights (``version``) as the last verified ones (embedded server);
        returns their digest."""
        try:
            body = await self._json("POST", "/weights/verified", json={"version": int(version)})
        except InferenceRequestError as exc:
            if exc.status_code == 404:  # a server without rollback (older than issue 21)
                return ""
            raise
        return str(body.get("digest", ""))

    async def rollback_weights(self) -> int:
        """Restore the last verified weights and their version (embedded server)."""
        body = await self._json("POST", "/weights/rollback", retries=0)
        return int(body["weight_version"])

    async def update_weights_from_path(self, path: str | Path, version: int) -> None:
        """Load the safetensors weights in directory ``path`` (a path on the server's machine),
        then set ``version``. Uses vLLM's ``/collective_rpc`` ``reload_weights``, which the
        embedded server also speaks (and there takes the version with the weights, atomically).
        Pause the server first when requests are in flight."""
        kwargs: dict[str, Any] = {"weights_path": str(path)}
        if await self._resolve_backend() == "embedded":
            kwargs["version"] = int(version)
        body = {"method": "reload_weights", "kwargs": kwargs}
        await self._request("POST", "/collective_rpc", json=body, retries=0)
        await self.set_weight_version(version)

    async def update_weights_from_bytes(
        self, data: bytes | SafetensorsPayload, version: int
    ) -> None:
        """Stream a safetensors file to the server (embedded server only); weights and version
        change together. A :class:`~agentrl.inference.weights.SafetensorsPayload` is streamed
        from the tensors' own memory (no serialization copy)."""
        if await self._resolve_backend() == "vllm":
            raise NotImplementedError(
                f"{self.base_url} is a vLLM server, which cannot receive weights in an HTTP body; "
                "use the shared-directory transport (update_weights_from_path) or NCCL on GPUs"
            )
        headers = {"content-type": "application/octet-stream", "x-weight-version": str(version)}
        content: bytes | AsyncIterator[bytes]
        if isinstance(data, SafetensorsPayload):
            headers["content-length"] = str(data.num_bytes)
            content = _stream(data)
        else:
            content = data
        await self._request("POST", "/update_weights", content=content, headers=headers, retries=0)

    async def update_weights_from_url(self, url: str, version: int) -> None:
        """Make the embedded server pull a safetensors file from ``url`` (plain HTTP, e.g. a
        :class:`~agentrl.inference.weights.WeightServer`); weights and version change together."""
        if await self._resolve_backend() == "vllm":
            raise NotImplementedError(
                f"{self.base_url} is a vLLM server, which cannot pull weights over HTTP; "
                "use the shared-directory transport (update_weights_from_path) or NCCL on GPUs"
            )
        body = {"url": url, "version": int(version)}
        await self._request("POST", "/update_weights_from_url", json=body, retries=0)

    # ---- the collective transport (embedded server) ----------------------------------------
    async def join_weight_group(
        self,
        *,
        group_id: str,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
    ) -> None:
        """Make the embedded server join the trainer's weight group as ``rank``
        (``POST /weight_group/join``); returns once every rank is in."""
        body = {
            "group_id": group_id,
            "master_address": master_address,
            "master_port": int(master_port),
            "rank": int(rank),
            "world_size": int(world_size),
            "backend": backend,
            "timeout_s": float(timeout_s),
        }
        await self._request(
            "POST",
            "/weight_group/join",
            json=body,
            retries=0,
            timeout=httpx.Timeout(timeout_s + 30.0, connect=self._connect_s),
        )

    async def receive_weights(
        self,
        *,
        group_id: str,
        version: int,
        buckets: list[dict[str, Any]],
        lora: dict[str, Any] | None = None,
    ) -> None:
        """Make the embedded server receive one version's buckets on its weight group and load
        them (``POST /weight_group/receive``); weights and version change together."""
        body: dict[str, Any] = {"group_id": group_id, "version": int(version), "buckets": buckets}
        if lora is not None:
            body["lora"] = lora
        await self._request("POST", "/weight_group/receive", json=body, retries=0)

    async def leave_weight_group(self) -> None:
        """Make the embedded server leave its weight group."""
        await self._request("POST", "/weight_group/leave", retries=0)

    # ---- vLLM: LoRA adapters and the native weight-transfer API (VLLM_SERVER_DEV_MODE=1) ----
    async def load_lora_adapter(self, name: str, path: str | Path) -> None:
        """vLLM ``POST /v1/load_lora_adapter`` (``--enable-lora`` and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): (re)load the peft adapter directory ``path``
        under ``name``, in place; requests then name ``model=name``."""
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}
        await self._request("POST", "/v1/load_lora_adapter", json=body, retries=0)

    async def get_world_size(self) -> int:
        """vLLM ``GET /get_world_size``: the server's worker count (TP x PP x DP)."""
        body = await self._json("GET", "/get_world_size", params={"include_dp": "true"})
        return int(body["world_size"])

    async def init_weight_transfer_engine(
        self, init_info: dict[str, Any], timeout_s: float
    ) -> None:
        """vLLM ``POST /init_weight_transfer_engine {"init_info": ...}``: the workers join the
        trainer's NCCL group (returns once the rendezvous is done)."""
        await self._request(
            "POST",
            "/init_weight_transfer_engine",
            json={"init_info": init_info},
            retries=0,
            timeout=httpx.Timeout(timeout_s, connect=self._connect_s),
        )

    async def start_weight_update(self) -> None:
        """vLLM ``POST /start_weight_update`` (no body)."""
        await self._request("POST", "/start_weight_update", retries=0)

    async def vllm_update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM ``POST /update_weights {"update_info": {"names", "dtype_names", "shapes"}}``:
        returns once the workers received (over NCCL) and loaded those tensors."""
        await self._request("POST", "/update_weights", json={"update_info": update_info}, retries=0)

    async def finish_weight_update(self, version: int) -> None:
        """vLLM ``POST /finish_weight_update {"weight_version": "<version>"}``."""
        body = {"weight_version": str(int(version))}
        await self._request("POST", "/finish_weight_update", json=body, retries=0)

    async def probe(
        self,
        prompt_ids: list[int],
        *,
        temperature: float = 1.0,
        max_tokens: int = 8,
        seed: int = 0,
        token_ids: list[int] | None = None,
    ) -> Generation:
        """A short generation the embedded server serves ahead of its queue, even while paused
        (``POST /probe``): how a weight push verifies before resuming. With ``token_ids`` the
        server scores those tokens. vLLM has no such route: :class:`NotImplementedError`."""
        if await self._resolve_backend() != "embedded":
            raise NotImplementedError(
                f"{self.base_url} is a vLLM server: no route is served while it is paused"
            )
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "temperature": temperature,
            "max_tokens": max_tokens,
            "seed": seed,
        }
        if token_ids is not None:
            body["token_ids"] = list(token_ids)
        out = await self._json("POST", "/probe", json=body, retries=0)
        return Generation(
            token_ids=[int(t) for t in out["token_ids"]],
            logprobs=[float(x) for x in out["logprobs"]],
            finish_reason="length",
            weight_version=parse_weight_version(out.get("weight_version"), self.base_url),
            server=self.base_url,
        )


async def _stream(payload: SafetensorsPayload) -> AsyncIterator[bytes]:
    """The payload's bytes for httpx, as views of the tensors (the socket layer copies once)."""
    for chunk in payload.chunks():
        yield chunk  # type: ignore[misc]  # a memoryview: httpx/h11 only need a bytes-like object
