"""The embedded server over real HTTP (a subprocess), driven by the stock ``openai`` client.

Shows: chat with tools returns parsed ``tool_calls`` (the model is overfit to emit one);
completions with token-id prompts return logprobs equal to a ``transformers`` forward pass at
the same temperature (float32, within 1e-4) while requests are batched; weight updates from a
directory, a streamed body and vLLM's ``collective_rpc`` change the outputs and the version;
the request log holds the exact token ids.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import httpx
import openai  # a dev dependency: missing it must fail, never skip
import pytest
import torch

from agentrl.inference.chat import render_chat
from agentrl.inference.handle import ServerStartError
from agentrl.inference.server import launch_embedded_server
from agentrl.inference.tiny_model import build_tiny_model, tiny_tokenizer

pytestmark = pytest.mark.integration


MODEL_NAME = "tiny-tools"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]
TARGET = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>'


def _overfit_tool_model(base: Path, out: Path) -> Path:
    """Fine-tune the tiny model until it answers MESSAGES with a calculator tool call."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer(base)
    prompt = render_chat(tok, MESSAGES, TOOLS)
    target = tok.encode(TARGET, add_special_tokens=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ids = torch.tensor([prompt + target])
    labels = torch.tensor([[-100] * len(prompt) + target])
    for _ in range(200):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.005:
            break
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("embedded_models")
    return {
        "tools": _overfit_tool_model(tiny_model_dir, tmp / "tools"),
        "other": build_tiny_model(tmp / "other", seed=42),
    }


@pytest.fixture(scope="module")
def server(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("embedded_server")
    with launch_embedded_server(
        models["tools"],
        log_path=tmp / "server.log",
        request_log=tmp / "requests.jsonl",
        extra_args=["--served-model-name", MODEL_NAME, "--max-batch-size", "16"],
        startup_timeout_s=300,
    ) as handle:
        handle.request_log = tmp / "requests.jsonl"  # type: ignore[attr-defined]  # test convenience
        yield handle
    assert not handle.is_running()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300
    )


def _log_rows(server) -> list[dict]:
    return [json.loads(x) for x in server.request_log.read_text().splitlines()]


def test_openai_chat_with_tools_returns_tool_calls(server, client, models) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=TOOLS,
        temperature=0,
        max_tokens=120,
        logprobs=True,
        user="session-abc",
        extra_body={"return_token_ids": True},
    )
    assert raw.headers["x-weight-version"] == "0"
    resp = raw.parse()
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and calls[0].function.name == "calculator"
    assert json.loads(calls[0].function.arguments) == {"expression": "2+3"}
    assert (
        choice.logprobs is not None and len(choice.logprobs.content) == resp.usage.completion_tokens
    )
    extra = resp.model_extra or {}
    assert extra["weight_version"] == 0
    # The request log has the exact prompt the template renders and the exact output ids.
    tok = tiny_tokenizer(models["tools"])
    row = _log_rows(server)[-1]
    assert row["session_id"] == "session-abc"
    assert row["prompt_ids"] == render_chat(tok, MESSAGES, TOOLS)
    assert row["output_ids"] == tok.encode(TARGET, add_special_tokens=False)
    assert row["output_ids"] == (choice.model_extra or {})["token_ids"]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_concurrent_completion_logprobs_match_transformers(
    server, client, models, temperature: float, report_metric
) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [[(11 * i + 3 * j) % 256 for j in range(2 + 9 * i)] for i in range(6)]
    steps_before = _metric(server, "agentrl_decode_steps")

    def one(i: int):
        return client.completions.create(
            model=MODEL_NAME,
            prompt=prompts[i],
            max_tokens=12 + 4 * i,
            temperature=temperature,
            seed=1000 + i,
            logprobs=0,
            extra_body={"return_tokens_as_token_ids": True, "stop_token_ids": []},
        )

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, range(len(prompts))))
    steps = _metric(server, "agentrl_decode_steps") - steps_before

    model = AutoModelForCausalLM.from_pretrained(models["tools"], dtype=torch.float32).eval()
    worst, total_tokens = 0.0, 0
    for prompt, res in zip(prompts, results, strict=True):
        lp = res.choices[0].logprobs
        out = [int(t.removeprefix("token_id:")) for t in lp.tokens]
        assert out, "every request generated at least one token"
        total_tokens += len(out)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits.float() / temperature, -1)
        ref = ref.gather(-1, torch.tensor(out)[:, None])[:, 0]
        diff = (ref - torch.tensor(lp.token_logprobs)).abs().max().item()
        worst = max(worst, diff)
        assert (res.model_extra or {})["weight_version"] == 0
    report_metric(f"max_abs_logprob_diff_T{temperature}", worst)
    report_metric(f"tokens_per_decode_step_T{temperature}", total_tokens / max(steps, 1))
    assert worst < 1e-4
    # Batched: fewer decode steps than tokens decoded one by one would need.
    assert steps < total_tokens - len(prompts)


