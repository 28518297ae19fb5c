"""The engine's sleep state machine (colocated mode, issue 26): a sleeping server generates
nothing, gives its memory back, wakes with what it had (or with what a push loaded)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from agentrl.inference.engine import InferenceEngine, VersionConflict
from agentrl.inference.engine.sleep import release_params, restore_params
from agentrl.inference.server import create_app
from agentrl.types import SamplingParams

SAMPLING = SamplingParams(max_tokens=6, temperature=1.0, seed=3)


@pytest.fixture
def engine(tiny_model_dir: Path):
    eng = InferenceEngine(tiny_model_dir, max_batch_size=4, max_model_len=256)
    yield eng
    eng.close()


def _shifted(engine: InferenceEngine) -> dict[str, torch.Tensor]:
    """New weights (every tensor + 0.01), as a push would bring."""
    return {k: v.detach().clone() + 0.01 for k, v in engine.model.state_dict().items()}


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_engine_holds_requests_and_wake_serves_them_unchanged(
    engine: InferenceEngine, level: int
) -> None:
    awake = engine.submit([1, 2, 3], SAMPLING).result(timeout=30)
    digest = engine.weight_info()["digest"]
    out = engine.sleep(level)
    assert out["level"] == level and engine.sleep_level == level
    assert (out["freed_bytes"] > 0) == (level == 2)
    held = engine.submit([1, 2, 3], SAMPLING)
    time.sleep(0.3)
    assert not held.done() and engine.num_waiting == 1  # held, not served, not refused
    info = engine.weight_info()
    assert info["sleeping"] == level and info["weights_released"] == (level == 2)
    assert info["digest"] == digest  # the same weights, released or not
    woke = engine.wake_up()
    assert woke == {"was_sleeping": level, "sleeping": 0, "weight_version": 0}
    again = held.result(timeout=30)
    assert engine.weight_info()["digest"] == digest  # byte for byte the same weights
    # re-allocated tensors may be aligned differently: the kernels may sum in another order
    assert again.token_ids == awake.token_ids
    assert max(abs(a - b) for a, b in zip(again.logprobs, awake.logprobs, strict=True)) < 1e-5


def test_sleep_parks_running_requests_and_they_finish_after_the_wake(
    engine: InferenceEngine,
) -> None:
    long = SamplingParams(max_tokens=200, temperature=1.0, seed=5)
    reference = engine.submit([4, 5, 6], long, ignore_eos=True).result(timeout=30)
    fut = engine.submit([4, 5, 6], long, ignore_eos=True)
    while engine.num_running == 0:
        time.sleep(0.001)
    assert engine.sleep(1)["parked"] == 1
    assert engine.num_running == 0 and engine.num_waiting == 1 and not fut.done()
    engine.wake_up()
    out = fut.result(timeout=30)
    assert out.token_ids == reference.token_ids  # re-prefilled, same weights: same tokens
    assert max(abs(a - b) for a, b in zip(out.logprobs, reference.logprobs, strict=True)) < 1e-4


def test_a_push_to_a_level2_server_loads_verifies_and_wakes_on_the_new_version(
    engine: InferenceEngine,
) -> None:
    new = _shifted(engine)
    engine.sleep(2)
    with pytest.raises(VersionConflict, match="level 2"):
        engine.probe([1, 2, 3], token_ids=[4, 5])  # no weights to probe
    assert engine.load_state_dict(new, version=1) == 1  # re-allocated, checked, loaded
    assert engine.sleep_level == 2 and not engine.weights.released  # still asleep
    probe = engine.probe([1, 2, 3], token_ids=[4, 5])  # served while asleep: verify works
    assert probe.weight_version == 1
    engine.mark_verified(1)
    engine.wake_up()
    assert engine.weight_version == 1
    served = dict(engine.model.state_dict())
    assert all(torch.equal(served[k], v) for k, v in new.items())


def test_a_failed_load_into_a_level2_server_leaves_the_verified_weights(
    engine: InferenceEngine,
) -> None:
    digest = engine.weight_info()["digest"]
    engine.sleep(2)
    bad = {"model.embed_tokens.weight": torch.zeros(3, 3)}
    with pytest.raises(Exception, match=r"shape|missing"):
        engine.load_state_dict(bad, version=1)
    engine.wake_up()
    assert engine.weight_version == 0 and engine.weight_info()["digest"] == digest


def test_level2_is_refused_while_the_served_version_is_unverified(
    engine: InferenceEngine,
) -> None:
    engine.load_state_dict(_shifted(engine), version=1)  # loaded, never verified
    with pytest.raises(VersionConflict, match="level 1"):
        engine.sleep(2)
    assert engine.sleep_level == 0 and not engine.weights.released
    assert engine.sleep(1)["level"] == 1  # level 1 keeps the weights: allowed


def test_release_and_restore_keep_tied_weights_tied() -> None:
    emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as lm_head and embed_tokens
    model = torch.nn.Sequential(emb, head)
    shapes, freed = release_params(model)
    assert freed == 10 * 4 * 4 and emb.weight.numel() == 0
    restore_params(model, shapes)
    assert emb.weight.shape == (10, 4) and head.weight is emb.weight


async def test_the_sleep_routes(engine: InferenceEngine) -> None:
    app = create_app(engine, served_model_name="tiny")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        assert (await c.get("/is_sleeping")).json() == {"is_sleeping": False, "level": 0}
        assert (await c.post("/sleep", params={"level": 3})).status_code == 400
        r = await c.post("/sleep", params={"level": 2})
        assert r.status_code == 200 and r.json()["status"] == "sleeping", r.text
        assert (await c.get("/is_sleeping")).json() == {"is_sleeping": True, "level": 2}
        info = (await c.get("/weight_info")).json()
        assert info["sleeping"] == 2 and info["weights_released"] is True
        assert "agentrl_sleep_level 2.0" in (await c.get("/metrics")).text
        r = await c.post("/probe", json={"prompt": [1, 2], "token_ids": [3]})
        assert r.status_code == 409 and "wake_up" in r.text
        r = await c.post("/wake_up", params={"tags": "weights"})
        assert r.json()["status"] == "sleeping"  # the weights are back, still asleep
        assert (
            await c.post("/probe", json={"prompt": [1, 2], "token_ids": [3]})
        ).status_code == 200
        assert (await c.post("/wake_up")).json()["status"] == "awake"
        assert (await c.get("/is_sleeping")).json()["is_sleeping"] is False
