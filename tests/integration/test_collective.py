"""The ``collective`` weight transport against real embedded servers (subprocesses), gloo on CPU.

What a user relies on, each checked here: a push broadcasts the new weights (several buckets)
into two servers that joined one weight group, every server verifies while paused and serves the
new version; the group is set up once and reused; a server killed in the middle of the broadcast
fails the push with a report naming every server's state, the other server is resumed on its old
weights and version (never left paused), and the next push rebuilds the group without the dead
server (it does not answer ``/health``) and succeeds on the survivor.

Measured (terminal summary): the verify max-abs-diff and the push seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agentrl.inference.client import PolicyClient
from agentrl.inference.handle import ServerHandle
from agentrl.inference.server import launch_embedded_server
from agentrl.weightsync.collective import CollectiveTransport
from agentrl.weightsync.engine import CheckpointEngine
from tests.integration.test_checkpoint_engine import (
    assert_serving,
    next_version,
    perturbed,
    scorer,
    state_of,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _launch(model_dir: Path, tmp: Path, n: int) -> list[ServerHandle]:
    handles: list[ServerHandle] = []
    try:
        for i in range(n):
            handles.append(
                launch_embedded_server(
                    model_dir,
                    log_path=tmp / f"server{i}.log",
                    startup_timeout_s=300,
                    extra_args=["--max-batch-size", "4"],
                )
            )
    except BaseException:
        for h in handles:
            h.stop()
        raise
    return handles


@pytest.fixture
def two_servers(tiny_model_dir: Path, tmp_path: Path) -> Iterator[list[ServerHandle]]:
    """Two fresh embedded servers (the fault test kills one)."""
    handles = _launch(tiny_model_dir, tmp_path, 2)
    try:
        yield handles
    finally:
        for h in handles:
            h.stop()


async def test_collective_push_to_two_servers_is_verified_and_reuses_the_group(
    two_servers, tiny_model_dir, report_metric
):
    clients = [PolicyClient(h.base_url) for h in two_servers]
    # 64 KiB buckets: the tiny model's ~1.6 MB go in many broadcasts, packed and single-tensor.
    transport = CollectiveTransport(bucket_mb=1 / 16, backend="gloo", timeout_s=30)
    engine = CheckpointEngine(clients, transport, verify_tolerance=1e-4)
    try:
        group_ids = []
        for seed in (21, 22):
            model = perturbed(tiny_model_dir, seed=seed)
            v = await next_version(clients)
            report = await engine.push(state_of(model), v, score=scorer(model))
            report.raise_if_failed()
            assert report.transport == "collective" and report.kind == "full"
            assert all(s.verified_while_paused for s in report.servers.values())
            assert report.max_abs_diff is not None and report.max_abs_diff <= 1e-4
            assert transport.group is not None
            group_ids.append(transport.group.group_id)
            for c in clients:
                await assert_serving(c, v)
                info = await c.weight_info()
                assert info["weight_group"]["group_id"] == transport.group.group_id
            report_metric("collective_verify_max_abs_diff", report.max_abs_diff)
            report_metric("collective_push_s", report.total_seconds)
        assert group_ids[0] == group_ids[1], "the group is set up once, then reused"
        stages = {k: report.stage_time(k) for k in ("pause", "transfer", "verify", "resume")}
        assert stages["transfer"] > 0
    finally:
        await engine.aclose()


class _KillsMidBroadcast(CollectiveTransport):
    """Kills ``victim`` after the first buckets went out (on the broadcasting thread)."""

    def __init__(self, victim: ServerHandle, **kwargs) -> None:
        super().__init__(**kwargs)
        self.victim: ServerHandle | None = victim

    def _broadcast(self, group, extra) -> None:
        layout = extra.layout
        original = layout.pack_into

        def pack_into(i, state, out):
            if i == 3 and self.victim is not None:
                self.victim.kill()
                self.victim = None
            return original(i, state, out)

        layout.pack_into = pack_into  # type: ignore[method-assign]
        super()._broadcast(group, extra)


async def test_a_server_killed_mid_broadcast_fails_the_push_and_the_other_is_resumed(
    two_servers, tiny_model_dir
):
    survivor, victim = two_servers
    clients = [PolicyClient(h.base_url, max_retries=0) for h in two_servers]
    transport = _KillsMidBroadcast(victim, bucket_mb=1 / 16, backend="gloo", timeout_s=5)
    engine = CheckpointEngine(clients, transport, push_timeout_s=60)
    try:
        model = perturbed(tiny_model_dir, seed=31)
        before = await clients[0].weight_version()
        report = await engine.push(state_of(model), before + 1, score=scorer(model))
        assert not report.ok
        alive, dead = report.servers[survivor.base_url], report.servers[victim.base_url]
        # The survivor kept its weights and version, and serves: never left paused.
        assert not alive.paused and alive.version == before, report.describe()
        assert "broadcast" in (alive.error or "") or "receiv" in (alive.error or ""), alive.error
        assert dead.version is None and not dead.paused, report.describe()
        assert "unreachable" in report.describe()
        await assert_serving(clients[0], before)
        assert transport.group is not None and transport.group.broken

        # The next push rebuilds the group without the dead server; the survivor moves on.
        model2 = perturbed(tiny_model_dir, seed=32)
        report2 = await engine.push(state_of(model2), before + 2, score=scorer(model2))
        assert report2.servers[survivor.base_url].ok, report2.describe()
        gone = report2.servers[victim.base_url]
        assert not gone.ok and gone.version is None  # unreachable, reported as such
        assert transport.group is not None and transport.group.world_size == 2
        await assert_serving(clients[0], before + 2)
    finally:
        await engine.aclose()
