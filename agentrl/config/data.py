"""The ``data`` sections: where tasks (RL) and conversations (SFT) come from, and how many a step
takes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from agentrl.config.reasoning_gym import ReasoningGymConfig
from agentrl.config.section import Section
from agentrl.config.verifiers import VerifiersConfig

__all__ = ["DataConfig", "SFTDataConfig"]


class DataConfig(Section):
    """Where tasks come from and how many are sampled per step."""

    train_files: list[str] = Field(default_factory=list)
    """Training task files (JSONL or Parquet, relative to the config file); empty = use `generator`."""
    val_files: list[str] = Field(default_factory=list)
    """Held-out task files; empty = `generator_val_size` generated tasks (0 or no generator = no validation)."""
    generator: str | None = "calculator"
    """Built-in task generator used when `train_files` is empty (`calculator`, `reasoning_gym`, `verifiers`); None = off."""
    generator_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the task generator (e.g. `{max_digits: 4}`)."""
    reasoning_gym: ReasoningGymConfig = Field(default_factory=ReasoningGymConfig)
    """The reasoning-gym tasks of `generator: reasoning_gym` (see docs/environments.md)."""
    verifiers: VerifiersConfig = Field(default_factory=VerifiersConfig)
    """The verifiers environment of `generator: verifiers` (see docs/environments.md)."""
    generator_train_size: int = Field(default=512, ge=1)
    """Training tasks the generator makes (seeded by `seed`)."""
    generator_val_size: int = Field(default=64, ge=0)
    """Held-out tasks the generator makes when `val_files` is empty; 0 = no validation set."""
    generator_val_seed: int = 10000
    """Seed of the held-out generated tasks (another stream than the training tasks)."""
    batch_size: int = Field(default=8, ge=1)
    """Tasks per training step (each sampled `n_samples` times)."""
    n_samples: int = Field(default=4, ge=1)
    """Samples per task: the GRPO/RLOO group size."""
    shuffle: bool = True
    """Shuffle tasks each epoch (deterministically, from `seed`)."""
    seed: int = 0
    """Seed of the task order."""
    max_prompt_tokens: int = Field(default=1024, ge=1)
    """Longest rendered prompt (chat template and tools included) in tokens."""
    overlong_prompts: Literal["drop", "error"] = "drop"
    """A task whose prompt is longer than `max_prompt_tokens`: `drop` it (counted, logged) or stop with an `error` naming it."""


class SFTDataConfig(Section):
    """Supervised data: chat conversations."""

    train_files: list[str] = Field(default_factory=list)
    """Training conversation files (JSONL/Parquet rows with `messages`); empty = `generator`."""
    val_files: list[str] = Field(default_factory=list)
    """Validation conversation files; empty = no validation."""
    generator: str | None = "calculator"
    """Built-in conversation generator used when `train_files` is empty; None = off."""
    generator_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the generator (e.g. `{n: 512, tool_fraction: 0.8}`)."""
    batch_size: int = Field(default=8, ge=1)
    """Conversations per optimizer step."""
    shuffle: bool = True
    """Shuffle conversations each epoch (deterministically, from `seed`)."""
    seed: int = 0
    """Seed of the conversation order."""
    max_seq_len: int = Field(default=1024, ge=1)
    """Longest tokenized conversation; longer ones are truncated on the right."""
    train_on: Literal["assistant", "all"] = "assistant"
    """Tokens that carry loss: assistant turns only, or every token."""
