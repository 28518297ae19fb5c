"""One entry of ``tools.mcp``: an MCP tool server whose tools the agent may call.

Why it exists: a user who already has tools behind an MCP server (the Model Context Protocol)
names the server here instead of rewriting them; :mod:`tools.mcp` connects to it, lists its
tools before anything starts and calls them under the ``tools`` limits. Imports pydantic only.
"""

from __future__ import annotations

import re

from pydantic import Field, model_validator

from agentrl.config.section import Section

__all__ = ["MCPServerConfig"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


class MCPServerConfig(Section):
    """An MCP server: a stdio `command` the run starts, or the `url` of a streamable-HTTP server."""

    name: str
    """What errors and logs call this server (letters, digits, `_ . -`)."""
    command: list[str] | None = None
    """Program and arguments of a stdio server the run starts (e.g. `[python, server.py]`); exactly one of `command` and `url`."""
    url: str | None = None
    """URL of a running streamable-HTTP server (e.g. `http://127.0.0.1:8000/mcp`); exactly one of `command` and `url`."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of a stdio server (it gets only HOME, PATH, USER and the like, plus these)."""
    cwd: str | None = None
    """Working directory of a stdio server (relative to the config file); null = the config file's folder."""
    headers: dict[str, str] = Field(default_factory=dict, exclude=True, repr=False)
    """HTTP headers sent to a `url` server (e.g. an `Authorization` bearer token; never logged or saved)."""
    tools: list[str] | None = None
    """Allow-list of the server's tool names the agent gets; null = every tool it lists."""
    prefix: str = ""
    """Prepended to each tool's name as the model sees it (e.g. `fs_`), to keep names unique."""
    startup_timeout_s: float = Field(default=30.0, gt=0)
    """Longest wait for the server to start and list its tools (at start-up, and when a worker connects)."""

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerConfig:
        if not _NAME.match(self.name):
            raise ValueError(
                f"name {self.name!r} must start with a letter or _ and hold only letters, "
                "digits, _ . -"
            )
        if (self.command is None) == (self.url is None):
            raise ValueError(
                f"MCP server {self.name!r}: give exactly one of `command` (a stdio server the "
                "run starts, e.g. [python, server.py]) and `url` (a streamable-HTTP server)"
            )
        if self.command is not None and not self.command:
            raise ValueError(f"MCP server {self.name!r}: `command` is empty; name the program")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"MCP server {self.name!r}: url {self.url!r} must start with http:// or https://"
            )
        return self
