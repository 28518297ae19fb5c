"""JSON from models and clients, parsed with a nesting limit.

Why it exists: Python's ``json`` decoder recurses once per nesting level, so a few kilobytes of
``[[[[...`` from a client (a safetensors header, LoRA metadata) or from a model (tool-call
arguments) raise ``RecursionError`` deep inside a request, which surfaces as a 5xx or, in a
tool-call parser, as an exception where the contract says "never raises". Every place that parses
JSON it did not write itself goes through :func:`loads_limited`.

Guarantees:

- :func:`loads_limited` refuses text nested deeper than ``max_depth`` (default
  :data:`MAX_JSON_DEPTH`) with :class:`JsonDepthError` before decoding it; the check is linear in
  the text and never recurses;
- :class:`JsonDepthError` is a :class:`json.JSONDecodeError` (hence a ``ValueError``), so callers
  that already turn malformed JSON into a 4xx or a parse error handle deep JSON the same way;
- a ``RecursionError`` the decoder raises anyway (a lower interpreter limit) is reported as a
  :class:`JsonDepthError` too.

Example::

    loads_limited('{"a": [1, 2]}')      # {'a': [1, 2]}
    loads_limited("[" * 10_000)          # raises JsonDepthError (a json.JSONDecodeError)
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "JsonDepthError", "json_depth", "loads_limited"]

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects accepted from a client or a model."""

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class JsonDepthError(json.JSONDecodeError):
    """JSON nested deeper than the limit (a ``json.JSONDecodeError``, so a ``ValueError``)."""


def json_depth(text: str, stop_above: int | None = None) -> int:
    """The deepest nesting of arrays/objects in ``text`` (brackets inside strings ignored).

    With ``stop_above``, returns as soon as the depth exceeds it (the text need not be read
    to its end). Works on malformed text too: it only counts brackets.
    """
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    return deepest
        else:
            depth -= 1
    return deepest


def loads_limited(
    text: str | bytes | bytearray, *, max_depth: int = MAX_JSON_DEPTH, what: str = "JSON"
) -> Any:
    """``json.loads(text)``, refusing nesting deeper than ``max_depth`` with
    :class:`JsonDepthError` (whose message names ``what``, the depth and the limit)."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8")
    # Fewer opening brackets than the limit cannot nest past it: skip the scan.
    few = text.count("[") + text.count("{") <= max_depth
    if not few and json_depth(text, stop_above=max_depth) > max_depth:
        raise JsonDepthError(
            f"{what} is nested more than {max_depth} levels deep; flatten it", text[:0], 0
        )
    try:
        return json.loads(text)
    except RecursionError:
        raise JsonDepthError(
            f"{what} is nested too deeply to decode; flatten it", text[:0], 0
        ) from None
