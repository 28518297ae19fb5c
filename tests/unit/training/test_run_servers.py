"""A local run's own servers under faults, in process over fake servers (issue 21): a dead
server is ejected and the push goes on without it (listed as ejected, not failed); restarted,
it joins the pool only at the next push that verified the trainer's version on it; restarts
are bounded and counted; with every server gone for good the run stops with RunFailed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from agentrl.config import load_config
from agentrl.inference.client import PolicyClient
from agentrl.serving.supervisor import ServerSupervisor
from agentrl.training.loop import RunFailed, push_weights
from agentrl.training.run_servers import RunServers
from agentrl.weightsync.engine import CheckpointEngine, HttpStreamTransport
from tests.fakes import FakeInferenceServer, PoolMembers
from tests.unit.service.test_supervisor import FakeHandle

pytestmark = pytest.mark.timeout(60)


class FakePool(PoolMembers):
    """The ServerPool's membership calls (what the supervisor adds and removes)."""

    def __init__(self, urls: list[str]) -> None:
        self.members = set(urls)


class Actor:
    """What ``push_weights`` reads of the actor."""

    def state_dict_for_push(self) -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(4)}

    def score_tokens(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        return [-0.5] * len(token_ids)


def _run(max_restarts: int = 2) -> tuple[Any, list[FakeInferenceServer], list[FakeInferenceServer]]:
    """A built run of two launched fake servers under :class:`RunServers`; the fakes, and the
    list the relaunched fakes go to."""
    cfg = load_config(
        None,
        [
            f"inference.max_server_restarts={max_restarts}",
            "inference.wait_for_server_s=0",
            "checkpoint.push_retries=0",
        ],
    )
    fakes = [FakeInferenceServer(f"http://fake{i}") for i in range(2)]
    launched: list[FakeInferenceServer] = []

    def client(url: str) -> PolicyClient:
        fake = next(f for f in fakes + launched if f.url == url)
        return PolicyClient(url, transport=fake.transport(), max_retries=0)

    engine = CheckpointEngine([client(f.url) for f in fakes], HttpStreamTransport(), verify=False)
    run = SimpleNamespace(
        cfg=cfg,
        engine=engine,
        pool=FakePool([f.url for f in fakes]),
        handles=[FakeHandle(f.url, pid=100 + i) for i, f in enumerate(fakes)],
        policies=SimpleNamespace(actor=Actor()),
        servers=None,
    )

    def relaunch(index: int, attempt: int) -> FakeHandle:
        fake = FakeInferenceServer(f"http://fake{index}-r{attempt}")
        launched.append(fake)
        return FakeHandle(fake.url, pid=200 + attempt)

    supervisor = ServerSupervisor(
        run, max_restarts=max_restarts, interval_s=3600.0, relaunch=relaunch, make_client=client
    )
    run.servers = RunServers(run, supervisor)
    return run, fakes, launched


@pytest.fixture
async def make_run():
    """``await make_run(max_restarts)`` -> :func:`_run`'s result, watched (one round now,
    the next an hour later: the test drives the rounds with ``check``); stopped at the end."""
    made: list[Any] = []

    async def make(max_restarts: int = 2) -> Any:
        out = _run(max_restarts)
        out[0].servers.start()
        made.append(out[0].servers)
        await asyncio.sleep(0.2)  # the first round (every server healthy) is over
        return out

    yield make
    for servers in made:
        await servers.aclose()


async def test_a_dead_server_is_ejected_restarted_and_joins_at_the_next_verified_push(
    make_run,
) -> None:
    run, (fake0, fake1), launched = await make_run()
    sup = run.servers.supervisor
    slot = sup.slots[0]
    assert (await push_weights(run, 1)).ok
    slot.handle.running, fake0.alive = False, False  # SIGKILL
    report = await push_weights(run, 2)  # the push goes on on the live server
    assert report.ok and list(report.servers) == ["http://fake1"]
    assert "exited" in report.ejected["http://fake0"] and "ejected" in report.describe()
    assert (fake0.version, fake1.version) == (1, 2)
    assert run.pool.members == {"http://fake1"}

    await sup.check(slot)  # restarted on a new URL, on model.path's weights: not yet serving
    assert slot.state == "ejected" and slot.url == "http://fake0-r1" and launched[0].version == 0
    assert "http://fake0-r1" not in run.pool.members
    report = await push_weights(run, 3)  # brings it to the trainer's version: it joins
    assert report.ok and set(report.servers) == {"http://fake0-r1", "http://fake1"}
    assert report.ejected == {} and launched[0].version == 3 == fake1.version
    assert slot.state == "serving" and run.pool.members == {"http://fake0-r1", "http://fake1"}
    assert run.servers.metrics() == {
        "servers/ejected": 1.0,
        "servers/restarts": 1.0,
        "servers/rejoined": 1.0,
        "servers/serving": 2.0,
        "servers/failed": 0.0,
    }


async def test_a_restarted_server_that_fails_its_first_push_stays_out_and_the_push_is_ok(
    make_run,
) -> None:
    run, (fake0, _), launched = await make_run()
    sup = run.servers.supervisor
    slot = sup.slots[0]
    slot.handle.running, fake0.alive = False, False
    await sup.check(slot)  # ejected
    await sup.check(slot)  # restarted, waits for the next push
    launched[0].alive = False  # unreachable for its first push (its process still runs)
    report = await push_weights(run, 1)
    assert report.ok and list(report.servers) == ["http://fake1"]
    assert slot.state == "ejected" and "http://fake0-r1" in report.ejected
    assert run.pool.members == {"http://fake1"}
    launched[0].alive = True
    await sup.check(slot)  # healthy again: tried at the next push
    assert (await push_weights(run, 2)).ok and slot.state == "serving"
    assert launched[0].version == 2


async def test_with_every_server_gone_for_good_the_run_stops_naming_them(make_run) -> None:
    run, fakes, _ = await make_run(max_restarts=0)
    sup = run.servers.supervisor
    lost: list[str] = []
    run.servers.on_lost(lost.append)
    for slot, fake in zip(sup.slots, fakes, strict=True):
        slot.handle.running, fake.alive = False, False
        await sup.check(slot)  # ejected
        await sup.check(slot)  # no restart left: failed
    assert [s.state for s in sup.slots] == ["failed", "failed"]
    assert len(lost) == 1 and "inference.max_server_restarts=0" in lost[0]
    with pytest.raises(RunFailed, match="every inference server is gone"):
        await push_weights(run, 1)
    assert run.servers.metrics()["servers/failed"] == 2.0


async def test_a_server_that_dies_and_is_relaunched_during_a_push_is_ejected_not_failed(
    make_run,
) -> None:
    run, (fake0, _), _ = await make_run()
    sup = run.servers.supervisor
    slot = sup.slots[0]
    push = run.engine.push

    async def push_while_server_0_dies(weights: Any, version: int, score: Any = None) -> Any:
        report = await push(weights, version, score=score)
        slot.handle.running, fake0.alive = False, False  # dies mid-push ...
        await sup.check(slot)
        await sup.check(slot)  # ... and is relaunched on a new URL before the push ends
        status = report.servers["http://fake0"]
        status.error, status.stage = "ReadError", "transfer"
        return report

    run.engine.push = push_while_server_0_dies
    report = await push_weights(run, 1)
    assert report.ok and list(report.servers) == ["http://fake1"]
    assert "left the pool during the push" in report.ejected["http://fake0"]
    assert "http://fake0-r1" in report.ejected  # it joins at the next push
