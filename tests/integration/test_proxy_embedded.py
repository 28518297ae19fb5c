"""The recording proxy against the real embedded server: an agent written with the stock
``openai`` client records exactly the trajectory the native ``tool_agent`` records for the same
task, seed and server (prompt, response, mask, logprobs as exact floats, versions).

To make the episode multi-turn, the tiny model is first over-fitted (a few dozen Adam steps)
on one calculator conversation, so that it calls the calculator and then answers. The test
asserts that this happened, so it cannot pass vacuously on a single-turn episode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentrl.episode import render_prompt_ids
from agentrl.rollout.calculator_task import CALCULATOR_SYSTEM_PROMPT, generate_sft_conversations
from agentrl.rollout.proxy import RecordingProxy
from agentrl.rollout.rewards import RewardManager
from agentrl.types import SamplingParams, StopReason, Task

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

SEED = 1234
TEMPERATURE = 0.7  # sharp enough that the over-fitted model reliably writes a valid call
MAX_TOKENS = 96
MAX_TURNS = 4
MAX_RESPONSE_TOKENS = 512


def _overfit(model_dir: Path, out_dir: Path, conversation: dict[str, Any], steps: int = 60) -> Path:
    """Train the tiny model on the assistant turns of one conversation; save it to out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    msgs, tools = conversation["messages"], conversation["tools"]
    ids = tok.encode(
        tok.apply_chat_template(msgs, tools=tools, tokenize=False), add_special_tokens=False
    )
    labels = [-100] * len(ids)
    for k, msg in enumerate(msgs):
        if msg["role"] == "assistant":  # the turn's content and its <|im_end|>, not the "\n"
            start = len(render_prompt_ids(tok, msgs[:k], tools))
            upto = tok.apply_chat_template(msgs[: k + 1], tools=tools, tokenize=False)
            end = len(tok.encode(upto, add_special_tokens=False)) - 1
            labels[start:end] = ids[start:end]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread is faster than two fighting
    try:
        torch.manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        x, y = torch.tensor([ids]), torch.tensor([labels])
        for _ in range(steps):
            loss = model(input_ids=x, labels=y).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 0.02, f"over-fitting did not converge (loss {loss.item():.3f})"
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def calculator_setup(tiny_model_dir, tmp_path_factory):
    conv = next(c for c in generate_sft_conversations(20, seed=5) if c["used_tool"])
    model_dir = _overfit(Path(tiny_model_dir), tmp_path_factory.mktemp("calc_model"), conv)
    task = Task(
        id="calc-0",
        prompt=conv["messages"][1]["content"],
        data_source="calculator",
        reward_spec={"ground_truth": conv["messages"][3]["content"]},
    )
    return model_dir, task


async def openai_tool_agent(client: Any, task: Task, toolset: Any) -> None:
    """An agent written against the stock openai client: the tool_agent loop, by hand."""
    messages: list[Any] = [
        {"role": "system", "content": CALCULATOR_SYSTEM_PROMPT},
        {"role": "user", "content": task.prompt},
    ]
    async with toolset.episode() as tools:
        for _ in range(MAX_TURNS):
            resp = await client.chat.completions.create(
                model="tiny",
                messages=messages,
                tools=toolset.schemas(),
                temperature=TEMPERATURE,
                max_tokens=MAX_TOKENS,
                seed=SEED,
            )
            msg = resp.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                return
            for call in msg.tool_calls:
                result = await tools.call(call.function.name, call.function.arguments)
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": result.content}
                )


async def test_openai_client_agent_through_proxy_equals_native_tool_agent(
    calculator_setup, report_metric
):
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    from agentrl.inference.client import PolicyClient
    from agentrl.inference.server import launch_embedded_server
    from agents.base import AgentContext, AgentLimits
    from agents.tool_agent import ToolAgent
    from tools import ToolSet, get_tool

    model_dir, task = calculator_setup
    tok = AutoTokenizer.from_pretrained(model_dir)
    toolset = ToolSet([get_tool("calculator")])
    rewards = RewardManager(sources={"calculator": "calculator"})
    with launch_embedded_server(model_dir) as server:
        async with PolicyClient(server.base_url) as policy:
            ctx = AgentContext(
                policy=policy,
                tokenizer=tok,
                tools=toolset,
                sampling=SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=SEED),
                limits=AgentLimits(max_turns=MAX_TURNS, max_response_tokens=MAX_RESPONSE_TOKENS),
                system_prompt=CALCULATOR_SYSTEM_PROMPT,
                uid="g",
                session_id="native",
            )
            native = await ToolAgent().run(task, ctx)

            async with RecordingProxy(
                policy, tok, max_response_tokens=MAX_RESPONSE_TOKENS
            ) as proxy:
                session = proxy.open_session(task)
                async with AsyncOpenAI(
                    base_url=proxy.session_url(session), api_key="unused", max_retries=0
                ) as client:
                    await openai_tool_agent(client, task, toolset)
                (proxied,) = proxy.finish(session, uid="g")
                assert proxied.data_source == "calculator" and proxied.task_id == task.id
                assert proxy.metrics()["proxy/prefix_breaks"] == 0.0

    # the episode really was multi-turn with a tool call (not a vacuous single turn)
    assert native.num_turns == 2, native.messages
    assert native.tool_calls == {"calculator": 1}, native.messages
    assert native.stop_reason == StopReason.EOS, native.messages
    assert proxied.num_turns == native.num_turns and proxied.tool_calls == native.tool_calls
    assert proxied.stop_reason == native.stop_reason
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "policy_version"):
        assert getattr(proxied, name) == getattr(native, name), name
    scored_native = await rewards.score(native, task)
    scored_proxied = await rewards.score(proxied, task)
    assert scored_proxied.reward == scored_native.reward
    report_metric("proxy_equality/response_tokens", len(native.response_ids))
    report_metric("proxy_equality/reward", scored_native.reward)
