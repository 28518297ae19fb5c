"""The scoring route of a reward-model or teacher server: ``POST /pooling`` (vLLM's subset, plus
a ``logprobs`` task for a distillation teacher).

Why vLLM's ``/pooling``: vLLM serves a sequence classifier with ``--runner pooling`` on CPU and
GPU, and answers ``POST /pooling`` with one vector per input; the embedded server answers the
same request the same way, so one client (:class:`agentrl.rollout.model_rewards.RewardModelClient`)
scores against either. (vLLM's ``/v1/score`` is something else: cross-encoder scores of text
pairs.)

Request: ``input`` (token ids, a batch of token-id lists, a string or a list of strings), or
``messages`` (one conversation, rendered with the model's chat template; no generation prompt
unless ``add_generation_prompt``); ``use_activation`` (default true, as vLLM: sigmoid for one
label, softmax for several; false returns the raw logits a reward model is trained on).
Response: ``{"id", "object": "list", "created", "model", "data": [{"index", "object":
"pooling", "data": [float, ...]}], "usage"}``, one entry per input, in order.

A teacher server (``--task logprobs``: a causal LM in a ScoringEngine) answers ``task:
"logprobs"`` (with ``temperature``, default 1): each input's ``data`` is the logprob of each of
its tokens after the first, ``log softmax(logits / temperature)`` as the trainer computes it
(``len(input) - 1`` floats). vLLM has no such task; a vLLM teacher is asked through
``/v1/completions`` with ``prompt_logprobs`` (:mod:`agentrl.rollout.teacher`).

Guarantees: a batch is scored together with every other request in flight (the engine batches
across requests); a bad input (empty, out-of-vocabulary ids, over the context limit, a task
other than ``classify``) is a 400 naming it and fails only its request; a client that
disconnects has its sequences dropped from the queue; the API key rule of every other route
applies (:mod:`agentrl.inference.routes.auth`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from agentrl.inference.chat import ChatInputError, normalize_messages, render_chat
from agentrl.inference.engine import EngineRequestError, EngineStepError
from agentrl.inference.routes.common import APIError, ServerState, until_disconnect

__all__ = ["PoolingRequest", "register"]

MAX_INPUTS = 1024
"""Most sequences one request may carry."""


class PoolingRequest(BaseModel):
    """``POST /pooling`` (a subset of vLLM's; unknown fields are ignored, as vLLM does)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: list[int] | list[list[int]] | str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    task: str | None = None
    """``classify`` (the only pooling task a sequence classifier serves) or null."""
    use_activation: bool | None = None
    add_special_tokens: bool | None = None
    """Tokenizer special tokens for string inputs (default true) and chats (default false)."""
    add_generation_prompt: bool = False
    temperature: float = 1.0
    """Task ``logprobs``: the softmax temperature of the logprobs (> 0)."""


async def _inputs(st: ServerState, req: PoolingRequest) -> list[list[int]]:
    """Token ids of every input of ``req`` (strings and chats rendered off the event loop)."""
    if (req.input is None) == (req.messages is None):
        raise APIError(400, "send exactly one of 'input' or 'messages'", param="input")
    if req.messages is not None:
        try:
            messages = normalize_messages(req.messages)
        except ChatInputError as e:
            raise APIError(400, str(e), param=e.param) from e

        def render() -> list[int]:
            """The conversation's token ids (the model's chat template)."""
            return render_chat(
                st.tokenizer,
                messages,
                None,
                add_generation_prompt=req.add_generation_prompt,
                max_chars=st.engine.max_model_len * 64,
            )

        try:
            return [await st.off_loop(render, what="rendering the chat", param="messages")]
        except ChatInputError as e:
            raise APIError(400, str(e), param=e.param) from e
    raw: Any = req.input
    one = isinstance(raw, str) or not raw or not isinstance(raw[0], list | str)
    items = [raw] if one else raw  # one string or token-id list, or a batch of them
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"{len(items)} inputs; send at most {MAX_INPUTS}", param="input")
    if all(isinstance(x, list) for x in items):
        return [[int(t) for t in x] for x in items]
    special = True if req.add_special_tokens is None else req.add_special_tokens

    def tokenize() -> list[list[int]]:
        """Token ids of every string input."""
        return [list(st.tokenizer.encode(x, add_special_tokens=special)) for x in items]

    return await st.off_loop(tokenize, what="tokenizing the input", param="input")


def _activate(logits: list[float], use_activation: bool | None) -> list[float]:
    if use_activation is False:
        return logits
    t = torch.tensor(logits, dtype=torch.float64)
    t = torch.sigmoid(t) if t.numel() == 1 else torch.softmax(t, dim=-1)
    return t.tolist()


async def pooling(st: ServerState, req: PoolingRequest, request: Request) -> JSONResponse:
    """``POST /pooling``: one vector (the classifier's logits or probabilities) per input."""
    if req.model is not None and req.model != st.model_name:
        raise APIError(
            404,
            f"The model `{req.model}` does not exist; this server serves `{st.model_name}`",
            param="model",
        )
    serves = getattr(st.engine, "task", "classify")
    if (req.task or "classify") != serves:
        what = "a causal LM's token logprobs" if serves == "logprobs" else "a sequence classifier"
        raise APIError(
            400, f"task={req.task!r}: this server serves {what}; use {serves!r}", param="task"
        )
    if not req.temperature > 0:
        raise APIError(400, f"temperature={req.temperature}; it must be > 0", param="temperature")
    seqs = await _inputs(st, req)
    try:
        for i, ids in enumerate(seqs):
            st.engine.validate(ids, param=f"input[{i}]" if len(seqs) > 1 else "input")
        work = (
            st.engine.score(seqs, req.temperature)
            if serves == "logprobs"
            else st.engine.score(seqs)
        )
        rows = await until_disconnect(request, work)
    except EngineRequestError as e:
        raise APIError(400, str(e), param=e.param) from e
    except EngineStepError as e:
        raise APIError(500, str(e)) from e
    except RuntimeError as e:  # the engine is closed
        raise APIError(503, str(e)) from e
    m = st.metrics
    m["requests"].labels("pooling", "stop").inc(len(seqs))
    m["prompt_tokens"].inc(sum(len(s) for s in seqs))
    tokens = sum(len(s) for s in seqs)
    body = {
        "id": f"pool-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": st.model_name,
        "data": [
            {
                "index": i,
                "object": "pooling",
                "data": row if serves == "logprobs" else _activate(row, req.use_activation),
            }
            for i, row in enumerate(rows)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }
    return JSONResponse(body)


def register(app: FastAPI, st: ServerState) -> None:
    """Add ``POST /pooling`` to ``app`` (a server whose engine is a ScoringEngine)."""

    @app.post("/pooling")
    async def _pooling(req: PoolingRequest, request: Request) -> JSONResponse:
        return await pooling(st, req, request)
