"""OpenAI function schemas from Python signatures, and argument validation with pydantic.

Why this module exists: a tool author writes a typed function and a docstring; the model
must see a JSON schema (OpenAI function-calling format) and the tool must receive arguments
that match its type hints. Both come from one pydantic model built from the signature, so the
schema the model sees and the validation the tool gets can never disagree.

Guarantees:

- :func:`arguments_model` turns a signature into a pydantic model (``extra="forbid"``, lax
  coercion such as ``"3" -> 3``); parameters without a default are required.
- :func:`clean_schema` returns a self-contained JSON schema: ``$ref``/``$defs`` are inlined,
  pydantic's ``title`` keys are dropped, and ``Optional[X] = None`` shows as plain ``X``
  (not required), which small models handle better than ``anyOf``.
- :func:`parse_docstring` reads Google style (``Args:`` / ``Arguments:`` / ``Parameters:``
  followed by ``name (type): text``), NumPy style (``Parameters`` + dashes, then
  ``name : type`` and an indented description) and Sphinx style (``:param name: text``)
  docstrings.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

__all__ = ["arguments_model", "clean_schema", "format_validation_error", "parse_docstring"]

_GOOGLE_SECTIONS = {
    "args",
    "arguments",
    "parameters",
    "params",
    "returns",
    "return",
    "yields",
    "raises",
    "examples",
    "example",
    "notes",
    "note",
    "see also",
    "attributes",
}
_GOOGLE_ARG_SECTIONS = {"args", "arguments", "parameters", "params"}
_GOOGLE_ARG = re.compile(r"^(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:(.*)$")
_SPHINX_FIELD = re.compile(r"^:(?:returns?|rtype|raises?|type|yields?)\b[^:]*:")
_NUMPY_ARG = re.compile(r"^(\*{0,2}\w+)\s*(?::\s*(.*))?$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a docstring into (description, {argument name: argument description}).

    The description is the text before the first section header (``Args:``, ``Returns:``,
    a NumPy header underlined with dashes, ...), paragraphs joined by a blank line.
    """
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    args: dict[str, str] = {}
    desc_lines, i = _read_description(lines, args)
    while i < len(lines):
        if _is_google_header(lines, i):
            i = _read_google_section(lines, i, args)
        elif _is_numpy_header(lines, i):
            i = _read_numpy_section(lines, i, args)
        else:
            i += 1
    description = "\n".join(desc_lines).strip()
    description = re.sub(r"\n{3,}", "\n\n", description)
    return description, args


def _is_numpy_header(lines: list[str], k: int) -> bool:
    """Line ``k`` is a NumPy section header (a non-blank line underlined with dashes)."""
    return (
        k + 1 < len(lines)
        and lines[k].strip() != ""
        and re.fullmatch(r"-{3,}", lines[k + 1].strip()) is not None
    )


def _is_google_header(lines: list[str], k: int) -> bool:
    """Line ``k`` is a Google section header such as ``Args:`` or ``Returns:``."""
    s = lines[k].strip()
    return s.endswith(":") and s[:-1].strip().lower() in _GOOGLE_SECTIONS


def _read_description(lines: list[str], args: dict[str, str]) -> tuple[list[str], int]:
    """The description lines before the first section header, and that header's index.

    Sphinx fields met on the way are read too: ``:param name: text`` (continuation lines
    indented) into ``args``; ``:returns:``, ``:raises ...:`` and ``:type x:`` are skipped.
    """
    desc_lines: list[str] = []
    i, n = 0, len(lines)
    while i < n and not _is_numpy_header(lines, i) and not _is_google_header(lines, i):
        sphinx = _SPHINX_PARAM.match(lines[i].strip())
        if sphinx:
            name = sphinx.group(1)
            args[name] = sphinx.group(2).strip()
            i += 1
            while i < n and lines[i].startswith((" ", "\t")) and lines[i].strip():
                args[name] = (args[name] + " " + lines[i].strip()).strip()
                i += 1
            continue
        if _SPHINX_FIELD.match(lines[i].strip()):
            i += 1
            continue
        desc_lines.append(lines[i])
        i += 1
    return desc_lines, i


def _read_google_section(lines: list[str], i: int, args: dict[str, str]) -> int:
    """Read the Google section whose header is line ``i`` (its argument items into ``args``);
    return the index of the first line after it (the first line indented no deeper than the
    header)."""
    n = len(lines)
    section = lines[i].strip()[:-1].strip().lower()
    header_indent = len(lines[i]) - len(lines[i].lstrip())
    i += 1
    current: str | None = None
    item_indent: int | None = None
    while i < n:
        line = lines[i]
        if line.strip() == "":
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= header_indent:
            break
        if item_indent is None:
            item_indent = indent
        if section in _GOOGLE_ARG_SECTIONS:
            m = _GOOGLE_ARG.match(line.strip())
            if indent == item_indent and m:
                key = str(m.group(1)).lstrip("*")
                args[key] = str(m.group(3)).strip()
                current = key
            elif current is not None:
                args[current] = (args[current] + " " + line.strip()).strip()
        i += 1
    return i


