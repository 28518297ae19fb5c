"""``notebook``: a stateful tool: each episode gets its own page, released when it ends."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tools import Tool, ToolResult, register_tool


class NotebookArgs(BaseModel):
    action: Literal["write", "read"] = Field(description="write a value, or read one back")
    key: str = Field(description="the name of the value")
    value: str = Field(default="", description="the value to write (write only)")


@register_tool
class Notebook(Tool):
    """Write a value down under a name, or read it back (one notebook per episode)."""

    name = "notebook"
    description = "Write a value under a name, or read a value written earlier in this episode."
    arguments_model = NotebookArgs

    async def create(self) -> dict[str, str]:
        return {}

    async def execute(self, state: dict[str, str], arguments: dict) -> ToolResult:
        if arguments["action"] == "write":
            state[arguments["key"]] = arguments["value"]
            return ToolResult(content=f"wrote {arguments['key']}")
        if arguments["key"] not in state:
            return ToolResult(
                content=f"error: nothing written under {arguments['key']!r}", error=True
            )
        return ToolResult(content=state[arguments["key"]])

    async def release(self, state: dict[str, str]) -> None:
        state.clear()
