"""Weight routes: load from a path, a URL, a streamed body, vLLM's ``collective_rpc``; versions.

Each route also takes a LoRA adapter instead of full weights (peft's adapter safetensors with the
spec in its metadata, or a peft adapter directory; :mod:`agentrl.inference.lora`): it is merged
onto the base weights. The collective transport's routes are in
:mod:`agentrl.inference.routes.weight_group`.

Guarantees: an update is checked completely (its version too) before anything is swapped, and
the weights and the version change together or not at all; any bad input (a missing or
unreadable path, bytes that are not safetensors, a wrong name/shape/dtype, a NaN, a version
that is not an int in ``[0, 2**63 - 1]``) is a 400 naming the field. ``POST /update_weights``
streams the body straight into a reused staging buffer (no extra copy of the bytes; its size
must be declared with ``Content-Length``); one upload at a time (409 otherwise).
``POST /update_weights_from_url`` pulls the bytes from a
:class:`~agentrl.inference.weights.WeightServer` (the HTTP transport's fast path).
``GET /weight_info`` reports the version with its content digest (read together; the digest
is cached until the weights change).

One writer (issue 21): ``POST /push_lease`` takes the push lease (409 while another holds it);
while it is held every weight-changing route needs its token in ``x-push-lease`` (409
otherwise); ``DELETE /push_lease`` releases it. A load to a version not greater than the
served one is a 409, except the first load by a writer new to the server (the lease's
``writer``: a new or resumed trainer run starts its own sequence); ``POST /weights/verified`` keeps the served weights as the last verified
ones and ``POST /weights/rollback`` restores them (a failed verify never leaves bad weights
serving).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agentrl.inference import protocol as P
from agentrl.inference.engine import EngineRequestError, VersionConflict, check_version
from agentrl.inference.routes import weight_group
from agentrl.inference.routes.common import APIError, ServerState, check_lease
from agentrl.inference.weights import MAX_HEADER_BYTES, WeightLoadError

__all__ = ["register"]


def _loaded(version: int, casts: dict[str, int] | None = None) -> JSONResponse:
    """The answer to a weight load; ``cast`` lists the dtype widenings it applied (if any)."""
    body: dict[str, Any] = {"status": "ok", "weight_version": version}
    if casts:
        body["cast"] = casts
    return JSONResponse(body, headers={"x-weight-version": str(version)})


async def _load(fn: Any, *args: Any, param: str, version_param: str = "version") -> int:
    try:
        return await asyncio.to_thread(fn, *args)
    except WeightLoadError as e:
        raise APIError(400, str(e), param=param) from e
    except VersionConflict as e:
        raise APIError(409, str(e), param=e.param) from e
    except EngineRequestError as e:
        raise APIError(400, str(e), param=version_param if e.param == "version" else e.param) from e
    except RuntimeError as e:  # the engine is closed
        raise APIError(503, str(e)) from e


def _header_version(request: Request) -> int | None:
    raw = request.headers.get("x-weight-version")
    if raw is None:
        return None
    try:
        if not raw.isdigit() or len(raw) > 19:
            raise EngineRequestError("send a decimal integer in [0, 2**63 - 1]", "x-weight-version")
        return check_version(int(raw), "x-weight-version")
    except EngineRequestError as e:
        raise APIError(
            400,
            f"x-weight-version header {raw!r:.40} is not a valid version: {e}",
            param="x-weight-version",
        ) from e


async def _receive_into(request: Request, buf: memoryview) -> None:
    """Copy the body into ``buf`` (exactly its size, from Content-Length)."""
    offset = 0
    async for chunk in request.stream():
        end = offset + len(chunk)
        if end > len(buf):
            raise APIError(400, "the body is longer than its Content-Length", param="body")
        buf[offset:end] = chunk
        offset = end
    if offset != len(buf):
        raise APIError(
            400, f"the body ended after {offset} of {len(buf)} bytes; send it whole", param="body"
        )


async def update_weights(st: ServerState, request: Request) -> JSONResponse:
    """``POST /update_weights``: the safetensors body, streamed into the staging buffer."""
    engine = st.engine
    check_lease(st, request)
    version = _header_version(request)
    raw = request.headers.get("content-length")
    if raw is None or not raw.isdigit():
        raise APIError(411, "send the safetensors bytes with a Content-Length header", param="body")
    size = int(raw)
    if size == 0:
        raise APIError(400, "empty body; send the safetensors bytes as the body", param="body")
    limit = engine.state_bytes + MAX_HEADER_BYTES
    if size > limit:
        raise APIError(413, f"a {size}-byte body cannot be this model's weights (<= {limit})")
    if not engine.staging_lock.acquire(blocking=False):
        raise APIError(409, "another weight update is in progress; retry after it finishes")
    try:
        buf = engine.staging_buffer(size)
        await _receive_into(request, buf)
        new = await _load(
            engine.load_safetensors, buf, version, param="body", version_param="x-weight-version"
        )
    finally:
        engine.staging_lock.release()
    return _loaded(new, engine.last_load_casts)


async def collective_rpc(
    st: ServerState, req: P.CollectiveRpcRequest, request: Request
) -> JSONResponse:
    """vLLM's ``POST /collective_rpc``; only ``reload_weights`` (path, optional version)."""
    check_lease(st, request)
    if req.method != "reload_weights":
        raise APIError(
            400,
            f"method {req.method!r:.100} is not supported here; the embedded server knows "
            "'reload_weights' (kwargs: weights_path, optional version)",
            param="method",
        )
    path = req.kwargs.get("weights_path") or (req.args[0] if req.args else None)
    if not isinstance(path, str):
        raise APIError(400, "reload_weights needs kwargs.weights_path", param="kwargs.weights_path")
    version = req.kwargs.get("version")
    if version is not None:
        try:
            check_version(version)
        except EngineRequestError as e:
            raise APIError(400, str(e), param="kwargs.version") from e
    new = await _load(
        st.engine.load_weights_from_path,
        path,
        version,
        param="kwargs.weights_path",
        version_param="kwargs.version",
    )
    body: dict[str, Any] = {"results": [None], "weight_version": new}
    if st.engine.last_load_casts:
        body["cast"] = st.engine.last_load_casts
    return JSONResponse(body, headers={"x-weight-version": str(new)})


