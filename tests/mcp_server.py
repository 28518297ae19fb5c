"""A real MCP tool server for the tests, written with the official `mcp` SDK (MCPServer, the SDK's
FastMCP).

Run over stdio (``python tests/mcp_server.py``; other arguments are ignored, so tests can mark
the processes they start) or streamable HTTP on 127.0.0.1 (``python tests/mcp_server.py --http
PORT``). Its tools:

- ``add(a, b)``: a + b;
- ``shout(text)``: the text upper-cased;
- ``long_text(n)``: ``n`` characters (for the output limit);
- ``sleep(seconds)``: waits, then says so (for the deadline);
- ``fail(message)``: raises, so the result is an MCP error result.
"""

from __future__ import annotations

import asyncio
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("agentrl-test-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


@server.tool()
def long_text(n: int) -> str:
    """A text of n characters."""
    return "x" * n


@server.tool()
async def sleep(seconds: float) -> str:
    """Wait some seconds."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def fail(message: str) -> str:
    """Always fails with the message."""
    raise RuntimeError(message)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
