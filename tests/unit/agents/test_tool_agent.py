"""Built-in agents with a scripted policy: token bookkeeping, tool handling, every stop reason."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentrl.episode import render_prompt_ids
from agentrl.inference.tiny_model import build_tiny_tokenizer
from agentrl.types import Generation, SamplingParams, StopReason, Task
from agents import (
    INVALID_TOOL,
    AgentContext,
    AgentLimits,
    AgentLoop,
    create_agent,
    get_agent_class,
    list_agents,
    register_agent,
)
from tests.fakes import ScriptedPolicy
from tests.waiting import within
from tools import ToolResult, ToolSet, get_tool, tool


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def call(name: str, **args) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def make_ctx(tok, script, *, tools=None, limits=None, max_tokens=256, **kw) -> AgentContext:
    return AgentContext(
        policy=ScriptedPolicy(tok, script),
        tokenizer=tok,
        tools=ToolSet(tools if tools is not None else [get_tool("calculator")], timeout_s=0.5),
        sampling=SamplingParams(max_tokens=max_tokens),
        limits=limits or AgentLimits(),
        session_id="s0",
        uid="g0",
        **kw,
    )


TASK = Task(prompt="What is 4821 * 37? Use the calculator tool.")


async def test_calculator_episode_is_token_exact(tok):
    script = [call("calculator", expression="4821 * 37"), "The answer is 178377."]
    ctx = make_ctx(tok, script)
    traj = await create_agent("tool_agent").run(TASK, ctx)
    assert traj.stop_reason == StopReason.EOS and traj.num_turns == 2
    assert traj.tool_calls == {"calculator": 1}
    assert traj.messages[-1] == {"role": "assistant", "content": "The answer is 178377."}
    assert traj.messages[2]["role"] == "tool" and traj.messages[2]["content"] == "178377"
    (p1, _, s1), (p2, _, s2) = ctx.policy.requests  # type: ignore[attr-defined]  # ScriptedPolicy
    assert s1 == s2 == "s0"
    schemas = ctx.tools.schemas()  # type: ignore[union-attr]  # set above
    assert p1 == render_prompt_ids(tok, TASK.initial_messages(), schemas) == traj.prompt_ids
    # turn 2's prompt = turn 1's prompt + exactly the generated tokens + the tool delta
    gen1 = [*tok.encode(script[0], add_special_tokens=False), tok.eos_token_id]
    assert p2[: len(p1) + len(gen1)] == p1 + gen1
    full = [
        *TASK.initial_messages(),
        {"role": "assistant", "content": script[0]},
        {"role": "tool", "content": "178377"},
    ]
    assert p2 == render_prompt_ids(tok, full, schemas)
    assert traj.prompt_ids + traj.response_ids[: len(p2) - len(p1)] == p2
    n1, nd = len(gen1), len(p2) - len(p1) - len(gen1)
    gen2 = [*tok.encode(script[1], add_special_tokens=False), tok.eos_token_id]
    assert traj.loss_mask == [1] * n1 + [0] * nd + [1] * len(gen2)
    assert traj.rollout_logprobs[:3] == [-0.05, -0.1, -0.15000000000000002]
    assert all(
        lp == 0.0 for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=False) if m == 0
    )


async def test_malformed_and_unknown_calls_are_answered_and_counted(tok):
    script = [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+</tool_call>'
        + call("nope", x=1),
        "done",
    ]
    ctx = make_ctx(tok, script)
    traj = await create_agent("tool_agent").run(TASK, ctx)
    assert traj.stop_reason == StopReason.EOS
    assert traj.tool_calls == {INVALID_TOOL: 2}
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_msgs[0].startswith("error: unknown tool 'nope'")
    assert tool_msgs[1].startswith("error: malformed tool call #1: invalid JSON")
    assert traj.metrics["tool_calls_malformed"] == 1 and traj.metrics["tool_calls_unknown"] == 1
    # the errors went back to the model: its second prompt contains them
    second_prompt = tok.decode(ctx.policy.requests[1][0])  # type: ignore[attr-defined]  # ScriptedPolicy
    assert "malformed tool call" in second_prompt and "unknown tool" in second_prompt


async def test_tool_error_and_timeout_become_messages(tok):
    @tool
    async def slow(x: int) -> str:
        """Sleep.

        Args:
            x: Anything.
        """
        await asyncio.Event().wait()  # never set: only the call's deadline ends it
        return "never"

    @tool
    def boom() -> str:
        """Raise."""
        raise RuntimeError("kaboom")

    ctx = make_ctx(tok, [call("slow", x=1) + call("boom"), "ok"], tools=[slow, boom])
    traj = await within(create_agent("tool_agent").run(TASK, ctx), "the tool deadline did not fire")
    contents = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert "timed out" in contents[0] and "kaboom" in contents[1]
    assert traj.metrics["tool_errors"] == 2 and traj.metrics["tool_timeouts"] == 1
    assert traj.tool_calls == {"slow": 1, "boom": 1} and traj.stop_reason == StopReason.EOS


async def test_parallel_calls_are_bounded(tok):
    running, peak = 0, 0

    @tool
    async def probe(i: int) -> str:
        """Count concurrency.

        Args:
            i: Call number.
        """
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        running -= 1
        return str(i)

    script = ["".join(call("probe", i=i) for i in range(6)), "done"]
    limits = AgentLimits(max_parallel_calls=2)
    traj = await create_agent("tool_agent").run(
        TASK, make_ctx(tok, script, tools=[probe], limits=limits, max_tokens=2048)
    )
    assert peak == 2 and traj.tool_calls == {"probe": 6}
    # results come back in call order
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == [
        str(i) for i in range(6)
    ]


async def test_tool_stop(tok):
    @tool
    def submit(answer: str) -> ToolResult:
        """Submit the final answer.

        Args:
            answer: The answer.
        """
        return ToolResult(content="submitted", stop=True, reward=1.0)

    @tool
    def noop() -> ToolResult:
        """Do nothing, with a small step reward."""
        return ToolResult(content="ok", reward=0.25)

    script = [call("calculator", expression="1"), call("noop"), call("submit", answer="42"), "x"]
    tools = [get_tool("calculator"), noop, submit]
    traj = await create_agent("tool_agent").run(TASK, make_ctx(tok, script, tools=tools))
    assert traj.stop_reason == StopReason.TOOL_STOP and traj.num_turns == 3
    # one step reward per model turn, 0.0 where its tools gave none
    assert traj.turn_rewards == [0.0, 0.25, 1.0] and traj.messages[-1]["content"] == "submitted"
    assert traj.loss_mask[-1] == 0  # the tool response is recorded after the last model turn


async def test_max_turns(tok):
    limits = AgentLimits(max_turns=3)
    ctx = make_ctx(tok, [call("calculator", expression="1+1")], limits=limits)
    traj = await create_agent("tool_agent").run(TASK, ctx)
    assert traj.stop_reason == StopReason.MAX_TURNS and traj.num_turns == 3
    assert traj.tool_calls == {"calculator": 2}  # the last turn's call is not run
    assert len(ctx.policy.requests) == 3  # type: ignore[attr-defined]  # ScriptedPolicy


async def test_response_budget_stops_with_length(tok):
    limits = AgentLimits(max_response_tokens=150)
    ctx = make_ctx(tok, [call("calculator", expression="1+1")], limits=limits)
    traj = await create_agent("tool_agent").run(TASK, ctx)
    assert traj.stop_reason == StopReason.LENGTH and traj.response_length <= 150
    # every request asked for no more than the remaining budget
    for prompt, sampling, _ in ctx.policy.requests:  # type: ignore[attr-defined]  # ScriptedPolicy
        assert sampling.max_tokens <= 150 - (len(prompt) - len(traj.prompt_ids))


async def test_context_limit_stops_with_length(tok):
    prompt_len = len(
        render_prompt_ids(tok, TASK.initial_messages(), ToolSet([get_tool("calculator")]).schemas())
    )
    limits = AgentLimits(max_context_tokens=prompt_len + 30)
    traj = await create_agent("tool_agent").run(TASK, make_ctx(tok, ["x" * 100], limits=limits))
    assert traj.stop_reason == StopReason.LENGTH
    assert len(traj.prompt_ids) + traj.response_length == prompt_len + 30


async def test_cut_turn_without_call_stops_with_length(tok):
    ctx = make_ctx(tok, ["a long answer that never ends"], max_tokens=5)
    traj = await create_agent("tool_agent").run(TASK, ctx)
    assert traj.stop_reason == StopReason.LENGTH and traj.response_length == 5


async def test_abort_after_resumes_are_used_up(tok):
    ctx = make_ctx(tok, ["abort"])
    traj = await create_agent("tool_agent").run(TASK, ctx)
    assert traj.stop_reason == StopReason.ABORTED and traj.response_length == 0
    assert traj.metrics["abort_resumes"] == 3 and len(ctx.policy.requests) == 4  # type: ignore[attr-defined]  # ScriptedPolicy


async def test_aborted_turn_is_resumed_with_new_weights(tok):
    """A weight push aborts a turn midway; the turn continues, each token keeps its version."""
    text = call("calculator", expression="6*7")
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    first = Generation(
        token_ids=ids[:10], logprobs=[-0.1] * 10, finish_reason="abort", weight_version=4
    )
    rest = Generation(
        token_ids=ids[10:],
        logprobs=[-0.2] * (len(ids) - 10),
        finish_reason="stop",
        weight_version=5,
    )
    ctx = make_ctx(tok, [first, rest, "It is 42."])
    ctx.policy.version = 5  # type: ignore[attr-defined]  # ScriptedPolicy: the last turn's version
    traj = await create_agent("tool_agent").run(TASK, ctx)
    assert traj.stop_reason == StopReason.EOS and traj.num_turns == 2
    assert traj.tool_calls == {"calculator": 1} and traj.metrics["abort_resumes"] == 1
    assert traj.response_ids[: len(ids)] == ids
    assert traj.policy_version[: len(ids)] == [4] * 10 + [5] * (len(ids) - 10)
    assert traj.rollout_logprobs[: len(ids)] == [-0.1] * 10 + [-0.2] * (len(ids) - 10)
    (p1, s1, _), (p2, s2, _), _ = ctx.policy.requests  # type: ignore[attr-defined]  # ScriptedPolicy
    assert p2 == p1 + ids[:10]  # resumed from exactly the tokens generated so far
    assert s2.max_tokens == s1.max_tokens - 10
    assert traj.staleness(current_version=5) == 1  # the oldest sampled token is version 4


async def test_single_turn(tok):
    ctx = make_ctx(tok, [call("calculator", expression="1")])
    traj = await create_agent("single_turn").run(TASK, ctx)
    assert traj.stop_reason == StopReason.EOS and traj.num_turns == 1 and traj.tool_calls == {}
    assert traj.prompt_ids == render_prompt_ids(tok, TASK.initial_messages())  # no tools rendered
    assert all(traj.loss_mask)


def test_registry():
    assert {"single_turn", "tool_agent"} <= set(list_agents())
    with pytest.raises(ValueError, match="unknown agent 'nope'"):
        get_agent_class("nope")
    with pytest.raises(TypeError, match="AgentLoop subclass"):
        register_agent("bad")(object)  # type: ignore[arg-type]  # the point of the test


def _readme_agent_code() -> str:
    """The README's 'Write your own agent' example, exactly as printed there."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme[readme.index("## Write your own agent") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("\n```", start)]


