"""An OpenAI-compatible recording proxy: train agents written against the stock ``openai`` client.

Why it exists: many agents are already written as ``AsyncOpenAI(base_url=...)`` loops. Pointed
at this proxy (``base_url=f"{proxy.base_url}/sessions/{session_id}/v1"``) such an agent runs
unmodified, while the proxy talks to the policy in token ids and records, per session, exactly
the tokens the model saw and sampled — the same :class:`~agentrl.types.Trajectory` a native
agent produces (the bookkeeping is :class:`agentrl.episode.EpisodeRecorder`, shared with
the native agents).

How each ``POST /sessions/{sid}/v1/chat/completions`` is recorded:

1. **Continuation** (the usual case): the request's messages start with the conversation the
   proxy already recorded — the previous request's messages plus the assistant message the proxy
   returned (compared by role, content and tool calls; ids and extra fields are ignored) — and
   the tools are unchanged. Only the new messages are rendered, as a token delta after the
   recorded context (mask 0), exactly as a native agent appends tool results.
2. **Token prefix**: otherwise, the whole conversation is rendered with the chat template
   (``add_generation_prompt=True``); if the recorded context (prompt + everything so far) is a
   token prefix of that render, the rest is appended (mask 0).
3. **Prefix break**: otherwise the client rewrote history (edited, dropped or summarised
   earlier turns). The current segment is closed and a new one starts from the render; the
   break is counted in ``proxy/prefix_breaks``. Earlier turns are never re-tokenized into a
   segment.

The model generates from the recorded context (``Policy.generate``: a PolicyClient, a
ServerPool, or a scripted fake), so the tokens are exactly what it saw. Its output is parsed for
tool calls (hermes by default) and returned as an OpenAI ``ChatCompletion``. Sampling params of
the request (``temperature``, ``top_p``, ``max_tokens``/``max_completion_tokens``, ``seed``)
are passed through; ``stream``, ``n > 1`` and ``stop`` strings are refused with a 400.

Sessions and access (the control-plane rules of DESIGN section 10):

- a session exists only once :meth:`ProxyRecorder.open_session` issued its id (192 random
  bits); a request to any other id is a 404 and creates nothing, so a failed request never
  leaves an empty session behind and no client can write into an episode it was not given;
- a session is bound to its task (``task_id``, ``data_source`` and ``uid`` of its
  trajectories) and evicted after ``session_ttl_s`` idle (counted in ``proxy/evicted``);
- roles other than system/user/assistant/tool, and text that is not valid Unicode (a lone
  surrogate), are refused with a 400 naming the field;
- with an API key every route but ``/health`` needs ``Authorization: Bearer <key>`` (the
  ``api_key`` of the OpenAI client); without one only loopback clients are served.

``finish(sid)`` returns one trajectory per segment and forgets the session. Requests of one
session are serialized (a per-session lock); sessions run concurrently.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import secrets
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from agentrl.auth import BearerAuth, resolve_api_key, warn_if_exposed
from agentrl.episode import EpisodeRecorder, get_delta_renderer, render_prompt_ids
from agentrl.inference.client import InferenceRequestError
from agentrl.types import Message, Policy, SamplingParams, StopReason, Task, Trajectory

__all__ = [
    "ALLOWED_ROLES",
    "ChatCompletionRequest",
    "ProxyError",
    "ProxyRecorder",
    "RecordingProxy",
    "create_proxy_app",
]


class ProxyError(Exception):
    """A request the proxy cannot serve; carries the HTTP status and an OpenAI-style error."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "upstream_error")

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


class ChatCompletionRequest(BaseModel):
    """The subset of OpenAI's chat-completions request the proxy understands.

    Other OpenAI fields (``frequency_penalty``, ``tool_choice``, ``user``, ...) are accepted
    and ignored.
    """

    model_config = ConfigDict(extra="allow")

    model: str = ""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    n: int | None = 1
    stream: bool | None = False
    stop: str | list[str] | None = None
    logprobs: bool | None = False


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return str(content)


def _arguments_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments


ALLOWED_ROLES = ("system", "user", "assistant", "tool")
"""Message roles the chat template renders; any other role is refused with a 400."""


