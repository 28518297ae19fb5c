"""``data.verifiers``: a verifiers (0.4) environment whose tasks, episodes and rubric are trained.

Why it exists: ``data.generator: verifiers`` trains an environment written for the `verifiers`
library unchanged (see :mod:`agentrl.rollout.verifiers_env` and docs/environments.md). Imports
pydantic only.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from agentrl.config.section import Section

__all__ = ["VerifiersConfig"]


class VerifiersConfig(Section):
    """The verifiers environment `data.generator: verifiers` trains."""

    taskset: str | None = None
    """The verifiers taskset: an importable module exporting its `Taskset` subclass in `__all__` (verifiers' `taskset.id`)."""
    env: str | None = None
    """The verifiers `Env` playing it (a module exporting its `Env` subclass); null = the taskset module's own, else one seat (`SingleAgentEnv`)."""
    taskset_args: dict[str, Any] = Field(default_factory=dict)
    """Fields of the taskset's config (its `TasksetConfig` subclass), e.g. `{max_target: 9}`."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Fields of the env's config (its `EnvConfig` subclass): env options and seat caps such as `{player: {max_turns: 4}}`."""
