"""MCP tool servers: the tools of a server that speaks the Model Context Protocol, as our tools.

Why it exists: tools are often already written as MCP servers (a stdio program, or a service
over streamable HTTP). ``tools.mcp`` in a config names such servers; this module lists their
tools when the run resolves its config and calls them like any other tool, through the official
`mcp` SDK (imported lazily: the rest of :mod:`tools` does not need it).

What it guarantees:

- :func:`mcp_tools` lists each server's tools once per process (a stdio server is started,
  listed and stopped) under ``startup_timeout_s``; a server that will not start, does not answer
  or lacks a tool of its allow-list raises :class:`MCPServerError` naming the server, what went
  wrong (a stdio server's last stderr lines included) and the fix, so the run stops before any
  inference server starts;
- an :class:`MCPTool` is a plain :class:`~tools.base.Tool`, so the ToolSet's limits
  (``tools.timeout_s``, ``tools.max_output_chars``), its error answers and its counters
  (``tools/<name>/calls|errors|timeouts|latency_*``) apply to it unchanged; an MCP error result
  (``isError``) is answered to the model as ``error: ...`` and counted as an error;
- each process (each event loop) holds at most one session per server (:class:`MCPConnection`),
  opened on the first call and shared by the episodes of the worker(s) on that loop; a session
  whose transport fails (the server died, the connection dropped) is closed and the call
  answers an error; the next call opens a new session (a stdio server is started again);
- sessions are owned by a task of their own and closed on every exit path: by
  :func:`close_mcp_connections`, when the loop's ``asyncio.run`` ends (normally, by exception or
  by Ctrl-C it cancels the owner task, and the SDK's shutdown terminates a stdio server's process
  tree with bounded waits); a stdio server also sees its stdin close when our process is killed.

Example::

    server = MCPServerParams(name="calc", command=("python", "server.py"), tools=("add",))
    tools = ToolSet(mcp_tools([server]), timeout_s=10, max_output_chars=2000)
    async with tools.episode() as ep:
        (await ep.call("add", {"a": 2, "b": 3})).content       # "5"
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import difflib
import functools
import json
import logging
import sys
import tempfile
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tools.base import Tool, ToolResult

__all__ = [
    "MCPConnection",
    "MCPServerError",
    "MCPServerParams",
    "MCPTool",
    "close_mcp_connections",
    "list_server_tools",
    "mcp_tools",
    "mcp_tools_from_config",
]

logger = logging.getLogger(__name__)

_STDERR_TAIL_LINES = 8
"""Lines of a stdio server's stderr quoted when it fails to start."""


class MCPServerError(ValueError):
    """An MCP server would not start, does not answer, or lacks a tool it was asked for."""


@dataclass(frozen=True)
class MCPServerParams:
    """Where an MCP server is and which of its tools to use (hashable, picklable).

    Exactly one of ``command`` (a stdio server this process starts) and ``url`` (a
    streamable-HTTP server) is set; ``key`` names the config entry in error messages.
    """

    name: str
    command: tuple[str, ...] | None = None
    url: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    tools: tuple[str, ...] | None = None
    prefix: str = ""
    startup_timeout_s: float = 30.0
    key: str = "tools.mcp"

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"{self.key}: give exactly one of `command` and `url`")

    def where(self) -> str:
        """The server as messages name it: ``'calc' (stdio: python server.py)``."""
        how = f"stdio: {' '.join(self.command)}" if self.command else f"url: {self.url}"
        return f"MCP server {self.name!r} ({how})"


@dataclass(frozen=True)
class _RemoteTool:
    """What a server says of one tool."""

    name: str
    description: str
    input_schema: dict[str, Any]


def mcp_tools_from_config(servers: Sequence[Any], base_dir: Any = None) -> list[Tool]:
    """The tools of the ``tools.mcp`` entries of a config (each with ``name``, ``command`` or
    ``url``, ``env``, ``cwd``, ``headers``, ``tools``, ``prefix``, ``startup_timeout_s``).

    A stdio server's ``cwd`` is relative to ``base_dir`` (the config file's folder), which is also
    its working directory when ``cwd`` is null.
    """
    params = []
    for i, s in enumerate(servers):
        cwd = Path(s.cwd) if s.cwd else None
        if base_dir is not None and (cwd is None or not cwd.is_absolute()):
            cwd = Path(base_dir) / (cwd or "")
        params.append(
            MCPServerParams(
                name=s.name,
                command=tuple(s.command) if s.command else None,
                url=s.url,
                env=tuple(sorted(s.env.items())),
                cwd=str(cwd) if cwd is not None and s.command else None,
                headers=tuple(sorted(s.headers.items())),
                tools=tuple(s.tools) if s.tools is not None else None,
                prefix=s.prefix,
                startup_timeout_s=s.startup_timeout_s,
                key=f"tools.mcp[{i}]",
            )
        )
    return mcp_tools(params)


