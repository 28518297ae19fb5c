"""Control routes: pause / resume / abort / prefix cache, and the probe a push verifies with.

Guarantees:

- every pause has a server-side deadline (``timeout_s``, capped by ``--max-pause-s``): a server
  whose controller died resumes by itself;
- ``POST /pause?mode=wait`` stops admitting, waits for the running batch, then pauses; if its
  caller disconnects before that, or a ``/resume`` arrives, the pause is cancelled (it never
  lands later behind the caller's back); a cancelled wait answers 409;
- ``POST /sleep?level=1|2`` parks the running batch and releases the KV cache (level 2: the
  weights too; :mod:`agentrl.inference.engine.sleep`); a sleeping server holds generation
  requests until ``POST /wake_up``; ``GET /is_sleeping`` and ``GET /weight_info`` say it sleeps
  (vLLM's dev-mode routes, same names);
- ``POST /probe`` is served between decode steps *and while paused*, ahead of every queued
  request: a weight push checks the new weights with it before resuming.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse

from agentrl.inference import protocol as P
from agentrl.inference.engine import EngineRequestError, EngineStepError, VersionConflict
from agentrl.inference.routes.common import APIError, ClientGone, ServerState, until_disconnect

__all__ = ["register"]


async def _wait_pause(st: ServerState, request: Request, timeout_s: float | None) -> None:
    engine = st.engine
    epoch = await asyncio.to_thread(engine.start_drain, max_pause_s=timeout_s)

    async def paused() -> None:
        while engine.pause_state != "paused":
            if engine.is_closed:
                raise APIError(503, "the server is shutting down")
            if engine.resume_epoch != epoch:
                raise APIError(
                    409,
                    "the pause was cancelled (a resume, or its deadline) before the in-flight "
                    "requests finished",
                    param="mode",
                )
            await asyncio.sleep(0.01)

    try:
        await until_disconnect(request, paused())
    except ClientGone:
        engine.cancel_pause(epoch)  # nobody waits for this pause any more
        raise


async def pause(
    st: ServerState, request: Request, mode: str, timeout_s: float | None
) -> JSONResponse:
    """``POST /pause``: keep, abort or wait, each with a deadline."""
    if mode not in ("keep", "abort", "wait"):
        raise APIError(400, f"mode={mode!r}; use 'keep', 'abort' or 'wait'", param="mode")
    aborted = 0
    try:
        if mode == "wait":
            await _wait_pause(st, request, timeout_s)
        else:
            aborted = await asyncio.to_thread(st.engine.pause, mode, max_pause_s=timeout_s)
    except EngineRequestError as e:
        raise APIError(400, str(e), param=e.param) from e
    except RuntimeError as e:  # the engine is closed
        raise APIError(503, str(e)) from e
    return JSONResponse({"status": "paused", "mode": mode, "aborted": aborted})


async def probe(st: ServerState, req: P.ProbeRequest) -> JSONResponse:
    """``POST /probe``: served ahead of the queue, also while paused."""
    try:
        out = await asyncio.to_thread(
            st.engine.probe,
            req.prompt,
            temperature=req.temperature,
            max_tokens=req.max_tokens,
            seed=req.seed,
            token_ids=req.token_ids,
        )
    except VersionConflict as e:  # asleep with the weights released
        raise APIError(409, str(e), param=e.param) from e
    except EngineRequestError as e:
        raise APIError(400, str(e), param=e.param) from e
    except EngineStepError as e:
        raise APIError(500, str(e)) from e
    except RuntimeError as e:
        raise APIError(503, str(e)) from e
    body = P.ProbeResponse(
        token_ids=out.token_ids, logprobs=out.logprobs, weight_version=out.weight_version
    )
    return JSONResponse(body.model_dump(), headers={"x-weight-version": str(out.weight_version)})


async def sleep(st: ServerState, level: int) -> JSONResponse:
    """``POST /sleep``: release the KV cache (level 1) and the weights (level 2)."""
    try:
        out = await asyncio.to_thread(st.engine.sleep, level)
    except VersionConflict as e:
        raise APIError(409, str(e), param=e.param) from e
    except EngineRequestError as e:
        raise APIError(400, str(e), param=e.param) from e
    except RuntimeError as e:
        raise APIError(503, str(e)) from e
    return JSONResponse({"status": "sleeping", **out})


async def wake_up(st: ServerState, tags: list[str] | None) -> JSONResponse:
    """``POST /wake_up``: re-allocate and generate again (``tags=weights``: the weights only)."""
    unknown = sorted(set(tags or []) - {"weights", "kv_cache"})
    if unknown:
        raise APIError(400, f"tags={unknown}; use 'weights' and/or 'kv_cache'", param="tags")
    weights_only = tags is not None and set(tags) == {"weights"}
    try:
        out = await asyncio.to_thread(st.engine.wake_up, weights_only=weights_only)
    except RuntimeError as e:
        raise APIError(503, str(e)) from e
    return JSONResponse({"status": "awake" if not out["sleeping"] else "sleeping", **out})


def register(app: FastAPI, st: ServerState) -> None:
    """Add the control routes to ``app``."""
    engine = st.engine

    @app.post("/pause")
    async def _pause(
        request: Request,
        mode: str = "keep",
        timeout_s: float | None = None,
    ) -> JSONResponse:
        return await pause(st, request, mode, timeout_s)

    @app.post("/resume")
    async def _resume() -> JSONResponse:
        engine.resume()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def _is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": engine.is_paused, "state": engine.pause_state})

    @app.post("/sleep")
    async def _sleep(level: int = 1) -> JSONResponse:
        return await sleep(st, level)

    @app.post("/wake_up")
    async def _wake_up(tags: list[str] | None = Query(default=None)) -> JSONResponse:
        return await wake_up(st, tags)

    @app.get("/is_sleeping")
    async def _is_sleeping() -> JSONResponse:
        level = engine.sleep_level
        return JSONResponse({"is_sleeping": bool(level), "level": level})

    @app.post("/abort_requests")
    async def _abort_requests() -> JSONResponse:
        try:
            n = await asyncio.to_thread(engine.abort_all)
        except RuntimeError as e:
            raise APIError(503, str(e)) from e
        return JSONResponse({"status": "ok", "aborted": n})

    @app.post("/reset_prefix_cache")
    async def _reset_prefix_cache() -> JSONResponse:
        try:
            enabled = await asyncio.to_thread(engine.reset_prefix_cache)
        except RuntimeError as e:
            raise APIError(503, str(e)) from e
        return JSONResponse({"status": "ok", "prefix_cache": enabled})

    @app.post("/probe")
    async def _probe(req: P.ProbeRequest) -> JSONResponse:
        return await probe(st, req)
