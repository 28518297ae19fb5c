"""Hung sync tool calls give their workers back: healthy calls after them keep their deadlines
(issue 21: 16 hung calls once made the next 10 healthy calls time out).

The hung calls block until the test ends, so had a healthy call queued behind them it would
time out (and the test fail) rather than pass by luck; no wall-clock bound is asserted.
"""

from __future__ import annotations

import asyncio
import threading

from tests.waiting import until, within
from tools import ToolSet, tool
from tools.executor import DaemonThreadPool

HUNG, HEALTHY = 16, 10


async def test_sixteen_hung_sync_calls_do_not_time_out_the_next_ten_healthy_ones() -> None:
    release = threading.Event()

    @tool
    def hung() -> str:
        """Blocks until released."""
        release.wait()
        return "late"

    @tool
    def healthy() -> str:
        """Answers at once."""
        return "ok"

    # The deadline is generous for a healthy call; only a call queued behind a hung worker can
    # miss it (the hung ones never return before the test ends).
    ts = ToolSet([hung, healthy], timeout_s=3.0, sync_workers=HUNG)
    try:
        async with ts.episode() as ep:
            hung_calls = asyncio.gather(*(ep.call("hung", {}) for _ in range(HUNG)))
            assert all(r.timed_out for r in await within(hung_calls, "the deadline never fired"))
            ok = asyncio.gather(*(ep.call("healthy", {}) for _ in range(HEALTHY)))
            results = await within(ok, "the healthy calls hung")
        assert [r.content for r in results] == ["ok"] * HEALTHY
        assert not any(r.timed_out for r in results)
        m = ts.metrics()
        assert m["tools/healthy/timeouts"] == 0 and m["tools/hung/timeouts"] == HUNG
    finally:
        release.set()
    await until(lambda: ts.metrics()["tools/sync_threads_busy"] == 0, "hung threads never ended")


def test_detach_frees_a_worker_within_a_separate_budget() -> None:
    pool = DaemonThreadPool(1, name="t", max_detached=1)
    release = threading.Event()
    started = threading.Event()

    def block() -> str:
        started.set()
        release.wait()
        return "late"

    first = pool.submit(block)
    assert started.wait(30)
    queued = pool.submit(lambda: "next")
    assert pool.detach(first) and pool.detached == 1
    assert queued.result(timeout=30) == "next"  # a fresh worker served the queue
    started.clear()
    second = pool.submit(block)
    assert started.wait(30)
    assert not pool.detach(second)  # the separate budget (1) is spent: it keeps its worker
    assert not pool.detach(queued)  # done calls have nothing to free
    release.set()
    assert first.result(timeout=30) == second.result(timeout=30) == "late"
    deadline_ok = threading.Event()
    pool.submit(deadline_ok.set).result(timeout=30)
    assert pool.detached == 0
    pool.shutdown()
