"""Two tests at a time (``make test``: ``pytest -n 2``, pytest-xdist), with lanes.

Why it exists: most integration tests wait more than they compute (servers starting, paced
episodes, health checks), so on 2 cores two at a time finish the suite sooner (measured: the
serial suite kept the cores 60 % busy). Some tests must not overlap, or are costly to set up
twice, so they share one lane (one worker, one after another):

- ``ray``: every test that starts or joins a Ray cluster (the session's head, a two-node
  cluster, ``agentrl train distributed.backend=ray``): one cluster at a time, one set-up;
- ``vllm``: every test of a real vLLM server (the session's server, its own ones): one set-up,
  and never two vLLM servers' memory at once.

How: each worker computes the lane of every item it collected (:func:`lane_of`, from the marks
and fixtures) and writes ``{nodeid: lane}`` to a file the controller named
(:func:`write_lanes`); the controller's :class:`LaneScheduling` groups the node ids of a lane into
one work unit. (xdist's own ``--dist loadgroup`` cannot be used: with pytest 9 its group suffix
never reaches the node ids, so every test was scheduled alone.) The lanes are the biggest units
and go first; the other tests follow in collection order, where the slow ones come first
(:func:`slow_first`), so no long test starts last while the other worker idles.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

RAY_MODULES = ("test_ray", "test_ray_auth", "test_ray_faults", "test_ray_multinode")
"""Modules that start or join Ray clusters (some of their tests need no fixture for it)."""

LANES_KEY = "agentrl_lanes"
"""The ``workerinput`` key of the file the workers write their lanes to."""


def lane_of(item: pytest.Item) -> str | None:
    """``ray`` (a Ray cluster), ``vllm`` (a real vLLM server), or None (any worker)."""
    names = set(getattr(item, "fixturenames", ()))
    params = getattr(getattr(item, "callspec", None), "params", {})
    module = getattr(item, "module", None)
    if item.get_closest_marker("ray") or "ray_cluster" in names:
        return "ray"
    if module is not None and module.__name__.rsplit(".", 1)[-1] in RAY_MODULES:
        return "ray"
    if item.get_closest_marker("vllm") or "vllm_server" in names:
        return "vllm"
    if params.get("inference_server") == "vllm":
        return "vllm"
    return None


def slow_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: those marked ``slow`` first, otherwise as collected."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def write_lanes(path: Path, items: list[pytest.Item], worker: str) -> None:
    """Write ``{nodeid: lane}`` of the laned ``items`` to ``path`` (atomically: every worker
    writes the same map)."""
    lanes = {item.nodeid: lane for item in items if (lane := lane_of(item)) is not None}
    tmp = path.with_name(f"{path.name}.{worker}")
    tmp.write_text(json.dumps(lanes))
    os.replace(tmp, path)


class LaneScheduling(LoadScopeScheduling):
    """xdist's scope scheduling, where a test's scope is its lane (module docstring), or the
    test itself when it has none."""

    def __init__(self, config: pytest.Config, log: Any, lanes_path: Path) -> None:
        super().__init__(config, log)
        self.lanes_path = lanes_path
        self._lanes: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        lanes = self._lanes
        if lanes is None:  # the workers wrote it before they reported their collection
            lanes = self._lanes = dict(json.loads(self.lanes_path.read_text()))
        lane = lanes.get(nodeid)
        return f"lane:{lane}" if lane is not None else nodeid
