"""The ``tools`` section: which tools agents may call, and the limits of each built-in tool."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agentrl.config.mcp import MCPServerConfig
from agentrl.config.section import Section

__all__ = ["PythonToolConfig", "SearchToolConfig", "ToolsConfig"]


class PythonToolConfig(Section):
    """Limits of the python sandbox tool."""

    wall_time_s: float = Field(default=5.0, gt=0)
    """Wall-clock limit of one python call."""
    memory_mb: int = Field(default=512, ge=32)
    """Per-process address-space limit, MiB; with a cgroup also the whole call's (+ disk_mb)."""
    cpu_time_s: float | None = Field(default=None, gt=0)
    """CPU seconds per sandboxed process; None = wall_time_s rounded up, plus 1."""
    max_processes: int = Field(default=16, ge=1)
    """Most processes the code of one call may run at once (itself included)."""
    disk_mb: int = Field(default=64, ge=1)
    """Size of the sandbox's private tmpfs (working directory, /tmp, /dev/shm), in MiB."""
    allow_unsandboxed: bool = False
    """Run model code without OS isolation when bubblewrap is unavailable (unsafe; else refuse)."""
    cgroups: Literal["auto", "required", "off"] = "auto"
    """Per-call cgroup limits: auto (else rlimits and a warning), required (else refuse), off."""
    cgroup_parent: str | None = None
    """A delegated cgroup v2 directory for the calls' cgroups; None = this process's cgroup."""


class SearchToolConfig(Section):
    """The local search tool."""

    corpus_path: str | None = None
    """JSONL corpus the search tool indexes; None = search tool unavailable."""


class ToolsConfig(Section):
    """Which tools agents may call and how their output is bounded."""

    enabled: list[str] = Field(default_factory=lambda: ["calculator"])
    """Names of the tools offered to the agent (built-ins: calculator, python, search)."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Wall-clock limit of one tool call; a timeout becomes an error message to the model."""
    max_output_chars: int = Field(default=2000, ge=1)
    """Longest tool output shown to the model; longer output is truncated with a marker."""
    max_output_tokens: int | None = Field(default=None, ge=1)
    """Token budget of one tool message in the policy's tokenizer, marker included, applied after `max_output_chars` (null = characters only)."""
    truncate_side: Literal["left", "right", "middle"] = "right"
    """Which part of an over-long tool output is cut."""
    python: PythonToolConfig = Field(default_factory=PythonToolConfig)
    """The python sandbox tool."""
    search: SearchToolConfig = Field(default_factory=SearchToolConfig)
    """The search tool."""
    mcp: list[MCPServerConfig] = Field(default_factory=list)
    """MCP tool servers whose tools the agent also gets (`{name, command | url, tools, ...}`; see docs/environments.md)."""
