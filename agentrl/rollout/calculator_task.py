"""The calculator-agent task: arithmetic a tiny model cannot do in its head, but can with a tool.

Why it exists: the quickstart needs a task where reward rises visibly within minutes on a CPU.
Multi-digit arithmetic is out of reach for a tiny model, but copying the expression into a
``calculator`` tool call and copying the tool's result into the answer is learnable. So the
reward (``calculator`` in :mod:`agentrl.rollout.rewards`: 1.0 for the right number) rises as
the policy learns to use the tool.

What it guarantees:

- :func:`generate_calculator_tasks` and :func:`generate_sft_conversations` are deterministic
  for a seed (Python's ``random.Random(seed)``, independent of global state);
- the prompt, the system prompt (:data:`CALCULATOR_SYSTEM_PROMPT`, defined once here), the
  tool call and the final answer format (``\\boxed{N}``, see :func:`format_answer`) are the
  same in the SFT conversations and the RL tasks, and the final answer is exactly what the
  ``calculator`` reward extracts;
- every ground truth is an exact integer (division only appears where it is exact).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.rollout.datasets import write_tasks_jsonl
from agentrl.types import Message, Task

__all__ = [
    "CALCULATOR_SYSTEM_PROMPT",
    "DEFAULT_OPS",
    "calculator_tool_schemas",
    "format_answer",
    "format_prompt",
    "generate_calculator_tasks",
    "generate_sft_conversations",
    "write_calculator_tasks",
]

CALCULATOR_SYSTEM_PROMPT = (
    "Use the calculator tool for arithmetic. Answer with the result as \\boxed{N}."
)
"""The system prompt of the calculator task (SFT conversations and RL episodes alike)."""

DEFAULT_OPS: tuple[str, ...] = ("+", "-", "*")
"""Operators used by default; ``/`` is supported and always divides exactly."""

_SUPPORTED_OPS = ("+", "-", "*", "/")


def format_prompt(a: int, op: str, b: int) -> str:
    """The user prompt, e.g. ``What is 4821 * 37? Use the calculator tool.``"""
    return f"What is {a} {op} {b}? Use the calculator tool."


def format_answer(value: int) -> str:
    """The final assistant answer, e.g. ``\\boxed{178377}`` (what the ``calculator`` reward reads)."""
    return f"\\boxed{{{value}}}"


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def _problem(
    rng: random.Random, min_digits: int, max_digits: int, ops: Sequence[str]
) -> tuple[int, str, int, int]:
    op = rng.choice(list(ops))
    a = _operand(rng, min_digits, max_digits)
    b = _operand(rng, min_digits, max_digits)
    if op == "/":
        b = max(b, 1)
        a = b * max(_operand(rng, min_digits, max_digits), 1)  # exact quotient
        return a, op, b, a // b
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return a, op, b, result


def _check_args(n: int, min_digits: int, max_digits: int, ops: Sequence[str]) -> None:
    if n < 0:
        raise ValueError(f"n = {n}; the number of items must be >= 0")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(
            f"min_digits = {min_digits}, max_digits = {max_digits}; need 1 <= min_digits <= max_digits"
        )
    bad = [op for op in ops if op not in _SUPPORTED_OPS]
    if not ops or bad:
        raise ValueError(f"ops = {list(ops)!r}; choose from {list(_SUPPORTED_OPS)}")


def generate_calculator_tasks(
    n: int,
    seed: int = 0,
    min_digits: int = 3,
    max_digits: int = 4,
    ops: Sequence[str] = DEFAULT_OPS,
) -> list[Task]:
    """``n`` calculator tasks: ``data_source="calculator"``, ``agent="tool_agent"``,
    ``reward_spec={"ground_truth": "<int>"}``, ``extra={"a", "op", "b"}``, ids
    ``calc-{seed}-{i}``. Operands have ``min_digits..max_digits`` digits."""
    _check_args(n, min_digits, max_digits, ops)
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, op, b, result = _problem(rng, min_digits, max_digits, ops)
        tasks.append(
            Task(
                id=f"calc-{seed}-{i}",
                prompt=format_prompt(a, op, b),
                agent="tool_agent",
                data_source="calculator",
                reward_spec={"ground_truth": str(result)},
                extra={"a": a, "op": op, "b": b},
            )
        )
    return tasks


def write_calculator_tasks(
    path: str | Path,
    n: int,
    seed: int = 0,
    min_digits: int = 3,
    max_digits: int = 4,
    ops: Sequence[str] = DEFAULT_OPS,
) -> Path:
    """Generate ``n`` tasks and write them as JSONL (loadable by ``load_tasks``)."""
    return write_tasks_jsonl(generate_calculator_tasks(n, seed, min_digits, max_digits, ops), path)


def calculator_tool_schemas() -> list[dict[str, Any]]:
    """The OpenAI tool schemas an agent offers for this task: the built-in ``calculator``."""
    from tools import get_tool

    return [get_tool("calculator").schema()]


def _wrong_guess(rng: random.Random, result: int) -> int:
    """A plausible-looking but wrong answer: same sign and magnitude, some digits changed."""
    digits = list(str(abs(result)))
    while True:
        guess_digits = list(digits)
        for _ in range(max(1, len(digits) // 2)):
            pos = rng.randrange(len(digits))
            guess_digits[pos] = str(rng.randint(1 if pos == 0 and len(digits) > 1 else 0, 9))
        guess = int("".join(guess_digits)) * (-1 if result < 0 else 1)
        if guess != result:
            return guess


def generate_sft_conversations(
    n: int,
    seed: int = 0,
    tool_fraction: float = 0.8,
    min_digits: int = 3,
    max_digits: int = 4,
    ops: Sequence[str] = DEFAULT_OPS,
    schema_free_fraction: float = 0.0,
) -> list[dict[str, Any]]:
    """``n`` chat conversations for a supervised warm start, each
    ``{"messages": [...], "tools": [calculator schema], "used_tool": bool, "correct": bool}``.

    A ``tool_fraction`` of them solve the problem the intended way::

        system: CALCULATOR_SYSTEM_PROMPT
        user: What is 4821 * 37? Use the calculator tool.
        assistant: tool_calls=[calculator(expression="4821 * 37")]   (hermes <tool_call> when rendered)
        tool: 178377
        assistant: \\boxed{178377}

    the others answer at once with a wrong guess (``assistant: \\boxed{178311}``), so that the
    warm-started policy still explores both behaviours and RL has something to prefer. Render
    them with the tokenizer's chat template and ``tools``; the tool message content is what
    the built-in ``calculator`` tool returns for integer results.

    ``schema_free_fraction`` of the conversations carry ``"tools": None``, so the chat template
    renders them without the tools block. Why: a tiny model must learn to copy the user's
    expression into the call, i.e. to attend from the call back to the user turn. Behind a
    tools block of hundreds of positions that attention pattern takes thousands of steps to
    emerge; on short contexts it forms in a few hundred, and it carries over to the full
    prompt (the relative positions of user turn and call are the same). RL always shows the tools.
    Drawn from a separate stream, so the problems do not depend on it.
    """
    _check_args(n, min_digits, max_digits, ops)
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction = {tool_fraction}; it must be in [0, 1]")
    if not 0.0 <= schema_free_fraction <= 1.0:
        raise ValueError(f"schema_free_fraction = {schema_free_fraction}; it must be in [0, 1]")
    schemas = calculator_tool_schemas()
    rng = random.Random(seed)
    schema_rng = random.Random(f"{seed}-schema-free")
    conversations = []
    for i in range(n):
        a, op, b, result = _problem(rng, min_digits, max_digits, ops)
        used_tool = rng.random() < tool_fraction
        messages: list[Message] = [
            {"role": "system", "content": CALCULATOR_SYSTEM_PROMPT},
            {"role": "user", "content": format_prompt(a, op, b)},
        ]
        if used_tool:
            messages += _tool_solution(f"call_{seed}_{i}", f"{a} {op} {b}", result)
            answer = result
        else:
            answer = _wrong_guess(rng, result)
            messages.append({"role": "assistant", "content": format_answer(answer)})
        schema_free = schema_rng.random() < schema_free_fraction
        conversations.append(
            {
                "messages": messages,
                "tools": None if schema_free else schemas,
                "used_tool": used_tool,
                "correct": answer == result,
            }
        )
    return conversations


def _tool_solution(call_id: str, expression: str, result: int) -> list[Message]:
    """The intended solution after the user turn: a calculator call on ``expression``, the
    tool's reply and the boxed answer."""
    return [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": expression}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "name": "calculator", "content": str(result)},
        {"role": "assistant", "content": format_answer(result)},
    ]
