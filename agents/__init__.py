"""Agents: the agent contract, the registry, the built-in agents and tool-call parsers.

Start with :mod:`agents.base` (``AgentLoop``, ``AgentContext``, ``register_agent``). Built-ins:
``single_turn`` (:mod:`agents.single_turn`) and ``tool_agent`` (:mod:`agents.tool_agent`).
Parsers for tool-call formats live in :mod:`agents.parsers`.
"""

from agents.base import (
    AGENTS,
    INVALID_TOOL,
    AgentContext,
    AgentLimits,
    AgentLoop,
    Turn,
    create_agent,
    get_agent_class,
    list_agents,
    register_agent,
)
from agents.parsers import ParseResult, ToolCall, ToolCallParser, get_parser
from agents.single_turn import SingleTurnAgent
from agents.tool_agent import ToolAgent

__all__ = [
    "AGENTS",
    "INVALID_TOOL",
    "AgentContext",
    "AgentLimits",
    "AgentLoop",
    "ParseResult",
    "SingleTurnAgent",
    "ToolAgent",
    "ToolCall",
    "ToolCallParser",
    "Turn",
    "create_agent",
    "get_agent_class",
    "get_parser",
    "list_agents",
    "register_agent",
]
