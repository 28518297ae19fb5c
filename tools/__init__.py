"""agentrl tools: the tool contract, ``@tool``, and built-in tools.

This package imports only the standard library and pydantic, so it can be used (and tested)
without the agentrl runtime. Start with :mod:`tools.base` (the contract); built-ins live in
:mod:`tools.calculator`, :mod:`tools.python_sandbox` and :mod:`tools.search` and are also
reachable by name through :func:`get_tool`.
"""

from tools.base import (
    FunctionTool,
    Tool,
    ToolArgumentError,
    ToolEpisode,
    ToolResult,
    ToolSet,
    TruncateSide,
    get_tool,
    register_tool,
    registered_tools,
    tool,
    truncate,
)

__all__ = [
    "FunctionTool",
    "Tool",
    "ToolArgumentError",
    "ToolEpisode",
    "ToolResult",
    "ToolSet",
    "TruncateSide",
    "get_tool",
    "register_tool",
    "registered_tools",
    "tool",
    "truncate",
]
