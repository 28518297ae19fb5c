"""The ``collective`` weight transport: bucketed broadcasts from the trainer into the servers.

Why it exists: on GPUs, and between machines, a file or an HTTP body through the trainer's host
memory is the slow part of a push; a collective broadcast moves the bytes once per link, device
to device with NCCL. Behind the same :class:`~agentrl.weightsync.engine.WeightTransport`
interface, so the CheckpointEngine's guarantees hold unchanged (pause -> transfer -> reset ->
version -> verify while paused -> resume; a failed push never leaves a server paused).

**Embedded servers** form one weight group with the trainer (:mod:`agentrl.inference.collective`:
a standalone ``torch.distributed`` group, gloo on CPUs, NCCL on GPUs; the trainer is rank 0,
server ``i`` rank ``i + 1``). The group is set up by :meth:`CollectiveTransport.prepare` at the
first push, before any server is paused, and rebuilt whenever it broke (a failed collective) or
its members changed; a server that does not answer ``/health`` then is left out (its push fails
with "not in the weight group"). Per push each server is asked to receive
(``POST /weight_group/receive`` with the bucket layout) while the trainer broadcasts every bucket
once for all of them (one shared task per push), packing the next bucket while the previous one
is on the wire. Every collective has a timeout (``timeout_s``): when a server dies mid-push the
broadcast fails, the other servers' receives fail by that deadline with nothing changed, every
server is resumed by the engine, and the report names each one's state.

**vLLM servers** (GPUs; the server started with ``--weight-transfer-config '{"backend":
"nccl"}'`` and ``VLLM_SERVER_DEV_MODE=1``) are driven through vLLM 0.32's native weight-transfer
API, one NCCL group per server (trainer rank 0, the server's W workers ranks 1..W):
once ``GET /get_world_size`` and ``POST /init_weight_transfer_engine {"init_info": {master_address,
master_port, rank_offset: 1, world_size: 1 + W, packed: true, packed_buffer_size_bytes,
packed_num_buffers: 2}}`` while the trainer opens its end (vLLM's own trainer-side communicator,
``vllm.distributed.weight_transfer.nccl_common.trainer_init``: vLLM must be importable in the
trainer); per push ``POST /start_weight_update``, then ``POST /update_weights {"update_info":
{names, dtype_names, shapes}}`` while the trainer broadcasts the tensors packed exactly as vLLM's
consumer unpacks them (:func:`vllm_packed_chunks`), then ``POST /finish_weight_update
{"weight_version": "<v>"}``. This path was unit-tested against a recorded-protocol fake only: no
GPU vLLM ran here. vLLM's NCCL communicator has no collective timeout, so the transport bounds
the wait (``timeout_s``) and abandons a link that timed out.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from agentrl.inference.client import InferenceError, PolicyClient
from agentrl.inference.collective import BucketLayout, WeightGroup, WeightGroupError, dtype_name
from agentrl.inference.lora import LoraSpec
from agentrl.inference.weights import local_address_for
from agentrl.weightsync.transports import StagedWeights, WeightTransport

__all__ = ["CollectiveTransport", "VllmCommunicatorFactory", "vllm_packed_chunks"]

logger = logging.getLogger(__name__)

VllmCommunicatorFactory = Callable[[str, int, int], Any]
"""``(master_address, master_port, world_size) -> communicator`` with ``broadcast(tensor, src)``
and a ``device``: the trainer's end of a vLLM NCCL weight-transfer group."""


