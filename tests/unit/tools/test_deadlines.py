"""Every wait on tool code has a deadline that holds whatever the tool does.

Chaos cases from issue 13: a tool that swallows ``CancelledError`` (it once kept an episode
12 s past a 2 s limit, reported as ``eos`` with 0 timeouts), and hung sync tools (eight of them
starved the loop's default thread pool, which weight staging also uses). Each case is counted
(``tools/<name>/timeouts``, ``cancelled``, ``abandoned``) and each test shows the wait ended
on time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.inference.tiny_model import build_tiny_tokenizer
from agentrl.rollout.manager import AgentLoopManager, WorkerConfig
from agentrl.types import StopReason, Task
from tests.fakes import ScriptedPolicy
from tools import Tool, ToolResult, ToolSet, tool
from tools.base import ABANDON_GRACE_S


class Swallower(Tool):
    """Ignores cancellation until ``stop`` is set or ``budget_s`` has passed (a retry loop
    written with ``except BaseException``)."""

    name = "swallow"
    description = "Takes forever and ignores cancellation."
    parameters = {"type": "object", "properties": {}}  # noqa: RUF012 (test tool)

    def __init__(self, budget_s: float = 12.0) -> None:
        self.budget_s = budget_s
        self.stop = asyncio.Event()
        self.cancels = 0
        self.finished = False

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        deadline = time.monotonic() + self.budget_s
        while time.monotonic() < deadline and not self.stop.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                self.cancels += 1
        self.finished = True
        return ToolResult(content="finally done")

    async def finish(self) -> None:
        self.stop.set()
        for _ in range(200):
            if self.finished:
                return
            await asyncio.sleep(0.01)


async def test_a_call_returns_at_its_timeout_even_if_the_tool_swallows_cancellation():
    swallow = Swallower()
    ts = ToolSet([swallow], timeout_s=0.5)
    try:
        async with ts.episode() as ep:
            t0 = time.monotonic()
            r = await ep.call("swallow", {})
            elapsed = time.monotonic() - t0
        assert r.timed_out and r.content == "error: tool 'swallow' timed out after 0.5 s"
        assert 0.5 <= elapsed < 1.5
        await asyncio.sleep(ABANDON_GRACE_S + 0.2)
        assert swallow.cancels >= 1 and not swallow.finished  # told to stop; it did not
        m = ts.metrics()
        assert m["tools/swallow/timeouts"] == 1 and m["tools/swallow/abandoned"] == 1
        assert m["tools/abandoned_running"] == 1
    finally:
        await swallow.finish()
    assert ts.metrics()["tools/abandoned_running"] == 0


async def test_a_cooperative_timeout_is_not_counted_as_abandoned():
    @tool
    async def sleepy(seconds: float) -> str:
        """Sleeps."""
        await asyncio.sleep(seconds)
        return "done"

    ts = ToolSet([sleepy], timeout_s=0.1)
    async with ts.episode() as ep:
        r = await ep.call("sleepy", {"seconds": 30})
    await asyncio.sleep(ABANDON_GRACE_S + 0.2)
    m = ts.metrics()
    assert r.timed_out and m["tools/sleepy/timeouts"] == 1 and m["tools/sleepy/abandoned"] == 0


def _call(name: str, **args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


async def test_chaos_the_episode_deadline_holds_against_a_cancel_swallowing_tool():
    """The issue's case: a 2 s episode limit and a tool that ignores cancellation for 12 s."""
    tok = build_tiny_tokenizer()
    swallow = Swallower(budget_s=12.0)
    tools = ToolSet([swallow], timeout_s=None)  # only the episode deadline applies
    policy = ScriptedPolicy(tok, [_call("swallow"), "never reached"])
    mgr = AgentLoopManager(policy, tok, tools=tools, config=WorkerConfig(episode_timeout_s=2.0))
    try:
        t0 = time.monotonic()
        (traj,) = await asyncio.wait_for(mgr.generate([Task(id="t", prompt="q")]), 30)
        elapsed = time.monotonic() - t0
        assert elapsed < 3.5, f"the episode ran {elapsed:.1f} s past its 2 s limit"
        assert traj.stop_reason == StopReason.ABORTED
        assert mgr.stats()["rollout/timeouts"] == 1
        await asyncio.sleep(ABANDON_GRACE_S + 0.2)
        m = tools.metrics()
        assert m["tools/swallow/cancelled"] == 1 and m["tools/swallow/abandoned"] == 1
    finally:
        await swallow.finish()


