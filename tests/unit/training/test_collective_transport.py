"""The collective transport's vLLM side against a recorded-protocol fake (no GPU vLLM runs here).

The fake is written from vLLM 0.32's own source (``entrypoints/rl/online/api_router.py``,
``distributed/weight_transfer/{base,nccl_common,nccl_engine,packed_tensor}.py``):

- the HTTP routes and their exact bodies: ``GET /get_world_size`` -> ``{"world_size"}``;
  ``POST /init_weight_transfer_engine {"init_info": {...}}`` whose keys must be fields of
  ``NCCLWeightTransferInitInfo`` (vLLM builds it with ``**init_info``: an unknown key is an error);
  ``POST /start_weight_update`` (no body); ``POST /update_weights {"update_info": {"names",
  "dtype_names", "shapes"}}`` (``NCCLWeightTransferUpdateInfo(**update_info)``, equal lengths,
  ``getattr(torch, dtype_name)``); ``POST /finish_weight_update {"weight_version": "<str>"}``;
- the NCCL side: the workers' ``packed_nccl_broadcast_consumer`` loop, re-stated here from vLLM's
  code (add tensors until the running size exceeds ``packed_buffer_size_bytes``, receive one
  ``uint8`` broadcast of exactly that size from rank 0, split it into the tensors), fed by a fake
  communicator that stands in for vLLM's ``PyNcclCommunicator`` (``broadcast(tensor, src)``).

The fake checks the order of the calls (init once, then per push start -> update -> finish, all
while paused) and that every received tensor equals the trainer's, bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import math
import queue
import time
from typing import Any

import httpx
import pytest
import torch

from agentrl.inference.client import PolicyClient
from agentrl.inference.collective import BucketLayout, WeightGroupError
from agentrl.inference.lora import LoraAdapter, LoraSpec
from agentrl.weightsync.collective import CollectiveTransport, vllm_packed_chunks
from agentrl.weightsync.engine import CheckpointEngine
from tests.fakes import FakeInferenceServer

INIT_INFO_FIELDS = {
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "nccl_unique_id_b64",
    "packed",
    "packed_buffer_size_bytes",
    "packed_num_buffers",
}
"""``NCCLWeightTransferInitInfo``'s fields (vLLM 0.32, nccl_common.py)."""
UPDATE_INFO_FIELDS = {"names", "dtype_names", "shapes"}
"""``NCCLWeightTransferUpdateInfo``'s fields (vLLM 0.32, nccl_engine.py)."""


class FakeNccl:
    """Stands in for the trainer's ``PyNcclCommunicator``: broadcasts go to the fake workers."""

    def __init__(self, address: str, port: int, world_size: int) -> None:
        self.address, self.port, self.world_size = address, port, world_size
        self.device = torch.device("cpu")
        self.wire: queue.Queue[torch.Tensor] = queue.Queue()
        self.broadcasts: list[int] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        assert src == 0 and tensor.dtype == torch.uint8 and tensor.dim() == 1
        self.broadcasts.append(tensor.numel())
        self.wire.put(tensor.clone())


def consume_packed(
    update_info: dict[str, Any], buffer_bytes: int, receive: Any
) -> dict[str, torch.Tensor]:
    """vLLM 0.32's ``packed_nccl_broadcast_consumer``, re-stated: what the workers receive."""
    out: dict[str, torch.Tensor] = {}
    pending: list[tuple[str, list[int], torch.dtype, int]] = []
    total = 0

    def flush() -> None:
        packed = receive(total)
        sizes = [p[3] for p in pending]
        for (name, shape, dtype, _), part in zip(pending, packed.split(sizes), strict=True):
            out[name] = part.contiguous().view(dtype).view(shape)

    entries = zip(
        update_info["names"], update_info["dtype_names"], update_info["shapes"], strict=True
    )
    for name, dtype_name, shape in entries:
        dtype = getattr(torch, dtype_name)
        size = math.prod(shape) * dtype.itemsize
        pending.append((name, shape, dtype, size))
        total += size
        if total > buffer_bytes:
            flush()
            pending, total = [], 0
    if pending:
        flush()
    return out


