"""The PolicyClient against real servers: a real vLLM server (CPU build) and the embedded server,
the same tests for both (``inference_server`` runs each test once per backend), plus the
vLLM-only parts (launcher, stock openai client, version bracketing across a weight update).

Measured: the max abs difference between the servers' logprobs and a ``transformers`` forward
pass (reported in the terminal summary and as JUnit properties).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from agentrl.inference.client import InferenceRequestError, PolicyClient
from agentrl.inference.tiny_model import build_tiny_model
from agentrl.inference.vllm_backend import attach_vllm_server
from agentrl.types import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

PROMPTS = [
    [1, 2, 3],
    [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100],
    list(range(40, 80)),
    [200, 17, 5, 99, 99, 99, 13],
]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference_logprobs(
    model, prompt_ids: list[int], token_ids: list[int], temperature: float
) -> torch.Tensor:
    """log softmax(logits / T) of each generated token under ``model``: ``[len(token_ids)]``."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


async def test_generate_returns_tokens_logprobs_and_version(inference_server):
    async with PolicyClient(inference_server.base_url) as client:
        assert await client.health()
        version = await client.weight_version()
        gen = await client.generate(
            PROMPTS[1], SamplingParams(max_tokens=12, temperature=1.0, seed=7), session_id="s-1"
        )
        again = await client.generate(
            PROMPTS[1], SamplingParams(max_tokens=12, temperature=1.0, seed=7)
        )
    assert len(gen.token_ids) == len(gen.logprobs) > 0
    assert gen.finish_reason in ("length", "stop")
    assert all(lp <= 0.0 for lp in gen.logprobs)
    assert gen.weight_version == version
    assert gen.server == inference_server.base_url
    assert again.token_ids == gen.token_ids  # same seed, same sample


@pytest.mark.parametrize("temperature", [0.7, 1.0])
async def test_logprobs_match_a_transformers_forward_pass(
    inference_server, hf_model, temperature, report_metric
):
    sampling = SamplingParams(max_tokens=24, temperature=temperature, seed=11)
    async with PolicyClient(inference_server.base_url) as client:
        gens = await asyncio.gather(*(client.generate(p, sampling) for p in PROMPTS))
    diffs = []
    for prompt, gen in zip(PROMPTS, gens, strict=True):
        ref = reference_logprobs(hf_model, prompt, gen.token_ids, temperature)
        diffs.append((ref - torch.tensor(gen.logprobs)).abs().max().item())
    max_diff = max(diffs)
    report_metric(f"max_abs_logprob_diff_T{temperature}", max_diff)
    assert max_diff < 1e-4, f"server logprobs differ from transformers by {max_diff:.2e}"


async def test_bad_request_is_a_4xx_with_the_servers_message(inference_server):
    async with PolicyClient(inference_server.base_url) as client:
        with pytest.raises(InferenceRequestError) as info:
            await client.generate([1, 2], SamplingParams(max_tokens=100_000))
    assert 400 <= info.value.status_code < 500
    assert "max_tokens" in info.value.message or "context" in info.value.message.lower()


async def test_weight_reload_from_a_directory_changes_outputs_and_version(
    inference_server, tiny_model_dir, hf_model, tmp_path, report_metric
):
    other_dir = build_tiny_model(tmp_path / "other", seed=1)
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32).eval()
    sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    prompt = PROMPTS[2]
    async with PolicyClient(inference_server.base_url) as client:
        v0 = await client.weight_version()
        before = await client.generate(prompt, sampling)
        try:
            await client.pause("wait")
            assert await client.is_paused()
            await client.update_weights_from_path(other_dir, v0 + 1)
            await client.reset_prefix_cache()
            await client.resume()
            after = await client.generate(prompt, sampling)
            assert after.weight_version == v0 + 1
            assert await client.weight_version() == v0 + 1
        finally:
            # Put the shared server back on the session's weights, under a new version.
            await client.pause("wait")
            await client.update_weights_from_path(tiny_model_dir, v0 + 2)
            await client.reset_prefix_cache()
            await client.resume()
        restored = await client.generate(prompt, sampling)
    assert (after.token_ids, after.logprobs) != (before.token_ids, before.logprobs)
    # The new logprobs are those of the new weights, not just "different".
    diff = reference_logprobs(other, prompt, after.token_ids, 1.0) - torch.tensor(after.logprobs)
    report_metric("max_abs_logprob_diff_after_reload", diff.abs().max().item())
    assert diff.abs().max().item() < 1e-4
    assert restored.weight_version == v0 + 2
    assert restored.token_ids == before.token_ids
    assert max(abs(a - b) for a, b in zip(restored.logprobs, before.logprobs, strict=True)) < 1e-4


