"""Agents: the agent contract, the registry, the built-in agents and tool-call parsers."""

from agents.parsers import ParseResult, ToolCall, ToolCallParser, get_parser

__all__ = ["ParseResult", "ToolCall", "ToolCallParser", "get_parser"]