def _check_text(value: Any, where: str) -> None:
    """Refuse strings the tokenizer cannot encode (a lone UTF-16 surrogate, e.g. ``"\\ud800"``
    in JSON) with a 400 naming the field, instead of failing deep inside tokenization."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ProxyError(
                400,
                f"{where} holds a lone surrogate (position {exc.start}); send valid Unicode text",
                param=where,
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{where}[{i}]")


def _plain_message(msg: dict[str, Any], index: int) -> Message:
    """A message as the chat template expects it: string content, no null fields."""
    role = msg.get("role")
    if not isinstance(role, str) or not role:
        raise ProxyError(400, f"messages[{index}] has no 'role'", param=f"messages[{index}].role")
    if role not in ALLOWED_ROLES:
        raise ProxyError(
            400,
            f"messages[{index}].role={role[:50]!r} is not a role the chat template renders; "
            f"use one of {', '.join(ALLOWED_ROLES)}",
            param=f"messages[{index}].role",
        )
    out: Message = {k: v for k, v in msg.items() if v is not None}
    if "content" in out and not isinstance(out["content"], str):
        out["content"] = _content_text(out["content"])
    if role != "assistant" and "content" not in out:
        out["content"] = ""
    return out


def _message_key(msg: Message) -> tuple[Any, ...]:
    """What identifies a message for continuation checks: role, content text and tool calls."""
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        calls.append(
            (fn.get("name"), json.dumps(_arguments_value(fn.get("arguments")), sort_keys=True))
        )
    return (msg.get("role"), _content_text(msg.get("content")).strip(), tuple(calls))


def _tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    return json.dumps(list(tools), sort_keys=True) if tools else ""


@dataclass
class _Segment:
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


@dataclass
class _Session:
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
    segments: list[_Segment] = field(default_factory=list)
    prefix_breaks: int = 0

    def expired(self, now: float) -> bool:
        """Idle for longer than its TTL at ``now`` (a session serving a request never expires)."""
        return not self.lock.locked() and now - self.last_used > self.ttl_s


def _draft(seg: _Segment) -> _Segment:
    """A copy of ``seg`` that can be extended without touching ``seg``."""
    rec = copy.copy(seg.recorder)
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "policy_version"):
        setattr(rec, name, list(getattr(seg.recorder, name)))
    return dataclasses.replace(seg, recorder=rec, tool_calls=dict(seg.tool_calls))


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
    ) -> None:
        from agents.parsers import get_parser

        if session_ttl_s <= 0 or max_sessions < 1:
            raise ValueError(
                f"session_ttl_s={session_ttl_s} and max_sessions={max_sessions}: both must be > 0"
            )
        self.session_ttl_s = session_ttl_s
        self.max_sessions = max_sessions

        self.policy = policy
        self.tokenizer = tokenizer
        self.parser = get_parser(parser)
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.max_response_tokens = max_response_tokens
        self.max_context_tokens = max_context_tokens
        self.default_sampling = default_sampling or SamplingParams()
        self._sessions: dict[str, _Session] = {}
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
        self._sessions[session_id] = _Session(
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

    def _session(self, session_id: str) -> _Session:
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
        meta = {**session.meta, **meta}
        if session.task is not None:
            meta.setdefault("task_id", session.task.id)
            meta.setdefault("data_source", session.task.data_source)
            if uid is None:
                uid = session.task.id
        meta.setdefault("agent", "openai_proxy")
        out = []
        for i, seg in enumerate(session.segments):
            if seg.recorder.num_turns == 0:
                continue
            reason = stop_reason or {
                "length": StopReason.LENGTH,
                "abort": StopReason.ABORTED,
            }.get(seg.finish_reason, StopReason.EOS)
            if seg.recorder.truncated and stop_reason is None:
                reason = StopReason.LENGTH
            out.append(
                seg.recorder.to_trajectory(
                    uid=uid if uid is not None else session_id,
                    stop_reason=reason,
                    tool_calls=dict(seg.tool_calls),
                    messages=list(seg.messages),
                    timings={
                        "generate": seg.generate_s,
                        "total": time.perf_counter() - seg.started,
                    },
                    metrics={
                        "proxy/segment": float(i),
                        "proxy/prefix_breaks": float(session.prefix_breaks),
                    },
                    **meta,
                )
            )
        return out

    def metrics(self) -> dict[str, float]:
        """Cumulative counters (``proxy/`` family)."""
        return {f"proxy/{k}": float(v) for k, v in self._counts.items()} | {
            "proxy/open_sessions": float(len(self._sessions))
        }

    # ---- recording --------------------------------------------------------------------------
    def _new_segment(self, messages: list[Message], tools: list | None) -> _Segment:
        try:
            recorder = EpisodeRecorder.from_messages(
                messages,
                self.tokenizer,
                tools=tools,
                max_response_tokens=self.max_response_tokens,
                max_context_tokens=self.max_context_tokens,
            )
        except ValueError as exc:  # template errors, empty renders
            raise ProxyError(400, f"cannot render the messages: {exc}", param="messages") from exc
        return _Segment(recorder=recorder, tools_key=_tools_key(tools))

    def _continue(self, seg: _Segment, messages: list[Message], tools: list | None) -> bool:
        """Append the new part of ``messages`` to ``seg`` if it continues it; else False."""
        if _tools_key(tools) != seg.tools_key:
            return False
        keys = [_message_key(m) for m in messages]
        n = len(seg.conversation)
        if len(keys) > n and keys[:n] == seg.conversation:
            try:
                seg.recorder.add_messages(messages[n:])
            except ValueError as exc:
                raise ProxyError(400, f"cannot render the new messages: {exc}", "messages") from exc
            seg.turn_closed = True
            return True
        # Token-level check: is the recorded context a prefix of the full render?
        try:
            render = render_prompt_ids(self.tokenizer, messages, tools)
        except ValueError as exc:
            raise ProxyError(400, f"cannot render the messages: {exc}", param="messages") from exc
        context = seg.recorder.context_ids()
        eot = [] if seg.turn_closed else self._eot_ids()
        expected = context + eot
        if len(render) > len(expected) and render[: len(expected)] == expected:
            seg.recorder.close_turn()
            seg.recorder.add_environment_tokens(render[len(expected) :])
            seg.turn_closed = True
            return True
        return False

    def _decode(self, token_ids: Sequence[int]) -> str:
        # As the native agents decode (agents.base.AgentContext.decode): special tool tags kept,
        # a trailing end-of-turn token dropped, so both parse the same text.
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        eos = get_delta_renderer(self.tokenizer).end_of_turn_token
        return text[: -len(eos)] if text.endswith(eos) else text

    def _eot_ids(self) -> list[int]:
        return list(get_delta_renderer(self.tokenizer).end_of_turn_ids)

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

    async def chat(self, session_id: str, req: ChatCompletionRequest) -> dict[str, Any]:
        """Serve one chat-completions request of ``session_id``; returns the ChatCompletion."""
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
        _check_text(req.model, "model")
        _check_text(req.messages, "messages")
        _check_text(req.tools, "tools")
        messages = [_plain_message(m, i) for i, m in enumerate(req.messages)]
        tools = list(req.tools) if req.tools else None
        session = self._session(session_id)
        async with session.lock:
            self._counts["requests"] += 1
            # Work on a draft and commit it only once the generation succeeded: a failed or
            # cancelled request (which the client may retry) leaves the session untouched.
            current = session.segments[-1] if session.segments else None
            draft = _draft(current) if current is not None else None
            continued = draft is not None and self._continue(draft, messages, tools)
            if draft is None or not continued:
                draft = self._new_segment(messages, tools)
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

    async def _generate(
        self, session: _Session, seg: _Segment, messages: list[Message], req: ChatCompletionRequest
    ) -> dict[str, Any]:
        """Generate the next assistant turn into ``seg``; return it as a ChatCompletion."""
        prompt_len = len(seg.recorder.context_ids())
        token_ids, logprobs, version = await self._sample(session, seg, req)
        assistant = self._assistant_message(seg, token_ids)
        seg.conversation = [_message_key(m) for m in messages] + [_message_key(assistant)]
        seg.messages = [*messages, assistant]
        return self._completion(req, seg, assistant, token_ids, logprobs, prompt_len, version)

    async def _sample(
        self, session: _Session, seg: _Segment, req: ChatCompletionRequest
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
        eot = self._eot_ids()
        seg.turn_closed = token_ids[-len(eot) :] == eot
        seg.finish_reason = "length" if rec.truncated else gen.finish_reason
        return token_ids, logprobs, gen.weight_version

    def _assistant_message(self, seg: _Segment, token_ids: list[int]) -> Message:
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

    def _completion(
        self,
        req: ChatCompletionRequest,
        seg: _Segment,
        assistant: Message,
        token_ids: list[int],
        logprobs: list[float],
        prompt_len: int,
        version: int,
    ) -> dict[str, Any]:
        """The ``chat.completion`` response body (one choice, usage, ``weight_version``)."""
        if assistant.get("tool_calls"):
            finish = "tool_calls"
        elif seg.finish_reason == "length":
            finish = "length"
        else:
            finish = "stop"
        choice: dict[str, Any] = {
            "index": 0,
            "message": assistant,
            "finish_reason": finish,
            "logprobs": None,
        }
        if req.logprobs:
            choice["logprobs"] = {
                "content": [
                    {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(token_ids, logprobs, strict=True)
                ]
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_len,
                "completion_tokens": len(token_ids),
                "total_tokens": prompt_len + len(token_ids),
            },
            "weight_version": version,
        }


def add_proxy_error_handlers(app: FastAPI) -> None:
    """OpenAI-style error bodies for :class:`ProxyError` and request validation (400)."""

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(
            ProxyError(400, f"invalid request: {param}: {first.get('msg')}", param or None).body(),
            status_code=400,
        )


def _build_app(recorder: ProxyRecorder) -> FastAPI:
    app = FastAPI(title="agentrl recording proxy")
    app.state.recorder = recorder
    add_proxy_error_handlers(app)

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, req: ChatCompletionRequest) -> JSONResponse:
        """Record one turn of the session; returns an OpenAI ``ChatCompletion``."""
        return JSONResponse(await recorder.chat(session_id, req))

    @app.get("/sessions/{session_id}/v1/models")
    async def models(session_id: str) -> dict[str, Any]:
        """The one model this proxy serves (404 for an unknown session)."""
        recorder.task_of(session_id)  # 404 for an unknown session
        return {
            "object": "list",
            "data": [
                {"id": recorder.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}
            ],
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: ``{"status": "ok"}`` (no auth needed)."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> dict[str, float]:
        """The recorder's ``proxy/...`` counters."""
        return recorder.metrics()

    return app


