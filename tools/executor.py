"""A bounded pool of daemon threads for user code that may hang (sync tools, sync rewards).

Why it exists: a Python thread cannot be killed. When a sync tool or reward runs past its
deadline the caller abandons it, but the thread keeps running. On the event loop's default
executor such threads would starve everything else that uses it (weight staging, file I/O),
and a ``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter exit, so one
hung call would also hang shutdown. This pool:

- runs at most ``max_workers`` calls at once (more wait in a queue, so a caller's deadline
  covers its wait too);
- uses daemon threads that are never joined: the process exits even with hung calls;
- reports ``busy`` (threads running a call now), so the hung ones can be seen in metrics;
- :meth:`detach` takes a call its caller abandoned off the worker budget: its thread runs on
  (it cannot be stopped) and exits when the call returns, and a new thread serves the queue, so
  hung calls never starve healthy ones. At most ``max_detached`` threads are detached at once
  (a separate budget; past it an abandoned call keeps its worker).

Example::

    pool = DaemonThreadPool(8, name="agentrl-tool")
    result = await asyncio.wait_for(loop.run_in_executor(pool, fn, arg), timeout=5)
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["DaemonThreadPool"]


class DaemonThreadPool(concurrent.futures.Executor):
    """An ``Executor`` of at most ``max_workers`` daemon threads, started on demand."""

    def __init__(
        self, max_workers: int, *, name: str = "agentrl-worker", max_detached: int | None = None
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"DaemonThreadPool: max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.max_detached = 4 * max_workers if max_detached is None else max_detached
        self._detached: set[concurrent.futures.Future[Any]] = set()
        self.name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._pending = 0
        self._shutdown = False

    @property
    def busy(self) -> int:
        """Threads running a call right now (hung calls included)."""
        with self._lock:
            return self._threads - self._idle + len(self._detached)

    @property
    def detached(self) -> int:
        """Threads still running a call that :meth:`detach` took off the worker budget."""
        with self._lock:
            return len(self._detached)

    def detach(self, future: concurrent.futures.Future[Any]) -> bool:
        """Free the worker of the running call ``future`` (abandoned by its caller): its thread
        exits when the call returns, and a new thread takes queued calls meanwhile. False when
        the call is not running (queued or done) or ``max_detached`` threads are detached."""
        with self._lock:
            if not future.running() or future in self._detached:
                return False
            if len(self._detached) >= self.max_detached:
                return False
            self._detached.add(future)
            self._threads -= 1
            if self._pending > self._idle and self._threads < self.max_workers:
                self._start_thread()
        return True

    def _start_thread(self) -> None:
        """Start one more worker (call with the lock held)."""
        self._threads += 1
        self._idle += 1  # it is idle until it takes a call
        threading.Thread(
            target=self._work, name=f"{self.name}-{self._threads}", daemon=True
        ).start()

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        """Queue ``fn(*args, **kwargs)``; returns a ``concurrent.futures.Future``."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"{self.name}: cannot submit after shutdown")
            self._pending += 1
            if self._pending > self._idle and self._threads < self.max_workers:
                self._start_thread()
            self._queue.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
                if item is None:
                    self._threads -= 1
                    return
                self._pending -= 1
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # handed to the caller through the future
                    future.set_exception(exc)
            with self._lock:
                if future in self._detached:  # its worker was replaced: this thread ends
                    self._detached.discard(future)
                    return
                self._idle += 1
            del item, future, fn, args, kwargs

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = False) -> None:
        """Stop accepting calls; idle threads exit. Never waits for a running call."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        self._pending -= 1
                        item[0].cancel()
            for _ in range(self._threads):
                self._queue.put(None)
