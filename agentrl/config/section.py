"""The base of every config section, and the error every configuration problem raises.

Why it exists: each section file (``model``, ``data``, ... ``distributed``) builds on one
:class:`Section` so that every section behaves alike: unknown keys are errors, the attribute
docstrings are the field descriptions (``docs/configuration.md`` is generated from them), and
assignments are validated. Imports pydantic only.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "Section"]


class ConfigError(ValueError):
    """A configuration file or override is wrong; the message names every bad key path."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=True,
    )