async def test_pause_abort_ends_in_flight_requests_and_resume_serves_again(inference_server):
    # Deterministic: the server is paused (keep) *before* the requests are sent, so none can
    # finish, whatever the machine's speed, and it stays paused while pauses in abort mode end
    # whatever has arrived (a request still on its way is queued, then ended by the next one).
    url = inference_server.base_url
    sampling = SamplingParams(max_tokens=64, temperature=1.0)
    async with PolicyClient(url) as client:
        await client.weight_version()  # the vLLM client brackets generations with this
        await client.pause("keep")
        tasks: list[asyncio.Task] = []
        try:
            tasks = [
                asyncio.create_task(
                    client.generate([i + 1, 7, 9], sampling, extra_body={"ignore_eos": True})
                )
                for i in range(4)
            ]
            deadline = time.monotonic() + 120
            while not all(t.done() for t in tasks):
                assert time.monotonic() < deadline, "the requests were not aborted"
                await client.pause("abort")
                await asyncio.wait(tasks, timeout=0.5)
            gens = [t.result() for t in tasks]
        finally:
            await client.resume()
            for t in tasks:
                t.cancel()
        assert not await client.is_paused()
        short = await client.generate(PROMPTS[0], SamplingParams(max_tokens=4))
    assert [g.finish_reason for g in gens] == ["abort"] * 4
    assert all(len(g.token_ids) < 64 for g in gens)
    assert short.finish_reason in ("length", "stop") and short.token_ids


# ---- vLLM only -----------------------------------------------------------------------------


@pytest.mark.vllm
async def test_vllm_launcher_turns_on_control_endpoints(vllm_server):
    assert attach_vllm_server(vllm_server.base_url + "/") == vllm_server.base_url
    log = vllm_server.log_path.read_text(errors="replace")
    assert "processed_logprobs" in log
    assert vllm_server.is_running()
    async with PolicyClient(vllm_server.base_url) as client:
        assert not await client.is_paused()
        assert isinstance((await client.weight_info())["weight_version"], int)
        with pytest.raises(NotImplementedError, match="shared-directory"):
            await client.update_weights_from_bytes(b"", 1)
        assert client.backend == "vllm"  # learnt from /weight_info's string version


@pytest.mark.vllm
def test_stock_openai_client_gets_token_ids_and_logprobs_from_vllm(vllm_server):
    import openai

    client = openai.OpenAI(base_url=vllm_server.base_url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model,
        prompt=PROMPTS[1],
        max_tokens=8,
        temperature=0.7,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    choice = out.choices[0]
    assert choice.logprobs is not None
    tokens = choice.logprobs.tokens or []
    assert len(tokens) == len(choice.logprobs.token_logprobs or []) > 0
    assert all(t.startswith("token_id:") for t in tokens)
    assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs or [])


@pytest.mark.vllm
async def test_vllm_version_bracketing_detects_a_keep_mode_update(vllm_server):
    """vLLM's /v1/completions carries no version: the client reads /weight_info around the
    request. A request that a keep-mode pause parks across a version change is reported with
    the older version and counted."""
    async with PolicyClient(vllm_server.base_url) as client:
        v0 = await client.weight_version()
        # Deterministic: the request is sent to a paused server (keep), so it cannot run before
        # the version changes; the change waits until the client has read the version it
        # brackets the request with (its first /weight_info read inside generate()).
        read = asyncio.Event()
        plain_read = client.weight_version

        async def traced_read() -> int:
            version = await plain_read()
            read.set()
            return version

        client.weight_version = traced_read  # type: ignore[method-assign]  # observe the read
        await client.pause("keep")
        try:
            parked = asyncio.create_task(
                client.generate(
                    PROMPTS[0], SamplingParams(max_tokens=32), extra_body={"ignore_eos": True}
                )
            )
            await asyncio.wait_for(read.wait(), timeout=60)
            await client.set_weight_version(v0 + 1)
        finally:
            await client.resume()
        gen = await asyncio.wait_for(parked, timeout=600)
        assert len(gen.token_ids) == 32  # it was parked, not aborted, and finished afterwards
        assert gen.weight_version == v0
        assert client.version_straddles == 1
        after = await client.generate(PROMPTS[0], SamplingParams(max_tokens=2))
        assert after.weight_version == v0 + 1
