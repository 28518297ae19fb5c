"""A proxy session: one episode of an OpenAI-client agent, bound to its task, recorded as segments.

Why it exists: the recorder serves many sessions at once; each needs its own segments, its own
lock (requests of one session are serialized), its idle clock and what its trajectories are
labelled with when it is finished.

Invariants:

- a session serving a request (its lock held) never expires; otherwise it expires after
  ``ttl_s`` seconds without a request;
- :meth:`Session.trajectories` gives one trajectory per segment that recorded a turn, in order;
  ``uid``/``task_id``/``data_source`` come from the bound task unless given, and each
  trajectory's ``proxy/segment`` and ``proxy/prefix_breaks`` metrics say where it came from.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.rollout.proxy.segment import Segment
from agentrl.types import SamplingParams, StopReason, Task, Trajectory

__all__ = ["Session"]

_STOP_REASONS = {"length": StopReason.LENGTH, "abort": StopReason.ABORTED}
"""A segment's last finish reason -> its trajectory's stop reason (otherwise EOS)."""


@dataclass
class Session:
    """One session's state: its task, its base sampling, its segments and its idle clock."""

    id: str
    task: Task | None = None
    """The task the session works on (trajectory ``task_id``/``data_source``/``uid``)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Trajectory fields given at open (``index``, ``agent``, ...)."""
    ttl_s: float = 3600.0
    sampling: SamplingParams | None = None
    """Base sampling of this session (request fields override it)."""
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    segments: list[Segment] = field(default_factory=list)
    prefix_breaks: int = 0

    def expired(self, now: float) -> bool:
        """Idle for longer than its TTL at ``now`` (a session serving a request never expires)."""
        return not self.lock.locked() and now - self.last_used > self.ttl_s

    def trajectories(
        self, *, uid: str | None, stop_reason: StopReason | None, meta: dict[str, Any]
    ) -> list[Trajectory]:
        """One trajectory per segment with a recorded turn (see :meth:`ProxyRecorder.finish
        <agentrl.rollout.proxy.recorder.ProxyRecorder.finish>` for the arguments)."""
        meta = {**self.meta, **meta}
        if self.task is not None:
            meta.setdefault("task_id", self.task.id)
            meta.setdefault("data_source", self.task.data_source)
            if uid is None:
                uid = self.task.id
        meta.setdefault("agent", "openai_proxy")
        out = []
        for i, seg in enumerate(self.segments):
            if seg.recorder.num_turns == 0:
                continue
            reason = stop_reason or _STOP_REASONS.get(seg.finish_reason, StopReason.EOS)
            if seg.recorder.truncated and stop_reason is None:
                reason = StopReason.LENGTH
            out.append(
                seg.recorder.to_trajectory(
                    uid=uid if uid is not None else self.id,
                    stop_reason=reason,
                    tool_calls=dict(seg.tool_calls),
                    messages=list(seg.messages),
                    timings={
                        "generate": seg.generate_s,
                        "total": time.perf_counter() - seg.started,
                    },
                    metrics={
                        "proxy/segment": float(i),
                        "proxy/prefix_breaks": float(self.prefix_breaks),
                    },
                    **meta,
                )
            )
        return out
