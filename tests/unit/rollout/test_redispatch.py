"""AgentLoopManager: an episode whose worker fails (e.g. a Ray worker actor that died) is
re-dispatched once, to another worker, as the same admitted episode; a second failure is a
counted drop; nothing is delivered twice and every admitted episode still ends exactly once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentrl.inference.tiny_model import build_tiny_tokenizer
from agentrl.rollout.manager import AgentLoopManager, AgentLoopWorker, AlwaysAdmit, EpisodeKey
from agentrl.types import EpisodeDropped, Task, Trajectory
from tests.fakes import ScriptedPolicy
from tests.waiting import until


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


class WorkerDied(RuntimeError):
    """What a dead remote worker raises (Ray raises ``RayActorError``)."""


class FlakyWorker:
    """An ``AgentLoopWorker`` that fails its first ``fail`` calls (after ``delay_s``), or every
    call from the ``fail_from``-th on; records every call."""

    def __init__(
        self, inner: AgentLoopWorker, *, fail: int = 0, fail_from: int | None = None
    ) -> None:
        self.inner = inner
        self.fail = fail
        self.fail_from = fail_from
        self.calls: list[tuple[str, int]] = []
        self.available = True

    @property
    def counts(self) -> dict[str, int]:
        return self.inner.counts

    async def run_episode(self, task: Task, uid: str, index: int) -> Trajectory | None:
        self.calls.append((uid, index))
        await asyncio.sleep(0.01)
        if self.fail > 0 or (self.fail_from is not None and len(self.calls) > self.fail_from):
            self.fail -= 1
            raise WorkerDied(f"worker died during {uid}/{index}")
        return await self.inner.run_episode(task, uid, index)


class Recording(AlwaysAdmit):
    def __init__(self) -> None:
        self.admitted: list[EpisodeKey] = []
        self.finished: list[tuple[EpisodeKey, Trajectory | None]] = []

    def on_admitted(self, key: EpisodeKey) -> None:
        self.admitted.append(key)

    def on_finished(self, key: EpisodeKey, traj: Trajectory | None) -> None:
        self.finished.append((key, traj))


def tasks(n: int) -> list[Task]:
    return [Task(id=f"t{i}", prompt=f"question {i}") for i in range(n)]


def workers(tok, *flaky: dict[str, Any]) -> list[FlakyWorker]:
    return [
        FlakyWorker(AgentLoopWorker(ScriptedPolicy(tok, ["The answer is 42."]), tok), **kw)
        for kw in flaky
    ]


def assert_each_admitted_ends_once(mgr: AgentLoopManager, adm: Recording) -> dict[str, float]:
    s = mgr.stats()
    assert len(adm.admitted) == len(adm.finished) == s["rollout/admitted"]
    assert sorted((k.uid, k.index) for k in adm.admitted) == sorted(
        (k.uid, k.index) for k, _ in adm.finished
    )
    assert s["rollout/admitted"] == s.get("rollout/finished", 0) + s.get("rollout/dropped", 0)
    assert s["rollout/running"] == 0 and mgr._outstanding == [0] * len(mgr.workers)
    return s


async def test_a_failed_workers_episode_runs_again_once_on_another_worker(tok):
    dead, alive = workers(tok, {"fail": 2}, {})
    adm = Recording()
    mgr = AgentLoopManager(workers=[dead, alive], admission=adm, max_concurrency=4)
    got = await mgr.generate(tasks(2), n_samples=2)
    # Every episode delivered exactly once; the two that failed ran again on the other worker.
    assert sorted((t.uid, t.index) for t in got) == sorted({(t.uid, t.index) for t in got})
    assert len(got) == 4 and all(t.error is None for t in got)
    failed = dead.calls[:2]
    assert all(alive.calls.count(key) == 1 for key in failed)
    s = assert_each_admitted_ends_once(mgr, adm)
    assert s["rollout/redispatched"] == 2 and s["rollout/worker_errors"] == 2
    assert s["rollout/dropped"] == 0 and mgr.failures == []


async def test_a_second_failure_is_a_counted_drop_never_a_third_try(tok):
    a, b = workers(tok, {"fail_from": 0}, {"fail_from": 0})  # both workers are gone
    adm = Recording()
    mgr = AgentLoopManager(workers=[a, b], admission=adm, max_concurrency=2)
    got = await mgr.generate(tasks(1), n_samples=2)
    assert got == []
    s = assert_each_admitted_ends_once(mgr, adm)
    assert s["rollout/redispatched"] == 2  # once per episode
    assert s["rollout/worker_errors"] == 4 and s["rollout/dropped"] == 2
    assert len(a.calls) + len(b.calls) == 4  # two tries per episode, no more
    # Each episode's second try went to the other worker.
    for key in {*a.calls, *b.calls}:
        assert a.calls.count(key) == b.calls.count(key) == 1
    assert [reason for reason, _ in mgr.failures] == ["worker_error", "worker_error"]
    assert all(traj is None for _, traj in adm.finished)


async def test_max_redispatches_zero_drops_at_once(tok):
    (a,) = workers(tok, {"fail": 1})
    mgr = AgentLoopManager(workers=[a], max_concurrency=1, max_redispatches=0)
    got = await mgr.generate(tasks(1), n_samples=2)
    s = mgr.stats()
    assert len(got) == 1 and s["rollout/dropped"] == 1 and "rollout/redispatched" not in s


async def test_a_single_worker_gets_its_failed_episode_again(tok):
    (a,) = workers(tok, {"fail": 1})
    mgr = AgentLoopManager(workers=[a], max_concurrency=1)
    got = await mgr.generate(tasks(1))
    assert len(got) == 1 and a.calls == [(got[0].uid, 0), (got[0].uid, 0)]
    assert mgr.stats()["rollout/redispatched"] == 1


async def test_a_dropped_episode_is_not_redispatched(tok):
    class Drops(FlakyWorker):
        async def run_episode(self, task: Task, uid: str, index: int) -> Trajectory | None:
            self.calls.append((uid, index))
            raise EpisodeDropped("reward_error", "the reward failed")

    inner = AgentLoopWorker(ScriptedPolicy(tok, ["x"]), tok)
    w = Drops(inner)
    other = workers(tok, {})[0]
    mgr = AgentLoopManager(workers=[w, other], max_concurrency=1)
    await mgr.generate(tasks(1))
    s = mgr.stats()
    assert "rollout/redispatched" not in s and other.calls == []
    assert s["rollout/dropped/reward_error"] == 1


async def test_an_unavailable_worker_gets_no_new_episode(tok):
    gone, alive = workers(tok, {}, {})
    gone.available = False
    mgr = AgentLoopManager(workers=[gone, alive], max_concurrency=4)
    got = await mgr.generate(tasks(2), n_samples=2)
    assert len(got) == 4 and gone.calls == [] and len(alive.calls) == 4


async def test_no_redispatch_once_the_stream_is_stopping(tok):
    class SlowDeath(FlakyWorker):
        async def run_episode(self, task: Task, uid: str, index: int) -> Trajectory | None:
            self.calls.append((uid, index))
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                raise WorkerDied("died while being cancelled") from None
            return None

    inner = AgentLoopWorker(ScriptedPolicy(tok, ["x"]), tok)
    a, b = SlowDeath(inner), SlowDeath(inner)
    adm = Recording()
    mgr = AgentLoopManager(workers=[a, b], admission=adm, max_concurrency=2)
    stream = mgr.stream(tasks(1), n_samples=2)
    consumer = asyncio.create_task(anext(stream, None))
    await until(lambda: len(a.calls) + len(b.calls) == 2, "the two episodes never started")
    mgr.cancel()
    assert await asyncio.wait_for(consumer, 5) is None
    s = assert_each_admitted_ends_once(mgr, adm)
    assert len(a.calls) + len(b.calls) == 2 and "rollout/redispatched" not in s


def test_max_redispatches_must_not_be_negative(tok):
    with pytest.raises(ValueError, match="max_redispatches"):
        AgentLoopManager(workers=workers(tok, {}), max_redispatches=-1)