async def test_eight_hung_sync_tools_do_not_starve_the_default_executor():
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    release = threading.Event()
    started: list[str] = []

    @tool
    def hung() -> str:
        """Blocks until released."""
        started.append(threading.current_thread().name)
        release.wait(30)
        return "late"

    ts = ToolSet([hung], timeout_s=0.3, sync_workers=8)
    try:
        async with ts.episode() as ep:
            t0 = time.monotonic()
            results = await asyncio.gather(*(ep.call("hung", {}) for _ in range(8)))
            assert time.monotonic() - t0 < 2.0
        assert all(r.timed_out for r in results)
        assert len(started) == 8 and all(n.startswith("agentrl-tool") for n in started)
        # the loop's default pool (2 threads here) is free for weight staging
        assert await asyncio.wait_for(loop.run_in_executor(None, lambda: 42), 2.0) == 42
        await asyncio.sleep(ABANDON_GRACE_S + 0.2)
        m = ts.metrics()
        assert m["tools/hung/timeouts"] == 8 and m["tools/hung/abandoned"] == 8
        assert m["tools/sync_threads_busy"] == 8 and m["tools/abandoned_running"] == 8
    finally:
        release.set()
    for _ in range(100):
        if ts.metrics()["tools/sync_threads_busy"] == 0:
            break
        await asyncio.sleep(0.02)
    assert ts.metrics()["tools/sync_threads_busy"] == 0


async def test_control_hung_calls_on_the_default_executor_do_starve_it():
    """What the test above guards against: the same hang on the default pool blocks it."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    release = threading.Event()
    hung = [loop.run_in_executor(None, release.wait, 30) for _ in range(2)]
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(loop.run_in_executor(None, lambda: 42), 0.5)
    finally:
        release.set()
        await asyncio.gather(*hung)


async def test_the_sync_pool_is_bounded_and_queued_calls_time_out_unstarted():
    release = threading.Event()
    started: list[int] = []

    @tool
    def hung() -> str:
        """Blocks until released."""
        started.append(1)
        release.wait(30)
        return "late"

    ts = ToolSet([hung], timeout_s=0.3, sync_workers=2)
    try:
        async with ts.episode() as ep:
            results = await asyncio.gather(*(ep.call("hung", {}) for _ in range(3)))
        assert all(r.timed_out for r in results)
        assert len(started) == 2  # the third waited for a thread, then gave up unstarted
        assert ts.metrics()["tools/sync_threads_busy"] == 2
    finally:
        release.set()


async def test_a_release_that_swallows_cancellation_is_abandoned_on_time():
    class StuckRelease(Tool):
        name = "stuck"
        parameters = {"type": "object", "properties": {}}  # noqa: RUF012 (test tool)

        def __init__(self) -> None:
            self.stop = False

        async def create(self) -> str:
            return "state"

        async def execute(self, state: Any, arguments: dict[str, Any]) -> str:
            return "ok"

        async def release(self, state: Any) -> None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not self.stop:
                try:
                    await asyncio.sleep(0.02)
                except asyncio.CancelledError:
                    continue

    stuck = StuckRelease()
    ts = ToolSet([stuck], release_timeout_s=0.3)
    ep = ts.episode()
    await ep.call("stuck", {})
    t0 = time.monotonic()
    await ep.aclose()
    assert time.monotonic() - t0 < 1.5
    await asyncio.sleep(ABANDON_GRACE_S + 0.2)
    m = ts.metrics()
    assert m["tools/stuck/release_errors"] == 1 and m["tools/stuck/abandoned"] == 1
    stuck.stop = True


def test_a_hung_sync_tool_does_not_keep_the_process_from_exiting(tmp_path):
    script = textwrap.dedent(
        """
        import asyncio, threading
        from tools import ToolSet, tool

        @tool
        def hung() -> str:
            "Blocks forever."
            threading.Event().wait()
            return "never"

        async def main():
            async with ToolSet([hung], timeout_s=0.2).episode() as ep:
                print((await ep.call("hung", {})).content, flush=True)

        asyncio.run(main())
        """
    )
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[3]), "OMP_NUM_THREADS": "1"},
        cwd=str(tmp_path),
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "error: tool 'hung' timed out after 0.2 s"
    assert time.monotonic() - t0 < 30
