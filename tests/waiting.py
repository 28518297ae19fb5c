"""Waiting in tests without asserting on the wall clock.

A unit test never compares a measured time with a bound (CI runs on a loaded 2-core machine,
issue 27). A test that shows "the deadline fired instead of waiting for the hung thing" makes
the hung thing block until the test's teardown, so a missed deadline hangs instead of passing,
and waits through these helpers: they fail the test with ``hung: <what>`` after
``HANG_GUARD_S`` (far beyond anything a working test waits) instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

HANG_GUARD_S = 60.0
"""How long a helper waits before it calls the test hung (the waits it guards take < 1 s)."""


async def within(aw: Awaitable[T], what: str, guard_s: float = HANG_GUARD_S) -> T:
    """``await aw``; fails the test with ``hung: {what}`` if it has not ended after ``guard_s``.

    ``aw`` runs as its own task and the guard does not wait for it to unwind (it is cancelled,
    and may ignore that: the test still fails at the guard). Whatever ``aw`` raises, a
    ``TimeoutError`` included, propagates unchanged.
    """
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=guard_s)
    if not done:
        task.cancel()
        pytest.fail(f"hung: {what} (still waiting after {guard_s:g} s)")
    return task.result()


Message = str | Callable[[], str]
"""What a guard names when it fails (a callable is asked at that moment)."""


def _never(what: Message, guard_s: float) -> None:
    text = what() if callable(what) else what
    pytest.fail(f"hung: {text} (still not true after {guard_s:g} s)")


async def until(
    predicate: Callable[[], bool],
    what: Message,
    guard_s: float = HANG_GUARD_S,
    poll_s: float = 0.005,
) -> None:
    """Return once ``predicate()`` is true (checked every ``poll_s``); fails the test with
    ``hung: {what}`` if it is still false after ``guard_s``."""
    deadline = time.monotonic() + guard_s
    while not predicate():
        if time.monotonic() > deadline:
            _never(what, guard_s)
        await asyncio.sleep(poll_s)


def until_sync(
    predicate: Callable[[], bool],
    what: Message,
    guard_s: float = HANG_GUARD_S,
    poll_s: float = 0.01,
) -> None:
    """:func:`until` for a test without an event loop (blocks the calling thread)."""
    deadline = time.monotonic() + guard_s
    while not predicate():
        if time.monotonic() > deadline:
            _never(what, guard_s)
        time.sleep(poll_s)


def in_thread(fn: Callable[[], Any], what: str, guard_s: float = HANG_GUARD_S) -> Any:
    """``fn()`` run in a daemon thread: its value, or the exception it raised (re-raised here);
    fails the test with ``hung: {what}`` if it has not returned after ``guard_s`` (the thread
    is left behind: a blocking call cannot be stopped from outside)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the test thread below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="hang-guard", daemon=True)
    thread.start()
    thread.join(guard_s)
    if thread.is_alive():
        pytest.fail(f"hung: {what} (still running after {guard_s:g} s)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
