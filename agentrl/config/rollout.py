"""The ``rollout`` section: agent-loop workers, admission and dynamic sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agentrl.config.section import Section

__all__ = ["RolloutConfig"]


class RolloutConfig(Section):
    """Agent-loop workers and admission."""

    num_workers: int = Field(default=1, ge=1)
    """Agent-loop workers (asyncio in-process, or Ray actors)."""
    max_concurrency: int = Field(default=32, ge=1)
    """Most episodes running at once over all workers."""
    partial_rollout: Literal["keep", "abort"] = "keep"
    """On a weight push: `keep` in-flight episodes (they continue on new weights) or `abort` them."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no GRPO signal) and sample more (DAPO)."""
    max_sampling_rounds: int = Field(default=3, ge=1)
    """Most extra sampling rounds to fill a batch when `dynamic_sampling` drops groups."""
