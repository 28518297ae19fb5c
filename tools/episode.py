"""The tool calls of one episode, and the per-episode state of every tool they used.

Why it exists: a :class:`~tools.toolset.ToolSet` is shared by every episode of a worker and
holds no per-episode state; the states (a sandbox directory, a database connection, a game
board) live here, in a :class:`ToolEpisode` that exists for exactly one episode.

Guarantees of :meth:`ToolEpisode.call`:

- it never raises, except ``asyncio.CancelledError``: an unknown tool, arguments that are not
  JSON or do not match the schema, an exception inside the tool and a timeout all come back as
  a :class:`~tools.base.ToolResult` with ``error=True`` and a message starting with ``error:``
  that the model can read and react to;
- the content is at most ``max_output_chars`` characters plus a ``...[truncated N chars]``
  marker, then (with ``max_output_tokens`` and the policy's tokenizer) at most that many tokens,
  a ``...[truncated N tokens]`` marker included;
- a tool's state is created lazily on its first call in an episode (parallel calls share one
  ``create``) and released exactly once when the episode ends, normally, by exception or by
  cancellation; a ``release`` that raises is logged and counted
  (``tools/<name>/release_errors``), never masks the original error;
- every wait on tool code has a deadline that holds even when the tool ignores cancellation
  (:mod:`tools.call`): a call returns at its timeout, a cancelled call (e.g. the episode's
  deadline) re-raises at once, and a release gives up after ``release_timeout_s``.

An episode takes its tools, limits, counters and thread pool as arguments, not a ToolSet, so
anything that owns per-episode tools can run them with the run's limits and counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from agentrl.jsonsafe import loads_limited
from tools.base import Tool, ToolArgumentError, ToolResult
from tools.call import TIMED_OUT, ToolCall, run_with_deadline
from tools.executor import DaemonThreadPool
from tools.limits import TextTokenizer, ToolLimits, truncate, truncate_tokens
from tools.metrics import ToolMetrics
from tools.schema import format_validation_error

__all__ = ["ToolEpisode"]

logger = logging.getLogger(__name__)


class ToolEpisode:
    """The tool calls of one episode; owns the per-episode state of every tool it used.

    Use as an async context manager (``async with toolset.episode() as ep``), or call
    :meth:`aclose` yourself in a ``finally``. Calls may run concurrently (parallel tool calls);
    a tool's state is created once even when two calls race for it.

    Args:
        tools: The tools by name (the ToolSet's, shared, not copied).
        limits: The limits of every call (a tool's own timeout and output limit win).
        metrics: Where calls, errors, timeouts and releases are counted.
        pool: Returns the thread pool that runs sync tools (created on first use).
        clock: Where call latencies are read from (seconds; tests inject a fake clock).
        tokenizer: The policy's tokenizer, which ``limits.max_output_tokens`` counts in
            (required when that limit is set).
    """

    def __init__(
        self,
        tools: Mapping[str, Tool],
        limits: ToolLimits,
        metrics: ToolMetrics,
        pool: Callable[[], DaemonThreadPool],
        clock: Callable[[], float] = time.perf_counter,
        tokenizer: TextTokenizer | None = None,
    ) -> None:
        if limits.max_output_tokens is not None and tokenizer is None:
            raise ValueError(
                f"tools.max_output_tokens={limits.max_output_tokens} counts tokens of the "
                "policy's tokenizer: pass it, ToolSet.episode(tokenizer=...), or set "
                "max_output_tokens to null"
            )
        self.tokenizer = tokenizer
        self.clock = clock
        self.tools = tools
        self.limits = limits
        self.metrics = metrics
        self._pool = pool
        self._states: dict[str, Any] = {}
        self._create_locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    async def __aenter__(self) -> ToolEpisode:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """The episode has been closed (every tool state released)."""
        return self._closed

    def state(self, name: str) -> Any:
        """The live state of tool ``name`` in this episode (``KeyError`` if not created)."""
        return self._states[name]

    async def call(self, name: str, arguments: dict[str, Any] | str | None) -> ToolResult:
        """Run tool ``name`` with ``arguments`` (a dict or a JSON string). Never raises.

        See the module docstring for the error messages; the only exception that escapes is
        ``asyncio.CancelledError``, after which the episode still releases the states.
        """
        t = self.tools.get(name)
        if t is None:
            self.metrics.record_unknown()
            available = ", ".join(self.tools) or "(none)"
            return ToolResult(
                content=f"error: unknown tool {name!r}; available: {available}", error=True
            )
        start = self.clock()
        try:
            result, timed_out = await self._run(t, arguments)
        except asyncio.CancelledError:
            self.metrics.record_cancelled(name, self.clock() - start)
            raise
        latency = self.clock() - start
        limit = self.limits.output_chars_of(t.max_output_chars)
        content, dropped = truncate(result.content, limit, self.limits.truncate_side)
        if self.tokenizer is not None:
            content, cut = truncate_tokens(
                content, self.limits.max_output_tokens, self.limits.truncate_side, self.tokenizer
            )
            dropped += cut
        if dropped:
            result = result.model_copy(update={"content": content})
        self.metrics.record_call(
            name,
            latency,
            error=result.error,
            timeout=timed_out,
            truncated=dropped > 0,
            metrics=result.metrics,
        )
        return result

    async def _run(
        self, t: Tool, arguments: dict[str, Any] | str | None
    ) -> tuple[ToolResult, bool]:
        """One call as (result, timed out): arguments checked, the tool run under its deadline."""
        if self._closed:
            return ToolResult(
                content=f"error: tool {t.name!r} called after its episode ended", error=True
            ), False
        try:
            args = t.validate_arguments(_parse_arguments(arguments))
        except (ValidationError, ToolArgumentError, ValueError) as exc:
            msg = format_validation_error(exc)
            return ToolResult(
                content=f"error: invalid arguments for {t.name!r}: {msg}", error=True
            ), False
        except Exception as exc:  # a broken validate_arguments override
            return ToolResult(
                content=f"error: invalid arguments for {t.name!r}: {type(exc).__name__}: {exc}",
                error=True,
            ), False
        timeout = self.limits.timeout_of(t.timeout_s)
        out = await self._guarded(t.name, self._execute(t, args), timeout)
        if out is TIMED_OUT:
            return ToolResult(
                content=f"error: tool {t.name!r} timed out after {_fmt_s(timeout)} s",
                error=True,
                timed_out=True,
            ), True
        return _as_result(t, out), False

    async def _execute(self, t: Tool, args: dict[str, Any]) -> Any:
        """The tool's own work, in its own task; its exceptions become values (so a
        TimeoutError raised by the tool is never mistaken for the call's deadline)."""
        try:
            state = await self._ensure_state(t)
            return await t.execute(state, args)
        except Exception as exc:
            return exc

    async def _guarded(self, name: str, work: Any, timeout: float | None) -> Any:
        """``work`` under a deadline (:func:`tools.call.run_with_deadline`), counted if abandoned."""

        def abandoned(call: ToolCall) -> None:
            """Count a call of ``name`` that kept running after it was abandoned."""
            self.metrics.record_abandoned(name, call)

        return await run_with_deadline(name, work, timeout, self._pool(), abandoned)

    async def _ensure_state(self, t: Tool) -> Any:
        """The tool's state in this episode, created on first use (once, even under races)."""
        if t.name in self._states:
            return self._states[t.name]
        lock = self._create_locks.setdefault(t.name, asyncio.Lock())
        async with lock:
            if t.name in self._states:
                return self._states[t.name]
            if self._closed:
                raise RuntimeError("episode already ended")
            try:
                state = await t.create()
            except Exception as exc:
                raise _CreateError() from exc
            if self._closed:
                # The episode ended while this state was being created: free it now, since
                # aclose() has already run and will not see it.
                with contextlib.suppress(Exception):
                    await t.release(state)
                raise RuntimeError("episode already ended")
            self._states[t.name] = state
            return state

    async def aclose(self) -> None:
        """Release every created state, once. Survives failing releases and cancellation.

        A release that raises or exceeds ``release_timeout_s`` is logged and counted. If the
        closing task is cancelled while releasing, the remaining states are still released and
        the cancellation is re-raised at the end.
        """
        if self._closed:
            return
        self._closed = True
        cancelled: BaseException | None = None
        for name, state in list(self._states.items()):
            t = self.tools.get(name)
            if t is None or getattr(t.release, "__func__", None) is Tool.release:
                continue  # the base release does nothing: skip its timer
            try:
                await self._release(name, t, state)
            except asyncio.CancelledError as exc:
                cancelled = exc
                self.metrics.record_release_error(name)
                logger.warning("release of tool %r was cancelled; state may leak", name)
        self._states.clear()
        if cancelled is not None:
            raise cancelled

    async def _release(self, name: str, t: Tool, state: Any) -> None:
        """Release one state under ``release_timeout_s``; log and count a failure."""
        timeout = self.limits.release_timeout_s
        out = await self._guarded(name, _release(t, state), timeout)
        if out is TIMED_OUT or isinstance(out, BaseException):
            self.metrics.record_release_error(name)
            if isinstance(out, BaseException):
                logger.error("release of tool %r failed", name, exc_info=out)
            else:
                logger.error(
                    "release of tool %r took more than %s s; abandoned", name, _fmt_s(timeout)
                )


def _as_result(t: Tool, out: Any) -> ToolResult:
    """What the tool's task returned (a value or its exception) as the model's message."""
    if isinstance(out, _CreateError):
        return ToolResult(
            content=f"error: tool {t.name!r} failed to start: {_describe(out.__cause__)}",
            error=True,
        )
    if isinstance(out, BaseException):
        return ToolResult(content=f"error: {_describe(out)}", error=True)
    if isinstance(out, str):
        return ToolResult(content=out)
    if isinstance(out, ToolResult):
        return out
    return ToolResult(
        content=f"error: tool {t.name!r} returned {type(out).__name__}, expected ToolResult or str",
        error=True,
    )


async def _release(t: Tool, state: Any) -> BaseException | None:
    """``t.release(state)``, its exception returned as a value."""
    try:
        await t.release(state)
    except Exception as exc:
        return exc
    return None


class _CreateError(Exception):
    """Internal marker: ``Tool.create`` raised (the cause is chained)."""


def _parse_arguments(arguments: dict[str, Any] | str | None) -> dict[str, Any]:
    """The call's arguments as a dict (from a dict, a JSON string, or nothing)."""
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            parsed = loads_limited(arguments, what="arguments")
        except json.JSONDecodeError as exc:
            raise ToolArgumentError(f"not valid JSON ({exc})") from exc
        arguments = parsed
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    return arguments


def _describe(exc: BaseException | None) -> str:
    """``Type: message`` of an exception (``Type`` alone when the message is empty)."""
    if exc is None:
        return "unknown error"
    msg = str(exc)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _fmt_s(seconds: float | None) -> str:
    """Seconds as the messages print them (``10``, ``0.5``; ``?`` for no limit)."""
    if seconds is None:
        return "?"
    return f"{seconds:g}"
