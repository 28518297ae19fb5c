"""WeightStore versions (issue 21): they only grow, except that the first push may replace the
weights a server was launched with at the launch version (every run's first push is at its start
version, usually 0; the staleness ablation smoke failed on it)."""

from __future__ import annotations

import pytest
import torch

from agentrl.inference.engine import VersionConflict
from agentrl.inference.engine.weight_store import WeightStore, WeightUpdate


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
