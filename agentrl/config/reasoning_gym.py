"""``data.reasoning_gym``: procedural tasks from the `reasoning-gym` library, scored by its own
scorers.

Why it exists: reasoning-gym generates hundreds of kinds of verifiable tasks offline from a seed
(no download); ``data.generator: reasoning_gym`` draws a weighted mixture of them, and
:mod:`agentrl.rollout.reasoning_gym` builds the tasks and scores them. Imports pydantic only.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from agentrl.config.section import Section

__all__ = ["ReasoningGymConfig", "ReasoningGymTaskConfig"]


class ReasoningGymTaskConfig(Section):
    """One reasoning-gym task of the mixture."""

    name: str
    """The task's reasoning-gym name (e.g. `basic_arithmetic`, `leg_counting`, `letter_counting`)."""
    weight: float = Field(default=1.0, gt=0)
    """Share of the generated tasks drawn from this task (relative to the other weights)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The task's own options (its reasoning-gym config dataclass, e.g. `{min_digits: 2}`)."""


class ReasoningGymConfig(Section):
    """The mixture `data.generator: reasoning_gym` draws from."""

    tasks: list[ReasoningGymTaskConfig] = Field(default_factory=list)
    """The tasks: names (`[leg_counting, basic_arithmetic]`) or `{name, weight, config}` entries; each task's `data_source` is its name (metrics `val/<name>/...`)."""
    system_prompt: str | None = "default"
    """System prompt of every task: a reasoning-gym preset (`default`, `simple`, `direct`, `DeepSeekZero`, `chain_of_draft`), any other text as it is, or null = `agent.system_prompt`."""
    answer_tag: str = "answer"
    """The answer is the text of the last `<answer_tag>...</answer_tag>` of the final message (what the presets ask for)."""

    @field_validator("tasks", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"name": v} if isinstance(v, str) else v for v in value]
        return value

    @model_validator(mode="after")
    def _unique(self) -> ReasoningGymConfig:
        names = [t.name for t in self.tasks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(
                f"tasks: {dup} listed more than once; give each task once (raise its `weight`)"
            )
        return self