def vllm_packed_chunks(sizes: Sequence[int], buffer_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each packed broadcast, by vLLM 0.32's rule
    (``packed_tensor.packed_nccl_broadcast_{producer,consumer}``): add tensors in order until the
    running size exceeds ``buffer_bytes``, then send; the rest goes last."""
    chunks: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        chunks[-1].append(i)
        total += size
        if total > buffer_bytes:
            chunks.append([])
            total = 0
    return [c for c in chunks if c]


def _vllm_trainer_communicator(address: str, port: int, world_size: int) -> Any:
    """vLLM's trainer-side NCCL endpoint (rank 0 of a ``StatelessProcessGroup``)."""
    try:
        from vllm.distributed.weight_transfer.nccl_common import (  # type: ignore[import-not-found]  # vLLM is optional in the trainer
            trainer_init,
        )
    except ImportError as e:
        raise WeightGroupError(
            "pushing to vLLM with checkpoint.transport='collective' uses vLLM's NCCL weight "
            "transfer, which needs vLLM importable in the trainer process and GPUs; use "
            "'shared_dir' for vLLM on CPUs"
        ) from e
    return trainer_init({"master_address": address, "master_port": port, "world_size": world_size})


@dataclass
class _VllmLink:
    """The trainer's NCCL link to one vLLM server."""

    communicator: Any
    world_size: int
    broken: bool = False


@dataclass
class _Staged:
    """The collective part of a staged version: its tensors, layout and (once) the broadcast."""

    state: dict[str, torch.Tensor]
    layout: BucketLayout
    broadcast: asyncio.Future[None] | None = None
    group_id: str | None = None


@dataclass
class _Members:
    """The embedded servers of the weight group, in rank order, and why others are not in it."""

    urls: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)


