"""The agent loop against the real embedded server over HTTP.

A tiny model is fine-tuned (a few SFT steps, in the fixture) to answer one calculator question
with a hermes tool call and then the answer, so that a real server produces a real multi-turn
tool episode at temperature 0. The server's ``--request-log`` shows exactly which tokens it was
sent and which it generated; the tests assert that each turn's prompt is the previous prompt plus
exactly the generated tokens plus the tool delta, and that the trajectory's masks, logprobs and
versions line up with what the server returned.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentrl.episode import render_prompt_ids
from agentrl.inference.client import PolicyClient
from agentrl.inference.server import launch_embedded_server
from agentrl.inference.tiny_model import tiny_tokenizer
from agentrl.rollout.manager import AgentLoopManager, WorkerConfig
from agentrl.types import Generation, SamplingParams, StopReason, Task, Trajectory
from agents import INVALID_TOOL, AgentLimits, AgentLoop, register_agent
from tools import ToolSet, tool
from tools.calculator import evaluate, format_number

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

QUESTION = "What is 4821 * 37?"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 37"}}\n</tool_call>'
ANSWER = "The answer is 178377."


def make_calculator(behavior: str = "real"):
    """A calculator tool with a short schema; ``behavior`` changes only what it does."""

    @tool(name="calculator", description="Evaluate arithmetic.")
    async def calculator(expression: str) -> str:
        """Evaluate arithmetic.

        Args:
            expression: The expression.
        """
        if behavior == "raise":
            raise ZeroDivisionError("division by zero")
        if behavior == "hang":
            await asyncio.sleep(30)
        return format_number(evaluate(expression))

    return calculator


def tools_for(behavior: str = "real") -> ToolSet:
    return ToolSet([make_calculator(behavior)], timeout_s=0.5)


@pytest.fixture(scope="module")
def sft_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after a few SFT steps on the calculator conversation (memorized)."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.training.sft import SFTSettings, train_sft

    tok = tiny_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    conv = {
        "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": CALL},
            {"role": "tool", "content": "178377"},
            {"role": "assistant", "content": ANSWER},
        ],
        "tools": tools_for().schemas(),
    }
    settings = SFTSettings(steps=40, batch_size=1, lr=1e-2, warmup_steps=3, max_seq_len=2048)
    train_sft(model, tok, [conv], settings)
    out = tmp_path_factory.mktemp("sft") / "calc-model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(sft_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("server") / "requests.jsonl"
    handle = launch_embedded_server(
        sft_model_dir, request_log=log, extra_args=["--max-batch-size", "64"]
    )
    handle.request_log = log  # type: ignore[attr-defined]  # remembered for the tests
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def tok(sft_model_dir: Path) -> Any:
    return tiny_tokenizer(sft_model_dir)


class RecordingClient:
    """Wraps the real PolicyClient and keeps every Generation the server returned."""

    def __init__(self, client: PolicyClient) -> None:
        self.client = client
        self.generations: dict[str | None, list[Generation]] = {}

    async def generate(self, prompt_ids, sampling, session_id=None) -> Generation:
        gen = await self.client.generate(prompt_ids, sampling, session_id)
        self.generations.setdefault(session_id, []).append(gen)
        return gen


def requests_of(server: Any, session_id: str) -> list[dict[str, Any]]:
    lines = Path(server.request_log).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("session_id") == session_id]


def greedy(max_tokens: int = 128) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


async def run(server: Any, tok: Any, tasks: list[Task], *, behavior: str = "real", **cfg: Any):
    async with PolicyClient(server.base_url) as client:
        policy = RecordingClient(client)
        config = WorkerConfig(sampling=cfg.pop("sampling", greedy()), **cfg)
        mgr = AgentLoopManager(policy, tok, tools=tools_for(behavior), config=config)
        out = await mgr.generate(tasks)
        return out, policy, mgr


def assert_token_exact(traj: Trajectory, reqs: list[dict[str, Any]], gens: list[Generation]):
    """Each request's prompt = previous prompt + its output + the delta; the trajectory agrees."""
    assert len(reqs) == len(gens) == traj.num_turns
    assert reqs[0]["prompt_ids"] == traj.prompt_ids
    pos = 0  # position in traj.response_ids
    for k, (req, gen) in enumerate(zip(reqs, gens, strict=True)):
        out = req["output_ids"]
        assert out == gen.token_ids
        n = len(out)
        assert traj.response_ids[pos : pos + n] == out
        assert traj.loss_mask[pos : pos + n] == [1] * n
        assert traj.rollout_logprobs[pos : pos + n] == gen.logprobs
        assert traj.policy_version[pos : pos + n] == [gen.weight_version] * n
        pos += n
        if k + 1 < len(reqs):
            nxt = reqs[k + 1]["prompt_ids"]
            prev = req["prompt_ids"] + out
            assert nxt[: len(prev)] == prev, f"turn {k + 1}: earlier tokens changed"
            delta = nxt[len(prev) :]
            assert traj.response_ids[pos : pos + len(delta)] == delta
            assert traj.loss_mask[pos : pos + len(delta)] == [0] * len(delta)
            assert traj.rollout_logprobs[pos : pos + len(delta)] == [0.0] * len(delta)
            pos += len(delta)
    assert (
        traj.prompt_ids + traj.response_ids[:pos] == reqs[-1]["prompt_ids"] + reqs[-1]["output_ids"]
    )