def _read_numpy_section(lines: list[str], i: int, args: dict[str, str]) -> int:
    """Read the NumPy section whose header is line ``i`` (``name : type`` items of a parameters
    section into ``args``); return the index of the next NumPy header or the end."""
    n = len(lines)
    section = lines[i].strip().lower()
    i += 2
    current: str | None = None
    while i < n and not _is_numpy_header(lines, i):
        line = lines[i]
        if line.strip() == "":
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        if section in ("parameters", "other parameters") and indent == 0:
            m = _NUMPY_ARG.match(line.strip())
            current = m.group(1).lstrip("*") if m else None
            if current is not None:
                args[current] = ""
        elif section in ("parameters", "other parameters") and current is not None:
            args[current] = (args[current] + " " + line.strip()).strip()
        i += 1
    return i


def arguments_model(
    fn: Callable[..., Any],
    arg_docs: dict[str, str] | None = None,
    *,
    model_name: str | None = None,
    method: bool = False,
) -> type[BaseModel]:
    """A pydantic model of ``fn``'s parameters (type hints, defaults, docstring descriptions).

    ``*args``/``**kwargs`` are not allowed (a tool's arguments are a JSON object with named
    fields), and neither is a parameter without a type hint (the model would see an empty
    schema for it): both raise ``TypeError`` naming the parameter and the fix. ``method=True``
    skips the first parameter (``self`` of a tool method, bound per episode).
    """
    arg_docs = arg_docs or {}
    sig = inspect.signature(fn)
    try:
        hints = _type_hints(fn)
    except Exception as exc:  # a forward reference that cannot be resolved
        raise TypeError(
            f"tool {getattr(fn, '__name__', fn)!r}: cannot resolve type hints ({exc}); "
            "import the types the signature names at module level"
        ) from exc
    fields: dict[str, Any] = {}
    params = list(sig.parameters.items())[1 if method else 0 :]
    for pname, param in params:
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise TypeError(
                f"tool {fn.__name__!r}: parameter {pname!r} is *args/**kwargs; a tool takes "
                "named arguments only (declare each one with a type hint)"
            )
        if pname not in hints:
            raise TypeError(
                f"tool {fn.__name__!r}: parameter {pname!r} has no type annotation, so the "
                f"model would see no schema for it; annotate it (e.g. `{pname}: int`, "
                f"`{pname}: str`, `{pname}: Literal['a', 'b']`)"
            )
        annotation = hints[pname]
        default = ... if param.default is inspect.Parameter.empty else param.default
        desc = arg_docs.get(pname)
        fields[pname] = (annotation, Field(default, description=desc or None))
    name = model_name or f"{fn.__name__}_arguments"
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(fn, include_extras=True)


def clean_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A self-contained JSON schema for ``model``: refs inlined, titles dropped."""
    raw = model.model_json_schema()
    defs = raw.pop("$defs", {})
    schema = _inline(raw, defs, depth=0)
    schema.setdefault("properties", {})
    schema["type"] = "object"
    required = set(schema.get("required", []))
    for pname, prop in list(schema["properties"].items()):
        if pname not in required:
            schema["properties"][pname] = _drop_null_branch(prop)
    if not schema.get("required"):
        schema.pop("required", None)
    return schema


def _inline(node: Any, defs: dict[str, Any], depth: int) -> Any:
    if depth > 32:
        raise TypeError("tool argument types nest too deeply (recursive model?) for a schema")
    if isinstance(node, dict):
        if "$ref" in node:
            ref = node["$ref"].split("/")[-1]
            target = copy.deepcopy(defs[ref])
            extra = {k: v for k, v in node.items() if k != "$ref"}
            target.update(extra)
            return _inline(target, defs, depth + 1)
        return {k: _inline(v, defs, depth) for k, v in node.items() if k != "title"}
    if isinstance(node, list):
        return [_inline(v, defs, depth) for v in node]
    return node


def _drop_null_branch(prop: dict[str, Any]) -> dict[str, Any]:
    """``{"anyOf": [X, {"type": "null"}], "default": None}`` -> ``X`` (the field is optional)."""
    branches = prop.get("anyOf")
    if not isinstance(branches, list):
        return prop
    non_null = [b for b in branches if b != {"type": "null"}]
    if len(non_null) != 1 or len(non_null) == len(branches):
        return prop
    out = {k: v for k, v in prop.items() if k != "anyOf"}
    merged = dict(non_null[0])
    merged.update(out)
    if merged.get("default", 0) is None:
        merged.pop("default")
    return merged


def format_validation_error(exc: Exception) -> str:
    """``field: problem; other.0: problem`` for a pydantic ValidationError, else ``str(exc)``."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "arguments"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)