def mcp_tools(servers: Sequence[MCPServerParams]) -> list[Tool]:
    """An :class:`MCPTool` for every allowed tool of every server (listed once per process)."""
    out: list[Tool] = []
    for server in servers:
        listed = {t.name: t for t in list_server_tools(server)}
        wanted = server.tools if server.tools is not None else tuple(listed)
        missing = [n for n in wanted if n not in listed]
        if missing:
            hints = [
                f"{n!r} (did you mean {m[0]!r}?)"
                if (m := difflib.get_close_matches(n, listed, 1))
                else repr(n)
                for n in missing
            ]
            raise MCPServerError(
                f"{server.key}.tools: {server.where()} has no tool {', '.join(hints)}; it offers "
                f"{', '.join(sorted(listed)) or '(none)'}; fix the allow-list or the server"
            )
        out.extend(MCPTool(server, listed[n]) for n in wanted)
        _prewarm(server)
    return out


def _prewarm(server: MCPServerParams) -> None:
    """Inside a running loop (a worker building its tools), start opening the session now, so
    the first call does not wait for a stdio server to start."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    connection(server).start()


class MCPTool(Tool):
    """One tool of an MCP server, called through the session of the calling process.

    Its name is the server's ``prefix`` plus the tool's own name; its description and JSON
    schema are the server's. Stateless per episode: the session belongs to the worker.
    """

    def __init__(self, server: MCPServerParams, remote: _RemoteTool) -> None:
        self.server = server
        self.remote_name = remote.name
        self.name = server.prefix + remote.name
        self.description = remote.description
        self.parameters = remote.input_schema or {"type": "object", "properties": {}}

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult | str:
        """Call the tool on the server (connecting first if this process has no session)."""
        return await connection(self.server).call(self.remote_name, arguments)

    def __repr__(self) -> str:
        return f"MCPTool(name={self.name!r}, server={self.server.name!r})"


# -- listing at start-up ---------------------------------------------------------------------


@functools.cache
def list_server_tools(server: MCPServerParams) -> tuple[_RemoteTool, ...]:
    """The tools ``server`` lists (cached per process); :class:`MCPServerError` if it fails.

    Runs on a thread of its own with its own event loop, so it works from sync code and from
    inside a running loop alike; the session is closed (a stdio server stopped) before it returns.
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="agentrl-mcp-list") as ex:
        return ex.submit(asyncio.run, _list_tools(server)).result()


async def _list_tools(server: MCPServerParams) -> tuple[_RemoteTool, ...]:
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errlog:
        try:
            async with asyncio.timeout(server.startup_timeout_s):
                async with _session(server, errlog) as client:
                    return await _all_tools(client)
        except Exception as exc:
            raise MCPServerError(_startup_message(server, exc, _tail(errlog))) from None


async def _all_tools(client: Any) -> tuple[_RemoteTool, ...]:
    """Every page of ``tools/list``."""
    tools: list[_RemoteTool] = []
    cursor: str | None = None
    for _ in range(1000):
        page = await client.list_tools(cursor=cursor)
        tools.extend(
            _RemoteTool(t.name, t.description or "", dict(t.input_schema or {})) for t in page.tools
        )
        cursor = page.next_cursor
        if cursor is None:
            break
    return tuple(tools)


def _startup_message(server: MCPServerParams, exc: BaseException, stderr: str) -> str:
    """Why ``server`` could not be listed, and what to do about it."""
    if isinstance(exc, TimeoutError):
        why = f"did not start and list its tools within {server.startup_timeout_s:g} s"
    else:
        why = f"failed to start or answer: {_describe(exc)}"
    if server.command:
        fix = (
            f"check that `{' '.join(server.command)}` runs an MCP server over stdin/stdout "
            f"(from {server.cwd or 'the current folder'}), or raise {server.key}.startup_timeout_s"
        )
    else:
        fix = f"check that an MCP server answers streamable HTTP at {server.url}"
    said = f"; its stderr ends with:\n{stderr}" if stderr else ""
    return f"{server.key}: {server.where()} {why}; {fix}{said}"


def _tail(errlog: TextIO) -> str:
    """The last lines a stdio server wrote to its stderr."""
    with contextlib.suppress(OSError, ValueError):
        errlog.seek(0)
        lines = errlog.read().strip().splitlines()
        return "\n".join("    " + line for line in lines[-_STDERR_TAIL_LINES:])
    return ""


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, of the first leaf of an exception group."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    msg = str(exc)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


@contextlib.asynccontextmanager
async def _session(server: MCPServerParams, errlog: TextIO) -> AsyncIterator[Any]:
    """A connected ``mcp.Client`` for ``server`` (stdio: the process runs while this is open)."""
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client

    async with contextlib.AsyncExitStack() as stack:
        if server.command:
            params = StdioServerParameters(
                command=server.command[0],
                args=list(server.command[1:]),
                env=dict(server.env) or None,
                cwd=server.cwd,
            )
            transport: Any = stdio_client(params, errlog=errlog)
        else:
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            http = await stack.enter_async_context(
                create_mcp_http_client(headers=dict(server.headers) or None)
            )
            transport = streamable_http_client(str(server.url), http_client=http)
        yield await stack.enter_async_context(Client(transport, cache=None))