class FakeVllmWeightTransfer(FakeInferenceServer):
    """A vLLM server (string versions, no paused probe) with the weight-transfer routes."""

    def __init__(self, url: str, *, workers: int = 1) -> None:
        super().__init__(url, version=0, version_in_body=False)
        self.workers = workers
        self.init_info: dict[str, Any] | None = None
        self.nccl: FakeNccl | None = None
        self.received: list[dict[str, torch.Tensor]] = []
        self.updating = False
        self.fail_update = False
        self.inits = 0

    def connect(self, nccl: FakeNccl) -> None:
        """The trainer opened its end of the group this server was told to join."""
        assert self.init_info is not None
        assert (nccl.address, nccl.port, nccl.world_size) == (
            self.init_info["master_address"],
            self.init_info["master_port"],
            self.init_info["world_size"],
        )
        self.nccl = nccl

    def _receive(self, nbytes: int) -> torch.Tensor:
        assert self.nccl is not None
        packed = self.nccl.wire.get(timeout=10)
        assert packed.numel() == nbytes, "the trainer's chunk differs from the worker's"
        return packed

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        if path == "/get_world_size":
            assert request.url.params.get("include_dp") == "true"
            return httpx.Response(200, json={"world_size": self.workers})
        if path == "/init_weight_transfer_engine":
            return self._init(body)
        if path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
            self.control_calls.append((path, body))
            assert self.paused, f"{path} while serving"
            assert self.init_info is not None, f"{path} before init_weight_transfer_engine"
        if path == "/start_weight_update":
            assert body is None and not self.updating
            self.updating = True
            return httpx.Response(200, json={"message": "Weight update started"})
        if path == "/update_weights":
            return await self._update(body)
        if path == "/finish_weight_update":
            assert self.updating and set(body) == {"weight_version"}
            assert isinstance(body["weight_version"], str)
            self.updating = False
            self.version = int(body["weight_version"])
            return httpx.Response(200, json={"message": "Weight update finished"})
        return await super()._handle(request)

    def _init(self, body: dict[str, Any]) -> httpx.Response:
        assert set(body) == {"init_info"}
        info = body["init_info"]
        assert set(info) <= INIT_INFO_FIELDS, set(info) - INIT_INFO_FIELDS
        assert info["rank_offset"] == 1 and info["world_size"] == 1 + self.workers
        assert info["packed"] is True and info["packed_num_buffers"] == 2
        assert "nccl_unique_id_b64" not in info  # TCP rendezvous: the unset mode is dropped
        self.init_info = info
        self.inits += 1
        return httpx.Response(200, json={"message": "Weight transfer initialized"})

    async def _update(self, body: dict[str, Any]) -> httpx.Response:
        assert set(body) == {"update_info"} and self.updating
        info = body["update_info"]
        assert set(info) == UPDATE_INFO_FIELDS
        assert len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"])
        if self.fail_update:
            return httpx.Response(500, json={"error": "scripted worker failure"})
        assert self.init_info is not None
        buffer_bytes = self.init_info["packed_buffer_size_bytes"]
        got = await asyncio.to_thread(consume_packed, info, buffer_bytes, self._receive)
        self.received.append(got)
        return httpx.Response(200, json={"message": "Weights updated"})


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 32, generator=g).to(torch.float16),
        "model.norm.weight": torch.ones(32),
        "lm_head.weight": torch.randn(64, 32, generator=g),
    }


def _engine(fakes: list[FakeVllmWeightTransfer], **kwargs: Any) -> CheckpointEngine:
    def open_nccl(address: str, port: int, world_size: int) -> FakeNccl:
        """The trainer's end: a rendezvous with the server that was told this port (vLLM's
        init blocks until both sides are in; the trainer's end may start first)."""
        nccl = FakeNccl(address, port, world_size)
        for _ in range(500):
            told = [f for f in fakes if f.init_info and f.init_info["master_port"] == port]
            if told:
                told[0].connect(nccl)
                return nccl
            time.sleep(0.01)
        raise TimeoutError(f"no server joined {address}:{port}")

    clients = [PolicyClient(f.url, transport=f.transport(), max_retries=0) for f in fakes]
    transport = CollectiveTransport(
        bucket_mb=kwargs.pop("bucket_mb", 8 / 1024), timeout_s=10, vllm_communicator=open_nccl
    )
    return CheckpointEngine(clients, transport, **kwargs)


