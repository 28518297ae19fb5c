"""DaemonThreadPool: bounded, reports busy threads, never joins a hung call."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from tests.waiting import HANG_GUARD_S
from tools.executor import DaemonThreadPool


def test_runs_calls_and_propagates_exceptions():
    pool = DaemonThreadPool(2)
    assert pool.submit(lambda a, b: a + b, 2, b=3).result(5) == 5

    def boom() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        pool.submit(boom).result(5)
    pool.shutdown()


def test_at_most_max_workers_run_at_once_and_busy_counts_them():
    release = threading.Event()
    started = threading.Semaphore(0)

    def hang() -> str:
        started.release()
        release.wait()  # until the test releases it
        return threading.current_thread().name

    pool = DaemonThreadPool(2, name="t-pool")
    try:
        futures = [pool.submit(hang) for _ in range(3)]
        # Threads are started by submit itself: two exist, not three.
        assert sum(t.name.startswith("t-pool") for t in threading.enumerate()) == 2
        for _ in range(2):
            assert started.acquire(timeout=HANG_GUARD_S), "hung: a call never started"
        # Both threads are held: the third waits for one (no timing: none is free to take it).
        assert pool.busy == 2 and not futures[2].running() and not futures[2].done()
    finally:
        release.set()
    names = {f.result(HANG_GUARD_S) for f in futures}
    assert names <= {"t-pool-1", "t-pool-2"}
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("t-pool"))
    pool.shutdown()


def test_shutdown_cancels_queued_calls_without_waiting_for_a_hung_one():
    release = threading.Event()
    started = threading.Event()

    def hang() -> bool:
        started.set()
        return release.wait(10)

    pool = DaemonThreadPool(1)
    running = pool.submit(hang)
    assert started.wait(5)
    queued = pool.submit(lambda: "never")
    pool.shutdown(cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: 1)
    release.set()
    assert running.result(5) is True


def test_rejects_a_pool_without_threads():
    with pytest.raises(ValueError, match="max_workers"):
        DaemonThreadPool(0)


def test_is_an_executor():
    assert isinstance(DaemonThreadPool(1), concurrent.futures.Executor)
