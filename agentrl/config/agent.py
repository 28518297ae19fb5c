"""The ``agent`` section: how the default agent runs an episode (turns, budgets, tool calls)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from agentrl.config.section import Section

__all__ = ["AgentConfig"]


class AgentConfig(Section):
    """How the default agent runs an episode."""

    default: str = "tool_agent"
    """Registered agent used for tasks that do not name one."""
    max_turns: int = Field(default=4, ge=1)
    """Most model turns per episode."""
    max_response_tokens: int = Field(default=512, ge=1)
    """Token budget of the whole episode after the prompt (model and tool turns)."""
    max_parallel_calls: int = Field(default=1, ge=1)
    """Most tool calls executed from one model turn."""
    tool_call_format: str = "hermes"
    """Tool-call parser: hermes (`<tool_call>{...}</tool_call>`), json, mistral, or a registered name."""
    system_prompt: str | None = None
    """System prompt prepended to every task that has none; None = the agent's own default."""
    kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Agent name -> keyword arguments of its constructor (e.g. `{my_agent: {hint: true}}`)."""
    history: Literal["concat", "per_turn"] = "concat"
    """`concat`: one trained sequence of exact token deltas; `per_turn`: each model turn trained as its own sample, its prompt re-rendered by the chat template (earlier thinking stripped by Qwen3-style templates), sharing the episode's reward and group."""
    episode_timeout_s: float = Field(default=300.0, gt=0)
    """Wall-clock limit of one episode; past it the episode stops as `aborted`."""
