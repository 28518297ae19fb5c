"""A segment: one token-exact stretch of a proxy session, and how a request extends it.

Why it exists: an OpenAI client resends the whole conversation on every request. The recorder
must turn that into exactly the tokens the model saw, as a native agent would record them. A
segment holds that recording (an :class:`~agentrl.episode.EpisodeRecorder`) plus what is needed
to recognise the next request as its continuation.

How a request relates to a segment (:meth:`Segment.continue_with`):

1. **Continuation**: the messages start with the segment's conversation (the previous request's
   messages plus the reply returned, compared by
   :func:`~agentrl.rollout.proxy.messages.message_key`) and the tools are unchanged: only the new
   messages are rendered, as a token delta (mask 0);
2. **Token prefix**: otherwise, if the recorded context (plus the end-of-turn token when the last
   turn was cut) is a token prefix of the whole conversation's render, the rest is appended;
3. otherwise it is a **prefix break**: the caller opens a new segment (:meth:`Segment.open`)
   from the render; earlier turns are never re-tokenized into a segment.

Invariants: a segment's tokens are only ever appended to; :meth:`Segment.draft` gives a copy
that can be extended and thrown away (a failed request leaves its session untouched).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.episode import EpisodeRecorder, get_delta_renderer, render_prompt_ids
from agentrl.rollout.proxy.messages import message_key, tools_key
from agentrl.rollout.proxy.protocol import ProxyError
from agentrl.types import Message

__all__ = ["Segment", "end_of_turn_ids"]


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The token ids that end an assistant turn in ``tokenizer``'s chat template."""
    return list(get_delta_renderer(tokenizer).end_of_turn_ids)


@dataclass
class Segment:
    """One token-exact stretch of a session (a new one starts at each prefix break)."""

    recorder: EpisodeRecorder
    tools_key: str
    conversation: list[tuple[Any, ...]] = field(default_factory=list)
    """Message keys of the recorded conversation (last request + the reply returned)."""
    messages: list[Message] = field(default_factory=list)
    """The conversation for display (``Trajectory.messages``)."""
    turn_closed: bool = True
    """False when the last model turn ended without the end-of-turn token."""
    tool_calls: dict[str, int] = field(default_factory=dict)
    finish_reason: str = "stop"
    generate_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def open(
        cls,
        messages: list[Message],
        tools: list | None,
        tokenizer: Any,
        *,
        max_response_tokens: int | None,
        max_context_tokens: int | None,
    ) -> Segment:
        """A new segment whose prompt is the render of ``messages`` (400 when it cannot render)."""
        try:
            recorder = EpisodeRecorder.from_messages(
                messages,
                tokenizer,
                tools=tools,
                max_response_tokens=max_response_tokens,
                max_context_tokens=max_context_tokens,
            )
        except ValueError as exc:  # template errors, empty renders
            raise ProxyError(400, f"cannot render the messages: {exc}", param="messages") from exc
        return cls(recorder=recorder, tools_key=tools_key(tools))

    def draft(self) -> Segment:
        """A copy that can be extended without touching this segment."""
        rec = copy.copy(self.recorder)
        for name in (
            "prompt_ids",
            "response_ids",
            "loss_mask",
            "rollout_logprobs",
            "policy_version",
        ):
            setattr(rec, name, list(getattr(self.recorder, name)))
        return dataclasses.replace(self, recorder=rec, tool_calls=dict(self.tool_calls))

    def continue_with(self, messages: list[Message], tools: list | None, tokenizer: Any) -> bool:
        """Append the new part of ``messages`` if they continue this segment; else False."""
        if tools_key(tools) != self.tools_key:
            return False
        keys = [message_key(m) for m in messages]
        n = len(self.conversation)
        if len(keys) > n and keys[:n] == self.conversation:
            try:
                self.recorder.add_messages(messages[n:])
            except ValueError as exc:
                raise ProxyError(400, f"cannot render the new messages: {exc}", "messages") from exc
            self.turn_closed = True
            return True
        # Token-level check: is the recorded context a prefix of the full render?
        try:
            render = render_prompt_ids(tokenizer, messages, tools)
        except ValueError as exc:
            raise ProxyError(400, f"cannot render the messages: {exc}", param="messages") from exc
        context = self.recorder.context_ids()
        eot = [] if self.turn_closed else end_of_turn_ids(tokenizer)
        expected = context + eot
        if len(render) > len(expected) and render[: len(expected)] == expected:
            self.recorder.close_turn()
            self.recorder.add_environment_tokens(render[len(expected) :])
            self.turn_closed = True
            return True
        return False
