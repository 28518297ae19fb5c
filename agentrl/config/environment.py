"""The ``environment`` section: the environment that runs the tasks (see docs/environments.md).

One key names it: ``environment: secret_number`` (or ``environment: game.py:SecretNumber``) is
short for ``environment: {name: secret_number}``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from agentrl.config.section import Section

__all__ = ["EnvironmentConfig"]


class EnvironmentConfig(Section):
    """The environment tasks run in (an `agents.Environment`); null name = none."""

    name: str | None = None
    """Registered environment or `module:Class` / `path/file.py:Class`; tasks naming no agent run in it, tasks naming no data_source are scored by its `reward`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's `__init__(task, **kwargs)`."""

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value
