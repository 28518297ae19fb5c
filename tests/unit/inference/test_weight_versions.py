"""WeightStore versions (issue 21): they only grow, except that the first push may replace the
weights a server was launched with at the launch version (every run's first push is at its start
version, usually 0; the staleness ablation smoke failed on it)."""

from __future__ import annotations

import pytest
import torch

from agentrl.inference.engine import VersionConflict
from agentrl.inference.engine.weight_store import WeightStore, WeightUpdate, state_digest


def _store(version: int = 0) -> WeightStore:
    return WeightStore(torch.nn.Linear(2, 2, bias=False), version)


def _update(version: int, value: float) -> WeightUpdate:
    return WeightUpdate(version=version, state={"weight": torch.full((2, 2), value)})


def test_the_first_push_replaces_the_launch_weights_at_the_launch_version() -> None:
    store = _store(0)
    before = store.digest()
    assert store.apply(_update(0, 1.0)) == 0
    assert store.digest() != before and store.loaded
    with pytest.raises(VersionConflict, match="not greater than the served version 0"):
        store.apply(_update(0, 2.0))  # a second set of weights under version 0: refused
    assert float(store.params["weight"][0, 0]) == 1.0  # unchanged by the refused load


def test_versions_only_grow_after_that() -> None:
    store = _store(3)
    with pytest.raises(VersionConflict):
        store.apply(_update(2, 1.0))  # lower than the launch version: refused even at first
    assert store.apply(_update(4, 1.0)) == 4
    with pytest.raises(VersionConflict):
        store.apply(_update(4, 2.0))
    assert store.apply(_update(5, 2.0)) == 5


def test_a_new_writer_starts_its_own_sequence_and_then_only_grows() -> None:
    """A second trainer run (or a resumed one) against the same servers pushes from its own start
    version; the run before it left the servers higher (the CI failure of stop 29)."""
    store = _store(0)
    first = store.lease.acquire("run a", 60.0, writer="a")
    assert store.apply(_update(3, 1.0)) == 3
    store.lease.release(first)
    store.lease.acquire("run b", 60.0, writer="b")
    assert store.apply(_update(0, 2.0)) == 0  # a new writer: its first load may go lower
    assert store.digest() == state_digest({"weight": torch.full((2, 2), 2.0)})
    with pytest.raises(VersionConflict, match="not greater than the served version 0"):
        store.apply(_update(0, 3.0))  # within writer b versions only grow again


def test_the_replaced_writer_is_fenced() -> None:
    """Two runs on one server never interleave versions: the run that was taken over is refused
    (it stops with a WeightPushError naming the new writer) instead of pushing on."""
    store = _store(0)
    store.lease.release(store.lease.acquire("run a", 60.0, writer="a"))
    store.lease.release(store.lease.acquire("run b", 60.0, writer="b"))
    with pytest.raises(VersionConflict, match="writer 'a' was replaced by writer 'b'"):
        store.lease.acquire("run a", 60.0, writer="a")
    assert store.lease.writer == "b"


def test_the_same_writer_cannot_go_back_across_leases() -> None:
    store = _store(0)
    for version in (1, 2):
        token = store.lease.acquire("run a", 60.0, writer="a")
        store.apply(_update(version, float(version)))
        store.lease.release(token)
    store.lease.acquire("run a", 60.0, writer="a")
    with pytest.raises(VersionConflict):
        store.apply(_update(1, 9.0))
    anonymous = _store(5)
    anonymous.lease.acquire("curl", 60.0)  # no writer id: the strict rule
    with pytest.raises(VersionConflict):
        anonymous.apply(_update(4, 1.0))
