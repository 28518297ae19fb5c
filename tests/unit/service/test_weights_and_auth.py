"""Weight pushes (validation before any server is touched, versions, the report), bearer auth
and body limits of the rollout service, in process over a real CheckpointEngine and fake servers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from tests.unit.service.conftest import http, make_serving

pytestmark = pytest.mark.timeout(60)


def _weights(model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t.contiguous()
    return out


def _octet(data: bytes) -> dict:
    return {"content": data, "headers": {"content-type": "application/octet-stream"}}


async def test_push_reaches_every_server_and_versions_move_forward(service_factory, tiny_model_dir):
    service, app, serving = await service_factory()
    data = save(_weights(tiny_model_dir))
    async with http(app) as h:
        r = await h.post("/v1/weights", params={"version": 3}, **_octet(data))
        assert r.status_code == 200, r.text
        report = r.json()
        assert (
            report["ok"]
            and report["version"] == 3
            and set(report["servers"])
            == {
                "http://fake0",
                "http://fake1",
            }
        )
        assert all(s["version"] == 3 and not s["paused"] for s in report["servers"].values())
        import hashlib

        assert report["sha256"] == hashlib.sha256(data).hexdigest()
        assert [f.version for f in serving.fake_servers] == [3, 3]
        r = await h.post("/v1/weights", params={"version": 3}, **_octet(data))
        assert r.status_code == 409 and "only move forward" in r.json()["error"]["message"]
        r = await h.post("/v1/weights", **_octet(data))  # default: current + 1
        assert r.status_code == 200 and r.json()["version"] == 4
        info = (await h.get("/v1/weights")).json()
    assert info["version"] == 4 and info["servers"] == {"http://fake0": 4, "http://fake1": 4}
    assert service.weights.version == 4


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda w: {**w, "bogus.weight": torch.zeros(2)}, "not a parameter"),
        (lambda w: {k: (v[:1] if i == 0 else v) for i, (k, v) in enumerate(w.items())}, "shape"),
        (lambda w: {k: v.to(torch.float16) for k, v in w.items()}, "dtype"),
        (lambda w: {k: v.clone().fill_(float("nan")) for k, v in w.items()}, "NaN"),
        (lambda w: dict(list(w.items())[1:]), "missing"),
    ],
)
async def test_a_bad_push_is_refused_before_any_server_is_touched(
    service_factory, tiny_model_dir, mutate, message
):
    _, app, serving = await service_factory()
    data = save(mutate(_weights(tiny_model_dir)))
    async with http(app) as h:
        r = await h.post("/v1/weights", **_octet(data))
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert all(f.control_calls == [] for f in serving.fake_servers)  # never paused


async def test_garbage_paths_and_content_types_are_4xx(service_factory, tmp_path):
    _, app, _ = await service_factory(weights_dirs=[str(tmp_path / "w")])
    (tmp_path / "w").mkdir()
    async with http(app) as h:
        r = await h.post("/v1/weights", **_octet(b"not safetensors"))
        assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
        r = await h.post("/v1/weights", json={"path": "/etc/passwd"})
        assert r.status_code == 403 and "--weights-dir" in r.json()["error"]["message"]
        r = await h.post("/v1/weights", json={"path": str(tmp_path / "w" / "missing")})
        assert r.status_code == 400
        r = await h.post("/v1/weights", content=b"x", headers={"content-type": "text/plain"})
        assert r.status_code == 415


async def test_verification_failure_is_a_502_with_the_report(service_factory, tiny_model_dir):
    serving = make_serving(tiny_model_dir)
    serving.engine.verify = True  # the fake servers answer logprob -0.5: never the model's own
    _, app, _ = await service_factory(serving)
    async with http(app) as h:
        r = await h.post("/v1/weights", **_octet(save(_weights(tiny_model_dir))))
        assert r.status_code == 502
        report = r.json()
        assert not report["ok"] and not report["verified"]
        assert all("verify" in s["error"] for s in report["servers"].values())
        assert all(not s["paused"] for s in report["servers"].values())
        assert (await h.get("/v1/weights")).json()["version"] == 0  # did not move
        # version 1 was sent (a server may hold it): a retry must go above it
        r = await h.post(
            "/v1/weights", params={"version": 1}, **_octet(save(_weights(tiny_model_dir)))
        )
        assert (
            r.status_code == 409 and "version 1 was tried already" in r.json()["error"]["message"]
        )
        r = await h.post("/v1/weights", **_octet(save(_weights(tiny_model_dir))))
        assert r.status_code == 502 and r.json()["version"] == 2


async def test_bearer_auth_on_every_route_but_health(service_factory):
    _, app, _ = await service_factory(api_key="s3cret")
    async with http(app) as h:
        assert (await h.get("/health")).status_code == 200
        for method, path in [
            ("GET", "/v1/status"),
            ("GET", "/metrics"),
            ("GET", "/openapi.json"),
            ("GET", "/docs"),
            ("POST", "/v1/rollouts"),
            ("GET", "/v1/weights"),
            ("POST", "/v1/sessions"),
            ("POST", "/v1/sessions/x/v1/chat/completions"),
        ]:
            r = await h.request(method, path)
            assert r.status_code == 401, (method, path)
            assert r.headers["www-authenticate"] == "Bearer"
        r = await h.get("/v1/status", headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
    async with http(app, api_key="s3cret") as h:
        assert (await h.get("/v1/status")).status_code == 200
        assert "agentrl_service_weight_version" in (await h.get("/metrics")).text


async def test_without_a_key_only_loopback_clients_are_served(service_factory):
    import httpx

    _, app, _ = await service_factory()
    remote = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=("10.1.2.3", 5555)), base_url="http://s"
    )
    async with remote:
        assert (await remote.get("/health")).status_code == 200
        r = await remote.get("/v1/status")
        assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
    async with http(app) as local:
        assert (await local.get("/v1/status")).status_code == 200


async def test_oversize_bodies_are_413(service_factory):
    _, app, _ = await service_factory(max_body_bytes=2048, max_weights_bytes=4096)
    async with http(app) as h:
        r = await h.post(
            "/v1/rollouts", content=b"x" * 4096, headers={"content-type": "application/json"}
        )
        assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]

        async def chunks():
            for _ in range(10):
                yield b"y" * 1024

        r = await h.post(
            "/v1/rollouts", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        r = await h.post("/v1/weights", **_octet(b"z" * 5000))
        assert r.status_code == 413
        assert (await h.get("/health")).status_code == 200
