"""A running tool call, and the deadline its caller waits on it with.

Why it exists: tool code is user code, and user code may hang, ignore its cancellation
(``except BaseException: continue``) or block a thread that cannot be killed. The episode must
still end on time, so the tool never runs in the caller's task: :func:`run_with_deadline` runs
it in a task of its own (and a sync tool's function on a thread of the ToolSet's pool) and
waits for that task, not with it.

What it guarantees:

- the wait ends at the deadline, or at once when the waiting task is cancelled, whatever the
  tool does with its own cancellation;
- a call the caller stopped waiting for is cancelled, and a sync tool's thread still running it
  is detached from the pool (:meth:`DaemonThreadPool.detach`), so hung calls never hold the
  workers healthy calls need; if its task (or a sync tool's thread) is
  still running :data:`ABANDON_GRACE_S` later, it is logged and reported to ``on_abandoned``
  (the ToolSet counts it in ``tools/<name>/abandoned``);
- a sync tool runs on the pool of the call that runs it (:func:`run_in_tool_thread`), never on
  the event loop's default executor; outside a call (``await tool.execute(...)`` in a test) it
  runs on a small shared fallback pool;
- an exception of an abandoned task is marked as retrieved (no "never retrieved" log).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tools.executor import DaemonThreadPool

__all__ = [
    "ABANDON_GRACE_S",
    "TIMED_OUT",
    "ToolCall",
    "run_in_tool_thread",
    "run_with_deadline",
]

logger = logging.getLogger(__name__)

ABANDON_GRACE_S = 1.0
"""Seconds a cancelled tool call (or release) has to stop before it counts as abandoned."""

TIMED_OUT = object()
"""What :func:`run_with_deadline` returns when the deadline came first."""


class ToolCall:
    """One running tool call (or release): its task, and the thread of a sync tool."""

    __slots__ = ("pool", "task", "thread")

    def __init__(self, pool: DaemonThreadPool) -> None:
        self.pool = pool
        self.task: asyncio.Task[Any] | None = None
        self.thread: concurrent.futures.Future[Any] | None = None

    def running(self) -> bool:
        """Whether the tool's code still runs (its task, or a sync tool's thread)."""
        if self.task is not None and not self.task.done():
            return True
        return self.thread is not None and not self.thread.done()


_CURRENT_CALL: contextvars.ContextVar[ToolCall] = contextvars.ContextVar("agentrl_tool_call")
_FALLBACK_POOL: list[DaemonThreadPool] = []


def _fallback_pool() -> DaemonThreadPool:
    """The pool of a sync tool executed outside a ToolSet (e.g. ``await tool.execute(...)``)."""
    if not _FALLBACK_POOL:
        _FALLBACK_POOL.append(DaemonThreadPool(8, name="agentrl-tool"))
    return _FALLBACK_POOL[0]


async def run_in_tool_thread(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """``fn(**kwargs)`` on a thread of the running call's pool; its result (awaited if awaitable).

    The thread is recorded on the call, so an abandoned call whose thread keeps running is
    seen and counted. The function runs in a copy of the caller's context variables.
    """
    call = _CURRENT_CALL.get(None)
    pool = call.pool if call is not None else _fallback_pool()
    context = contextvars.copy_context()
    future = pool.submit(context.run, functools.partial(fn, **kwargs))
    if call is not None:
        call.thread = future
    out = await asyncio.wrap_future(future)
    if inspect.isawaitable(out):
        out = await out
    return out


async def run_with_deadline(
    name: str,
    work: Awaitable[Any],
    timeout: float | None,
    pool: DaemonThreadPool,
    on_abandoned: Callable[[ToolCall], None],
) -> Any:
    """Run ``work`` (a coroutine of tool ``name``) in its own task; wait at most ``timeout``.

    Returns its value, :data:`TIMED_OUT`, or a ``CancelledError`` value when the tool cancelled
    its own task. When the deadline passes or the caller is cancelled, the tool's task is
    cancelled and abandoned (``on_abandoned(call)`` if it keeps running), and the caller's
    cancellation is re-raised.
    """
    call = ToolCall(pool)
    token = _CURRENT_CALL.set(call)
    try:
        task = asyncio.ensure_future(work)
    finally:
        _CURRENT_CALL.reset(token)
    call.task = task
    task.add_done_callback(_retrieve)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        _abandon(name, call, on_abandoned)
        raise
    if not done:
        _abandon(name, call, on_abandoned)
        return TIMED_OUT
    if task.cancelled():
        return asyncio.CancelledError(f"tool {name!r} cancelled its own call")
    return task.result()


def _abandon(name: str, call: ToolCall, on_abandoned: Callable[[ToolCall], None]) -> None:
    """Cancel a call the caller stopped waiting for; report it if it keeps running."""
    if call.task is not None:
        call.task.cancel()
    if call.thread is not None:
        call.thread.cancel()  # only stops a call still queued for a thread
        call.pool.detach(call.thread)  # a running one gives its worker back to healthy calls

    def check() -> None:
        """Report the call as abandoned (and warn) if it still runs after the grace time."""
        if call.running():
            logger.warning(
                "tool %r is still running %.1f s after it was abandoned (it ignores "
                "cancellation, or a sync tool's thread cannot be stopped)",
                name,
                ABANDON_GRACE_S,
            )
            on_abandoned(call)

    asyncio.get_running_loop().call_later(ABANDON_GRACE_S, check)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Done-callback: mark an abandoned task's exception as seen (no 'never retrieved' log)."""
    if not task.cancelled():
        task.exception()
