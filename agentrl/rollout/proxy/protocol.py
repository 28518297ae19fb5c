"""The OpenAI wire format the proxy speaks: the request it reads, the response and errors it writes.

Why it exists: the recorder works in token ids and trajectories; what crosses HTTP is OpenAI's
chat-completions shape. Keeping that shape here lets the recorder, the proxy's own app and the
rollout service's session routes share one definition.

Guarantees: every error leaves as OpenAI's ``{"error": {"message", "type", "param", "code"}}``
with the HTTP status it carries; a response has exactly one choice, OpenAI's ``usage`` and a
top-level ``weight_version`` (the oldest weight version that produced its tokens; -1 when none
were made).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.types import Message

__all__ = ["ChatCompletionRequest", "ProxyError", "chat_completion"]


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


def chat_completion(
    req: ChatCompletionRequest,
    assistant: Message,
    token_ids: list[int],
    logprobs: list[float],
    *,
    model_name: str,
    cut_by_length: bool,
    aborted: bool = False,
    prompt_len: int,
    version: int,
) -> dict[str, Any]:
    """The ``chat.completion`` response body (one choice, usage, ``weight_version``).

    ``finish_reason`` is ``abort`` when the server cut the generation (a deadline, a shutdown:
    truncation is never reported as success), else ``tool_calls`` when the reply calls tools,
    else ``length`` when the generation was cut by a token budget (``cut_by_length``), else
    ``stop``.
    """
    if aborted:
        finish = "abort"
    elif assistant.get("tool_calls"):
        finish = "tool_calls"
    elif cut_by_length:
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
        "model": req.model or model_name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": len(token_ids),
            "total_tokens": prompt_len + len(token_ids),
        },
        "weight_version": version,
    }
