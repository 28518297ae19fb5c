"""The recorder: the proxy's logic without HTTP (sessions in, trajectories out).

Why it exists: the proxy's own app (:mod:`agentrl.rollout.proxy.app`), the rollout service's
session routes and :class:`~agentrl.rollout.openai_agent.OpenAIAgent` all serve OpenAI
chat-completions requests the same way; this class is that way, callable in process.

Per request (:meth:`ProxyRecorder.chat`): check the request at the door, translate its messages
(:mod:`~agentrl.rollout.proxy.messages`), extend a draft of the session's current segment or
open a new one (:mod:`~agentrl.rollout.proxy.segment`), generate from the recorded context with
the policy, parse tool calls from the output, and answer an OpenAI ``ChatCompletion``.

Invariants (the control-plane rules of DESIGN section 10):

- a session exists only once :meth:`ProxyRecorder.open_session` issued its id (192 random
  bits); a request to any other id is a 404 and creates nothing;
- requests of one session are serialized (its lock); sessions run concurrently;
- a request changes its session only once its generation succeeded: it works on a draft of the
  current segment, so a failed or cancelled request (which the client may retry) leaves the
  session as it was;
- a session idle for longer than its TTL is evicted (counted in ``proxy/evicted``); one with a
  request in flight is never evicted and cannot be finished (409);
- the policy's refusals become 400s and its failures 502s, each counted in ``proxy/errors``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Sequence
from typing import Any

from agentrl.episode import get_delta_renderer
from agentrl.inference.client import InferenceRequestError
from agentrl.rollout.proxy.messages import check_text, message_key, plain_message
from agentrl.rollout.proxy.protocol import ChatCompletionRequest, ProxyError, chat_completion
from agentrl.rollout.proxy.segment import Segment, end_of_turn_ids
from agentrl.rollout.proxy.session import Session
from agentrl.types import Message, Policy, SamplingParams, StopReason, Task, Trajectory

__all__ = ["MAX_PROMPT_CHARS", "ProxyRecorder"]

MAX_PROMPT_CHARS = 2_000_000
"""Default bound on the characters of one request's messages and tools (about 500k tokens)."""