def _metric(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


def test_weight_updates_change_outputs_and_version(server, models) -> None:
    base = server.base_url
    probe = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0, "logprobs": 0}

    def complete() -> tuple[list[float], int, str]:
        r = httpx.post(base + "/v1/completions", json=probe, timeout=120)
        r.raise_for_status()
        body = r.json()
        return (
            body["choices"][0]["logprobs"]["token_logprobs"],
            body["weight_version"],
            r.headers["x-weight-version"],
        )

    lp0, v0, h0 = complete()
    info0 = httpx.get(base + "/weight_info", params={"checksum": "true"}, timeout=60).json()
    assert v0 == 0 and h0 == "0"

    # 1) from a directory (pause -> update -> resume, as the checkpoint engine does)
    assert httpx.post(base + "/pause", timeout=60).status_code == 200
    r = httpx.post(
        base + "/update_weights_from_path", json={"path": str(models["other"])}, timeout=120
    )
    assert r.status_code == 200 and r.json()["weight_version"] == 1
    httpx.post(base + "/reset_prefix_cache", timeout=30).raise_for_status()
    assert httpx.post(base + "/resume", timeout=60).status_code == 200
    lp1, v1, h1 = complete()
    assert (v1, h1) == (1, "1") and lp1 != lp0
    info1 = httpx.get(base + "/weight_info", params={"checksum": "true"}, timeout=60).json()
    assert info1["version"] == 1 and info1["checksum"] != info0["checksum"]

    # 2) streamed safetensors body back to the original weights, explicit version
    body = (models["tools"] / "model.safetensors").read_bytes()
    r = httpx.post(
        base + "/update_weights", content=body, headers={"x-weight-version": "5"}, timeout=120
    )
    assert r.status_code == 200 and r.json()["weight_version"] == 5
    lp5, v5, _ = complete()
    assert v5 == 5 and lp5 == pytest.approx(lp0, abs=1e-6)
    assert (
        httpx.get(base + "/weight_info", params={"checksum": "true"}, timeout=60).json()["checksum"]
        == info0["checksum"]
    )

    # 3) vLLM's collective_rpc reload_weights, then restore and reset the version
    r = httpx.post(
        base + "/collective_rpc",
        json={"method": "reload_weights", "kwargs": {"weights_path": str(models["other"])}},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["weight_version"] == 6
    lp6, v6, _ = complete()
    assert v6 == 6 and lp6 == pytest.approx(lp1, abs=1e-6)
    # versions only grow (issue 21): going back to 0 is refused unless it says rollback
    r = httpx.post(
        base + "/update_weights_from_path",
        json={"path": str(models["tools"]), "version": 0},
        timeout=120,
    )
    assert r.status_code == 409 and "not greater than the served version 6" in r.text
    httpx.post(
        base + "/update_weights_from_path",
        json={"path": str(models["tools"]), "version": 7},
        timeout=120,
    ).raise_for_status()
    assert httpx.post(base + "/update_weight_version", json={"version": 0}).status_code == 409
    httpx.post(
        base + "/update_weight_version", json={"version": 0, "rollback": True}, timeout=60
    ).raise_for_status()
    assert complete()[1] == 0


def test_client_errors_over_http_are_4xx(server, client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt=[1, 2], max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=[1, 10**7], max_tokens=1)
    assert e.value.body["param"] == "prompt"  # type: ignore[index]  # openai gives the error dict
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_launch_failure_reports_the_log(tmp_path: Path) -> None:
    with pytest.raises(ServerStartError, match="exited"):
        launch_embedded_server(tmp_path / "no-such-model", startup_timeout_s=120)
