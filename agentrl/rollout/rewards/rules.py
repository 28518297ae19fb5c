"""The built-in rule rewards: ``exact_match``, ``numeric_match``, ``calculator``, ``tool_format``.

Why it exists: most verifiable tasks are scored by comparing the final answer with a ground
truth (``task.reward_spec["ground_truth"]``), and every project would otherwise write the same
answer reading and number comparison. These functions are registered under the names above
(:mod:`agentrl.rollout.rewards.registry`). They read the answer with
:mod:`agentrl.rollout.answers` and return a dict with ``score`` and what they read, so
``reward_info`` shows why an episode scored what it did.

They are bounded and pure (microseconds, no I/O), which is why the ``async`` executor runs
them inline on the event loop (:mod:`agentrl.rollout.rewards.executor`); user functions never
run there.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from agentrl.rollout.answers import (
    answer_number,
    extract_answer,
    final_answer_text,
    last_boxed,
    last_number,
    parse_number,
)
from agentrl.types import Task, Trajectory

__all__ = ["calculator_reward", "exact_match", "numeric_match", "tool_format"]


def _numbers_close(a: Fraction, b: Fraction, rel_tol: float, abs_tol: float) -> bool:
    if a == b:
        return True
    if a.denominator == 1 and b.denominator == 1:
        return False  # integers compare exactly: 999999 is not 1000000 at any tolerance
    return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=abs_tol)


def _ground_truths(task: Task) -> list[str]:
    if "ground_truth" not in task.reward_spec:
        raise ValueError(
            f"task {task.id!r} has no reward_spec['ground_truth']; this reward compares the "
            'final answer with it (e.g. reward_spec={"ground_truth": "42"})'
        )
    gt = task.reward_spec["ground_truth"]
    return [str(g) for g in gt] if isinstance(gt, list | tuple) else [str(gt)]


def _normalize_text(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = s.removeprefix("\\text{").removesuffix("}") if s.startswith("\\text{") else s
    s = " ".join(s.split()).casefold()
    return s.rstrip(".").strip()


def exact_match(traj: Trajectory, task: Task) -> dict[str, Any]:
    """1.0 when the answer equals ``reward_spec["ground_truth"]`` (or one of a list of them)
    after normalization (trimmed, whitespace collapsed, case-folded, trailing period dropped).

    The answer is the marked one (``\\boxed{}`` / ``####``) when present, else the whole final
    assistant message. A ground truth in GSM8K form (``"... #### 42"``) is reduced to ``42``.
    """
    text = final_answer_text(traj)
    marked = extract_answer(text)
    answer = marked if marked is not None else text
    targets = [extract_answer(g) or g for g in _ground_truths(task)]
    ok = any(_normalize_text(answer) == _normalize_text(t) for t in targets)
    return {"score": 1.0 if ok else 0.0, "answer": answer, "correct": ok}


def numeric_match(
    traj: Trajectory, task: Task, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9
) -> dict[str, Any]:
    """1.0 when the answer's number equals the ground truth's number.

    The answer is, in order: the last ``\\boxed{...}``, the text after the last ``####``
    (GSM8K), else the last number in the final assistant message. Numbers compare exactly as
    fractions (so ``1,234``, ``1234.0`` and ``2468/2`` are equal); when either is not an
    integer, also within ``rel_tol`` / ``abs_tol`` (``reward_spec`` may override both).
    """
    rel_tol = float(task.reward_spec.get("rel_tol", rel_tol))
    abs_tol = float(task.reward_spec.get("abs_tol", abs_tol))
    value, how = answer_number(final_answer_text(traj))
    targets = []
    for g in _ground_truths(task):
        target = parse_number(extract_answer(g) or g)
        if target is None:
            target = last_number(g)
        if target is None:
            raise ValueError(
                f"task {task.id!r}: reward_spec['ground_truth'] = {g!r} is not a number; "
                "numeric_match needs a numeric ground truth (use exact_match for text)"
            )
        targets.append(target)
    ok = value is not None and any(_numbers_close(value, t, rel_tol, abs_tol) for t in targets)
    return {
        "score": 1.0 if ok else 0.0,
        "answer": None if value is None else str(value),
        "extracted_by": how,
        "correct": ok,
    }


def calculator_reward(traj: Trajectory, task: Task) -> dict[str, Any]:
    """The calculator task's reward: 1.0 for the correct final answer, else 0.0.

    The answer is read like :func:`numeric_match` (``\\boxed{N}`` first — the format the SFT
    conversations and the system prompt teach — else the last number). There is no format
    bonus and no tool bonus on purpose: shaping terms can be farmed without solving the task,
    and the arithmetic is chosen so that the tiny model only gets it right through the tool.
    ``reward_info`` reports ``correct``, ``boxed`` (the answer was in ``\\boxed{}``),
    ``used_tool`` and ``invalid_tool_calls`` so that format and tool use can be tracked.
    """
    result = numeric_match(traj, task)
    text = final_answer_text(traj)
    result["boxed"] = last_boxed(text) is not None
    result["used_tool"] = traj.tool_calls.get("calculator", 0) > 0
    result["invalid_tool_calls"] = int(traj.tool_calls.get("<invalid>", 0))
    return result


def tool_format(traj: Trajectory, task: Task) -> dict[str, Any]:
    """Fraction of the episode's tool calls that were well formed (0.0 if it made none).

    A call is well formed when the agent's parser accepted it (``traj.tool_calls`` counts
    calls per tool name, malformed ones under ``<invalid>``) — or, for trajectories without
    those counts, when each hermes ``<tool_call>`` block in the assistant messages is closed
    and holds a JSON object with a string ``name`` and an object ``arguments``. A call to a
    tool the task does not offer (``reward_spec["tools"]``, a list of names, when given)
    counts as malformed.
    """
    allowed = task.reward_spec.get("tools")
    counts = dict(traj.tool_calls)
    if not counts:
        counts = _count_text_tool_calls(traj)
    invalid = counts.pop("<invalid>", 0)
    if allowed is not None:
        for name in [n for n in counts if n not in allowed]:
            invalid += counts.pop(name)
    valid = sum(counts.values())
    total = valid + invalid
    return {
        "score": valid / total if total else 0.0,
        "valid_calls": valid,
        "invalid_calls": invalid,
    }


def _count_text_tool_calls(traj: Trajectory) -> dict[str, int]:
    """Calls per tool name in the assistant messages (``<invalid>`` for malformed ones), by the
    one hermes parser the agents and the proxy use (``agents.parsers``)."""
    from agents.parsers import get_parser

    parser = get_parser("hermes")
    counts: dict[str, int] = {}
    for msg in traj.messages:
        if msg.get("role") != "assistant":
            continue
        names: list[str | None] = []
        for call in msg.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            names.append(fn.get("name") if isinstance(fn.get("name"), str) else None)
        content = msg.get("content")
        if not msg.get("tool_calls") and isinstance(content, str):
            parsed = parser.parse(content)
            names += [c.name for c in parsed.calls] + [None] * len(parsed.errors)
        for name in names:
            key = name if name else "<invalid>"
            counts[key] = counts.get(key, 0) + 1
    return counts