def register(app: FastAPI, st: ServerState) -> None:
    """Add the weight and version routes to ``app`` (and the weight-group routes)."""
    engine = st.engine
    weight_group.register(app, st)

    @app.post("/update_weights_from_url")
    async def _from_url(req: P.UpdateWeightsFromUrlRequest, request: Request) -> JSONResponse:
        check_lease(st, request)
        new = await _load(engine.load_weights_from_url, req.url, req.version, param="url")
        return _loaded(new, engine.last_load_casts)

    @app.post("/update_weights_from_path")
    async def _from_path(req: P.UpdateWeightsFromPathRequest, request: Request) -> JSONResponse:
        check_lease(st, request)
        new = await _load(engine.load_weights_from_path, req.path, req.version, param="path")
        return _loaded(new, engine.last_load_casts)

    @app.post(
        "/update_weights",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def _update_weights(request: Request) -> JSONResponse:
        return await update_weights(st, request)

    @app.post("/collective_rpc")
    async def _collective_rpc(req: P.CollectiveRpcRequest, request: Request) -> JSONResponse:
        return await collective_rpc(st, req, request)

    @app.post("/update_weight_version")
    async def _update_weight_version(req: P.WeightVersionRequest, request: Request) -> JSONResponse:
        check_lease(st, request)
        set_version = functools.partial(engine.set_weight_version, rollback=req.rollback)
        v = await _load(set_version, req.version, param="version")
        return JSONResponse(
            {"status": "ok", "weight_version": v}, headers={"x-weight-version": str(v)}
        )

    @app.post("/push_lease")
    async def _take_lease(req: P.PushLeaseRequest) -> JSONResponse:
        try:
            token = engine.weights.lease.acquire(req.holder, req.ttl_s, req.writer)
        except VersionConflict as e:
            raise APIError(409, str(e), param="lease") from e
        except EngineRequestError as e:
            raise APIError(400, str(e), param=e.param) from e
        return JSONResponse({"status": "ok", "lease": token})

    @app.delete("/push_lease")
    async def _release_lease(request: Request) -> JSONResponse:
        released = engine.weights.lease.release(request.headers.get("x-push-lease"))
        return JSONResponse({"status": "ok", "released": released})

    @app.post("/weights/verified")
    async def _verified(req: P.WeightVersionRequest, request: Request) -> JSONResponse:
        check_lease(st, request)
        try:
            digest = await asyncio.to_thread(engine.mark_verified, req.version)
        except VersionConflict as e:
            raise APIError(409, str(e), param="version") from e
        return JSONResponse({"status": "ok", "weight_version": req.version, "digest": digest})

    @app.post("/weights/rollback")
    async def _rollback(request: Request) -> JSONResponse:
        check_lease(st, request)
        v = await _load(engine.rollback_weights, param="rollback")
        return JSONResponse(
            {"status": "ok", "weight_version": v}, headers={"x-weight-version": str(v)}
        )

    @app.get("/weight_info")
    async def _weight_info(checksum: bool = False) -> JSONResponse:
        try:
            info = await asyncio.to_thread(engine.weight_info, checksum)
        except RuntimeError as e:
            raise APIError(503, str(e)) from e
        info["weight_version"] = info["version"]
        return JSONResponse(info, headers={"x-weight-version": str(info["version"])})
