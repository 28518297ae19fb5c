"""Reading a config field's type annotation: its non-null type, whether it is a section, and the
name a user reads in an error message or in the configuration reference.

Shared by the override parser (which needs to know where a mapping or a section starts), the
validation messages (``expected one of 'keep', 'abort'``) and the docs generator.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel

__all__ = ["is_model", "strip_optional", "type_name"]


def strip_optional(ann: Any) -> Any:
    """``X`` for ``X | None`` (and for ``Annotated[X | None, ...]``); anything else unchanged."""
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    origin = typing.get_origin(ann)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def is_model(ann: Any) -> bool:
    """True when ``ann`` is a pydantic model class (a config section)."""
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def type_name(ann: Any) -> str:
    """The annotation as a user reads it: ``one of 'a', 'b'``, ``int or null``, ``list[str]``,
    ``mapping with type: 'judge'``."""
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if ann is None:
        return "?"
    if ann is type(None):
        return "null"
    origin = typing.get_origin(ann)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(ann))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(ann))
    if is_model(ann):
        tag = ann.model_fields.get("type")
        kinds = typing.get_args(tag.annotation) if tag is not None else ()
        return f"mapping with type: {kinds[0]!r}" if len(kinds) == 1 else "mapping"
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(ann))
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{args}]"
    return getattr(ann, "__name__", str(ann))
