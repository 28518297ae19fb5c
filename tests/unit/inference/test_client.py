"""PolicyClient against a scripted in-process server: payloads, versions, retries, errors."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agentrl.inference.client import (
    InferenceError,
    InferenceRequestError,
    InferenceServerError,
    PolicyClient,
    parse_completion,
    parse_weight_version,
)
from agentrl.types import Policy, SamplingParams
from tests.fakes import FakeInferenceServer


def make_client(fake: FakeInferenceServer, **kwargs) -> PolicyClient:
    kwargs.setdefault("backoff_s", 0.001)
    return PolicyClient(fake.url, transport=fake.transport(), **kwargs)


async def test_generate_embedded_style_parses_tokens_logprobs_and_body_version():
    fake = FakeInferenceServer(version=3)
    async with make_client(fake) as client:
        assert isinstance(client, Policy)
        gen = await client.generate(
            [1, 2, 10],
            SamplingParams(max_tokens=3, temperature=0.7, seed=5, stop_token_ids=[9]),
            session_id="ep-1",
        )
    assert gen.token_ids == [11, 12, 13]
    assert gen.logprobs == [-0.5, -0.5, -0.5]
    assert gen.finish_reason == "length"
    assert gen.weight_version == 3
    assert gen.server == fake.url
    assert client.backend == "embedded"
    (req,) = fake.generate_requests
    body = req["body"]
    assert body["prompt"] == [1, 2, 10]
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert body["model"] == "fake-model"
    assert body["temperature"] == 0.7 and body["seed"] == 5 and body["stop_token_ids"] == [9]
    assert "top_k" not in body  # off by default: the server's own default is "off" too
    assert req["headers"]["x-session-id"] == "ep-1"


async def test_concurrent_first_calls_probe_the_server_once():
    fake = FakeInferenceServer(version_in_body=False)
    async with make_client(fake) as client:
        gens = await asyncio.gather(
            *(client.generate([i], SamplingParams(max_tokens=1)) for i in range(10))
        )
    assert [g.token_ids for g in gens] == [[i + 1] for i in range(10)]
    assert fake.paths.count("/v1/models") == 1
    # one backend probe, then a read before and after each of the 10 generations
    assert fake.paths.count("/weight_info") == 1 + 2 * 10


async def test_generate_sends_top_k_only_when_on():
    fake = FakeInferenceServer()
    async with make_client(fake) as client:
        await client.generate([1], SamplingParams(max_tokens=1, top_k=20))
    assert fake.generate_requests[0]["body"]["top_k"] == 20


async def test_vllm_style_version_comes_from_weight_info_and_default_is_zero():
    fake = FakeInferenceServer(version_in_body=False)
    async with make_client(fake) as client:
        gen = await client.generate([4], SamplingParams(max_tokens=2))
        assert client.backend == "vllm"
        assert gen.weight_version == 0
        await client.set_weight_version(7)
        assert fake.control_calls[-1] == ("/update_weight_version", {"new_version": "7"})
        gen = await client.generate([4], SamplingParams(max_tokens=2))
        assert gen.weight_version == 7
        assert client.version_straddles == 0


async def test_vllm_style_straddled_update_reports_the_older_version():
    fake = FakeInferenceServer(version=2, version_in_body=False)
    fake.bump_version_during_generate = True
    async with make_client(fake) as client:
        gen = await client.generate([4], SamplingParams(max_tokens=2))
    assert gen.weight_version == 2  # the older one: staleness is over-, never under-estimated
    assert fake.version == 3
    assert client.version_straddles == 1


async def test_embedded_set_weight_version_sends_an_int():
    fake = FakeInferenceServer()
    async with make_client(fake) as client:
        await client.set_weight_version(4)
    assert fake.control_calls[-1] == ("/update_weight_version", {"version": 4})
    assert fake.version == 4


async def test_retries_connection_errors_then_succeeds():
    fake = FakeInferenceServer()
    async with make_client(fake, max_retries=3) as client:
        await client.generate([1], SamplingParams(max_tokens=1))  # learn model and backend
        fake.fail_next = ["connect", "drop", 503]
        gen = await client.generate([1], SamplingParams(max_tokens=1))
    assert gen.token_ids == [2]
    assert len(fake.generate_requests) == 1 + 4


async def test_gives_up_after_max_retries_with_a_server_error():
    fake = FakeInferenceServer()
    async with make_client(fake, max_retries=2) as client:
        await client.generate([1], SamplingParams(max_tokens=1))
        fake.fail_next = ["connect"] * 5
        with pytest.raises(InferenceServerError) as info:
            await client.generate([1], SamplingParams(max_tokens=1))
    assert info.value.connection_failed
    assert len(fake.generate_requests) == 1 + 3
    assert fake.fail_next == ["connect"] * 2


async def test_5xx_is_retried_and_reported_as_not_a_connection_failure():
    fake = FakeInferenceServer()
    async with make_client(fake, max_retries=1) as client:
        await client.generate([1], SamplingParams(max_tokens=1))
        fake.fail_next = [500, 500]
        with pytest.raises(InferenceServerError) as info:
            await client.generate([1], SamplingParams(max_tokens=1))
    assert info.value.status_code == 500 and not info.value.connection_failed
    assert "scripted HTTP 500" in str(info.value)


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_4xx_is_never_retried_and_carries_the_server_message(status):
    fake = FakeInferenceServer()
    async with make_client(fake, max_retries=5) as client:
        await client.generate([1], SamplingParams(max_tokens=1))
        fake.fail_next = [status, status]
        with pytest.raises(InferenceRequestError) as info:
            await client.generate([1], SamplingParams(max_tokens=1))
    assert info.value.status_code == status
    assert info.value.message == f"scripted HTTP {status}"
    assert len(fake.generate_requests) == 2  # the warm-up and exactly one try
    assert fake.fail_next == [status]


async def test_control_calls_reach_their_endpoints():
    fake = FakeInferenceServer()
    async with make_client(fake) as client:
        assert await client.health()
        await client.pause("abort")
        assert await client.is_paused()
        await client.resume()
        assert not await client.is_paused()
        assert await client.abort_requests() == 0
        assert await client.reset_prefix_cache()
        await client.update_weights_from_path("/weights/v5", 5)
        assert (await client.weight_info())["weight_version"] == 5
        await client.update_weights_from_bytes(b"safetensors-bytes", 6)
        assert await client.weight_version() == 6
        with pytest.raises(ValueError, match="pause mode"):
            await client.pause("later")  # type: ignore[arg-type]
    paths = [p for p, _ in fake.control_calls]
    assert paths == [
        "/pause",
        "/is_paused",
        "/resume",
        "/is_paused",
        "/abort_requests",
        "/reset_prefix_cache",
        "/collective_rpc",
        "/update_weight_version",
        "/update_weights",
    ]
    assert fake.control_calls[0][1] == {"mode": "abort"}
    # The embedded server takes the version with the weights (both change or neither).
    assert fake.control_calls[6][1] == {
        "method": "reload_weights",
        "kwargs": {"weights_path": "/weights/v5", "version": 5},
    }


async def test_update_weights_from_bytes_on_vllm_names_the_shared_dir_transport():
    fake = FakeInferenceServer(version_in_body=False)
    async with make_client(fake) as client:
        with pytest.raises(NotImplementedError, match="shared-directory"):
            await client.update_weights_from_bytes(b"x", 1)
    assert not any(p == "/update_weights" for p, _ in fake.control_calls)


async def test_health_is_false_when_the_server_is_down_and_never_raises():
    fake = FakeInferenceServer()
    fake.alive = False
    async with make_client(fake) as client:
        assert not await client.health()


async def test_real_connection_refused_is_a_connection_failure():
    # Nothing listens on port 9 of localhost in the test environment (discard service).
    async with PolicyClient("http://127.0.0.1:9", max_retries=1, backoff_s=0.001) as client:
        with pytest.raises(InferenceServerError) as info:
            await client.weight_info()
    assert info.value.connection_failed


def test_parse_weight_version():
    assert parse_weight_version(3) == 3
    assert parse_weight_version("12") == 12
    assert parse_weight_version("default") == 0
    with pytest.raises(InferenceError, match="set_weight_version"):
        parse_weight_version("v1.2")
    with pytest.raises(InferenceError):
        parse_weight_version(True)


def test_parse_completion_prefers_token_ids_and_rejects_text_tokens():
    body = {
        "choices": [
            {
                "finish_reason": "stop",
                "token_ids": [5, 6],
                "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0]},
            }
        ]
    }
    assert parse_completion(body) == ([5, 6], [-1.0, -2.0], "stop")
    del body["choices"][0]["token_ids"]
    with pytest.raises(InferenceError, match="return_tokens_as_token_ids"):
        parse_completion(body)
    with pytest.raises(InferenceError, match="no choices"):
        parse_completion({"choices": []})
    bad = {"choices": [{"finish_reason": "stop", "logprobs": {"tokens": ["token_id:1"]}}]}
    with pytest.raises(InferenceError, match="logprobs=0"):
        parse_completion(bad)


def test_constructor_rejects_negative_retries():
    with pytest.raises(ValueError, match="max_retries"):
        PolicyClient("http://x", max_retries=-1)


async def test_timeout_is_not_a_connection_failure():
    async def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    client = PolicyClient("http://slow", transport=httpx.MockTransport(slow), max_retries=0)
    async with client:
        with pytest.raises(InferenceServerError) as info:
            await client.weight_info()
    assert not info.value.connection_failed


async def test_the_api_key_defaults_to_the_environment_and_travels_on_every_request(monkeypatch):
    monkeypatch.setenv("AGENTRL_API_KEY", "from-env")
    fake = FakeInferenceServer()
    async with make_client(fake, timeout_s=42) as client:
        await client.generate([1], SamplingParams(max_tokens=1))
    headers = fake.generate_requests[-1]["headers"]
    assert headers["authorization"] == "Bearer from-env"
    assert headers["x-request-timeout-s"] == "42"  # the server aborts it once we give up
    async with make_client(fake, api_key="explicit") as client:
        await client.generate([1], SamplingParams(max_tokens=1))
    assert fake.generate_requests[-1]["headers"]["authorization"] == "Bearer explicit"


async def test_probe_and_url_loads_are_embedded_only():
    fake = FakeInferenceServer(version=2)
    async with make_client(fake) as client:
        gen = await client.probe([4, 5], temperature=0.5, token_ids=[9, 8])
    assert gen.token_ids == [9, 8] and gen.logprobs == [-0.5, -0.5] and gen.weight_version == 2
    assert fake.probe_requests[-1]["body"]["temperature"] == 0.5
    vllm = FakeInferenceServer(version_in_body=False)
    async with make_client(vllm) as client:
        with pytest.raises(NotImplementedError, match="paused"):
            await client.probe([1])
        with pytest.raises(NotImplementedError, match="shared-directory"):
            await client.update_weights_from_url("http://127.0.0.1:1/w", 1)


def test_parse_token_versions_reads_the_embedded_servers_list_and_checks_it():
    from agentrl.inference.client import parse_token_versions

    body = {"choices": [{"token_versions": [2, 2, "3"]}]}
    assert parse_token_versions(body, 3) == [2, 2, 3]
    assert parse_token_versions({"choices": [{}]}, 3) is None  # vLLM: the body's version
    with pytest.raises(InferenceError, match="3 tokens but token_versions"):
        parse_token_versions({"choices": [{"token_versions": [2, 2]}]}, 3)
    with pytest.raises(InferenceError, match="weight_version"):
        parse_token_versions({"choices": [{"token_versions": [2, "x", 2]}]}, 3)
