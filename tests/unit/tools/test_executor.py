"""DaemonThreadPool: bounded, reports busy threads, never joins a hung call."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

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
        release.wait(10)
        return threading.current_thread().name

    pool = DaemonThreadPool(2, name="t-pool")
    futures = [pool.submit(hang) for _ in range(3)]
    assert started.acquire(timeout=5) and started.acquire(timeout=5)
    assert not started.acquire(timeout=0.3)  # the third waits for a thread
    assert pool.busy == 2
    release.set()
    names = {f.result(5) for f in futures}
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
