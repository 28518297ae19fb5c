"""Episodes as MLflow traces: what the agent did at each step, not only the numbers.

Every sample episode the trainer logs (``tracking.num_sample_trajectories``) and every episode of
``agentrl eval --report`` becomes one MLflow trace in the run's experiment, linked to the run:

- a root span ``episode`` (type ``AGENT``): the task's first messages in, the last answer out;
  reward, stop reason, turns, tool calls, training step, weight versions as attributes;
- one span per model turn (``model turn k``, type ``LLM``): the assistant message out; tokens,
  weight version, ``finish_reason`` and latency as attributes;
- one span per environment answer (``tool: name`` for tool results, type ``TOOL``, else
  ``environment``): the tool call in, the tool/user messages out; tokens and latency;
- a span ``reward`` (type ``EVALUATOR``-like ``UNKNOWN``): the reward and ``reward_info``.

Times come from :attr:`agentrl.types.Trajectory.turns`, recorded as the episode ran, so the
MLflow UI's timeline shows where an episode spent its time. Building the plan
(:func:`episode_plan`) is pure and tested without MLflow; :func:`log_episode_traces` writes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agentrl.types import Message, Trajectory, TurnRecord

__all__ = ["SpanPlan", "episode_plan", "log_episode_traces"]

_MAX_TEXT = 20_000  # characters of one message kept in a span (the UI stays responsive)


@dataclass
class SpanPlan:
    """One span to write: name, MLflow span type, wall-clock times (s), payloads, attributes."""

    name: str
    span_type: str
    start: float
    end: float
    inputs: Any = None
    outputs: Any = None
    attributes: dict[str, Any] = field(default_factory=dict)
    children: list[SpanPlan] = field(default_factory=list)


def _clip(message: Message) -> Message:
    """A message with long text content cut to :data:`_MAX_TEXT` characters."""
    content = message.get("content")
    if isinstance(content, str) and len(content) > _MAX_TEXT:
        return {**message, "content": content[:_MAX_TEXT] + f"... [{len(content)} chars]"}
    return message


def _split_messages(messages: list[Message]) -> tuple[list[Message], list[list[Message]]]:
    """The messages before the first assistant turn, then per assistant turn: that message and
    the non-assistant messages that answered it."""
    head: list[Message] = []
    turns: list[list[Message]] = []
    for m in messages:
        if m.get("role") == "assistant":
            turns.append([m])
        elif turns:
            turns[-1].append(m)
        else:
            head.append(m)
    return head, turns


def _tool_names(assistant: Message) -> list[str]:
    """Names of the tools an assistant message called (OpenAI ``tool_calls`` shape)."""
    names = []
    for call in assistant.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and fn.get("name"):
            names.append(str(fn["name"]))
    return names


def _model_span(k: int, turn: TurnRecord, assistant: Message | None) -> SpanPlan:
    return SpanPlan(
        name=f"model turn {k}",
        span_type="LLM",
        start=turn.start,
        end=turn.end,
        outputs=_clip(assistant) if assistant else None,
        attributes={
            "tokens": turn.tokens,
            "weight_version": turn.version,
            "finish_reason": turn.finish_reason,
            "latency_s": round(turn.end - turn.start, 6),
        },
    )


def _environment_span(
    turn: TurnRecord, assistant: Message | None, answers: list[Message]
) -> SpanPlan:
    names = _tool_names(assistant) if assistant else []
    tool = any(m.get("role") == "tool" for m in answers) or bool(names)
    return SpanPlan(
        name=f"tool: {', '.join(names)}" if names else ("tool" if tool else "environment"),
        span_type="TOOL" if tool else "UNKNOWN",
        start=turn.start,
        end=turn.end,
        inputs=(assistant or {}).get("tool_calls"),
        outputs=[_clip(m) for m in answers] or None,
        attributes={"tokens": turn.tokens, "latency_s": round(turn.end - turn.start, 6)},
    )


def _reward_span(traj: Trajectory, start: float) -> SpanPlan:
    seconds = float(traj.timings.get("reward", 0.0))
    info = json.loads(json.dumps(traj.reward_info, default=str))  # JSON-safe copy
    return SpanPlan(
        name="reward",
        span_type="UNKNOWN",
        start=start,
        end=start + seconds,
        inputs={"data_source": traj.data_source, "stop_reason": traj.stop_reason.value},
        outputs={"reward": traj.reward, "reward_info": info},
        attributes={"reward": traj.reward, "latency_s": round(seconds, 6)},
    )


def _turn_spans(traj: Trajectory) -> list[SpanPlan]:
    """Model and environment spans, each model turn paired with its assistant message."""
    _, by_turn = _split_messages(list(traj.messages))
    spans: list[SpanPlan] = []
    k = -1
    for turn in traj.turns:
        if turn.kind == "model":
            k += 1
        group = by_turn[k] if 0 <= k < len(by_turn) else []
        assistant = group[0] if group else None
        if turn.kind == "model":
            spans.append(_model_span(k + 1, turn, assistant))
        else:
            spans.append(_environment_span(turn, assistant, group[1:]))
    return spans


def episode_plan(traj: Trajectory, *, step: int | None = None) -> SpanPlan:
    """The span tree of one episode (see the module docstring)."""
    head, by_turn = _split_messages(list(traj.messages))
    children = _turn_spans(traj)
    total = float(traj.timings.get("total", 0.0))
    start = traj.turns[0].start if traj.turns else 0.0
    end = max([s.end for s in children], default=start)
    children.append(_reward_span(traj, end))
    end = max(end, children[-1].end, start + total)
    versions = sorted({t.version for t in traj.turns if t.kind == "model"})
    last = by_turn[-1][0] if by_turn else None
    attributes = {
        "uid": traj.uid,
        "task_id": traj.task_id,
        "agent": traj.agent,
        "data_source": traj.data_source,
        "reward": traj.reward,
        "stop_reason": traj.stop_reason.value,
        "num_turns": traj.num_turns,
        "tool_calls": dict(traj.tool_calls),
        "weight_versions": versions,
        "response_tokens": len(traj.response_ids),
        "error": traj.error,
    }
    if step is not None:
        attributes["step"] = step
    return SpanPlan(
        name="episode",
        span_type="AGENT",
        start=start,
        end=end,
        inputs=[_clip(m) for m in head],
        outputs=_clip(last) if last else None,
        attributes=attributes,
        children=children,
    )


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _write(client: Any, trace_id: str, parent_id: str, plan: SpanPlan) -> None:
    span = client.start_span(
        plan.name,
        trace_id=trace_id,
        parent_id=parent_id,
        span_type=plan.span_type,
        inputs=plan.inputs,
        attributes=plan.attributes,
        start_time_ns=_ns(plan.start),
    )
    for child in plan.children:
        _write(client, trace_id, span.span_id, child)
    client.end_span(trace_id, span.span_id, outputs=plan.outputs, end_time_ns=_ns(plan.end))


def log_episode_traces(
    trajs: list[Trajectory],
    *,
    experiment_id: str,
    run_id: str | None,
    step: int | None = None,
    tags: dict[str, str] | None = None,
) -> list[str]:
    """Write one MLflow trace per episode (linked to ``run_id``); returns the trace ids.

    Episodes without recorded turns (e.g. built by hand) still get a root and reward span."""
    from mlflow import MlflowClient

    client = MlflowClient()
    ids = []
    for traj in trajs:
        plan = episode_plan(traj, step=step)
        root = client.start_trace(
            plan.name,
            span_type=plan.span_type,
            inputs=plan.inputs,
            attributes=plan.attributes,
            tags={"agentrl.uid": traj.uid, **(tags or {})},
            experiment_id=experiment_id,
            start_time_ns=_ns(plan.start),
            run_id=run_id,
        )
        for child in plan.children:
            _write(client, root.trace_id, root.span_id, child)
        client.end_trace(root.trace_id, outputs=plan.outputs, end_time_ns=_ns(plan.end))
        ids.append(root.trace_id)
    return ids