class ProxyRecorder:
    """The proxy's logic without HTTP: sessions, segments, generation, OpenAI responses.

    Args:
        policy: anything with ``async generate(prompt_ids, sampling, session_id)``.
        tokenizer: the policy's Hugging Face tokenizer (chat template, decode).
        parser: tool-call format of the model's output (``agents.parsers.get_parser`` name).
        model_name: reported in responses and ``/v1/models``.
        default_max_tokens: ``max_tokens`` when the request gives none.
        max_response_tokens: budget for everything after a segment's prompt (model and
            environment tokens, as ``agent.max_response_tokens``); None = unlimited.
        max_context_tokens: context budget per segment (prompt + response); None = unlimited.
        default_sampling: base sampling params that request fields override.
        session_ttl_s: a session idle for longer is evicted (its recording is discarded and
            counted in ``proxy/evicted``); a session with a request in flight is never evicted.
        max_sessions: most open sessions; opening one more first evicts expired sessions,
            then refuses with a 429.
        max_prompt_chars: most characters in a request's messages and tools (a 400 past it,
            checked before rendering; rendering and tokenizing run off the event loop).

    Sessions are opened by :meth:`open_session`, which issues an unguessable id; requests to
    any other id are refused (404), so no client can create a session by naming it or post
    into another episode's session without its id.
    """

    def __init__(
        self,
        policy: Policy,
        tokenizer: Any,
        *,
        parser: str = "hermes",
        model_name: str = "agentrl-policy",
        default_max_tokens: int = 256,
        max_response_tokens: int | None = None,
        max_context_tokens: int | None = None,
        default_sampling: SamplingParams | None = None,
        session_ttl_s: float = 3600.0,
        max_sessions: int = 10_000,
        max_prompt_chars: int = MAX_PROMPT_CHARS,
    ) -> None:
        from agents.parsers import get_parser

        if session_ttl_s <= 0 or max_sessions < 1:
            raise ValueError(
                f"session_ttl_s={session_ttl_s} and max_sessions={max_sessions}: both must be > 0"
            )
        self.session_ttl_s = session_ttl_s
        self.max_sessions = max_sessions
        self.max_prompt_chars = max_prompt_chars

        self.policy = policy
        self.tokenizer = tokenizer
        self.parser = get_parser(parser)
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.max_response_tokens = max_response_tokens
        self.max_context_tokens = max_context_tokens
        self.default_sampling = default_sampling or SamplingParams()
        self._sessions: dict[str, Session] = {}
        self._counts = {
            "requests": 0,
            "prefix_breaks": 0,
            "segments": 0,
            "sessions": 0,
            "errors": 0,
            "evicted": 0,
        }

    # ---- sessions ---------------------------------------------------------------------------
    def open_session(
        self,
        task: Task | None = None,
        *,
        ttl_s: float | None = None,
        sampling: SamplingParams | None = None,
        **meta: Any,
    ) -> str:
        """Open a session and return its id (unguessable: 192 random bits).

        ``task`` binds the session to a task: its trajectories get the task's ``id`` as
        ``task_id`` and ``uid`` (so sessions of one task form a GRPO group) and its
        ``data_source``. ``meta`` sets other Trajectory fields at :meth:`finish` (``index``,
        ``agent``, ...). ``ttl_s`` overrides the idle TTL; ``sampling`` the base sampling.
        """
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s={ttl_s}; a session TTL must be > 0 seconds")
        self.evict_expired()
        if len(self._sessions) >= self.max_sessions:
            raise ProxyError(
                429,
                f"{len(self._sessions)} sessions are open (max_sessions={self.max_sessions}); "
                "finish sessions you are done with",
                kind="rate_limit_error",
            )
        session_id = secrets.token_urlsafe(24)
        self._sessions[session_id] = Session(
            session_id,
            task=task,
            meta=dict(meta),
            ttl_s=self.session_ttl_s if ttl_s is None else ttl_s,
            sampling=sampling,
        )
        self._counts["sessions"] += 1
        return session_id

    def evict_expired(self) -> list[str]:
        """Forget sessions idle for longer than their TTL; returns their ids."""
        now = time.monotonic()
        gone = [sid for sid, s in self._sessions.items() if s.expired(now)]
        for sid in gone:
            del self._sessions[sid]
        self._counts["evicted"] += len(gone)
        return gone

    def _session(self, session_id: str) -> Session:
        self.evict_expired()
        session = self._sessions.get(session_id)
        if session is None:
            raise ProxyError(
                404,
                "unknown or expired session id; open a session first (sessions idle for longer "
                "than their TTL are evicted)",
                param="session_id",
                kind="not_found_error",
            )
        session.last_used = time.monotonic()
        return session

    def session_info(self, session_id: str) -> dict[str, Any]:
        """``turns``, ``segments``, ``expires_in_s`` and ``task_id`` of an open session."""
        session = self._session(session_id)
        return {
            "id": session.id,
            "task_id": session.task.id if session.task else None,
            "turns": sum(seg.recorder.num_turns for seg in session.segments),
            "segments": len(session.segments),
            "expires_in_s": session.ttl_s,
        }

    def task_of(self, session_id: str) -> Task | None:
        """The task a session is bound to (None for an unbound session)."""
        return self._session(session_id).task

    def discard(self, session_id: str) -> bool:
        """Forget a session without producing trajectories; False if it was not open."""
        return self._sessions.pop(session_id, None) is not None

    def sessions(self) -> list[str]:
        """Ids of the sessions recorded and not yet finished."""
        return list(self._sessions)

    def prefix_breaks(self, session_id: str) -> int:
        """How many times the client rewrote history in this session (new segments)."""
        session = self._sessions.get(session_id)
        return session.prefix_breaks if session else 0

    def finish(
        self,
        session_id: str,
        *,
        uid: str | None = None,
        stop_reason: StopReason | None = None,
        **meta: Any,
    ) -> list[Trajectory]:
        """One trajectory per segment of the session (in order), then forget the session.

        ``uid`` defaults to the bound task's id, else the session id; ``meta`` (merged over
        what was given at open) sets other Trajectory fields (``index``, ``task_id``,
        ``agent``, ``data_source``, ...). ``stop_reason`` defaults to what the last generation
        of each segment reported (``stop`` -> eos, ``length`` -> length, ``abort`` ->
        aborted). Call it after the agent is done with the session; a session with a request
        in flight cannot be finished (409).
        """
        self.evict_expired()
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(
                f"no open proxy session {session_id[:64]!r} (never opened, finished already, "
                f"or evicted after its TTL); open sessions: {len(self._sessions)}"
            )
        if session.lock.locked():
            raise ProxyError(
                409, "the session has a request in flight; finish it after the reply arrives"
            )
        del self._sessions[session_id]
        return session.trajectories(uid=uid, stop_reason=stop_reason, meta=meta)

    def metrics(self) -> dict[str, float]:
        """Cumulative counters (``proxy/`` family)."""
        return {f"proxy/{k}": float(v) for k, v in self._counts.items()} | {
            "proxy/open_sessions": float(len(self._sessions))
        }

    # ---- recording --------------------------------------------------------------------------
    async def chat(self, session_id: str, req: ChatCompletionRequest) -> dict[str, Any]:
        """Serve one chat-completions request of ``session_id``; returns the ChatCompletion."""
        messages, tools = _checked_messages(req, self.max_prompt_chars)
        session = self._session(session_id)
        async with session.lock:
            self._counts["requests"] += 1
            # Work on a draft and commit it only once the generation succeeded: a failed or
            # cancelled request (which the client may retry) leaves the session untouched.
            current = session.segments[-1] if session.segments else None
            # Rendering and tokenizing run in a worker thread: a long prompt never stalls the
            # event loop (every other session and route keeps being served meanwhile).
            draft, continued = await asyncio.to_thread(self._render, current, messages, tools)
            completion = await self._generate(session, draft, messages, req)
            if continued:
                session.segments[-1] = draft
            else:
                if current is not None:
                    session.prefix_breaks += 1
                    self._counts["prefix_breaks"] += 1
                session.segments.append(draft)
                self._counts["segments"] += 1
            session.last_used = time.monotonic()
            return completion

    def _render(
        self, current: Segment | None, messages: list[Message], tools: list | None
    ) -> tuple[Segment, bool]:
        """A draft of ``current`` extended by ``messages`` (True), or a new segment (False)."""
        draft = current.draft() if current is not None else None
        if draft is not None and draft.continue_with(messages, tools, self.tokenizer):
            return draft, True
        segment = Segment.open(
            messages,
            tools,
            self.tokenizer,
            max_response_tokens=self.max_response_tokens,
            max_context_tokens=self.max_context_tokens,
        )
        return segment, False

    async def _generate(
        self, session: Session, seg: Segment, messages: list[Message], req: ChatCompletionRequest
    ) -> dict[str, Any]:
        """Generate the next assistant turn into ``seg``; return it as a ChatCompletion."""
        prompt_len = len(seg.recorder.context_ids())
        token_ids, logprobs, version = await self._sample(session, seg, req)
        assistant = self._assistant_message(seg, token_ids)
        seg.conversation = [message_key(m) for m in messages] + [message_key(assistant)]
        seg.messages = [*messages, assistant]
        return chat_completion(
            req,
            assistant,
            token_ids,
            logprobs,
            model_name=self.model_name,
            cut_by_length=seg.finish_reason == "length",
            aborted=seg.finish_reason == "abort",
            prompt_len=prompt_len,
            version=version,
        )

    async def _sample(
        self, session: Session, seg: Segment, req: ChatCompletionRequest
    ) -> tuple[list[int], list[float], int]:
        """Sample from the recorded context and record the kept tokens (mask 1); return the token
        ids, their log-probs and the weight version (-1 when the budget left no room)."""
        sampling = self._sampling(req, session.sampling)
        rec = seg.recorder
        max_tokens = min(sampling.max_tokens, rec.remaining_budget)
        if max_tokens <= 0:
            seg.finish_reason = "length"
            return [], [], -1
        start = time.perf_counter()
        try:
            gen = await self.policy.generate(
                rec.context_ids(),
                sampling.model_copy(update={"max_tokens": max_tokens}),
                session_id=session.id,
            )
        except InferenceRequestError as exc:  # the server refused the request: a 4xx
            self._counts["errors"] += 1
            raise ProxyError(
                400, f"the inference server refused the request: {exc.message}"
            ) from None
        except Exception as exc:
            self._counts["errors"] += 1
            raise ProxyError(
                502, f"the policy failed to generate: {type(exc).__name__}: {exc}"
            ) from exc
        seg.generate_s += time.perf_counter() - start
        before = len(rec.response_ids)
        rec.add_generation(gen)
        kept = len(rec.response_ids) - before  # a budget cut may drop the tail
        token_ids, logprobs = list(gen.token_ids[:kept]), list(gen.logprobs[:kept])
        eot = end_of_turn_ids(self.tokenizer)
        seg.turn_closed = token_ids[-len(eot) :] == eot
        seg.finish_reason = "length" if rec.truncated else gen.finish_reason
        return token_ids, logprobs, gen.weight_version

    def _assistant_message(self, seg: Segment, token_ids: list[int]) -> Message:
        """The OpenAI assistant message of the sampled tokens: tool calls parsed (and counted in
        ``seg``), the content without the call markup when every call parsed, else the raw text."""
        text = self._decode(token_ids)
        parsed = self.parser.parse(text)
        tool_calls = []
        for call in parsed.calls:
            call.id = call.id or f"call_{uuid.uuid4().hex[:16]}"
            tool_calls.append(call.to_openai())
            seg.tool_calls[call.name] = seg.tool_calls.get(call.name, 0) + 1
        if parsed.errors:
            seg.tool_calls["<invalid>"] = seg.tool_calls.get("<invalid>", 0) + len(parsed.errors)
        content: str | None = parsed.content if tool_calls and not parsed.errors else text
        assistant: Message = {"role": "assistant", "content": content or None}
        if tool_calls:
            assistant["tool_calls"] = tool_calls
        return assistant

    def _decode(self, token_ids: Sequence[int]) -> str:
        # As the native agents decode (agents.base.AgentContext.decode): special tool tags kept,
        # a trailing end-of-turn token dropped, so both parse the same text.
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        eos = get_delta_renderer(self.tokenizer).end_of_turn_token
        return text[: -len(eos)] if text.endswith(eos) else text

    def _sampling(
        self, req: ChatCompletionRequest, base: SamplingParams | None = None
    ) -> SamplingParams:
        update: dict[str, Any] = {}
        if req.temperature is not None:
            update["temperature"] = req.temperature
        if req.top_p is not None:
            update["top_p"] = req.top_p
        if req.seed is not None:
            update["seed"] = req.seed
        max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
        update["max_tokens"] = self.default_max_tokens if max_tokens is None else max_tokens
        return (base or self.default_sampling).model_copy(update=update)