def create_proxy_app(
    policy: Policy, tokenizer: Any, *, api_key: str | None = None, **options: Any
) -> Any:
    """An ASGI app serving ``/sessions/{sid}/v1/chat/completions`` for ``policy``.

    ``options`` go to :class:`ProxyRecorder`; the recorder is ``app.state.recorder`` (open
    sessions with its ``open_session()``, collect trajectories with ``finish(sid)``).
    ``api_key`` (default ``$AGENTRL_API_KEY``): every route but ``/health`` needs
    ``Authorization: Bearer <key>``; without a key only loopback clients are served.
    """
    app = _build_app(ProxyRecorder(policy, tokenizer, **options))
    return _with_auth(app, api_key)


def _with_auth(app: FastAPI, api_key: str | None) -> Any:
    secured = BearerAuth(app, api_key=resolve_api_key(api_key))
    secured.state = app.state  # type: ignore[attr-defined]  # callers reach the recorder here
    return secured


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RecordingProxy:
    """The proxy served on a local port, in the current event loop.

    Example::

        async with RecordingProxy(policy, tokenizer, api_key="s3cret") as proxy:
            sid = proxy.open_session(task)               # an unguessable id, bound to the task
            client = AsyncOpenAI(base_url=proxy.session_url(sid), api_key="s3cret")
            await my_agent(client)                       # unmodified OpenAI-client code
            trajectories = proxy.finish(sid)             # uid/task_id/data_source from task
    """

    def __init__(
        self,
        policy: Policy,
        tokenizer: Any,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 30.0,
        api_key: str | None = None,
        **options: Any,
    ) -> None:
        self.recorder = ProxyRecorder(policy, tokenizer, **options)
        self.api_key = resolve_api_key(api_key)
        self.app = _with_auth(_build_app(self.recorder), self.api_key)
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running proxy (``RuntimeError`` before :meth:`start`)."""
        if self.port is None or self._server is None:
            raise RuntimeError("the proxy is not running; use 'async with RecordingProxy(...)'")
        return f"http://{self.host}:{self.port}"

    def session_url(self, session_id: str) -> str:
        """The ``base_url`` to give ``AsyncOpenAI`` for one session."""
        return f"{self.base_url}/sessions/{session_id}/v1"

    def open_session(self, task: Task | None = None, **options: Any) -> str:
        """See :meth:`ProxyRecorder.open_session`."""
        return self.recorder.open_session(task, **options)

    def finish(self, session_id: str, **meta: Any) -> list[Trajectory]:
        """See :meth:`ProxyRecorder.finish`."""
        return self.recorder.finish(session_id, **meta)

    def metrics(self) -> dict[str, float]:
        """See :meth:`ProxyRecorder.metrics`."""
        return self.recorder.metrics()

    async def start(self) -> RecordingProxy:
        """Serve on ``host:port`` (a free port if none given); return once it accepts requests."""
        import uvicorn

        if self.port is None:
            self.port = _free_port(self.host)
        warn_if_exposed(self.host, self.api_key, "the recording proxy")
        config = uvicorn.Config(
            self.app, host=self.host, port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raise the start-up error (e.g. port in use)
                raise RuntimeError(f"the proxy stopped during start-up on port {self.port}")
            if time.monotonic() > deadline:
                await self.stop()
                raise TimeoutError(f"the proxy did not start within {self.startup_timeout_s} s")
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        """Stop the server (waits up to 10 s for requests in flight, then cancels)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=10)
            except (TimeoutError, SystemExit):
                self._task.cancel()
            self._task = None
        self._server = None

    async def __aenter__(self) -> RecordingProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