async def test_multi_turn_calculator_episode_is_token_exact(server, tok):
    task = Task(id="calc", prompt=QUESTION)
    (traj,), policy, _ = await run(server, tok, [task])
    assert traj.stop_reason == StopReason.EOS, traj.messages
    assert traj.tool_calls == {"calculator": 1} and traj.num_turns == 2
    assert traj.messages[2]["content"] == "178377"
    assert traj.messages[-1]["content"] == ANSWER
    sid = f"{traj.uid}/0"
    reqs, gens = requests_of(server, sid), policy.generations[sid]
    assert_token_exact(traj, reqs, gens)
    # the prompt the server saw at turn 2 is what the chat template renders for the whole
    # conversation: nothing was re-tokenized differently
    full = [*task.initial_messages(), {"role": "assistant", "content": CALL}]
    full.append({"role": "tool", "content": "178377"})
    assert reqs[1]["prompt_ids"] == render_prompt_ids(tok, full, tools_for().schemas())
    assert all(g.weight_version == gens[0].weight_version >= 0 for g in gens)
    assert all(lp <= 0.0 for lp in gens[0].logprobs)


async def test_tool_error_is_shown_to_the_model(server, tok):
    (traj,), policy, _ = await run(
        server,
        tok,
        [Task(id="err", prompt=QUESTION)],
        behavior="raise",
        limits=AgentLimits(max_turns=2),
    )
    assert traj.messages[2]["content"].startswith("error: ZeroDivisionError: division by zero")
    assert traj.metrics["tool_errors"] == 1 and traj.tool_calls == {"calculator": 1}
    assert traj.stop_reason in (StopReason.EOS, StopReason.MAX_TURNS, StopReason.LENGTH)
    sid = f"{traj.uid}/0"
    assert_token_exact(traj, requests_of(server, sid), policy.generations[sid])
    assert "division by zero" in tok.decode(requests_of(server, sid)[1]["prompt_ids"])


async def test_tool_timeout_is_shown_to_the_model(server, tok):
    (traj,), policy, _ = await run(
        server,
        tok,
        [Task(id="hang", prompt=QUESTION)],
        behavior="hang",
        limits=AgentLimits(max_turns=2),
    )
    assert "timed out after 0.5 s" in traj.messages[2]["content"]
    assert traj.metrics["tool_timeouts"] == 1
    sid = f"{traj.uid}/0"
    assert_token_exact(traj, requests_of(server, sid), policy.generations[sid])


async def test_malformed_call_cut_by_max_tokens(server, tok):
    """A turn cut inside its tool call: a counted malformed call, the turn closed by <|im_end|>."""
    (traj,), policy, _ = await run(
        server,
        tok,
        [Task(id="cut", prompt=QUESTION)],
        sampling=greedy(max_tokens=30),
        limits=AgentLimits(max_turns=2),
    )
    assert traj.tool_calls == {INVALID_TOOL: 1} and traj.metrics["tool_calls_malformed"] == 1
    assert "not closed by </tool_call>" in traj.messages[2]["content"]
    sid = f"{traj.uid}/0"
    reqs, gens = requests_of(server, sid), policy.generations[sid]
    assert gens[0].finish_reason == "length" and len(gens[0].token_ids) == 30
    assert_token_exact(traj, reqs, gens)
    # the closing <|im_end|> follows the cut turn with mask 0
    assert traj.response_ids[30] == tok.eos_token_id and traj.loss_mask[30] == 0


@register_agent("raises_after_one_turn")
class RaisesAfterOneTurn(AgentLoop):
    async def run(self, task, ctx):
        ctx.start_episode(task.initial_messages())
        await ctx.generate()
        raise RuntimeError("agent bug after a real turn")


async def test_raising_agent_keeps_what_the_server_generated(server, tok):
    task = Task(id="boom", prompt=QUESTION, agent="raises_after_one_turn")
    (traj,), policy, mgr = await run(server, tok, [task])
    assert traj.stop_reason == StopReason.ERROR
    assert traj.error == "RuntimeError: agent bug after a real turn"
    sid = f"{traj.uid}/0"
    assert_token_exact(traj, requests_of(server, sid), policy.generations[sid])
    assert mgr.stats()["rollout/errors"] == 1


async def test_two_hundred_concurrent_episodes_complete(server, tok, report_metric):
    import time

    tasks = [
        Task(id=f"c{i}", prompt=f"Say something {i}.", agent="single_turn") for i in range(200)
    ]
    async with PolicyClient(server.base_url) as client:
        mgr = AgentLoopManager(
            client,
            tok,
            config=WorkerConfig(sampling=SamplingParams(max_tokens=8, seed=1)),
            max_concurrency=200,
        )
        start = time.perf_counter()
        out = await mgr.generate(tasks)
        report_metric("200_episodes_wall_s", time.perf_counter() - start)
    assert len(out) == 200 and len({t.uid for t in out}) == 200
    assert all(t.stop_reason in (StopReason.EOS, StopReason.LENGTH) for t in out)
    assert all(0 < t.num_sampled_tokens <= 8 for t in out)
    s = mgr.stats()
    assert s["rollout/finished"] == 200 and s.get("rollout/dropped", 0) == 0
