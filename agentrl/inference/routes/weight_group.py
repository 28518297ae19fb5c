"""Weight-group routes: the server side of the ``collective`` weight transport.

- ``POST /weight_group/join`` ``{group_id, master_address, master_port, rank, world_size,
  backend, timeout_s}``: join the trainer's weight group (a standalone ``torch.distributed``
  group; :mod:`agentrl.inference.collective`) as ``rank``, leaving any group joined before.
  Answers once every rank is in (at most ``timeout_s``); 503 when the rendezvous fails, 400 for a
  backend this server cannot run (NCCL without a GPU).
- ``POST /weight_group/receive`` ``{group_id, version, buckets, lora}``: receive one version's
  buckets as the trainer broadcasts them, check them (names, shapes, dtypes, finiteness; or the
  LoRA checks when ``lora`` carries a spec), then swap weights and version together. 409 for
  another group than the one joined; 503 when a broadcast fails (a peer died or stalled: the
  group is left, the weights and version are unchanged, the trainer rebuilds the group at the
  next push); 400 when the received tensors do not fit the model (nothing changed).
- ``POST /weight_group/leave``: leave the group.

All three are control routes (an API key, or loopback callers on a server without one), and
while a push lease is held all three need its token (``x-push-lease``; 409 otherwise): nobody
but the pushing trainer joins, leaves or loads into the group in the middle of its push.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from agentrl.inference.collective import BucketLayout, WeightGroup, WeightGroupError
from agentrl.inference.engine import EngineRequestError
from agentrl.inference.lora import LoraSpec
from agentrl.inference.protocol import Version
from agentrl.inference.routes.common import APIError, ServerState, check_lease
from agentrl.inference.weights import WeightLoadError, local_address_for

__all__ = ["JoinRequest", "ReceiveRequest", "register"]


class JoinRequest(BaseModel):
    """``POST /weight_group/join``."""

    model_config = ConfigDict(extra="ignore")
    group_id: str = Field(min_length=1, max_length=128)
    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)
    world_size: int = Field(ge=2)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(default=120.0, gt=0, le=3600)


class ReceiveRequest(BaseModel):
    """``POST /weight_group/receive``."""

    model_config = ConfigDict(extra="ignore")
    group_id: str = Field(min_length=1, max_length=128)
    version: Version
    buckets: list[dict[str, Any]] = Field(min_length=1)
    lora: dict[str, Any] | None = None
    """A :class:`~agentrl.inference.lora.LoraSpec` as a dict: the buckets hold an adapter."""


async def join(st: ServerState, req: JoinRequest) -> JSONResponse:
    """Join the trainer's weight group as ``req.rank``."""
    if req.rank >= req.world_size:
        raise APIError(400, f"rank {req.rank} is outside world_size {req.world_size}", param="rank")
    group = WeightGroup(
        group_id=req.group_id,
        rank=req.rank,
        world_size=req.world_size,
        backend=req.backend,
        address=req.master_address,
        port=req.master_port,
        timeout_s=req.timeout_s,
    )
    url = f"http://{req.master_address}:{req.master_port}"
    try:
        local = await asyncio.to_thread(local_address_for, url)
        await asyncio.to_thread(st.engine.join_weight_group, group, local)
    except WeightLoadError as e:
        raise APIError(400, str(e), param="backend") from e
    except (WeightGroupError, OSError) as e:
        raise APIError(503, f"could not join the weight group: {e}") from e
    return JSONResponse({"status": "ok", **group.describe()})


async def receive(st: ServerState, req: ReceiveRequest) -> JSONResponse:
    """Receive one version's buckets on the joined group and load them."""
    engine = st.engine
    try:
        layout = BucketLayout.from_json(req.buckets)
    except WeightLoadError as e:
        raise APIError(400, str(e), param="buckets") from e
    try:
        lora = LoraSpec.from_dict(req.lora, "lora") if req.lora is not None else None
    except WeightLoadError as e:
        raise APIError(400, str(e), param="lora") from e
    try:
        new = await asyncio.to_thread(
            engine.receive_weights, req.group_id, layout, req.version, lora
        )
    except EngineRequestError as e:
        raise APIError(409 if e.param == "group_id" else 400, str(e), param=e.param) from e
    except WeightGroupError as e:
        raise APIError(503, f"receiving the weights failed; nothing changed: {e}") from e
    except WeightLoadError as e:
        raise APIError(400, f"the received weights were refused; nothing changed: {e}") from e
    except RuntimeError as e:  # the engine is closed
        raise APIError(503, str(e)) from e
    body: dict[str, Any] = {"status": "ok", "weight_version": new}
    if engine.last_load_casts:
        body["cast"] = engine.last_load_casts
    return JSONResponse(body, headers={"x-weight-version": str(new)})


def register(app: FastAPI, st: ServerState) -> None:
    """Add the weight-group routes to ``app``."""

    @app.post("/weight_group/join")
    async def _join(req: JoinRequest, request: Request) -> JSONResponse:
        check_lease(st, request)
        return await join(st, req)

    @app.post("/weight_group/receive")
    async def _receive(req: ReceiveRequest, request: Request) -> JSONResponse:
        check_lease(st, request)
        return await receive(st, req)

    @app.post("/weight_group/leave")
    async def _leave(request: Request) -> JSONResponse:
        check_lease(st, request)
        left = await asyncio.to_thread(st.engine.leave_weight_group)
        return JSONResponse({"status": "ok", "left": left})