def _checked_messages(
    req: ChatCompletionRequest, max_chars: int
) -> tuple[list[Message], list | None]:
    """The request's messages and tools as the chat template takes them; a 400 for what the
    proxy cannot serve (``stream``, ``n > 1``, ``stop`` strings, no messages, bad text, more
    than ``max_chars`` characters: checked before anything is rendered or tokenized)."""
    if req.stream:
        raise ProxyError(400, "stream=true is not supported by the recording proxy", "stream")
    if req.n not in (None, 1):
        raise ProxyError(400, f"n={req.n} is not supported; the proxy samples one choice", "n")
    if req.stop:
        raise ProxyError(
            400,
            "stop strings are not supported (the proxy works in token ids); remove 'stop'",
            "stop",
        )
    if not req.messages:
        raise ProxyError(400, "messages is empty; send at least one message", "messages")
    check_text(req.model, "model")
    chars = check_text(req.messages, "messages") + check_text(req.tools, "tools")
    if chars > max_chars:
        raise ProxyError(
            400,
            f"messages and tools hold {chars} characters, more than this proxy renders "
            f"({max_chars}); shorten the conversation",
            "messages",
        )
    messages = [plain_message(m, i) for i, m in enumerate(req.messages)]
    return messages, (list(req.tools) if req.tools else None)
