"""agentrl tools: the tool contract, ``@tool``, and built-in tools.

This package imports only the standard library and pydantic, so it can be used (and tested)
without the agentrl runtime. Start with :mod:`tools.base` (the contract: ``Tool``, ``@tool``,
``ToolResult``). Then, one noun per module:

- :mod:`tools.toolset`: the :class:`ToolSet` (the tools of an agent, shared by its episodes);
- :mod:`tools.limits`: the :class:`ToolLimits` of every call (timeout, output size) and
  :func:`truncate`;
- :mod:`tools.metrics`: the :class:`ToolMetrics` counters (``tools/<name>/...``);
- :mod:`tools.episode`: the :class:`ToolEpisode` (one episode's calls and tool states);
- :mod:`tools.call`: a running call and the deadline it is waited on with;
- :mod:`tools.registry`: tools by name (:func:`get_tool`, :func:`register_tool`);
- :mod:`tools.schema` (JSON schemas from signatures) and :mod:`tools.executor` (the daemon
  thread pool of sync tools).

Built-ins live in :mod:`tools.calculator`, :mod:`tools.python_sandbox` (with its sandbox in
:mod:`tools.sandbox`) and :mod:`tools.search`, and are also reachable by name through
:func:`get_tool`.
"""

from tools.base import BoundTool, FunctionTool, Tool, ToolArgumentError, ToolResult, tool
from tools.episode import ToolEpisode
from tools.limits import ToolLimits, TruncateSide, truncate
from tools.metrics import ToolMetrics
from tools.registry import get_tool, register_tool, registered_tools
from tools.toolset import ToolSet

__all__ = [
    "BoundTool",
    "FunctionTool",
    "Tool",
    "ToolArgumentError",
    "ToolEpisode",
    "ToolLimits",
    "ToolMetrics",
    "ToolResult",
    "ToolSet",
    "TruncateSide",
    "get_tool",
    "register_tool",
    "registered_tools",
    "tool",
    "truncate",
]
