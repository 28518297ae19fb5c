"""The embedded server in process (httpx ASGITransport): formats, errors, controls, request log."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from agentrl.inference.engine import InferenceEngine
from agentrl.inference.server import create_app


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    eng = InferenceEngine(tiny_model_dir, max_batch_size=8, max_model_len=1024)
    yield eng
    eng.close()


@pytest.fixture
async def client(engine, tmp_path: Path):
    log = tmp_path / "requests.jsonl"
    app = create_app(engine, served_model_name="tiny", request_log=log)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as c:
        c.request_log = log  # type: ignore[attr-defined]  # test convenience
        yield c


async def test_completions_token_ids_with_logprobs(client, engine) -> None:
    prompt = [5, 6, 7, 8]
    r = await client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 5,
            "temperature": 0.8,
            "seed": 3,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
        headers={"x-session-id": "sess-1"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["weight_version"] == 0 and r.headers["x-weight-version"] == "0"
    choice = body["choices"][0]
    lp = choice["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    assert ids == choice["token_ids"] and choice["prompt_token_ids"] == prompt
    assert len(lp["token_logprobs"]) == len(ids) == body["usage"]["completion_tokens"]
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert [list(d) for d in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
    # Same seed, same tokens; the engine directly agrees.
    from agentrl.types import SamplingParams

    direct = engine.submit(prompt, SamplingParams(max_tokens=5, temperature=0.8, seed=3)).result()
    assert direct.token_ids == ids
    assert direct.logprobs == pytest.approx(lp["token_logprobs"], abs=1e-6)
    # Request log: exact ids and the session id.
    rows = [json.loads(x) for x in client.request_log.read_text().splitlines()]
    assert rows[-1]["prompt_ids"] == prompt and rows[-1]["output_ids"] == ids
    assert rows[-1]["session_id"] == "sess-1" and rows[-1]["weight_version"] == 0
    assert set(rows[-1]) == {
        "request_id",
        "session_id",
        "prompt_ids",
        "output_ids",
        "weight_version",
        "finish_reason",
        "t",
    }


async def test_completions_text_prompt_top_logprobs_and_n(client) -> None:
    r = await client.post(
        "/v1/completions",
        json={"prompt": "hello", "max_tokens": 3, "logprobs": 2, "n": 2, "user": "u-7", "seed": 1},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 2
    for c in body["choices"]:
        assert all(1 <= len(d) <= 3 for d in c["logprobs"]["top_logprobs"])
        assert isinstance(c["text"], str)
    rows = [json.loads(x) for x in client.request_log.read_text().splitlines()]
    assert [r["session_id"] for r in rows[-2:]] == ["u-7", "u-7"]


async def test_chat_completions_with_tools_and_logprobs(client) -> None:
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "2+2?"}],
            "tools": tools,
            "max_tokens": 6,
            "logprobs": True,
            "top_logprobs": 1,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert body["weight_version"] == 0 and r.headers["x-weight-version"] == "0"
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")


async def test_health_models_metrics(client) -> None:
    assert (await client.get("/health")).status_code == 200
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 1024
    await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    text = (await client.get("/metrics")).text
    for name in (
        "agentrl_requests_total",
        "agentrl_generation_tokens_total",
        "agentrl_prompt_tokens_total",
        "agentrl_num_requests_running",
        "agentrl_num_requests_waiting",
        "agentrl_weight_version",
    ):
        assert name in text


@pytest.mark.parametrize(
    ("path", "payload", "status", "param"),
    [
        ("/v1/completions", {"model": "nope", "prompt": [1]}, 404, "model"),
        ("/v1/completions", {"prompt": [1] * 1100, "max_tokens": 0}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1100}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1], "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1], "temperature": -0.5}, 400, "temperature"),
        ("/v1/completions", {"prompt": [1], "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": [1], "stream": True}, 400, "stream"),
        ("/v1/completions", {"prompt": [1], "stop": ["x"]}, 400, "stop"),
        ("/v1/completions", {"prompt": [1], "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            400,
            "tools[0].function",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": "calc"},
            400,
            "tools",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": -2},
            400,
            "max_tokens",
        ),
        ("/update_weights_from_path", {"path": "/nonexistent/dir"}, 400, "path"),
        ("/update_weight_version", {"version": "x"}, 400, "version"),
        ("/collective_rpc", {"method": "sleep"}, 400, "method"),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {}}, 400, "kwargs.weights_path"),
    ],
)
async def test_client_errors_are_4xx_with_openai_body(client, path, payload, status, param) -> None:
    r = await client.post(path, json=payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["message"]


async def test_malformed_json_and_unknown_route(client) -> None:
    r = await client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = await client.post("/update_weights", content=b"garbage", headers={"x-weight-version": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-weight-version"
    r = await client.post("/update_weights", content=b"garbage")
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = await client.post("/update_weights", content=b"")
    assert r.status_code == 400
    r = await client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


async def test_pause_resume_abort_and_version(client, engine) -> None:
    r = await client.post("/pause")
    paused = (await client.get("/is_paused")).json()
    assert r.status_code == 200 and paused == {"is_paused": True, "state": "paused"}
    assert (await client.post("/abort_requests")).json()["aborted"] == 0
    assert (await client.post("/resume")).status_code == 200
    assert (await client.get("/is_paused")).json()["is_paused"] is False
    assert (await client.post("/reset_prefix_cache")).json()["status"] == "ok"
    assert (await client.post("/pause", params={"mode": "bogus"})).status_code == 400
    r = await client.post("/update_weight_version", json={"version": 4})
    assert r.json()["weight_version"] == 4 and r.headers["x-weight-version"] == "4"
    info = (await client.get("/weight_info", params={"checksum": "true"})).json()
    assert info["version"] == 4 and len(info["checksum"]) == 64 and info["num_params"] > 0
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert r.json()["weight_version"] == 4
    await client.post("/update_weight_version", json={"version": 0})


# ---- who may call what -----------------------------------------------------------------------
def _client_from(app, host: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=(host, 40000)), base_url="http://test"
    )


async def test_without_a_key_control_answers_loopback_callers_only(engine) -> None:
    app = create_app(engine, served_model_name="tiny")
    async with _client_from(app, "10.0.0.7") as remote, _client_from(app, "127.0.0.1") as local:
        for path in ("/pause", "/resume", "/abort_requests", "/update_weight_version", "/probe"):
            r = await remote.post(path, json={"version": 1, "prompt": [1]})
            assert r.status_code == 403, (path, r.text)
            assert "--api-key" in r.json()["error"]["message"]
        r = await remote.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        assert r.status_code == 200  # generation stays open, as on vLLM without a key
        assert (await remote.get("/weight_info")).status_code == 200
        assert (await local.post("/resume")).status_code == 200


async def test_with_a_key_everything_but_health_and_metrics_needs_it(engine) -> None:
    app = create_app(engine, served_model_name="tiny", api_key="k1")
    async with _client_from(app, "127.0.0.1") as c:
        for method, path in (
            ("POST", "/v1/completions"),
            ("GET", "/v1/models"),
            ("POST", "/resume"),
            ("GET", "/weight_info"),
        ):
            r = await c.request(method, path, json={"prompt": [1], "max_tokens": 1})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            r = await c.request(
                method,
                path,
                json={"prompt": [1], "max_tokens": 1},
                headers={"Authorization": "Bearer k1"},
            )
            assert r.status_code == 200, (path, r.text)
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200


async def test_oversized_or_unsized_json_bodies_are_refused(client) -> None:
    r = await client.post(
        "/v1/completions",
        content=b"{}",
        headers={"content-length": str(10**9), "content-type": "application/json"},
    )
    assert r.status_code == 413

    async def chunks():
        yield b'{"prompt": [1]}'

    r = await client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 411


async def test_a_trusted_request_template_renders_off_the_event_loop(engine) -> None:
    app = create_app(engine, served_model_name="tiny", trust_request_chat_template=True)
    # ~1e6 template steps (the sandbox caps one range at 1e5, so two nested loops).
    heavy = "{% for i in range(5000) %}{% for j in range(200) %}{{ (i * j) % 7 }}{% endfor %}{% endfor %}"
    async with _client_from(app, "127.0.0.1") as c:
        chat = asyncio.create_task(
            c.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "x"}],
                    "chat_template": heavy,
                    "max_tokens": 1,
                },
            )
        )
        await asyncio.sleep(0)
        health = await c.get("/health")  # answered while the template renders elsewhere
        assert health.status_code == 200 and not chat.done()
        r = await chat
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]  # too long


async def test_models_shows_no_path(client, engine) -> None:
    card = (await client.get("/v1/models")).json()["data"][0]
    assert card["root"] == "tiny" and str(engine.model_dir) not in json.dumps(card)


def test_a_non_loopback_bind_without_a_key_warns_loudly(capsys) -> None:
    from agentrl.inference.server import _warn_if_exposed

    _warn_if_exposed("127.0.0.1", None)
    _warn_if_exposed("0.0.0.0", "key")
    assert capsys.readouterr().err == ""
    _warn_if_exposed("0.0.0.0", None)
    assert "WARNING" in capsys.readouterr().err
