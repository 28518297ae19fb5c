"""Dotted command-line overrides: ``trainer.lr=1e-6`` applied to a raw config mapping.

Guarantees: values are parsed with YAML scalar rules (``2`` -> int, ``1e-6`` -> float, ``false``
-> bool, ``[a, b]`` -> list, ``null`` -> None) and applied before validation, so an override is
checked exactly like the file; an override into a mapping-valued field the file does not set
(``reward.sources.mydata=fn``) adds to that field's default mapping instead of replacing it; a
knob under a variant's shorthand (``algorithm.loss.clip_ratio_high=0.28`` over ``loss: vanilla``)
keeps the name. The input mapping is never changed.
"""

from __future__ import annotations

import copy
import typing
from typing import Any

import yaml
from pydantic import BaseModel

from agentrl.config.algorithm import VariantSection
from agentrl.config.annotation import is_model, strip_optional
from agentrl.config.section import ConfigError
from agentrl.config.yaml_io import load_yaml

__all__ = ["apply_overrides", "parse_override"]


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into (``["a", "b", "c"]``, value parsed with YAML scalar rules)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form 'section.key=value'")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"override {text!r}: empty component in key {key!r}")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: cannot parse value {raw!r}: {exc}") from exc
    return parts, value


def _default_mapping(model: Any, key: str) -> tuple[Any, dict[str, Any]]:
    """(annotation of ``model.key`` or None, its default when that is a mapping, else {})."""
    if not is_model(model) or key not in model.model_fields:
        return None, {}
    field = model.model_fields[key]
    ann = strip_optional(field.annotation)
    if typing.get_origin(ann) is dict:
        default = field.default_factory() if field.default_factory is not None else field.default
        return ann, copy.deepcopy(default) if isinstance(default, dict) else {}
    return ann, {}


def apply_overrides(
    data: dict[str, Any],
    overrides: typing.Iterable[str],
    schema: type[BaseModel] | None = None,
) -> dict[str, Any]:
    """Apply dotted overrides to a raw config mapping (a new mapping; the input is unchanged).

    With ``schema``, an override into a mapping-valued field the file does not set (e.g.
    ``reward.sources.mydata=fn``) adds to that field's default mapping instead of replacing it.
    """
    out = copy.deepcopy(data) if data else {}
    for text in overrides:
        parts, value = parse_override(text)
        node: dict[str, Any] = out
        model: Any = schema
        for i, part in enumerate(parts[:-1]):
            ann, default = _default_mapping(model, part)
            if is_model(model) and part in model.model_fields and ann is None:
                ann = strip_optional(model.model_fields[part].annotation)
            model = ann if is_model(ann) else None
            child: Any = node.get(part)
            if isinstance(child, str) and isinstance(ann, type) and issubclass(ann, VariantSection):
                child = node[part] = {"name": child}  # `loss: vanilla` shorthand, then a knob
            if child is None:
                child = node[part] = default
            elif not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(
                    f"override {text!r}: '{where}' is a value ({child!r}), not a section"
                )
            node = child
        node[parts[-1]] = value
    return out
