"""Request and response models of the embedded server's OpenAI/vLLM-compatible HTTP API.

Why it exists: the embedded server and vLLM must look the same to one client, so the wire
format lives in one place. Requests are validated here (negative ``max_tokens``, bad
temperatures ... become 400 errors naming the field); unknown fields are ignored, as vLLM does.

Every response that carries tokens has a top-level ``weight_version`` (the oldest weight version
that produced any of its tokens) and the server echoes it in the ``x-weight-version`` header.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CollectiveRpcRequest",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorBody",
    "ErrorResponse",
    "UpdateWeightsFromPathRequest",
    "Usage",
    "WeightVersionRequest",
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _SamplingFields(_Request):
    model: str | None = None
    """Served model name; must match the server's when given."""
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    """-1 or 0: off."""
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    user: str | None = None
    """Session id for the request log (the ``x-session-id`` header wins)."""
    return_tokens_as_token_ids: bool = False
    """Tokens in logprobs are ``"token_id:123"`` strings (vLLM)."""
    return_token_ids: bool = False
    """Add ``prompt_token_ids`` and ``token_ids`` to each choice (vLLM)."""
    ignore_eos: bool = False
    """Keep generating past EOS; only ``stop_token_ids`` and ``max_tokens`` stop (vLLM)."""


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``; ``prompt`` is token ids (or a string, tokenized by the server)."""

    prompt: list[int] | str | list[list[int]] | list[str]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    """Return the sampled token's logprob plus this many top alternatives."""
    echo: bool = False
    stop: str | list[str] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"]
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    weight_version: int


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` with OpenAI ``messages`` and function ``tools``."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    stop: str | list[str] | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None = None
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` (OpenAI format)."""
    finish_reason: Literal["stop", "length", "abort", "tool_calls"]
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    weight_version: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


class UpdateWeightsFromPathRequest(_Request):
    path: str
    """A directory of ``*.safetensors`` files (or one file)."""
    version: int | None = None
    """The new weight version; default: current + 1."""


class WeightVersionRequest(_Request):
    version: int


class CollectiveRpcRequest(_Request):
    """vLLM's ``/collective_rpc``; the embedded server knows ``reload_weights``."""

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None
