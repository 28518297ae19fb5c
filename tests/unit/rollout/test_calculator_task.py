"""The calculator task: deterministic generation, exact ground truths, SFT conversations that
match the reward's answer format and the real calculator tool's output."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.rollout.calculator_task import (
    CALCULATOR_SYSTEM_PROMPT,
    format_answer,
    generate_calculator_tasks,
    generate_sft_conversations,
    write_calculator_tasks,
)
from agentrl.rollout.datasets import load_tasks
from agentrl.rollout.rewards import calculator_reward
from agentrl.types import Trajectory


def _traj_answering(text: str, tool_calls: dict[str, int] | None = None) -> Trajectory:
    return Trajectory(
        prompt_ids=[1],
        response_ids=[],
        loss_mask=[],
        rollout_logprobs=[],
        policy_version=[],
        uid="u",
        tool_calls=tool_calls or {},
        messages=[{"role": "assistant", "content": text}],
    )


def test_tasks_are_deterministic_and_exact():
    a = generate_calculator_tasks(50, seed=3, min_digits=2, max_digits=4, ops=["+", "-", "*", "/"])
    assert a == generate_calculator_tasks(
        50, seed=3, min_digits=2, max_digits=4, ops=["+", "-", "*", "/"]
    )
    assert a != generate_calculator_tasks(
        50, seed=4, min_digits=2, max_digits=4, ops=["+", "-", "*", "/"]
    )
    ops_seen = set()
    for task in a:
        x, op, y = task.extra["a"], task.extra["op"], task.extra["b"]
        ops_seen.add(op)
        assert task.prompt == f"What is {x} {op} {y}? Use the calculator tool."
        assert task.data_source == "calculator" and task.agent == "tool_agent"
        assert 10 <= y < 10**4
        expected = {"+": x + y, "-": x - y, "*": x * y, "/": x // y}[op]
        if op == "/":
            assert x % y == 0
        assert task.reward_spec == {"ground_truth": str(expected)}
    assert ops_seen == {"+", "-", "*", "/"}
    assert len({t.id for t in a}) == 50


def test_written_tasks_load_back(tmp_path):
    path = write_calculator_tasks(tmp_path / "calc.jsonl", n=10, seed=1)
    assert load_tasks(path) == generate_calculator_tasks(10, seed=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": -1}, "n = -1"),
        ({"n": 1, "min_digits": 0}, "min_digits"),
        ({"n": 1, "min_digits": 5, "max_digits": 4}, "min_digits"),
        ({"n": 1, "ops": ["^"]}, "choose from"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_calculator_tasks(**kwargs)


def test_final_answer_format_is_what_the_reward_reads():
    task = generate_calculator_tasks(1, seed=0)[0]
    truth = int(task.reward_spec["ground_truth"])
    assert calculator_reward(_traj_answering(format_answer(truth)), task)["score"] == 1.0
    assert calculator_reward(_traj_answering(format_answer(truth + 1)), task)["score"] == 0.0


def test_sft_conversations_follow_the_task_and_the_real_tool():
    from tools import get_tool

    convs = generate_sft_conversations(200, seed=0, tool_fraction=0.7)
    assert convs == generate_sft_conversations(200, seed=0, tool_fraction=0.7)
    calculator = get_tool("calculator")
    with_tool = [c for c in convs if c["used_tool"]]
    assert 0.6 < len(with_tool) / len(convs) < 0.8
    for conv in convs:
        msgs = conv["messages"]
        assert msgs[0] == {"role": "system", "content": CALCULATOR_SYSTEM_PROMPT}
        assert msgs[1]["role"] == "user" and msgs[1]["content"].endswith("Use the calculator tool.")
        assert conv["tools"] == [calculator.schema()]
        assert msgs[-1]["role"] == "assistant"
        task_like = generate_calculator_tasks(1)[0].model_copy(
            update={"reward_spec": {"ground_truth": _truth(msgs[1]["content"])}}
        )
        score = calculator_reward(_traj_answering(msgs[-1]["content"]), task_like)["score"]
        assert score == (1.0 if conv["correct"] else 0.0)
        assert conv["correct"] == conv["used_tool"]
    for conv in with_tool[:20]:
        call = conv["messages"][2]["tool_calls"][0]["function"]
        assert call["name"] == "calculator"
        result = asyncio.run(calculator.execute(None, call["arguments"]))
        content = result if isinstance(result, str) else result.content
        assert conv["messages"][3] == {
            "role": "tool",
            "tool_call_id": conv["messages"][2]["tool_calls"][0]["id"],
            "name": "calculator",
            "content": content,
        }


def _truth(prompt: str) -> str:
    expr = prompt.removeprefix("What is ").removesuffix("? Use the calculator tool.")
    a, op, b = expr.split(" ")
    return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])


def test_sft_conversations_render_with_the_tiny_chat_template():
    from agentrl.inference.tiny_model import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    conv = next(c for c in generate_sft_conversations(10, seed=1) if c["used_tool"])
    text = tok.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False)
    expr = conv["messages"][2]["tool_calls"][0]["function"]["arguments"]["expression"]
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
        f'{{"expression": "{expr}"}}}}\n</tool_call><|im_end|>\n'
    ) in text
    assert text.endswith(f"<|im_start|>assistant\n{conv['messages'][-1]['content']}<|im_end|>\n")


def test_sft_bad_tool_fraction():
    with pytest.raises(ValueError, match="tool_fraction"):
        generate_sft_conversations(1, tool_fraction=1.5)


def test_schema_free_fraction_drops_only_the_tools_block():
    base = generate_sft_conversations(200, seed=3)
    none = generate_sft_conversations(200, seed=3, schema_free_fraction=1.0)
    half = generate_sft_conversations(200, seed=3, schema_free_fraction=0.5)
    assert all(c["tools"] for c in base)
    assert all(c["tools"] is None for c in none)
    assert 60 < sum(c["tools"] is None for c in half) < 140
    # the problems, answers and tool choices do not depend on it
    for a, b in zip(base, half, strict=True):
        assert a["messages"] == b["messages"] and a["used_tool"] == b["used_tool"]
    with pytest.raises(ValueError, match="schema_free_fraction"):
        generate_sft_conversations(1, schema_free_fraction=-0.1)
