"""One background task per watched server, started once and ended together.

Why it exists: whoever keeps servers alive (the rollout service's supervisor, the Ray run's
server registry) polls each server from a task of its own; starting them and, at the end,
cancelling and awaiting every one of them is the same few lines in both, so it is written once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, TypeVar

__all__ = ["Watchers"]

T = TypeVar("T")


class Watchers(Generic[T]):
    """``watch(item)`` in a task of its own for every item; :meth:`aclose` ends them all."""

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, watch: Callable[[T], Awaitable[None]], items: Iterable[T]) -> None:
        """Start one task per item (needs a running event loop); a second call does nothing."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(_run(watch, item)) for item in items]

    async def aclose(self) -> None:
        """Cancel every task and wait until each has ended."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []


async def _run(watch: Callable[[T], Awaitable[None]], item: T) -> None:
    await watch(item)