async def test_a_push_to_vllm_follows_the_recorded_protocol_and_moves_every_tensor() -> None:
    fakes = [
        FakeVllmWeightTransfer("http://127.0.0.1:9001"),
        FakeVllmWeightTransfer("http://127.0.0.1:9002", workers=2),
    ]
    engine = _engine(fakes)
    try:
        for version, seed in ((1, 1), (2, 2)):
            state = _state(seed)
            report = await engine.push(state, version, score=lambda p, t: [-0.5] * len(t))
            report.raise_if_failed()
            assert report.transport == "collective"
            for fake in fakes:
                got = fake.received[-1]
                assert list(got) == list(state)  # the order the workers load them in
                for name, t in state.items():
                    assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
                calls = [p for p, _ in fake.control_calls]
                i = calls.index("/pause", len(calls) - 8)
                assert calls[i:] == [
                    "/pause",
                    "/start_weight_update",
                    "/update_weights",
                    "/finish_weight_update",
                    "/reset_prefix_cache",
                    "/update_weight_version",
                    "/resume",
                    "/is_paused",
                ]
                assert fake.version == version and not fake.paused
                assert fake.generate_requests, "vLLM is verified by a probe after the resume"
        assert [f.inits for f in fakes] == [1, 1]  # the NCCL group is set up once per server
        nccl = fakes[0].nccl
        assert nccl is not None and len(nccl.broadcasts) > 2  # 8 KiB chunks: several
    finally:
        await engine.aclose()


async def test_a_failed_vllm_update_resumes_the_server_and_the_next_push_reinitializes() -> None:
    fake = FakeVllmWeightTransfer("http://127.0.0.1:9001")
    engine = _engine([fake], push_timeout_s=20)
    try:
        (await engine.push(_state(1), 1)).raise_if_failed()
        fake.fail_update = True
        report = await engine.push(_state(2), 2)
        status = report.servers["http://127.0.0.1:9001"]
        assert not report.ok and status.stage == "transfer" and not status.paused
        assert status.version == 1 and "scripted worker failure" in (status.error or "")
        fake.fail_update = False
        fake.updating = False  # vLLM's next start_weight_update begins a new round
        (await engine.push(_state(3), 3)).raise_if_failed()
        assert fake.inits == 2, "a link that failed mid-transfer is never reused"
    finally:
        await engine.aclose()


async def test_lora_to_vllm_over_nccl_is_refused_with_the_fix() -> None:
    fake = FakeVllmWeightTransfer("http://127.0.0.1:9001")
    engine = _engine([fake])
    adapter = LoraAdapter(
        {
            "base_model.model.q.lora_A.weight": torch.zeros(2, 4),
            "base_model.model.q.lora_B.weight": torch.zeros(4, 2),
        },
        LoraSpec(r=2, lora_alpha=4, target_modules=("q",)),
    )
    try:
        report = await engine.push(adapter, 1)
        assert not report.ok and "shared_dir" in (
            report.servers["http://127.0.0.1:9001"].error or ""
        )
        assert not fake.paused
    finally:
        await engine.aclose()


async def test_without_vllm_in_the_trainer_the_push_fails_before_pausing() -> None:
    fake = FakeVllmWeightTransfer("http://127.0.0.1:9001")
    client = PolicyClient(fake.url, transport=fake.transport(), max_retries=0)
    engine = CheckpointEngine([client], CollectiveTransport(timeout_s=5))
    try:
        report = await engine.push(_state(1), 1)
        status = report.servers["http://127.0.0.1:9001"]
        assert status.stage == "prepare" and "vLLM importable in the trainer" in (
            status.error or ""
        )
        assert not any(p == "/pause" for p, _ in fake.control_calls)
    finally:
        await engine.aclose()


@pytest.mark.parametrize("buffer_bytes", [1, 100, 4096, 1 << 30])
def test_packed_chunks_follow_vllms_rule(buffer_bytes: int) -> None:
    sizes = [4096, 128, 128, 2048, 64, 8192, 16, 16]
    chunks = vllm_packed_chunks(sizes, buffer_bytes)
    assert [i for c in chunks for i in c] == list(range(len(sizes)))
    for c in chunks[:-1]:  # every chunk but the last ends as soon as it exceeds the buffer
        assert sum(sizes[i] for i in c) > buffer_bytes
        assert sum(sizes[i] for i in c[:-1]) <= buffer_bytes
    # The re-stated consumer cuts the same chunks.
    info = {"names": [str(i) for i in range(len(sizes))], "dtype_names": ["uint8"] * len(sizes)}
    info["shapes"] = [[s] for s in sizes]
    seen: list[int] = []
    consume_packed(
        info, buffer_bytes, lambda n: (seen.append(n), torch.zeros(n, dtype=torch.uint8))[1]
    )
    assert seen == [sum(sizes[i] for i in c) for c in chunks]


def test_the_transport_rejects_bad_knobs() -> None:
    with pytest.raises(ValueError, match="backend='mpi'"):
        CollectiveTransport(backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bucket_mb=0"):
        CollectiveTransport(bucket_mb=0)
    assert isinstance(BucketLayout.plan(_state(0), 1 << 20), BucketLayout)
    assert issubclass(WeightGroupError, RuntimeError)
