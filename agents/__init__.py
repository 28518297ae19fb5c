"""Agents: the agent contract, the registry, the built-in agents and tool-call parsers.

Start with :mod:`agents.base` (``AgentLoop``, ``AgentContext``, ``register_agent``); a stateful
task (a game, a simulated user) is an :class:`Environment` (:mod:`agents.environment`). Built-ins:
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
from agents.environment import (
    ENVIRONMENTS,
    Environment,
    EnvironmentAgent,
    EnvironmentReward,
    get_environment_class,
    register_environment,
)
from agents.parsers import ParseResult, ToolCall, ToolCallParser, get_parser
from agents.single_turn import SingleTurnAgent
from agents.tool_agent import ToolAgent

__all__ = [
    "AGENTS",
    "ENVIRONMENTS",
    "INVALID_TOOL",
    "AgentContext",
    "AgentLimits",
    "AgentLoop",
    "Environment",
    "EnvironmentAgent",
    "EnvironmentReward",
    "ParseResult",
    "SingleTurnAgent",
    "ToolAgent",
    "ToolCall",
    "ToolCallParser",
    "Turn",
    "create_agent",
    "get_agent_class",
    "get_environment_class",
    "get_parser",
    "list_agents",
    "register_agent",
    "register_environment",
]