async def test_the_readme_agent_runs_as_printed(tok):
    code = _readme_agent_code()
    assert len(code.strip().splitlines()) <= 25, "keep the README agent short"
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    ctx = make_ctx(tok, [call("lookup", word="agentrl"), "It is an RL library."])
    traj = await create_agent("lookup_agent").run(
        Task(prompt="What is agentrl?", agent="lookup_agent"), ctx
    )
    assert traj.tool_calls == {"lookup": 1} and traj.stop_reason == StopReason.EOS
    assert traj.messages[2]["content"] == "an RL library"


async def test_a_turn_of_only_malformed_calls_is_answered_and_the_episode_goes_on(tok):
    script = ["<tool_call>\n{not json\n</tool_call>", call("calculator", expression="2+2"), "4"]
    ctx = make_ctx(tok, script)
    traj = await create_agent("tool_agent").run(TASK, ctx)
    assert traj.stop_reason == StopReason.EOS and traj.num_turns == 3
    assert traj.tool_calls == {INVALID_TOOL: 1, "calculator": 1}
    assert traj.metrics["tool_calls_malformed"] == 1
    assert traj.messages[2]["role"] == "tool" and traj.messages[2]["content"].startswith("error:")


async def test_malformed_calls_in_the_last_turn_are_answered_and_counted(tok):
    last = call("calculator", expression="1+1") + "<tool_call>\n{broken\n</tool_call>"
    ctx = make_ctx(
        tok, [call("calculator", expression="2+2"), last], limits=AgentLimits(max_turns=2)
    )
    traj = await create_agent("tool_agent").run(TASK, ctx)
    assert traj.stop_reason == StopReason.MAX_TURNS and traj.num_turns == 2
    assert traj.metrics["tool_calls_unrun"] == 1  # the valid call of the last turn: not run
    assert traj.metrics["tool_calls_malformed"] == 1 and traj.tool_calls[INVALID_TOOL] == 1
    assert traj.messages[-1]["role"] == "tool" and traj.messages[-1]["content"].startswith("error:")
    # the answer is environment tokens after the last model turn: never trained on
    assert traj.loss_mask[-1] == 0