# -- sessions of a worker --------------------------------------------------------------------

_CONNECTIONS: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[MCPServerParams, MCPConnection]
] = weakref.WeakKeyDictionary()


def connection(server: MCPServerParams) -> MCPConnection:
    """The session of ``server`` on the running loop (made, not yet opened, on first use)."""
    loop = asyncio.get_running_loop()
    per_loop = _CONNECTIONS.setdefault(loop, {})
    if server not in per_loop:
        per_loop[server] = MCPConnection(server)
    return per_loop[server]


async def close_mcp_connections() -> None:
    """Close every MCP session of the running loop (stdio servers stop)."""
    per_loop = _CONNECTIONS.pop(asyncio.get_running_loop(), {})
    await asyncio.gather(*(c.aclose() for c in per_loop.values()), return_exceptions=True)


class MCPConnection:
    """One session with one MCP server, owned by a task of its own on one event loop.

    The owner task enters the SDK's client (anyio needs enter and exit in one task) and holds it
    until :meth:`aclose`, a transport failure, or the loop's end cancels it. Calls from any task
    of the loop share the session; a caller's cancellation (its deadline) never reaches the owner.
    """

    def __init__(self, server: MCPServerParams) -> None:
        self.server = server
        self._ready: asyncio.Future[Any] | None = None
        self._stop: asyncio.Event | None = None
        self._owner: asyncio.Task[None] | None = None

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Call tool ``name``; transport failures raise :class:`MCPServerError` (the episode
        answers them to the model) and close the session so the next call reconnects."""
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED

        client = await self._client()
        try:
            result = await client.call_tool(name, arguments)
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                self._drop()
                raise MCPServerError(f"{self.server.where()} closed the connection") from None
            return ToolResult(content=f"error: {exc.message}", error=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._drop()
            raise MCPServerError(
                f"{self.server.where()} is unreachable: {_describe(exc)}"
            ) from None
        return _as_result(result)

    def start(self) -> asyncio.Future[Any]:
        """Start opening the session unless it is open or opening; the future of its client."""
        if self._ready is None or self._owner is None or self._owner.done():
            loop = asyncio.get_running_loop()
            self._ready = loop.create_future()
            self._ready.add_done_callback(_retrieve)
            self._stop = asyncio.Event()
            self._owner = loop.create_task(
                self._own(self._ready, self._stop), name=f"mcp-session-{self.server.name}"
            )
        return self._ready

    async def _client(self) -> Any:
        """The connected client, connecting first (one attempt shared by concurrent callers)."""
        ready = self.start()
        try:
            return await asyncio.wait_for(asyncio.shield(ready), self.server.startup_timeout_s)
        except TimeoutError:
            self._drop()
            raise MCPServerError(
                f"{self.server.where()} did not connect within {self.server.startup_timeout_s:g} s"
            ) from None

    async def _own(self, ready: asyncio.Future[Any], stop: asyncio.Event) -> None:
        """Hold the session open until ``stop`` (or cancellation); report how it ended."""
        try:
            async with _session(self.server, sys.stderr) as client:
                if not ready.done():
                    ready.set_result(client)
                await stop.wait()
        except asyncio.CancelledError:
            if not ready.done():
                ready.set_exception(MCPServerError(f"{self.server.where()}: session cancelled"))
            raise
        except Exception as exc:
            if not ready.done():
                ready.set_exception(
                    MCPServerError(f"{self.server.where()} failed to connect: {_describe(exc)}")
                )
            else:
                logger.warning("%s: the session ended: %s", self.server.where(), _describe(exc))

    def _drop(self) -> None:
        """Let the owner close this session; the next call opens a new one."""
        if self._stop is not None:
            self._stop.set()
        self._owner = None

    async def aclose(self) -> None:
        """Close the session and wait (bounded) until its owner task ended."""
        owner = self._owner
        self._drop()
        if owner is not None and not owner.done():
            try:
                await asyncio.wait_for(owner, timeout=10.0)
            except (TimeoutError, asyncio.CancelledError):
                owner.cancel()
            except Exception as exc:
                logger.warning("%s: closing failed: %s", self.server.where(), _describe(exc))


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a failed connection attempt's exception as seen (nobody may be waiting for it)."""
    if not future.cancelled():
        future.exception()


def _as_result(result: Any) -> ToolResult:
    """A ``CallToolResult`` as the model's tool message (``error: ...`` when ``isError``)."""
    parts: list[str] = []
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource_link" or kind == "resource":
            parts.append(f"[resource {getattr(block, 'uri', '') or ''}]".strip())
        else:
            parts.append(f"[{kind} content]")
    text = "\n".join(parts)
    if not text and result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False, default=str)
    if result.is_error:
        return ToolResult(content=f"error: {text or 'the tool failed'}", error=True)
    return ToolResult(content=text)
