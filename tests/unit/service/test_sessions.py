"""Service sessions over HTTP (in process, scripted policy): open -> chat -> finish (scored)."""

from __future__ import annotations

import pytest

from tests.unit.service.conftest import http, make_serving

pytestmark = pytest.mark.timeout(60)

TASK = {
    "id": "calc-1",
    "prompt": "What is 0 + 5?",
    "data_source": "calculator",
    "reward_spec": {"ground_truth": "5"},
}


async def test_open_chat_finish_returns_a_scored_trajectory_bound_to_the_task(service_factory):
    service, app, serving = await service_factory()
    async with http(app) as h:
        r = await h.post("/v1/sessions", json={"task": TASK, "sampling": {"temperature": 0.5}})
        assert r.status_code == 201
        info = r.json()
        assert info["base_url"] == f"/v1/sessions/{info['id']}/v1" and info["task_id"] == "calc-1"
        msgs = [{"role": "user", "content": "What is 0 + 5?"}]
        r = await h.post(
            f"{info['base_url']}/chat/completions", json={"model": "m", "messages": msgs}
        )
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]["message"]
        assert reply["content"] == "\\boxed{5}"
        assert serving.pool.requests[-1][1].temperature == 0.5  # the session's sampling
        assert serving.pool.requests[-1][2] == info["id"]  # sticky routing by session
        assert (await h.get(f"/v1/sessions/{info['id']}")).json()["turns"] == 1
        r = await h.post(f"/v1/sessions/{info['id']}/finish", json={})
        assert r.status_code == 200
        (traj,) = r.json()["trajectories"]
        assert (traj["task_id"], traj["uid"], traj["reward"]) == ("calc-1", "calc-1", 1.0)
        assert r.json()["dropped"] == []
        # finished: the id is gone
        assert (await h.post(f"/v1/sessions/{info['id']}/finish", json={})).status_code == 404
        r = await h.post(f"{info['base_url']}/chat/completions", json={"messages": msgs})
        assert r.status_code == 404
    assert service.sessions.stats()["sessions_finished"] == 1.0


async def test_a_failed_reward_is_reported_as_dropped_not_scored_zero(
    service_factory, tiny_model_dir
):
    from agentrl.rollout.rewards import RewardManager

    serving = make_serving(tiny_model_dir)

    def broken(traj, task):
        raise RuntimeError("judge down")

    serving.rewards = RewardManager(sources={"calculator": broken})
    _, app, _ = await service_factory(serving)
    async with http(app) as h:
        sid = (await h.post("/v1/sessions", json={"task": TASK})).json()["id"]
        await h.post(
            f"/v1/sessions/{sid}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
        )
        out = (await h.post(f"/v1/sessions/{sid}/finish")).json()
    assert out["trajectories"] == []
    assert (
        out["dropped"][0]["reason"] == "reward_error" and "judge down" in out["dropped"][0]["error"]
    )


async def test_unknown_sessions_data_sources_and_discards(service_factory, tiny_model_dir):
    from agentrl.rollout.rewards import RewardManager

    serving = make_serving(tiny_model_dir)
    serving.rewards = RewardManager(sources={"calculator": "calculator"})  # no default
    _, app, _ = await service_factory(serving)
    async with http(app) as h:
        r = await h.post("/v1/sessions", json={"task": {**TASK, "data_source": "nope"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "task.data_source"
        assert (await h.get("/v1/sessions/made-up")).status_code == 404
        assert (await h.get("/v1/sessions/made-up/v1/models")).status_code == 404
        sid = (await h.post("/v1/sessions", json={"task": TASK})).json()["id"]
        assert (await h.get(f"/v1/sessions/{sid}/v1/models")).status_code == 200
        assert (await h.delete(f"/v1/sessions/{sid}")).status_code == 204
        assert (await h.delete(f"/v1/sessions/{sid}")).status_code == 404