async def test_calls_without_tools_are_answered_as_unknown(tok):
    ctx = make_ctx(tok, [call("calculator", expression="2+2"), "done"], tools=[])

    class NoTools(AgentLoop):
        async def run(self, task, ctx):
            ctx.start_episode(task.initial_messages())
            while (turn := await ctx.turn()).stop is None:
                pass
            return ctx.finish(turn.stop)

    traj = await NoTools().run(TASK, ctx)
    assert traj.tool_calls == {INVALID_TOOL: 1} and traj.stop_reason == StopReason.EOS
    assert traj.messages[2]["content"].startswith("error:")


async def test_generate_before_start_is_a_clear_error(tok):
    with pytest.raises(RuntimeError, match="start_episode"):
        await make_ctx(tok, ["x"]).generate()


def test_limits_validate():
    with pytest.raises(ValueError, match=r"agent\.max_turns"):
        AgentLimits(max_turns=0)


async def test_a_resumed_turn_keeps_the_per_token_versions_of_each_part(tok):
    """A kept request crossed a push (versions 4 then 5), was aborted by the next push and resumed
    on 6: every token keeps the version the server reported for it."""
    text = call("calculator", expression="6*7")
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    first = Generation(
        token_ids=ids[:10],
        logprobs=[-0.1] * 10,
        finish_reason="abort",
        weight_version=4,
        token_versions=[4] * 3 + [5] * 7,
    )
    rest = Generation(
        token_ids=ids[10:],
        logprobs=[-0.2] * (len(ids) - 10),
        finish_reason="stop",
        weight_version=6,
    )
    ctx = make_ctx(tok, [first, rest, "It is 42."])
    ctx.policy.version = 6  # type: ignore[attr-defined]  # ScriptedPolicy: the last turn's version
    traj = await create_agent("tool_agent").run(TASK, ctx)
    assert traj.policy_version[: len(ids)] == [4] * 3 + [5] * 7 + [6] * (len(ids) - 10)
    assert traj.min_version == 4


def test_offered_tools_are_named_from_openai_or_bare_schemas():
    from agents.base import _schema_names

    schemas = [
        {"type": "function", "function": {"name": "calculator", "parameters": {}}},
        {"name": "search", "parameters": {}},  # a custom agent's bare schema
        {"type": "function", "function": {"parameters": {}}},  # no name: not a tool to count
    ]
    assert _schema_names(schemas) == ["calculator", "search"]
