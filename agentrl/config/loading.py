"""Loading a config: a YAML file, then dotted overrides, then one validation with readable errors.

Guarantees:

- a file's top-level ``kind:`` picks the schema (:data:`~agentrl.config.experiment.KINDS`):
  ``rl`` (default, :class:`ExperimentConfig`) or ``sft`` (:class:`SFTConfig`);
  :func:`load_any_config` dispatches on it;
- every problem is one :class:`ConfigError` listing every bad key path: an unknown key reads
  ``unknown key 'trainer.max_stalenes'; did you mean 'trainer.max_staleness'?``, a type error
  names the dotted path, the expected type and the value that was given, and a key of an earlier
  version (:data:`MOVED_KEYS`) says where it lives now;
- relative paths in an RL config resolve against the file's folder (``base_dir``).
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml
from pydantic import BaseModel, ValidationError

from agentrl.config.annotation import is_model, strip_optional, type_name
from agentrl.config.experiment import KINDS, ExperimentConfig, SFTConfig
from agentrl.config.overrides import apply_overrides
from agentrl.config.section import ConfigError
from agentrl.config.yaml_io import load_yaml

__all__ = [
    "MOVED_KEYS",
    "load_any_config",
    "load_config",
    "load_sft_config",
    "validate_config",
]


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def _resolve_loc(root: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[str, Any, Any]:
    """Dotted path, the annotation at the path, and the model class holding the last key."""
    ann: Any = root
    parent: Any = root
    path = ""
    for item in loc:
        ann = strip_optional(ann)
        origin = typing.get_origin(ann)
        if is_model(ann):
            parent = ann
            path = f"{path}.{item}" if path else str(item)
            field = ann.model_fields.get(str(item))
            ann = field.annotation if field is not None else None
        elif isinstance(item, int) and origin in (list, tuple):
            path = f"{path}[{item}]"
            args = typing.get_args(ann)
            ann = args[0] if args else None
        elif origin is dict:
            path = f"{path}.{item}" if path else str(item)
            args = typing.get_args(ann)
            ann = args[1] if len(args) == 2 else None
        elif origin in (Union, types.UnionType):
            # A union-member tag (class name, or a discriminator value): not part of the path.
            ann = next((a for a in typing.get_args(ann) if _union_tag_matches(a, item)), None)
        # otherwise the item is a validator tag: not part of the user's path
    return path, ann, parent


def _union_tag_matches(member: Any, tag: int | str) -> bool:
    """Whether pydantic's loc item ``tag`` names union ``member`` (its class or type name, or
    the value of its ``type`` discriminator)."""
    name = getattr(member, "__name__", None)
    if name is not None and (tag == name or str(tag).endswith(f", {name}]")):
        return True  # a plain member, or one with validators ('function-after[_check(), Cls]')
    field = member.model_fields.get("type") if is_model(member) else None
    return field is not None and tag in typing.get_args(field.annotation)


def _closest(word: str, candidates: typing.Iterable[str]) -> str | None:
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


def _error_lines(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    lines: list[str] = []
    errors = exc.errors()
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if err["type"] == "string_type" and isinstance(err.get("input"), dict) and len(errors) > 1:
            continue  # a mapping given where `str | Section` is accepted: the Section's errors say it
        path, ann, parent = _resolve_loc(root, loc)
        if err["type"] == "extra_forbidden":
            key = str(loc[-1])
            section = path.rpartition(".")[0]
            valid = list(parent.model_fields) if is_model(parent) else []
            guess = _closest(key, valid)
            if guess is not None:
                hint = f"did you mean '{section + '.' if section else ''}{guess}'?"
            else:
                hint = f"valid keys{' in ' + repr(section) if section else ''}: {', '.join(valid)}"
            lines.append(f"unknown key '{path}'; {hint}")
            continue
        if not path:
            lines.append(str(err["msg"]).removeprefix("Value error, "))
            continue
        if err["type"] == "value_error":  # a validator's own message names the problem
            lines.append(f"'{path}': {str(err['msg']).removeprefix('Value error, ')}")
            continue
        given = err.get("input")
        line = f"'{path}': expected {type_name(ann)}, got {given!r}"
        if err["type"] == "literal_error":
            literal_args = typing.get_args(strip_optional(ann))
            guess = _closest(str(given), [str(a) for a in literal_args])
            if guess is not None:
                line += f"; did you mean {guess!r}?"
        else:
            line += f" ({err['msg']})"
        lines.append(line)
    return lines


MOVED_KEYS: dict[str, str] = {
    "algorithm.adv_estimator": "algorithm.advantage: {name: <estimator>}",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.advantage: {name: grpo, norm_adv_by_std_in_grpo: <bool>}",
    "algorithm.gamma": "algorithm.advantage: {name: <gae|reinforce_plus_plus>, gamma: <float>}",
    "algorithm.lam": "algorithm.advantage: {name: gae, lam: <float>}",
    "algorithm.policy_loss": "algorithm.loss: {name: <loss>}",
    "algorithm.clip_ratio_low": "algorithm.loss: {name: vanilla, clip_ratio_low: <float>}",
    "algorithm.clip_ratio_high": "algorithm.loss: {name: vanilla, clip_ratio_high: <float>}",
    "algorithm.clip_ratio_c": "algorithm.loss: {name: vanilla, clip_ratio_c: <float>}",
}
"""Keys of earlier versions -> where they live now (a clear migration error, not a silent drop)."""


_MOVED_GENERATOR_KWARGS = {
    "n": "data.generator_train_size",
    "n_train": "data.generator_train_size",
    "n_val": "data.generator_val_size",
    "seed": "data.seed (training tasks) and data.generator_val_seed (held-out tasks)",
}


def _moved_key_errors(data: dict[str, Any]) -> list[str]:
    lines = []
    gen = (
        (data.get("data") or {}).get("generator_kwargs")
        if isinstance(data.get("data"), dict)
        else None
    )
    if isinstance(gen, dict):
        for key, new in _MOVED_GENERATOR_KWARGS.items():
            if key in gen:
                lines.append(f"'data.generator_kwargs.{key}' moved: set {new}")
    for old, new in MOVED_KEYS.items():
        section, _, key = old.partition(".")
        node = data.get(section)
        if isinstance(node, dict) and key in node:
            lines.append(f"'{old}' moved: write `{new}` (see docs/configuration.md)")
    return lines


def validate_config(data: dict[str, Any], schema: type[ConfigT], source: str = "") -> ConfigT:
    """Validate a raw mapping against ``schema``; raise :class:`ConfigError` with dotted paths."""
    where = f" in {source}" if source else ""
    if not isinstance(data, dict):
        raise ConfigError(f"config{where} must be a mapping of sections, got {type(data).__name__}")
    moved = _moved_key_errors(data) if schema is ExperimentConfig else []
    if moved:
        raise ConfigError(f"invalid {schema.__name__}{where}:\n  " + "\n  ".join(moved))
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        lines = _error_lines(exc, schema)
        raise ConfigError(f"invalid {schema.__name__}{where}:\n  " + "\n  ".join(lines)) from None


def _read_yaml(path: str | Path | None) -> tuple[dict[str, Any], str]:
    if path is None:
        return {}, "<defaults>"
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc.strerror}") from exc
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(p)!r} must hold a mapping of sections, got {type(data).__name__}"
        )
    return data, str(p)


def load_any_config(
    path: str | Path | None, overrides: typing.Iterable[str] = ()
) -> ExperimentConfig | SFTConfig:
    """Load a YAML file (or defaults when ``path`` is None), apply overrides, dispatch on ``kind``."""
    data, source = _read_yaml(path)
    overrides = list(overrides)
    kind = apply_overrides(
        {"kind": data.get("kind", "rl")}, [o for o in overrides if o.strip().startswith("kind=")]
    )["kind"]
    schema = KINDS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        guess = _closest(str(kind), KINDS)
        hint = f"; did you mean {guess!r}?" if guess else ""
        raise ConfigError(f"'kind' in {source} is {kind!r}; valid kinds: {', '.join(KINDS)}{hint}")
    cfg = validate_config(apply_overrides(data, overrides, schema), schema, source)
    if isinstance(cfg, ExperimentConfig) and cfg.base_dir is None and path is not None:
        cfg.base_dir = str(Path(path).resolve().parent)
    return cfg


def load_config(path: str | Path | None, overrides: typing.Iterable[str] = ()) -> ExperimentConfig:
    """Load an RL experiment config (``kind: rl``): YAML file, then dotted overrides."""
    cfg = load_any_config(path, overrides)
    if not isinstance(cfg, ExperimentConfig):
        raise ConfigError(f"{path} is a '{cfg.kind}' config; load it with load_sft_config")
    return cfg


def load_sft_config(path: str | Path | None, overrides: typing.Iterable[str] = ()) -> SFTConfig:
    """Load a supervised fine-tuning config (``kind: sft``); ``kind`` defaults to ``sft`` here."""
    data, source = _read_yaml(path)
    data = apply_overrides(data, overrides, SFTConfig)
    kind = data.setdefault("kind", "sft")
    if kind != "sft":
        raise ConfigError(f"{source} is a {kind!r} config; load it with load_config")
    return validate_config(data, SFTConfig, source)
