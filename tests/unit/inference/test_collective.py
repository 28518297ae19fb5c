"""The weight group and its bucket layout (``agentrl.inference.collective``): buckets round-trip
bit for bit, a real gloo group of two in-process ranks broadcasts every bucket, and a missing or
dead peer fails within the group's timeout instead of hanging."""

from __future__ import annotations

import threading

import pytest
import torch

from agentrl.inference.collective import (
    ALIGN,
    BucketLayout,
    WeightGroup,
    WeightGroupError,
    dtype_from_name,
)
from agentrl.inference.weights import WeightLoadError
from tests.waiting import in_thread


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(7, 3, generator=g),  # 84 bytes: the next tensor is realigned
        "b": torch.randn(5, generator=g).to(torch.bfloat16),
        "c": torch.randint(0, 9, (3, 3), generator=g),
        "big": torch.randn(300, generator=g),  # larger than a bucket: a bucket of its own
        "d": torch.randn(2, 2, generator=g).to(torch.float16),
        "empty": torch.zeros(0, 4),
    }


def test_buckets_round_trip_every_tensor_bit_for_bit() -> None:
    state = _state()
    layout = BucketLayout.plan(state, bucket_bytes=256)
    assert [m.name for b in layout.buckets for m in b] == list(state)
    assert any(len(b) == 1 and b[0].name == "big" for b in layout.buckets)
    assert all(m.offset % ALIGN == 0 for b in layout.buckets for m in b)
    again = BucketLayout.from_json(layout.to_json())  # what the receiver rebuilds
    out = torch.empty(layout.max_bucket_bytes(), dtype=torch.uint8)
    for i in range(len(layout.buckets)):
        packed = layout.pack_into(i, state, out).clone()
        assert packed.numel() == again.bucket_bytes(i)
        for name, t in again.unpack(i, packed):
            assert t.dtype == state[name].dtype and torch.equal(t, state[name]), name


def test_a_single_tensor_bucket_is_sent_from_the_tensors_own_memory() -> None:
    state = {"w": torch.randn(1000)}
    layout = BucketLayout.plan(state, bucket_bytes=64)
    packed = layout.pack_into(0, state, torch.empty(16, dtype=torch.uint8))
    assert packed.data_ptr() == state["w"].data_ptr()


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ([], "non-empty list"),
        ([{"names": ["a"], "dtype_names": ["float32"]}], r"buckets\[0\] needs"),
        ([{"names": ["a"], "dtype_names": ["complex64"], "shapes": [[1]]}], "not supported"),
        ([{"names": ["a"], "dtype_names": ["float32"], "shapes": [[-1]]}], "bad name"),
        ([{"names": [1], "dtype_names": ["float32"], "shapes": [[1]]}], "bad name"),
    ],
)
def test_a_bad_layout_is_refused_by_field(raw, match) -> None:
    with pytest.raises(WeightLoadError, match=match):
        BucketLayout.from_json(raw)
    assert dtype_from_name("bfloat16") is torch.bfloat16


def _pair(timeout_s: float) -> tuple[WeightGroup, WeightGroup]:
    root = WeightGroup.host(
        group_id="t", world_size=2, backend="gloo", address="127.0.0.1", timeout_s=timeout_s
    )
    peer = WeightGroup(
        group_id="t",
        rank=1,
        world_size=2,
        backend="gloo",
        address="127.0.0.1",
        port=root.port,
        timeout_s=timeout_s,
    )
    threads = [threading.Thread(target=g.connect) for g in (root, peer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return root, peer


def test_a_gloo_group_broadcasts_from_rank_0() -> None:
    root, peer = _pair(timeout_s=20)
    try:
        sent = torch.arange(100, dtype=torch.uint8)
        got = torch.zeros(100, dtype=torch.uint8)
        work = root.broadcast(sent)
        peer.wait(peer.broadcast(got))
        root.wait(work)
        assert torch.equal(sent, got)
        assert peer.describe() == {
            "group_id": "t",
            "rank": 1,
            "world_size": 2,
            "backend": "gloo",
            "broken": False,
        }
    finally:
        root.close()
        peer.close()
    with pytest.raises(WeightGroupError, match="not connected"):
        root.broadcast(sent)


def test_a_peer_that_never_joins_fails_the_rendezvous_within_the_timeout() -> None:
    root = WeightGroup.host(
        group_id="t2", world_size=2, backend="gloo", address="127.0.0.1", timeout_s=1.5
    )
    # No peer ever joins: only the group's timeout can end the rendezvous.
    with pytest.raises(WeightGroupError, match=r"could not join weight group t2.*within 1\.5s"):
        in_thread(root.connect, "the rendezvous outlived the group's timeout")
    assert root.broken


def test_a_broadcast_nobody_receives_fails_within_the_timeout() -> None:
    root, peer = _pair(timeout_s=1.5)
    try:
        got = torch.zeros(10, dtype=torch.uint8)
        with pytest.raises(WeightGroupError, match="peer died or stalled"):
            in_thread(  # the trainer never sends: only the group's timeout can end the wait
                lambda: peer.wait(peer.broadcast(got)), "the broadcast outlived the group's timeout"
            )
        assert peer.broken
    finally:
        root.close()
        peer.close()


def test_nccl_without_a_gpu_says_so(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    group = WeightGroup(
        group_id="n", rank=1, world_size=2, backend="nccl", address="127.0.0.1", port=1, timeout_s=1
    )
    with pytest.raises(WeightGroupError, match="'nccl' but this process has no CUDA device"):
        group.connect()
