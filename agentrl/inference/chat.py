"""Chat helpers for the embedded server: render messages to token ids, parse hermes tool calls.

Why it exists: ``/v1/chat/completions`` must turn OpenAI messages + tools into the exact token
ids the model sees (the tokenizer's own chat template, no re-tokenization tricks) and turn the
model's ``<tool_call>{json}</tool_call>`` output back into OpenAI ``tool_calls``.

Guarantees: :func:`parse_hermes_tool_calls` never drops a malformed call silently: a block that
is not valid JSON with a string ``name`` stays in the returned content and is reported in
``errors``; :func:`validate_tools` raises :class:`ChatInputError` naming the bad field
(``tools[2].function.name``) so the server can answer 400.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ChatInputError",
    "ParsedOutput",
    "normalize_messages",
    "parse_hermes_tool_calls",
    "render_chat",
    "validate_tools",
]

_ROLES = ("system", "user", "assistant", "tool")


class ChatInputError(ValueError):
    """Malformed chat input; ``param`` is the path of the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ParsedOutput:
    """The model's text split into plain content and OpenAI-style tool calls."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """``[{"id", "type": "function", "function": {"name", "arguments": json-string}}]``."""
    errors: list[str] = field(default_factory=list)
    """One message per ``<tool_call>`` block that could not be parsed (kept in ``content``)."""


def parse_hermes_tool_calls(text: str) -> ParsedOutput:
    """Split ``text`` into content and ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls.

    The one hermes parser of the project (:class:`agents.parsers.HermesParser`, which the agents,
    the proxy and the rewards use too), with malformed blocks kept in the content, as an
    OpenAI-compatible server returns them. ``arguments`` may be an object or a JSON string
    holding one. A trailing ``<tool_call>`` without its closing tag (generation cut by
    max_tokens) is an error and stays in content.
    """
    from agents.parsers import HermesParser

    parsed = HermesParser(keep_malformed=True).parse(text)
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in parsed.calls
    ]
    content = parsed.content if calls else text
    return ParsedOutput(content=content or None, tool_calls=calls, errors=list(parsed.errors))


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """Check an OpenAI ``tools`` list; returns it unchanged or raises :class:`ChatInputError`."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatInputError("'tools' must be a list of function tools", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ChatInputError(f"{where} must be an object with type 'function'", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ChatInputError(f"{where}.function must be an object", f"{where}.function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatInputError(
                f"{where}.function.name must be a non-empty string", f"{where}.function.name"
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ChatInputError(
                f"{where}.function.parameters must be a JSON-schema object",
                f"{where}.function.parameters",
            )
    return tools


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI messages and flatten text content parts; raises :class:`ChatInputError`."""
    if not isinstance(messages, list) or not messages:
        raise ChatInputError("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ChatInputError(f"{where} must be an object", where)
        role = msg.get("role")
        if role not in _ROLES:
            raise ChatInputError(f"{where}.role is {role!r}; use one of {_ROLES}", f"{where}.role")
        m = dict(msg)
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ChatInputError(
                        f"{where}.content[{j}] must be a text part; only text is supported",
                        f"{where}.content",
                    )
                parts.append(str(part.get("text", "")))
            m["content"] = "".join(parts)
        elif content is None:
            if not (role == "assistant" and m.get("tool_calls")):
                raise ChatInputError(f"{where}.content is missing", f"{where}.content")
        elif not isinstance(content, str):
            raise ChatInputError(f"{where}.content must be a string", f"{where}.content")
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise ChatInputError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ChatInputError(
                        f"{where}.tool_calls[{j}] needs function.name",
                        f"{where}.tool_calls[{j}].function",
                    )
        out.append(m)
    return out


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    max_chars: int | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of the chat template applied to ``messages`` (and ``tools``).

    Renders to text and encodes without adding special tokens, exactly as vLLM's chat endpoint
    does. Template errors, a rendered text longer than ``max_chars`` and text that is not valid
    Unicode (a lone surrogate) become :class:`ChatInputError` on ``messages``.
    """
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except Exception as e:  # jinja raises many types; all mean the input does not fit the template
        raise ChatInputError(
            f"the chat template could not render the messages: {e}", "messages"
        ) from e
    if not isinstance(text, str):
        raise ChatInputError("the chat template did not render to text", "messages")
    if max_chars is not None and len(text) > max_chars:
        raise ChatInputError(
            f"the rendered chat has {len(text)} characters, more than this server's context "
            f"could hold ({max_chars}); shorten the messages",
            "messages",
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ChatInputError(
            f"the messages are not valid Unicode text ({e.reason} at {e.start})", "messages"
        ) from e
    return list(tokenizer.encode(text, add_special_tokens=False))
