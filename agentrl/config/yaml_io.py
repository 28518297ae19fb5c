"""A config's YAML form: text in by YAML 1.2 scalar rules, text out, and dotted flat params.

Why it exists: PyYAML reads YAML 1.1, where ``1e-6`` is a string; a learning rate written that
way must be a float. Files and overrides are read by :func:`load_yaml`, a resolved config is
written back by :func:`dump_yaml` (it loads back to an equal config), and
:func:`flatten_params` turns it into ``section.key -> string`` params for trackers. Imports
PyYAML only.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml
from pydantic import BaseModel

__all__ = ["dump_yaml", "flatten_params", "load_yaml"]


class _Loader(yaml.SafeLoader):
    pass


_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_Loader.yaml_implicit_resolvers = {
    key: list(resolvers) for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _first in "-+0123456789.":
    _Loader.yaml_implicit_resolvers[_first] = [
        (tag, rx)
        for tag, rx in _Loader.yaml_implicit_resolvers.get(_first, [])
        if tag != "tag:yaml.org,2002:float"
    ]
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """Parse YAML ``text`` with YAML 1.2 float rules (``1e-6`` is a float); raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_Loader)


def dump_yaml(cfg: BaseModel) -> str:
    """``cfg`` as YAML, fields in schema order (loads back to an equal config)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def flatten_params(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys -> string values: scalars as JSON (strings as they are), lists as JSON."""
    out: dict[str, str] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(flatten_params(value, dotted + "."))
        elif isinstance(value, str):
            out[dotted] = value
        elif value is None or isinstance(value, bool | int | float):
            out[dotted] = "null" if value is None else json.dumps(value)
        else:
            out[dotted] = json.dumps(value, sort_keys=True)
    return out
