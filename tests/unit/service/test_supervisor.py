"""The service's servers under faults, in process over fake servers: a dead server is ejected
and the push goes on without it (version monotonic, /health degraded), it rejoins only at the
current version; a launched server is restarted (bounded, counted); a restarted service comes
back at its last verified push."""

from __future__ import annotations

import hashlib

import pytest
from safetensors.torch import save

from agentrl.inference.client import PolicyClient
from tests.fakes import FakeInferenceServer
from tests.unit.service.conftest import http, make_serving
from tests.unit.service.test_weights_and_auth import _octet, _weights

pytestmark = pytest.mark.timeout(60)


class FakeHandle:
    """What the supervisor reads of a ``ServerHandle``."""

    def __init__(self, url: str, pid: int) -> None:
        self.base_url, self.pid, self.running = url, pid, True
        self.process = type("P", (), {"returncode": None})()

    def is_running(self) -> bool:
        return self.running

    def stop(self) -> None:
        self.running = False


async def test_a_dead_server_is_ejected_the_push_goes_on_and_it_rejoins_at_the_version(
    service_factory, tiny_model_dir
):
    service, app, serving = await service_factory()
    fake0, fake1 = serving.fake_servers
    data = save(_weights(tiny_model_dir))
    async with http(app) as h:
        assert (await h.post("/v1/weights", **_octet(data))).json()["version"] == 1
        fake0.alive = False  # SIGKILLed
        r = await h.post("/v1/weights", **_octet(data))
        assert r.status_code == 200, r.text
        report = r.json()
        assert report["ok"] and report["version"] == 2 and report["persisted"]
        assert list(report["servers"]) == ["http://fake1"]
        assert "health check" in report["ejected"]["http://fake0"]
        assert (fake0.version, fake1.version, service.weights.version) == (1, 2, 2)
        health = (await h.get("/health")).json()
        assert health["status"] == "degraded"
        assert [(s["url"], s["state"]) for s in health["servers"]] == [("http://fake0", "ejected")]
        assert health["servers"][0]["since"] is not None
        assert serving.pool.members == {"http://fake1"}
        status = (await h.get("/v1/status")).json()
        assert status["health"]["status"] == "degraded" and status["server_counts"]["ejected"] == 1
        assert status["weights"]["version"] == 2 and status["weights"]["persisted"]
        metrics = (await h.get("/metrics")).text
        assert "agentrl_service_degraded 1.0" in metrics
        assert "agentrl_service_server_ejections 1.0" in metrics

        await service.servers.check(service.servers.slots[0])  # still down: stays out
        assert service.servers.slots[0].state == "ejected"
        fake0.alive = True
        await service.servers.check(service.servers.slots[0])  # back: caught up, then joins
        assert fake0.version == 2 and serving.pool.members == {"http://fake0", "http://fake1"}
        assert (await h.get("/health")).json() == {"status": "ok"}
        info = (await h.get("/v1/weights")).json()
    assert info["servers"] == {"http://fake0": 2, "http://fake1": 2} and info["ejected"] == {}
    assert info["sha256"] == hashlib.sha256(data).hexdigest()
    assert service.weights.pushes["catch_ups"] == 1


async def test_with_every_server_dead_a_push_is_503_and_nothing_moves(
    service_factory, tiny_model_dir
):
    service, app, serving = await service_factory()
    for f in serving.fake_servers:
        f.alive = False
    async with http(app) as h:
        r = await h.post("/v1/weights", **_octet(save(_weights(tiny_model_dir))))
    assert r.status_code == 503 and "no live inference server" in r.json()["error"]["message"]
    assert service.weights.version == 0 and service.weights.saved is None


async def test_a_launched_server_is_restarted_at_the_current_version_within_its_budget(
    service_factory, tiny_model_dir
):
    service, app, serving = await service_factory(max_server_restarts=2)
    sup = service.servers
    slot = sup.slots[0]
    slot.handle = FakeHandle(slot.url, pid=100)
    launched: list[FakeInferenceServer] = []

    def relaunch(index: int, attempt: int) -> FakeHandle:
        if attempt == 2:
            raise RuntimeError("server exited before becoming healthy")
        fake = FakeInferenceServer(f"http://fake{index}-r{attempt}")
        launched.append(fake)
        return FakeHandle(fake.url, pid=100 + attempt)

    sup.relaunch = relaunch
    sup.make_client = lambda url: PolicyClient(
        url, transport=next(f for f in launched if f.url == url).transport(), max_retries=0
    )
    async with http(app) as h:
        assert (await h.post("/v1/weights", **_octet(save(_weights(tiny_model_dir))))).is_success
    slot.handle.running = False  # SIGKILL
    await sup.check(slot)
    assert slot.state == "ejected" and "exited" in (slot.reason or "")
    await sup.check(slot)  # restarted on a new URL, pushed version 1, rejoined
    assert slot.state == "serving" and slot.url == "http://fake0-r1" and slot.restarts == 1
    assert launched[0].version == 1 and "http://fake0-r1" in serving.pool.members
    slot.handle.running = False
    await sup.check(slot)
    await sup.check(slot)  # the second restart fails to launch
    assert slot.state == "ejected" and "restart 2 failed" in (slot.reason or "")
    await sup.check(slot)  # restarts used up: out for good, said so
    assert slot.state == "failed" and "restarts used up (2 of 2)" in (slot.reason or "")
    assert sup.counts["restarts"] == 2 and service.health()["status"] == "degraded"


async def test_a_restarted_service_comes_back_at_its_last_verified_push(
    service_factory, tiny_model_dir
):
    first, app, _ = await service_factory()
    data = save(_weights(tiny_model_dir))
    async with http(app) as h:
        r = await h.post("/v1/weights", params={"version": 7}, **_octet(data))
    assert r.status_code == 200 and r.json()["persisted"]
    await first.close()
    second, app, serving = await service_factory(make_serving(tiny_model_dir))
    assert second.weights.version == 7
    assert [f.version for f in serving.fake_servers] == [7, 7]  # the saved weights, pushed
    async with http(app) as h:
        info = (await h.get("/v1/weights")).json()
        status = (await h.get("/v1/status")).json()
        r = await h.post("/v1/weights", params={"version": 7}, **_octet(data))
    assert info["version"] == 7 and info["sha256"] == hashlib.sha256(data).hexdigest()
    assert status["version"] == 7 and status["weights"]["persisted"]
    assert r.status_code == 409  # versions still only move forward


async def test_a_service_whose_saved_weights_are_corrupt_refuses_to_start(
    service_factory, tiny_model_dir
):
    from agentrl.service.weight_state import WeightStateError

    first, app, _ = await service_factory()
    async with http(app) as h:
        assert (await h.post("/v1/weights", **_octet(save(_weights(tiny_model_dir))))).is_success
    await first.close()
    assert first.weights.saved is not None
    first.weights.saved.path.write_bytes(b"not the pushed bytes")
    with pytest.raises(WeightStateError, match="delete"):
        await service_factory(make_serving(tiny_model_dir))
