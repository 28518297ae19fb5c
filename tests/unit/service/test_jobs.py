"""Rollout jobs through the HTTP app (in process, scripted policy): submit, stream, ack, groups,
idempotency, cancellation, staleness drops, and resumption from the store after a restart."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.client import AsyncRolloutClient
from agentrl.types import Generation
from tests.unit.service.conftest import ANSWER, FakePool, calc_tasks, http, make_serving
from tests.waiting import within

pytestmark = pytest.mark.timeout(60)


class FirstWaveOnly(FakePool):
    """Answers the episodes of the first ``n`` sessions at once; the later ones wait until the
    service is closed (so a restart finds exactly ``n`` stored and the rest unfinished)."""

    def __init__(self, tokenizer, script, *, n: int) -> None:
        super().__init__(tokenizer, script)
        self.n = n
        self.sessions: list[str | None] = []

    async def generate(self, prompt_ids, sampling, session_id=None):
        if session_id not in self.sessions:
            self.sessions.append(session_id)
        if self.sessions.index(session_id) >= self.n:
            await asyncio.Event().wait()  # never set: the close cancels it
        return await super().generate(prompt_ids, sampling, session_id)


def client_for(app) -> AsyncRolloutClient:
    import httpx

    return AsyncRolloutClient(
        "http://service", transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 1))
    )


async def test_submit_stream_and_ack_every_episode_once(service_factory):
    _, app, _ = await service_factory()
    async with client_for(app) as client:
        job = await client.submit(calc_tasks(3), n=2)
        assert job.counts["episodes"] == 6
        trajs = await client.collect(job.id)
        status = await client.job(job.id)
    assert len(trajs) == 6
    assert sorted((t.task_id, t.index) for t in trajs) == sorted(
        (f"t{i}", s) for i in range(3) for s in range(2)
    )
    assert all(t.reward == 1.0 for t in trajs if t.task_id == "t0")  # 0 + 5 = 5 = ANSWER
    assert status.status == "finished"
    c = status.counts
    assert (c["finished"], c["dropped"], c["delivered"], c["acked"], c["queued"]) == (6, 0, 6, 6, 0)
    assert c["pending_delivery"] == 0  # acked: freed from the store


async def test_reading_from_a_cursor_sends_each_later_trajectory_once(service_factory):
    _, app, _ = await service_factory()
    async with client_for(app) as client:
        job = await client.submit(calc_tasks(4), n=1)
        first = await client.collect(job.id, ack="manual")
        assert len(first) == 4
        # Nothing acked yet: a new reader from the start gets all four again, in the same order.
        again = [t async for t in client.trajectories(job.id, ack="manual")]
        assert [t.task_id for t in again] == [t.task_id for t in first]
        # Resuming after cursor 2 acknowledges 1..2 and sends only 3..4.
        rest = [t async for t in client.trajectories(job.id, cursor=2, ack="manual")]
        assert [t.task_id for t in rest] == [t.task_id for t in first[2:]]
        status = await client.job(job.id)
        assert status.counts["acked"] == 2 and status.counts["pending_delivery"] == 2
        # Acked trajectories are never sent again, whatever cursor a reader asks for.
        from_zero = [t async for t in client.trajectories(job.id, cursor=0, ack="manual")]
        assert [t.task_id for t in from_zero] == [t.task_id for t in first[2:]]


async def test_group_jobs_deliver_whole_groups_with_consecutive_cursors(service_factory):
    _, app, _ = await service_factory()
    async with client_for(app) as client:
        job = await client.submit(calc_tasks(3), n=3, group=True)
        groups = [g async for g in client.groups(job.id)]
    assert [len(g) for g in groups] == [3, 3, 3]
    for g in groups:
        assert len({t.uid for t in g}) == 1 and sorted(t.index for t in g) == [0, 1, 2]


async def test_a_failed_reward_is_a_counted_drop_and_drops_its_group(
    service_factory, tiny_model_dir
):
    serving = make_serving(tiny_model_dir)

    def broken(traj, task):
        if task.id == "t1":
            raise RuntimeError("judge down")
        return 1.0

    from agentrl.rollout.rewards import RewardManager

    serving.rewards = RewardManager(sources={"calculator": broken})
    _, app, _ = await service_factory(serving)
    async with client_for(app) as client:
        job = await client.submit(calc_tasks(2), n=2, group=True)
        trajs = await client.collect(job.id)
        status = await client.job(job.id)
    assert {t.task_id for t in trajs} == {"t0"}
    assert status.counts["dropped_by_reason"] == {"reward_error": 2}
    assert status.counts["finished"] + status.counts["dropped"] == 4


async def test_idempotency_key_returns_the_same_job_and_refuses_a_different_request(
    service_factory,
):
    _, app, _ = await service_factory()
    body = {"tasks": [{"prompt": "What is 1 + 5?", "data_source": "calculator"}], "n": 2}
    async with http(app) as h:
        r1 = await h.post("/v1/rollouts", json=body, headers={"idempotency-key": "k1"})
        r2 = await h.post("/v1/rollouts", json=body, headers={"idempotency-key": "k1"})
        assert (r1.status_code, r2.status_code) == (201, 200)
        assert r1.json()["id"] == r2.json()["id"]
        r3 = await h.post("/v1/rollouts", json={**body, "n": 3}, headers={"idempotency-key": "k1"})
        assert r3.status_code == 409 and "idempotency key" in r3.json()["error"]["message"]
        jobs = (await h.get("/v1/rollouts")).json()
    assert len(jobs) == 1


async def test_cancel_ends_running_episodes_as_counted_drops(service_factory, tiny_model_dir):
    serving = make_serving(tiny_model_dir, delay_s=3600.0)  # only the cancel ends them
    _, app, _ = await service_factory(serving)
    async with client_for(app) as client:
        job = await client.submit(calc_tasks(20), n=1)
        await asyncio.sleep(0.2)  # some start, some wait (the counts below hold either way)
        status = await client.cancel(job.id)
        trajs = await client.collect(job.id)
    assert status.status == "cancelled" and trajs == []
    c = status.counts
    assert c["dropped_by_reason"] == {"cancelled": 20} and c["running"] == 0 and c["queued"] == 0


async def test_stale_trajectories_are_dropped_and_counted(service_factory, tiny_model_dir):
    old = Generation(
        token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop", weight_version=0
    )
    serving = make_serving(tiny_model_dir, script=[old])
    service, app, _ = await service_factory(serving)
    service.weights.version = 3  # the trainer moved on; tokens of version 0 are 3 behind
    async with client_for(app) as client:
        job = await client.submit(calc_tasks(2), n=1, max_staleness=2)
        assert await client.collect(job.id) == []
        loose = await client.submit(calc_tasks(2), n=1, max_staleness=3)
        assert len(await client.collect(loose.id)) == 2
        status = await client.job(job.id)
    assert status.counts["dropped_by_reason"] == {"stale": 2}


async def test_a_restart_resumes_unfinished_episodes_and_keeps_unacked_trajectories(
    service_factory, tiny_model_dir
):
    first_wave = make_serving(tiny_model_dir)
    first_wave.pool = FirstWaveOnly(first_wave.tokenizer, [ANSWER], n=8)
    service, app, _ = await service_factory(first_wave)
    async with client_for(app) as client:
        job = await client.submit(calc_tasks(12), n=1)

        async def first_wave_stored() -> None:
            while (await client.job(job.id)).counts["finished"] < 8:
                await asyncio.sleep(0.05)

        await within(first_wave_stored(), "the first wave was never stored", guard_s=30)
        status = await client.job(job.id)
    assert status.counts["finished"] == 8 and status.status == "running"  # 4 still running
    await service.close()  # mid-job: running episodes are not recorded (they run again)

    _, app2, _ = await service_factory(make_serving(tiny_model_dir))
    async with client_for(app2) as client:
        trajs = await client.collect(job.id)
        status = await client.job(job.id)
    ids = [t.task_id for t in trajs]
    assert sorted(ids) == sorted(f"t{i}" for i in range(12))  # nothing lost, nothing twice
    assert status.status == "finished" and status.counts["dropped"] == 0


async def test_bad_requests_are_4xx_naming_the_field(service_factory):
    _, app, _ = await service_factory()
    async with http(app) as h:
        r = await h.post("/v1/rollouts", json={"tasks": [{"prompt": "x"}], "agent": "nope"})
        assert r.status_code == 400 and "unknown agent 'nope'" in r.json()["error"]["message"]
        r = await h.post("/v1/rollouts", json={"tasks": [], "n": 1})
        assert r.status_code == 400
        r = await h.post("/v1/rollouts", json={"tasks": [{"prompt": "x"}], "n": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = await h.post("/v1/rollouts", json={"dataset": {"path": "/etc/passwd"}})
        assert r.status_code == 403 and "--data-dir" in r.json()["error"]["message"]
        r = await h.get("/v1/rollouts/job-nope")
        assert r.status_code == 404
        r = await h.post("/v1/rollouts/job-nope/ack", json={"cursor": 1})
        assert r.status_code == 404
        r = await h.get("/v1/rollouts/job-x/trajectories", headers={"last-event-id": "abc"})
        assert r.status_code == 400
        r = await h.post(
            "/v1/rollouts", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400


async def test_dataset_split_reference_and_status(service_factory):
    _, app, _ = await service_factory()
    async with client_for(app) as client:
        job = await client.submit(dataset={"split": "train", "offset": 3, "limit": 2}, n=1)
        trajs = await client.collect(job.id)
        status = await client.status()
    assert len(trajs) == 2 and all(t.data_source == "calculator" for t in trajs)
    assert status["jobs"]["trajectories"] >= 2 and status["version"] == 0
