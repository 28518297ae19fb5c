"""The environment contract (agents/environment.py) with a scripted policy, through the real
worker and reward manager: state per episode, tools bound to it under the run's limits, answers
to plain turns, the end, the final state scored, and the per-tool counts of a step."""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path

import pytest

from agentrl.inference.tiny_model import build_tiny_tokenizer
from agentrl.registry import RegistryError
from agentrl.rollout.rewards import RewardManager
from agentrl.rollout.worker import AgentLoopWorker, WorkerConfig
from agentrl.training.metrics import compute_reward_component_metrics, compute_tool_metrics
from agentrl.types import SamplingParams, StopReason, Task
from agentrl.user_code import import_user_modules
from agents import (
    AgentContext,
    AgentLimits,
    AgentLoop,
    Environment,
    EnvironmentReward,
    get_environment_class,
    register_environment,
)
from agents.environment import check_environment
from tests.fakes import ScriptedPolicy
from tools import ToolSet, tool

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "secret_number"


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def game():
    import_user_modules(["game.py"], str(EXAMPLE))
    return get_environment_class("secret_number")


def call(name: str, **args) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def task(target: int, i: int = 0) -> Task:
    return Task(
        id=f"t{i}", prompt="Find the number.", data_source="secret_number", extra={"target": target}
    )


def worker(tok, script, *, toolset: ToolSet, max_turns: int = 6) -> AgentLoopWorker:
    rewards = RewardManager(sources={"secret_number": EnvironmentReward("secret_number")})
    return AgentLoopWorker(
        ScriptedPolicy(tok, script),
        tok,
        tools=toolset,
        reward=rewards,
        config=WorkerConfig(
            sampling=SamplingParams(max_tokens=64),
            limits=AgentLimits(max_turns=max_turns, max_response_tokens=2048),
            default_agent="environment",
            agent_kwargs={"environment": {"name": "secret_number"}},
        ),
    )


async def test_the_example_game_is_played_scored_and_counted(tok, game) -> None:
    script = [call("probe", x=8), call("probe", x=4), call("probe", x=6)]
    w = worker(tok, script, toolset=ToolSet([], timeout_s=5, max_output_chars=100))
    a, b = await asyncio.gather(
        w.run_episode(task(6, 0), "g0", 0), w.run_episode(task(4, 1), "g1", 0)
    )
    assert a is not None and b is not None
    # each episode has its own state: one target found on the 3rd probe, the other on the 2nd
    assert a.stop_reason is StopReason.TOOL_STOP and a.env_state == {
        "done": False,
        "target": 6,
        "probes": 3,
        "found": True,
    }
    assert [m["content"] for m in a.messages if m["role"] == "tool"] == [
        "lower",
        "higher",
        "correct",
    ]
    assert b.env_state["probes"] == 2 and b.env_state["found"]
    assert a.reward == pytest.approx(0.9) and b.reward == pytest.approx(0.95)
    m = compute_tool_metrics([a, b])
    assert m["tools/probe/calls"] == 5 and m["tools/probe/errors"] == 0
    assert m["tools/probe/timeouts"] == 0 and m["tools/probe/latency_max_s"] >= 0
    assert compute_reward_component_metrics([a, b]) == {
        "reward/secret_number/correct/mean": 1.0,
        "reward/secret_number/probes/mean": 2.5,
    }
    # the worker's ToolSet counted the environment's calls too (the run's counters)
    assert w.tools is not None and w.tools.metrics()["tools/probe/calls"] == 5


async def test_a_tool_the_model_never_calls_is_counted_as_zero_calls(tok, game) -> None:
    # A user whose model never calls their tool sees tools/<name>/calls = 0, not no metric
    w = worker(tok, ["I think it is 5."], toolset=ToolSet([], timeout_s=5, max_output_chars=100))
    traj = await w.run_episode(task(6), "g", 0)
    assert traj is not None and traj.tool_calls == {}
    assert traj.tool_stats == {
        "probe": {
            "calls": 0.0,
            "errors": 0.0,
            "timeouts": 0.0,
            "latency_s": 0.0,
            "latency_max_s": 0.0,
        }
    }
    m = compute_tool_metrics([traj])
    assert m["tools/probe/calls"] == 0 and m["tools/probe/latency_mean_s"] == 0


async def test_environment_tools_run_under_the_configs_limits(tok) -> None:
    @register_environment("slow_and_verbose")
    class Slow(Environment):
        def __init__(self, task):
            self.n = 0

        @tool
        async def wait(self) -> str:
            """Never answers in time."""
            await asyncio.sleep(30)
            return "late"

        @tool
        def talk(self) -> str:
            """Says too much."""
            self.n += 1
            return "x" * 500

    toolset = ToolSet([], timeout_s=0.05, max_output_chars=60)
    w = worker(tok, [call("wait"), call("talk"), "done"], toolset=toolset)
    w.reward = None
    w.config.agent_kwargs = {"environment": {"name": "slow_and_verbose"}}
    traj = await w.run_episode(task(1), "g", 0)
    assert traj is not None and traj.stop_reason is StopReason.EOS
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_msgs[0].startswith("error: tool 'wait' timed out after 0.05 s")
    assert tool_msgs[1] == "x" * 60 + "...[truncated 440 chars]"
    assert traj.tool_stats["wait"]["timeouts"] == 1 and traj.tool_stats["talk"]["errors"] == 0
    assert traj.env_state == {"done": False, "n": 1}


