"""Generation routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (vLLM's subset).

Guarantees (on top of the server's): a request whose client disconnects is aborted in the
engine (its tokens are not generated for nobody, and a pool that timed out and retried elsewhere
gets no duplicate); ``x-request-timeout-s`` gives the request a deadline after which the engine
aborts it; chat templates and string prompts are rendered/tokenized off the event loop with a
time limit; a request-supplied chat template is refused unless the server trusts them; every
logprob in a response is finite (tokens masked by top-k/top-p are left out of the
alternatives); each finished request appends one line to the request log.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agentrl.inference import protocol as P
from agentrl.inference.chat import (
    ChatInputError,
    normalize_messages,
    parse_hermes_tool_calls,
    render_chat,
    validate_tools,
)
from agentrl.inference.engine import EngineOutput, EngineRequestError, EngineStepError
from agentrl.inference.routes.common import APIError, ServerState, until_disconnect
from agentrl.types import SamplingParams

__all__ = ["register"]

MAX_CHARS_PER_TOKEN = 64
"""Longest text one token stands for, as far as the length checks before rendering go."""
MAX_TEMPLATE_CHARS = 64 * 1024
"""Largest request-supplied chat template accepted (when they are trusted at all)."""


# ---- request checks ------------------------------------------------------------------------------
def _check_common(st: ServerState, req: Any) -> None:
    if req.model is not None and req.model != st.model_name:
        raise APIError(
            404,
            f"The model `{req.model}` does not exist; this server serves `{st.model_name}`",
            param="model",
            type_="NotFoundError",
        )
    if req.stream:
        raise APIError(400, "stream=true is not supported by the embedded server", param="stream")
    if getattr(req, "echo", False):
        raise APIError(400, "echo=true is not supported by the embedded server", param="echo")
    if req.stop:
        raise APIError(
            400, "string 'stop' sequences are not supported; use stop_token_ids", param="stop"
        )
    if req.seed is not None and req.seed + req.n - 1 > P.INT64_MAX:
        raise APIError(
            400, f"seed + n - 1 = {req.seed + req.n - 1} overflows int64; lower seed", param="seed"
        )


def _sampling(req: Any, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k if req.top_k > 0 else -1,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
    )


def _timeout_header(request: Request) -> float | None:
    raw = request.headers.get("x-request-timeout-s")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise APIError(
            400, f"x-request-timeout-s={raw!r:.40}; send seconds > 0", param="x-request-timeout-s"
        )
    return value


def _utf8(text: str, param: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400, f"{param} is not valid Unicode text ({e.reason} at {e.start})", param=param
        ) from e
    return text


# ---- the engine call -----------------------------------------------------------------------------
async def _run_engine(
    st: ServerState,
    request: Request,
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    n: int,
    request_id: str,
    session_id: str | None,
    num_top: int,
    endpoint: str,
    ignore_eos: bool,
) -> list[EngineOutput]:
    engine = st.engine
    timeout_s = _timeout_header(request)
    futures = []
    try:
        for i in range(n):
            sp = sampling
            if n > 1 and sampling.seed is not None:
                sp = sampling.model_copy(update={"seed": sampling.seed + i})
            futures.append(
                engine.submit(
                    prompt_ids,
                    sp,
                    f"{request_id}-{i}",
                    num_top_logprobs=num_top,
                    ignore_eos=ignore_eos,
                    timeout_s=timeout_s,
                )
            )
    except EngineRequestError as e:
        for f in futures:
            engine.cancel(f)
        raise APIError(400, str(e), param=e.param) from e
    except RuntimeError as e:  # the engine is shutting down
        raise APIError(503, str(e)) from e

    async def gather() -> list[EngineOutput]:
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except BaseException:
            for f in futures:
                engine.cancel(f)
            raise

    try:
        outs = await until_disconnect(request, gather())
    except EngineStepError as e:
        raise APIError(500, f"generation failed: {e}") from e
    _record(st, outs, endpoint, session_id)
    return outs


def _record(st: ServerState, outs: list[EngineOutput], endpoint: str, session: str | None) -> None:
    m = st.metrics
    for o in outs:
        m["requests"].labels(endpoint, o.finish_reason).inc()
        m["prompt_tokens"].inc(len(o.prompt_ids))
        m["gen_tokens"].inc(len(o.token_ids))
        if st.log_sink is not None:
            st.log_sink.write(
                request_id=o.request_id,
                session_id=session,
                prompt_ids=o.prompt_ids,
                output_ids=o.token_ids,
                weight_version=o.weight_version,
                finish_reason=o.finish_reason,
            )


def _versioned(body: dict[str, Any], version: int) -> JSONResponse:
    body["weight_version"] = version
    return JSONResponse(body, headers={"x-weight-version": str(version)})


def _usage(outs: Sequence[EngineOutput]) -> P.Usage:
    p = len(outs[0].prompt_ids) if outs else 0
    c = sum(len(o.token_ids) for o in outs)
    return P.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


# ---- /v1/completions -----------------------------------------------------------------------------
def _completion_logprobs(st: ServerState, o: EngineOutput, as_ids: bool) -> dict[str, Any]:
    tok = st.tokenizer

    def name(t: int) -> str:
        return f"token_id:{t}" if as_ids else tok.decode([t])

    offsets, off = [], 0
    for t in o.token_ids:
        offsets.append(off)
        off += len(tok.decode([t]))
    tops = []
    for j, (t, v) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
        top = {name(t): v}
        for tid, tv in (o.top_logprobs or [[]] * len(o.token_ids))[j]:
            top.setdefault(name(tid), tv)
        tops.append(top)
    return {
        "text_offset": offsets,
        "token_logprobs": o.logprobs,
        "tokens": [name(t) for t in o.token_ids],
        "top_logprobs": tops,
    }


async def _completion_prompt(st: ServerState, req: P.CompletionRequest) -> list[int]:
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) != 1:
            raise APIError(
                400, "batched prompts are not supported; send one prompt", param="prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        text = _utf8(prompt, "prompt")
        max_chars = st.engine.max_model_len * MAX_CHARS_PER_TOKEN
        if len(text) > max_chars:  # checked before the tokenizer sees it: no token is this long
            raise APIError(
                400,
                f"the prompt has {len(text)} characters; the context holds "
                f"{st.engine.max_model_len} tokens (at most {max_chars} characters)",
                param="prompt",
            )
        ids = await st.off_loop(
            lambda: st.tokenizer.encode(text, add_special_tokens=False),
            what="tokenizing the prompt",
            param="prompt",
        )
        return list(ids)
    return [int(t) for t in prompt]


async def completions(st: ServerState, req: P.CompletionRequest, request: Request) -> JSONResponse:
    """``POST /v1/completions``: token ids (or text) in, tokens, logprobs and the version out."""
    _check_common(st, req)
    prompt_ids = await _completion_prompt(st, req)
    max_tokens = (
        req.max_tokens
        if req.max_tokens is not None
        else max(0, st.engine.max_model_len - len(prompt_ids))
    )
    rid = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
    outs = await _run_engine(
        st,
        request,
        prompt_ids,
        _sampling(req, max_tokens),
        n=req.n,
        request_id=rid,
        session_id=request.headers.get("x-session-id") or req.user,
        num_top=req.logprobs or 0,
        endpoint="completions",
        ignore_eos=req.ignore_eos,
    )
    choices = [
        P.CompletionChoice(
            index=i,
            text=st.tokenizer.decode(o.token_ids, skip_special_tokens=True),
            logprobs=(
                P.CompletionLogprobs.model_validate(
                    _completion_logprobs(st, o, req.return_tokens_as_token_ids)
                )
                if req.logprobs is not None
                else None
            ),
            finish_reason=o.finish_reason,
            prompt_token_ids=o.prompt_ids if req.return_token_ids else None,
            token_ids=o.token_ids if req.return_token_ids else None,
            token_versions=o.token_versions,
        )
        for i, o in enumerate(outs)
    ]
    version = min(o.weight_version for o in outs)
    body = P.CompletionResponse(
        id=rid,
        created=int(time.time()),
        model=st.model_name,
        choices=choices,
        usage=_usage(outs),
        weight_version=version,
    ).model_dump()
    return _versioned(body, version)


# ---- /v1/chat/completions ------------------------------------------------------------------------
async def _chat_prompt(
    st: ServerState, req: P.ChatCompletionRequest
) -> tuple[list[int], list[dict[str, Any]]]:
    """Token ids of the rendered chat (off the event loop) and the validated tools."""
    kwargs = dict(req.chat_template_kwargs or {})
    template = req.chat_template if req.chat_template is not None else kwargs.get("chat_template")
    if template is not None:
        if not st.trust_request_chat_template:
            raise APIError(
                400,
                "this request carries its own chat_template, which the server refuses unless it "
                "was started with --trust-request-chat-template (as vLLM)",
                param="chat_template",
            )
        if not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS:
            raise APIError(
                400,
                f"chat_template must be a string of <= {MAX_TEMPLATE_CHARS} chars",
                param="chat_template",
            )
        kwargs["chat_template"] = template
    try:
        tools = validate_tools(req.tools)
        messages = normalize_messages(req.messages)
        if req.tool_choice not in (None, "auto", "none"):
            raise ChatInputError("only tool_choice 'auto' or 'none' is supported", "tool_choice")
    except ChatInputError as e:
        raise APIError(400, str(e), param=e.param) from e
    max_chars = st.engine.max_model_len * MAX_CHARS_PER_TOKEN

    def render() -> list[int]:
        return render_chat(
            st.tokenizer,
            messages,
            tools if req.tool_choice != "none" else None,
            add_generation_prompt=req.add_generation_prompt,
            max_chars=max_chars,
            **kwargs,
        )

    try:
        ids = await st.off_loop(render, what="rendering the chat template", param="messages")
    except ChatInputError as e:
        raise APIError(400, str(e), param=e.param) from e
    return ids, tools


def _chat_logprobs(st: ServerState, o: EngineOutput, as_ids: bool) -> dict[str, Any]:
    tok = st.tokenizer

    def entry(t: int, v: float) -> dict[str, Any]:
        text = tok.decode([t])
        return {
            "token": f"token_id:{t}" if as_ids else text,
            "logprob": v,
            "bytes": list(text.encode("utf-8", errors="replace")),
        }

    entries = []
    for j, (t, v) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
        alternatives = (o.top_logprobs or [[]] * len(o.token_ids))[j]
        entries.append({**entry(t, v), "top_logprobs": [entry(a, av) for a, av in alternatives]})
    return {"content": entries}


async def chat_completions(
    st: ServerState, req: P.ChatCompletionRequest, request: Request
) -> JSONResponse:
    """``POST /v1/chat/completions``: messages and tools in, hermes tool calls parsed out."""
    _check_common(st, req)
    prompt_ids, tools = await _chat_prompt(st, req)
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    if max_tokens is None:
        max_tokens = max(0, st.engine.max_model_len - len(prompt_ids))
    rid = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
    outs = await _run_engine(
        st,
        request,
        prompt_ids,
        _sampling(req, max_tokens),
        n=req.n,
        request_id=rid,
        session_id=request.headers.get("x-session-id") or req.user,
        num_top=(req.top_logprobs or 0) if req.logprobs else 0,
        endpoint="chat",
        ignore_eos=req.ignore_eos,
    )
    choices = []
    for i, o in enumerate(outs):
        text = st.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        parsed = parse_hermes_tool_calls(text) if tools else None
        tool_calls = parsed.tool_calls if parsed is not None else []
        finish = "tool_calls" if tool_calls and o.finish_reason == "stop" else o.finish_reason
        choices.append(
            P.ChatChoice(
                index=i,
                message=P.ChatMessage(
                    content=parsed.content if parsed is not None else text, tool_calls=tool_calls
                ),
                logprobs=_chat_logprobs(st, o, req.return_tokens_as_token_ids)
                if req.logprobs
                else None,
                finish_reason=finish,
                prompt_token_ids=o.prompt_ids if req.return_token_ids else None,
                token_ids=o.token_ids if req.return_token_ids else None,
            )
        )
    version = min(o.weight_version for o in outs)
    body = P.ChatCompletionResponse(
        id=rid,
        created=int(time.time()),
        model=st.model_name,
        choices=choices,
        usage=_usage(outs),
        weight_version=version,
    ).model_dump()
    return _versioned(body, version)


def register(app: FastAPI, st: ServerState) -> None:
    """Add the generation routes to ``app``."""

    @app.post("/v1/completions")
    async def _completions(req: P.CompletionRequest, request: Request) -> JSONResponse:
        return await completions(st, req, request)

    @app.post("/v1/chat/completions")
    async def _chat(req: P.ChatCompletionRequest, request: Request) -> JSONResponse:
        return await chat_completions(st, req, request)
