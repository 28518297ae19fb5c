"""Episode traces (agentrl/traces.py): the span plan built from what the recorder saw."""

from __future__ import annotations

from agentrl.episode import EpisodeRecorder
from agentrl.traces import episode_plan
from agentrl.types import Generation, StopReason


def _clock(times: list[float]):
    it = iter(times)
    return lambda: next(it)


def _episode():
    # t=10 start; model turn ends 11.5; tool answer at 12.0; resumed model turn 12.4 + 12.9
    rec = EpisodeRecorder([1, 2, 3], clock=_clock([10.0, 11.5, 12.0, 12.4, 12.9]))
    rec.add_generation(
        Generation(token_ids=[5, 6, 7], logprobs=[-0.1] * 3, finish_reason="stop", weight_version=3)
    )
    rec.add_environment_tokens([8, 9])
    rec.add_generation(
        Generation(token_ids=[10], logprobs=[-0.2], finish_reason="abort", weight_version=3)
    )
    rec.add_generation(
        Generation(token_ids=[11, 12], logprobs=[-0.3] * 2, finish_reason="stop", weight_version=4),
        continue_turn=True,
    )
    messages = [
        {"role": "user", "content": "what is 2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    return rec.to_trajectory(
        uid="u1",
        reward=1.0,
        reward_info={"parsed": "5"},
        messages=messages,
        tool_calls={"calc": 1},
        stop_reason=StopReason.EOS,
        timings={"reward": 0.25, "total": 3.0},
    )


def test_recorder_keeps_each_turn_with_its_time_tokens_and_version() -> None:
    traj = _episode()
    got = [(t.kind, t.start, t.end, t.tokens, t.version, t.finish_reason) for t in traj.turns]
    assert got == [
        ("model", 10.0, 11.5, 3, 3, "stop"),
        ("environment", 11.5, 12.0, 2, -1, None),
        ("model", 12.0, 12.9, 3, 4, "stop"),  # the resumed turn is one turn, last version
    ]


def test_plan_has_a_span_per_turn_tool_and_reward() -> None:
    plan = episode_plan(_episode(), step=7)
    assert (plan.name, plan.span_type, plan.start) == ("episode", "AGENT", 10.0)
    assert plan.attributes["step"] == 7 and plan.attributes["weight_versions"] == [3, 4]
    assert plan.inputs == [{"role": "user", "content": "what is 2+3?"}]
    assert plan.outputs == {"role": "assistant", "content": "5"}
    names = [(c.name, c.span_type) for c in plan.children]
    assert names == [
        ("model turn 1", "LLM"),
        ("tool: calc", "TOOL"),
        ("model turn 2", "LLM"),
        ("reward", "UNKNOWN"),
    ]
    tool = plan.children[1]
    assert tool.outputs == [{"role": "tool", "content": "5"}]
    assert tool.attributes == {"tokens": 2, "latency_s": 0.5}
    reward = plan.children[3]
    assert (reward.start, reward.end) == (12.9, 13.15)
    assert reward.outputs == {"reward": 1.0, "reward_info": {"parsed": "5"}}
    assert plan.end == 13.15  # later than the turns + the reward; total (3 s) ends at 13.0


def test_long_messages_are_clipped_and_episodes_without_turns_still_plan() -> None:
    traj = _episode().model_copy(
        update={"turns": [], "messages": [{"role": "user", "content": "x" * 50_000}]}
    )
    plan = episode_plan(traj)
    assert len(plan.inputs[0]["content"]) < 21_000 and "50000 chars" in plan.inputs[0]["content"]
    assert [c.name for c in plan.children] == ["reward"] and "step" not in plan.attributes
    assert plan.children[0].start == 0.0