async def test_an_agents_own_tools_keep_the_configs_limits_and_counters(tok) -> None:
    # The bug of issue 23: ctx.tool_episode([...]) built a fresh ToolSet with class defaults.
    @tool
    def shout(word: str) -> str:
        """Repeat a word."""
        return word * 100

    class Shouter(AgentLoop):
        async def run(self, task, ctx):
            ctx.start_episode(task.initial_messages(), tools=[shout.schema()])
            async with ctx.tool_episode([shout]) as tools:
                while (turn := await ctx.turn(tools)).stop is None:
                    pass
                return ctx.finish(turn.stop)

    run_tools = ToolSet([], timeout_s=1, max_output_chars=10)
    ctx = AgentContext(
        policy=ScriptedPolicy(tok, [call("shout", word="hey"), "ok"]),
        tokenizer=tok,
        tools=run_tools,
    )
    traj = await Shouter().run(Task(prompt="go"), ctx)
    assert (
        traj.messages[2]["content"].startswith("heyheyhey")
        and "truncated" in traj.messages[2]["content"]
    )
    assert len(traj.messages[2]["content"].split("...")[0]) == 10
    assert run_tools.metrics()["tools/shout/calls"] == 1


async def test_respond_answers_plain_turns_and_done_ends_the_episode(tok) -> None:
    @register_environment("twenty_questions")
    class Questions(Environment):
        def __init__(self, task, answer: str = "cat"):
            self.answer = answer
            self.asked = 0

        async def respond(self, text):
            self.asked += 1
            if self.answer in text:
                self.done = True
                return "you got it"
            return "no"

        @staticmethod
        def reward(state, task):
            return float(state["done"])

    kinds = {"environment": {"name": "twenty_questions", "kwargs": {"answer": "owl"}}}
    w = worker(tok, ["is it a dog?", "is it an owl?"], toolset=ToolSet([]))
    w.config.agent_kwargs = kinds
    w.reward = RewardManager(sources={"q": EnvironmentReward("twenty_questions")})
    traj = await w.run_episode(Task(prompt="guess", data_source="q"), "g", 0)
    assert traj is not None and traj.stop_reason is StopReason.EOS and traj.num_turns == 2
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "user", "assistant"]
    assert traj.messages[2]["content"] == "no"
    assert traj.env_state["done"] and traj.env_state["asked"] == 2 and traj.reward == 1.0
    # a player that never finds it runs out of turns
    w2 = worker(tok, ["a dog?"], toolset=ToolSet([]), max_turns=3)
    w2.config.agent_kwargs, w2.reward = kinds, None
    t2 = await w2.run_episode(Task(prompt="guess"), "g", 0)
    assert t2 is not None and t2.stop_reason is StopReason.MAX_TURNS and t2.num_turns == 3


def test_a_tool_method_is_still_the_method_and_pickles_by_reference(game) -> None:
    env = game(task(5))
    assert env.probe(3).content == "higher" and env.probes == 1
    assert [t.name for t in env.tools()] == ["probe"]
    assert env.tools()[0].schema()["function"]["parameters"]["properties"] == {
        "x": {"type": "integer", "description": "Your guess."}
    }
    reward = pickle.loads(pickle.dumps(EnvironmentReward("secret_number")))
    assert reward.spec == "secret_number"


def test_a_tool_method_parameter_without_a_type_is_refused() -> None:
    with pytest.raises(TypeError, match=r"parameter 'x' has no type annotation.*x: int"):

        class Bad(Environment):
            @tool
            def probe(self, x) -> str:  # type: ignore[no-untyped-def]  # the mistake
                return str(x)


def test_an_environment_reward_of_the_wrong_arity_is_refused() -> None:
    class OneArg(Environment):
        @staticmethod
        def reward(state):  # type: ignore[no-untyped-def]  # the mistake: no task
            return 1.0

    with pytest.raises(RegistryError, match=r"must take \(state, task\).*@staticmethod"):
        _check_class(OneArg)


def _check_class(cls: type[Environment]) -> None:
    name = f"arity_{id(cls)}"
    register_environment(name)(cls)
    check_environment(name, {})


def test_environment_kwargs_that_do_not_fit_are_refused(game) -> None:
    with pytest.raises(RegistryError, match=r"environment.kwargs \{'level': 3\} do not fit"):
        check_environment("secret_number", {"level": 3})


async def test_the_readme_environment_runs_as_printed(tok) -> None:
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    section = readme[readme.index("## Write your own environment") :]
    start = section.index("```python\n") + len("```python\n")
    code = section[start : section.index("\n```", start)]
    assert len(code.strip().splitlines()) <= 30, "keep the README environment short"
    exec(compile(code, "README.md", "exec"), {})
    w = worker(tok, [call("probe", x=2), call("probe", x=3)], toolset=ToolSet([]))
    w.config.agent_kwargs = {"environment": {"name": "guess_number"}}
    w.reward = RewardManager(sources={"g": EnvironmentReward("guess_number")})
    traj = await w.run_episode(Task(prompt="go", data_source="g", extra={"target": 3}), "g", 0)
    assert traj is not None and traj.stop_reason is StopReason.TOOL_STOP and traj.reward == 1.0
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["higher", "correct"]
