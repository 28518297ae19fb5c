"""Tool-call parsers: model text in, tool calls (or counted errors) out.

Why this module exists: a tool call that fails to parse must never vanish. Every parser returns a
:class:`ParseResult` whose ``errors`` lists each malformed call with the reason, so the agent can
show the error to the model and count it (``Trajectory.tool_calls["<invalid>"]``).

Formats (pick one with ``agent.tool_call_format`` / :func:`get_parser`):

- ``hermes`` (Qwen2.5, Hermes, the tiny model): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the text; the text outside the blocks is the content.
- ``json`` (alias ``llama3_json``; Llama-3.x style): the whole message, optionally after
  ``<|python_tag|>``, is a JSON object ``{"name": ..., "parameters"|"arguments": {...}}``, a list
  of them, or several objects separated by ``;`` or newlines. A message that does not start with
  ``{`` or ``[`` is plain content.
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` objects; the
  text before the marker is the content.

Example::

    result = get_parser("hermes").parse('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>')
    assert result.calls[0].name == "calculator" and result.errors == []
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from agentrl.jsonsafe import MAX_JSON_DEPTH, json_depth, loads_limited
from agentrl.registry import Registry

__all__ = [
    "PARSERS",
    "HermesParser",
    "JsonParser",
    "MistralParser",
    "ParseResult",
    "ToolCall",
    "ToolCallParser",
    "get_parser",
    "list_parsers",
    "register_parser",
]


@dataclass
class ToolCall:
    """One well-formed tool call."""

    name: str
    arguments: dict[str, Any]
    raw: str
    """The exact text of the call as the model wrote it."""
    id: str = ""
    """A call id (set by the agent, e.g. ``call_0_1``), echoed in the tool message."""

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry of an assistant message."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclass
class ParseResult:
    """What a parser found in one model turn."""

    content: str
    """The text outside tool calls (stripped)."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One message per malformed call, suitable to show to the model."""


class ToolCallParser(ABC):
    """Turns the text of one model turn into content, tool calls and errors. Never raises."""

    name: str = ""

    @abstractmethod
    def parse(self, text: str) -> ParseResult:
        """The content, tool calls and error messages of one model turn's ``text``."""
        ...


def _call_from_obj(obj: Any, raw: str, where: str) -> ToolCall | str:
    """A ToolCall from a decoded JSON object, or an error message."""
    if not isinstance(obj, dict):
        return f"malformed tool call {where}: expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f'malformed tool call {where}: missing "name" (a non-empty string)'
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        # Some models double-encode the arguments (OpenAI style); accept a JSON string of an object.
        try:
            args = loads_limited(args, what="arguments") if args.strip() else {}
        except json.JSONDecodeError as exc:
            return (
                f"malformed tool call {where} to {name!r}: arguments are not valid JSON ({exc.msg})"
            )
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return (
            f'malformed tool call {where} to {name!r}: "arguments" must be a JSON object, '
            f"got {type(args).__name__}"
        )
    return ToolCall(name=name, arguments=args, raw=raw)


def _collect(call: ToolCall | str, calls: list[ToolCall], errors: list[str]) -> None:
    if isinstance(call, str):
        errors.append(call)
    else:
        calls.append(call)


def _decode_json(body: str, where: str) -> tuple[Any, str | None]:
    try:
        return loads_limited(body, what="the tool call"), None
    except json.JSONDecodeError as exc:
        snippet = body.strip()
        if len(snippet) > 80:
            snippet = snippet[:77] + "..."
        return None, f"malformed tool call {where}: invalid JSON ({exc.msg}): {snippet}"


class HermesParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>`` blocks (Hermes / Qwen2.5).

    ``keep_malformed=True`` leaves a malformed block's text in the content (what an
    OpenAI-compatible server returns, so a client sees what the model wrote); the agents'
    default drops it from the content and answers the error. Either way it is in ``errors``.
    """

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _OPEN = "<tool_call>"

    def __init__(self, *, keep_malformed: bool = False) -> None:
        self.keep_malformed = keep_malformed

    def parse(self, text: str) -> ParseResult:
        """Every ``<tool_call>{json}</tool_call>`` block; the text outside them is the content."""
        calls: list[ToolCall] = []
        errors: list[str] = []
        pieces: list[str] = []
        pos = 0
        n = 0
        for match in self._BLOCK.finditer(text):
            pieces.append(text[pos : match.start()])
            pos = match.end()
            n += 1
            where = f"#{n}"
            obj, err = _decode_json(match.group(1), where)
            call = err if err is not None else _call_from_obj(obj, match.group(0), where)
            if isinstance(call, str) and self.keep_malformed:
                pieces.append(match.group(0))
            _collect(call, calls, errors)
        rest = text[pos:]
        open_at = rest.find(self._OPEN)
        if open_at >= 0:
            n += 1
            pieces.append(rest if self.keep_malformed else rest[:open_at])
            errors.append(
                f"malformed tool call #{n}: <tool_call> is not closed by </tool_call> "
                "(the output may have been cut by the token limit)"
            )
        else:
            pieces.append(rest)
        return ParseResult(content="".join(pieces).strip(), calls=calls, errors=errors)


class JsonParser(ToolCallParser):
    """Plain JSON tool calls (Llama-3.x JSON style)."""

    name = "json"
    _PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParseResult:
        """JSON call objects or lists (after an optional ``<|python_tag|>``), else plain content."""
        body = text.strip()
        if body.startswith(self._PYTHON_TAG):
            body = body[len(self._PYTHON_TAG) :].strip()
        if not body.startswith(("{", "[")):
            return ParseResult(content=text.strip())
        if json_depth(body, stop_above=MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            return ParseResult(
                content="",
                errors=[f"malformed tool call #1: JSON nested more than {MAX_JSON_DEPTH} levels"],
            )
        calls: list[ToolCall] = []
        errors: list[str] = []
        decoder = json.JSONDecoder()
        idx, n = 0, 0
        while idx < len(body):
            while idx < len(body) and body[idx] in " \t\r\n;":
                idx += 1
            if idx >= len(body):
                break
            n += 1
            try:
                obj, end = decoder.raw_decode(body, idx)
            except json.JSONDecodeError as exc:
                errors.append(f"malformed tool call #{n}: invalid JSON ({exc.msg}) at char {idx}")
                break
            raw = body[idx:end]
            idx = end
            items = obj if isinstance(obj, list) else [obj]
            for k, item in enumerate(items):
                where = f"#{n}" if len(items) == 1 else f"#{n}.{k + 1}"
                call = _call_from_obj(item, raw, where)
                _collect(call, calls, errors)
        return ParseResult(content="", calls=calls, errors=errors)


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{...}, ...]`` (Mistral)."""

    name = "mistral"
    _MARKER = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParseResult:
        """The JSON list after ``[TOOL_CALLS]``; the text before it is the content."""
        at = text.find(self._MARKER)
        if at < 0:
            return ParseResult(content=text.strip())
        content = text[:at].strip()
        body = text[at + len(self._MARKER) :].strip()
        obj, err = _decode_json(body, "#1")
        if err is not None:
            return ParseResult(content=content, errors=[err])
        items = obj if isinstance(obj, list) else [obj]
        calls: list[ToolCall] = []
        errors: list[str] = []
        for k, item in enumerate(items):
            call = _call_from_obj(item, json.dumps(item), f"#{k + 1}")
            _collect(call, calls, errors)
        return ParseResult(content=content, calls=calls, errors=errors)


def _check_parser(obj: Any) -> None:
    if not (isinstance(obj, type) and issubclass(obj, ToolCallParser)):
        raise TypeError(f"a tool-call parser must be a ToolCallParser subclass, got {obj!r}")


PARSERS: Registry[type[ToolCallParser]] = Registry(
    "tool-call format",
    config_key="agent.tool_call_format",
    check=_check_parser,
    how_to_register="register a ToolCallParser subclass with register_parser('name', cls), or "
    "give 'module:Class'",
)
"""Tool-call parsers by format name."""
PARSERS.add("hermes", HermesParser)
PARSERS.add("json", JsonParser, "llama3_json")
PARSERS.add("mistral", MistralParser)


def register_parser(name: str, parser_cls: type[ToolCallParser]) -> type[ToolCallParser]:
    """Make ``parser_cls`` available as ``get_parser(name)``."""
    return PARSERS.add(name, parser_cls)


def list_parsers() -> list[str]:
    """Names of the registered tool-call formats."""
    return PARSERS.names()


def get_parser(name: str | ToolCallParser) -> ToolCallParser:
    """A parser by format name (``hermes``, ``json``/``llama3_json``, ``mistral``) or spec."""
    if isinstance(name, ToolCallParser):
        return name
    return PARSERS.get(name)()
