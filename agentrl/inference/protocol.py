"""Request and response models of the embedded server's OpenAI/vLLM-compatible HTTP API.

Why it exists: the embedded server and vLLM must look the same to one client, so the wire
format lives in one place. Requests are validated here (negative ``max_tokens``, bad
temperatures ... become 400 errors naming the field); unknown fields are ignored, as vLLM does.

Every response that carries tokens has a top-level ``weight_version`` (the oldest weight version
that produced any of its tokens) and the server echoes it in the ``x-weight-version`` header;
a ``/v1/completions`` choice also lists ``token_versions``, the version of each of its tokens (an
agentrl extension: a request that a ``keep`` pause carried across a weight push spans two).
Numbers that no engine can use are refused here, naming the field: non-finite floats, seeds
outside int64, versions outside ``[0, 2**63 - 1]`` or not integers (``"3"``, ``3.0``, ``true``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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
    "ProbeRequest",
    "ProbeResponse",
    "UpdateWeightsFromPathRequest",
    "UpdateWeightsFromUrlRequest",
    "Usage",
    "WeightVersionRequest",
]


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Version = Annotated[int, Field(ge=0, le=INT64_MAX, strict=True)]
"""A weight version: a JSON integer in ``[0, 2**63 - 1]``."""
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _SamplingFields(_Request):
    model: str | None = None
    """Served model name; must match the server's when given."""
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    """Below 1e-5 the server samples greedily (as vLLM)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=-1, ge=-1)
    """-1 or 0: off."""
    seed: Seed | None = None
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
    token_versions: list[int] | None = None
    """The weight version that sampled each token (agentrl's extension; vLLM sends none)."""


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
    chat_template: str | None = None
    """A Jinja chat template for this request; refused unless the server was started with
    ``--trust-request-chat-template`` (vLLM's flag of the same name)."""
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
    path: str = Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")
    """A directory of ``*.safetensors`` files (or one file)."""
    version: Version | None = None
    """The new weight version; default: current + 1."""


class UpdateWeightsFromUrlRequest(_Request):
    """``POST /update_weights_from_url``: pull a safetensors file over plain HTTP."""

    url: str = Field(max_length=4096)
    """``http://host:port/path`` (e.g. a :class:`~agentrl.inference.weights.WeightServer` URL)."""
    version: Version | None = None
    """The new weight version; default: current + 1."""


class WeightVersionRequest(_Request):
    version: Version
    rollback: bool = False
    """Allow a version lower than the served one (an explicit rollback)."""


class PushLeaseRequest(_Request):
    """``POST /push_lease``: take the one-writer lease for a weight push."""

    holder: str = Field(default="", max_length=200)
    ttl_s: float = 600.0
    writer: str = Field(default="", max_length=200)
    """Who pushes (one id per trainer process): a writer new to the server starts a new version
    sequence, so a new or resumed run may push versions below the served one."""


class ProbeRequest(_Request):
    """``POST /probe``: a short generation served ahead of the queue, also while paused.

    With ``token_ids`` the server scores those tokens after ``prompt`` (teacher forcing);
    without, it samples ``max_tokens`` tokens with ``seed``. No top-k/top-p, no EOS stop.
    """

    prompt: list[int] = Field(min_length=1)
    token_ids: list[int] | None = Field(default=None, min_length=1, max_length=256)
    max_tokens: int = Field(default=8, ge=1, le=256)
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    seed: Seed = 0


class ProbeResponse(BaseModel):
    token_ids: list[int]
    logprobs: list[float]
    """Processed logprob of each token under the weights the server holds now."""
    weight_version: int


class CollectiveRpcRequest(_Request):
    """vLLM's ``/collective_rpc``; the embedded server knows ``reload_weights``."""

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None
