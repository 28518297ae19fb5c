"""The test project's agent: it asks the MCP server's ``add`` tool first (a scripted call, so the
tiny random model's episodes always reach the server), shows the model the answer, then lets the
model answer. Every call's result and the worker's tool counters go to ``$MCP_AGENT_LOG``."""

from __future__ import annotations

import json
import os

from agents import AgentLoop, register_agent
from agents.parsers import ParseResult, ToolCall


@register_agent("mcp_probe_agent")
class MCPProbeAgent(AgentLoop):
    """One scripted ``add`` call through the framework's call path, then the model's turns."""

    async def run(self, task, ctx):
        ctx.start_episode(task.initial_messages())
        async with ctx.tool_episode() as tools:
            call = ToolCall(name="add", arguments=dict(task.extra["args"]), raw="", id="call_0")
            answers, _ = await ctx.call_tools(tools, ParseResult(content="", calls=[call]))
            content = answers[0]["content"]
            ctx.add_messages([{"role": "user", "content": f"The add tool says: {content}"}])
            _log({"content": content, "metrics": ctx.tools.metrics() if ctx.tools else {}})
            while True:
                turn = await ctx.turn(tools)
                if turn.stop is not None:
                    return ctx.finish(turn.stop)


def _log(record: dict) -> None:
    path = os.environ.get("MCP_AGENT_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