class CollectiveTransport(WeightTransport):
    """``checkpoint.transport: collective`` (see the module docstring).

    ``bucket_mb``: the largest packed broadcast; ``backend``: ``auto`` (NCCL when this process
    sees a GPU, else gloo), ``gloo`` or ``nccl``; ``timeout_s``: the bound on joining the group
    and on every collective; ``advertise_host``: the address servers reach the trainer at
    (default: the local interface that routes to each server); ``vllm_communicator``: the
    trainer's end of a vLLM NCCL group (default: vLLM's own; tests pass a fake).
    """

    name = "collective"

    def __init__(
        self,
        *,
        bucket_mb: float = 256,
        backend: Literal["auto", "gloo", "nccl"] = "auto",
        timeout_s: float = 120.0,
        advertise_host: str | None = None,
        vllm_communicator: VllmCommunicatorFactory | None = None,
    ) -> None:
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"collective backend={backend!r}; use 'auto', 'gloo' or 'nccl'")
        if not bucket_mb > 0 or not timeout_s > 0:
            raise ValueError(f"bucket_mb={bucket_mb} and timeout_s={timeout_s} must be > 0")
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.advertise_host = advertise_host
        self._vllm_factory = vllm_communicator or _vllm_trainer_communicator
        self._group: WeightGroup | None = None
        self._members = _Members()
        self._vllm: dict[str, _VllmLink] = {}
        self._buffers: list[torch.Tensor] = []

    @property
    def group(self) -> WeightGroup | None:
        """The embedded servers' weight group (None before the first push)."""
        return self._group

    def resolved_backend(self) -> Literal["gloo", "nccl"]:
        """``gloo`` or ``nccl`` (``auto``: NCCL when this process sees a GPU)."""
        if self.backend == "gloo" or self.backend == "nccl":
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"

    # ---- staging -------------------------------------------------------------------------
    def stage(
        self, state_dict: dict[str, torch.Tensor], version: int, *, lora: LoraSpec | None = None
    ) -> StagedWeights:
        """Plan the buckets (no copy: the tensors are packed as they are broadcast, so they must
        not change until the push returns)."""
        layout = BucketLayout.plan(state_dict, self.bucket_bytes)
        extra = _Staged(state=dict(state_dict), layout=layout)
        return StagedWeights(version=version, num_bytes=layout.num_bytes, lora=lora, extra=extra)

    # ---- the group -----------------------------------------------------------------------
    async def prepare(self, clients: Sequence[PolicyClient]) -> None:
        """Set up (or rebuild) the weight group of the embedded servers and the NCCL links of
        the vLLM servers, before any server is paused."""
        backends = await asyncio.gather(*(c.resolve_backend() for c in clients))
        embedded = [c for c, b in zip(clients, backends, strict=True) if b != "vllm"]
        vllm = [c for c, b in zip(clients, backends, strict=True) if b == "vllm"]
        await asyncio.gather(
            self._ensure_group(embedded), *(self._ensure_vllm_link(c) for c in vllm)
        )

    async def _ensure_group(self, clients: Sequence[PolicyClient]) -> None:
        urls = [c.base_url for c in clients]
        if not urls or (self._usable() and self._members.urls == urls):
            return
        alive = await asyncio.gather(*(c.health(timeout_s=10.0) for c in clients))
        members = [c for c, ok in zip(clients, alive, strict=True) if ok]
        if self._usable() and self._members.urls == [c.base_url for c in members]:
            return
        self._close_group()
        self._members = _Members(
            left_out={
                c.base_url: "it did not answer /health when the group was set up"
                for c, ok in zip(clients, alive, strict=True)
                if not ok
            }
        )
        if members:
            await self._build_group(members)

    def _usable(self) -> bool:
        return self._group is not None and not self._group.broken

    async def _build_group(self, members: Sequence[PolicyClient]) -> None:
        address = self.advertise_host or await asyncio.to_thread(
            local_address_for, members[0].base_url
        )
        group = await asyncio.to_thread(
            WeightGroup.host,
            group_id=secrets.token_hex(8),
            world_size=1 + len(members),
            backend=self.resolved_backend(),
            address=address,
            timeout_s=self.timeout_s,
        )
        joins = [
            c.join_weight_group(
                group_id=group.group_id,
                master_address=address,
                master_port=group.port,
                rank=rank,
                world_size=group.world_size,
                backend=group.backend,
                timeout_s=self.timeout_s,
            )
            for rank, c in enumerate(members, start=1)
        ]
        results = await asyncio.gather(
            asyncio.to_thread(group.connect, address), *joins, return_exceptions=True
        )
        errors = [
            f"{who}: {type(r).__name__}: {r}"
            for who, r in zip(["trainer", *(c.base_url for c in members)], results, strict=True)
            if isinstance(r, BaseException)
        ]
        if errors:
            group.close()
            raise WeightGroupError("setting up the weight group failed: " + "; ".join(errors))
        self._group = group
        self._members.urls = [c.base_url for c in members]
        logger.info(
            "weight group %s (%s) at %s:%d: trainer + %d server(s)",
            group.group_id, group.backend, address, group.port, len(members),
        )  # fmt: skip

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None
        self._members = _Members()

    # ---- one push ------------------------------------------------------------------------
    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        """Receive on ``client`` while the trainer broadcasts (once for every member)."""
        extra = staged.extra
        assert isinstance(extra, _Staged), "staged by another transport"
        if await client.resolve_backend() == "vllm":
            await self._load_vllm(client, staged, extra)
            return
        group = self._group
        if group is None or client.base_url not in self._members.urls:
            why = self._members.left_out.get(client.base_url, "the group is not set up")
            raise WeightGroupError(f"{client.base_url} is not in the weight group: {why}")
        if extra.broadcast is None or extra.group_id != group.group_id:
            extra.group_id = group.group_id
            extra.broadcast = asyncio.ensure_future(
                asyncio.to_thread(self._broadcast, group, extra)
            )
            extra.broadcast.add_done_callback(_retrieve)
        lora = None if staged.lora is None else _spec_json(staged.lora)
        try:
            await client.receive_weights(
                group_id=group.group_id,
                version=staged.version,
                buckets=extra.layout.to_json(),
                lora=lora,
            )
        except InferenceError as e:
            failed = extra.broadcast.done() and extra.broadcast.exception()
            if failed:
                raise WeightGroupError(f"{e} (the trainer's broadcast failed: {failed})") from e
            raise

    def _buffers_for(self, nbytes: int, device: torch.device) -> list[torch.Tensor]:
        """Two packing buffers of at least ``nbytes`` (reused across pushes: no page faults)."""
        if (
            not self._buffers
            or self._buffers[0].numel() < nbytes
            or self._buffers[0].device != device
        ):
            self._buffers = [
                torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)
            ]
        return self._buffers

    def _broadcast(self, group: WeightGroup, extra: _Staged) -> None:
        """Every bucket, in order; bucket i+1 is packed while bucket i is on the wire."""
        layout = extra.layout
        bufs = self._buffers_for(layout.max_bucket_bytes(), group.device)
        pending = None
        try:
            for i in range(len(layout.buckets)):
                packed = layout.pack_into(i, extra.state, bufs[i % 2])
                work = group.broadcast(packed)
                if pending is not None:
                    group.wait(pending)
                pending = work
            if pending is not None:
                group.wait(pending)
        except WeightGroupError:
            group.broken = True
            raise

    # ---- vLLM ----------------------------------------------------------------------------
    async def _ensure_vllm_link(self, client: PolicyClient) -> None:
        link = self._vllm.get(client.base_url)
        if link is not None and not link.broken:
            return
        workers = await client.get_world_size()
        address = self.advertise_host or await asyncio.to_thread(local_address_for, client.base_url)
        port = await asyncio.to_thread(_free_port, address)
        world_size = 1 + workers
        init_info = {
            "master_address": address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world_size,
            "packed": True,
            "packed_buffer_size_bytes": self.bucket_bytes,
            "packed_num_buffers": 2,
        }
        opened = asyncio.ensure_future(
            asyncio.to_thread(self._vllm_factory, address, port, world_size)
        )
        opened.add_done_callback(_retrieve)
        await asyncio.wait_for(
            asyncio.gather(client.init_weight_transfer_engine(init_info, self.timeout_s), opened),
            self.timeout_s,
        )
        self._vllm[client.base_url] = _VllmLink(opened.result(), world_size)

    async def _load_vllm(self, client: PolicyClient, staged: StagedWeights, extra: _Staged) -> None:
        if staged.lora is not None:
            raise WeightGroupError(
                f"{client.base_url} is a vLLM server: LoRA adapters reach vLLM through "
                "checkpoint.transport='shared_dir' (/v1/load_lora_adapter), not NCCL"
            )
        link = self._vllm.get(client.base_url)
        if link is None or link.broken:
            raise WeightGroupError(f"{client.base_url}: no NCCL weight-transfer link")
        metas = [m for bucket in extra.layout.buckets for m in bucket]
        update_info = {
            "names": [m.name for m in metas],
            "dtype_names": [dtype_name(m.dtype) for m in metas],
            "shapes": [list(m.shape) for m in metas],
        }
        await client.start_weight_update()
        receiving = asyncio.ensure_future(client.vllm_update_weights(update_info))
        try:
            sending = asyncio.to_thread(self._vllm_broadcast, link, extra.state, update_info)
            await asyncio.wait_for(asyncio.gather(receiving, sending), self.timeout_s)
        except BaseException:
            link.broken = True  # the NCCL stream may be stuck mid-collective: never reuse it
            receiving.cancel()
            raise
        await client.finish_weight_update(staged.version)

    def _vllm_broadcast(
        self, link: _VllmLink, state: dict[str, torch.Tensor], update_info: dict[str, Any]
    ) -> None:
        """The tensors packed by vLLM's rule, one broadcast per chunk, from rank 0."""
        device = getattr(link.communicator, "device", None) or torch.device("cuda")
        names: list[str] = update_info["names"]
        flat = [state[n].contiguous().reshape(-1).view(torch.uint8) for n in names]
        for chunk in vllm_packed_chunks([t.numel() for t in flat], self.bucket_bytes):
            packed = torch.cat([flat[i].to(device) for i in chunk])
            link.communicator.broadcast(packed, src=0)
        if torch.device(device).type == "cuda":
            torch.cuda.current_stream().synchronize()

    def cleanup(self, keep_version: int) -> None:
        """Nothing is kept between pushes but the packing buffers and the groups."""

    def close(self) -> None:
        """Leave the weight group and drop the vLLM links (servers keep theirs until the next
        join)."""
        self._close_group()
        self._vllm.clear()
        self._buffers = []


def _spec_json(spec: LoraSpec) -> dict[str, Any]:
    """A :class:`LoraSpec` as the JSON object the receive request carries."""
    import json

    return json.loads(spec.to_json())


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a background future's exception as seen (it is reported through the loads)."""
    if not fut.cancelled():
        fut.exception()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
