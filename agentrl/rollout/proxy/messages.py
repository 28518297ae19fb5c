"""Request translation: OpenAI messages as the chat template renders them, and as keys to compare.

Why it exists: an OpenAI client sends messages with content parts, null fields, call ids and
JSON-string arguments; the chat template wants plain messages, and the recorder must tell
whether a request continues the conversation it recorded regardless of those details.

Guarantees:

- a message that leaves :func:`plain_message` has a role the chat template renders
  (:data:`ALLOWED_ROLES`), string content (text parts joined), and no null field;
- text that is not valid Unicode (a lone surrogate) is refused by :func:`check_text` with a 400
  naming the field, before it reaches the tokenizer;
- two messages have equal :func:`message_key` exactly when they agree on role, content text
  (stripped) and tool calls (names and parsed arguments); call ids and extra fields are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentrl.jsonsafe import MAX_JSON_DEPTH, loads_limited
from agentrl.rollout.proxy.protocol import ProxyError
from agentrl.types import Message

__all__ = [
    "ALLOWED_ROLES",
    "check_text",
    "content_text",
    "message_key",
    "plain_message",
    "tools_key",
]

ALLOWED_ROLES = ("system", "user", "assistant", "tool")
"""Message roles the chat template renders; any other role is refused with a 400."""


def content_text(content: Any) -> str:
    """The text of a message's content: a string, or OpenAI's list of parts (text parts joined)."""
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
            return loads_limited(arguments, what="arguments") if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments


def check_text(value: Any, where: str, depth: int = 0) -> int:
    """Refuse strings the tokenizer cannot encode (a lone UTF-16 surrogate, e.g. ``"\\ud800"``
    in JSON) and values nested deeper than :data:`MAX_JSON_DEPTH` with a 400 naming the field,
    instead of failing deep inside tokenization or the chat template. Returns the number of
    characters in the strings of ``value`` (keys included), for a length check before rendering."""
    if depth > MAX_JSON_DEPTH:
        raise ProxyError(
            400, f"{where} is nested more than {MAX_JSON_DEPTH} levels deep; flatten it", where
        )
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return len(value)
        except UnicodeEncodeError as exc:
            raise ProxyError(
                400,
                f"{where} holds a lone surrogate (position {exc.start}); send valid Unicode text",
                param=where,
            ) from None
    if isinstance(value, dict):
        return sum(
            check_text(k, where, depth + 1) + check_text(v, f"{where}.{k}", depth + 1)
            for k, v in value.items()
        )
    if isinstance(value, list):
        return sum(check_text(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    return 0


def plain_message(msg: dict[str, Any], index: int) -> Message:
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
        out["content"] = content_text(out["content"])
    if role != "assistant" and "content" not in out:
        out["content"] = ""
    return out


def message_key(msg: Message) -> tuple[Any, ...]:
    """What identifies a message for continuation checks: role, content text and tool calls."""
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        calls.append(
            (fn.get("name"), json.dumps(_arguments_value(fn.get("arguments")), sort_keys=True))
        )
    return (msg.get("role"), content_text(msg.get("content")).strip(), tuple(calls))


def tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    """The tools list as one comparable string ("" for none)."""
    return json.dumps(list(tools), sort_keys=True) if tools else ""
