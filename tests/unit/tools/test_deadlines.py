"""Every wait on tool code has a deadline that holds whatever the tool does.

Chaos cases from issue 13: a tool that swallows ``CancelledError`` (it once kept an episode
12 s past a 2 s limit, reported as ``eos`` with 0 timeouts), and hung sync tools (eight of them
starved the loop's default thread pool, which weight staging also uses). Each case is counted
(``tools/<name>/timeouts``, ``cancelled``, ``abandoned``) and each test shows the wait ended
on time:
the hung tool blocks until the test ends (a missed deadline hangs, it cannot pass) and the
waits go through ``tests.waiting``, which fails a hung test instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from agentrl.inference.tiny_model import build_tiny_tokenizer
from agentrl.rollout.manager import AgentLoopManager, WorkerConfig
from agentrl.types import StopReason, Task
from tests.fakes import ScriptedPolicy
from tests.waiting import HANG_GUARD_S, until, within
from tools import Tool, ToolResult, ToolSet, tool
from tools.base import ABANDON_GRACE_S


class Swallower(Tool):
    """Ignores cancellation until :meth:`finish` (a retry loop written with ``except
    BaseException``): only a deadline that holds ends a call to it."""

    name = "swallow"
    description = "Takes forever and ignores cancellation."
    parameters = {"type": "object", "properties": {}}  # noqa: RUF012 (test tool)

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.cancels = 0
        self.finished = False

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        while not self.stop.is_set():
            try:
                await self.stop.wait()
            except asyncio.CancelledError:
                self.cancels += 1
        self.finished = True
        return ToolResult(content="finally done")

    async def finish(self) -> None:
        """Let the abandoned call end (the test's teardown)."""
        self.stop.set()
        await until(lambda: self.finished, "the released tool did not finish")


async def test_a_call_returns_at_its_timeout_even_if_the_tool_swallows_cancellation():
    swallow = Swallower()
    ts = ToolSet([swallow], timeout_s=0.5)
    try:
        async with ts.episode() as ep:
            r = await within(ep.call("swallow", {}), "the call's deadline did not fire")
        assert r.timed_out and r.content == "error: tool 'swallow' timed out after 0.5 s"
        # The abandon check was scheduled on this loop ABANDON_GRACE_S after the deadline,
        # before this sleep began: it runs first (timer order, not a race with the wall clock).
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
    """The issue's case: a 2 s episode limit and a tool that ignores cancellation (here for
    good: only the episode's deadline can end the episode)."""
    tok = build_tiny_tokenizer()
    swallow = Swallower()
    tools = ToolSet([swallow], timeout_s=None)  # only the episode deadline applies
    policy = ScriptedPolicy(tok, [_call("swallow"), "never reached"])
    mgr = AgentLoopManager(policy, tok, tools=tools, config=WorkerConfig(episode_timeout_s=2.0))
    try:
        (traj,) = await within(
            mgr.generate([Task(id="t", prompt="q")]), "the episode deadline did not fire"
        )
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
        release.wait()  # until the test ends: only the deadline ends the call
        return "late"

    ts = ToolSet([hung], timeout_s=0.3, sync_workers=8)
    try:
        async with ts.episode() as ep:
            calls = asyncio.gather(*(ep.call("hung", {}) for _ in range(8)))
            results = await within(calls, "the calls' deadline did not fire")
        assert all(r.timed_out for r in results)
        assert len(started) == 8 and all(n.startswith("agentrl-tool") for n in started)
        # the loop's default pool (2 threads here) is free for weight staging (had the hung
        # calls landed there, this call would wait for them, i.e. until the test ends)
        free = loop.run_in_executor(None, lambda: 42)
        assert await within(free, "the hung tools starve the default executor") == 42
        await asyncio.sleep(ABANDON_GRACE_S + 0.2)  # the abandon checks run first (timer order)
        m = ts.metrics()
        assert m["tools/hung/timeouts"] == 8 and m["tools/hung/abandoned"] == 8
        assert m["tools/sync_threads_busy"] == 8 and m["tools/abandoned_running"] == 8
    finally:
        release.set()
    await until(
        lambda: ts.metrics()["tools/sync_threads_busy"] == 0, "the released threads stayed busy"
    )


async def test_control_hung_calls_on_the_default_executor_do_starve_it():
    """What the test above guards against: the same hang on the default pool blocks it."""
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    loop.set_default_executor(pool)
    release = threading.Event()
    started = threading.Semaphore(0)

    def hang() -> bool:
        started.release()
        return release.wait()

    hung = [loop.run_in_executor(None, hang) for _ in range(2)]
    try:
        for _ in hung:
            assert started.acquire(timeout=HANG_GUARD_S), "hung: a hung call never started"
        probe = pool.submit(lambda: 42)
        # Both threads are held by the hung calls: the probe waits for one (not a timing: no
        # thread is free to take it until the release below).
        assert not probe.running() and not probe.done()
    finally:
        release.set()
        await within(asyncio.gather(*hung), "the released calls did not return")
    assert probe.result(HANG_GUARD_S) == 42


async def test_the_sync_pool_is_bounded_and_queued_calls_time_out_unstarted():
    release = threading.Event()
    started: list[str] = []

    def block(who: str) -> str:
        """Blocks until released."""
        started.append(who)
        release.wait()  # until the test ends
        return "late"

    # Two calls that take both threads (their own deadline is far away, so they are running
    # before the third is made), then one with a short deadline that finds no free thread.
    holder = tool(block, name="holder", timeout_s=HANG_GUARD_S)
    queued = tool(block, name="queued", timeout_s=0.3)
    ts = ToolSet([holder, queued], sync_workers=2)
    try:
        async with ts.episode() as ep:
            holding = [asyncio.create_task(ep.call("holder", {"who": "holder"})) for _ in "ab"]
            await until(lambda: len(started) == 2, "the first two calls never started")
            r = await within(ep.call("queued", {"who": "queued"}), "the deadline did not fire")
            assert r.timed_out and started == ["holder", "holder"]  # it gave up unstarted
            assert ts.metrics()["tools/sync_threads_busy"] == 2
            release.set()
            done = await within(asyncio.gather(*holding), "the released calls did not return")
            assert [h.content for h in done] == ["late", "late"]
        assert started == ["holder", "holder"]  # the queued call never ran, even once free
    finally:
        release.set()


async def test_a_release_that_swallows_cancellation_is_abandoned_on_time():
    class StuckRelease(Tool):
        name = "stuck"
        parameters = {"type": "object", "properties": {}}  # noqa: RUF012 (test tool)

        def __init__(self) -> None:
            self.stop = asyncio.Event()
            self.finished = False

        async def create(self) -> str:
            return "state"

        async def execute(self, state: Any, arguments: dict[str, Any]) -> str:
            return "ok"

        async def release(self, state: Any) -> None:
            while not self.stop.is_set():  # until the test ends, whatever it is told
                try:
                    await self.stop.wait()
                except asyncio.CancelledError:
                    continue
            self.finished = True

    stuck = StuckRelease()
    ts = ToolSet([stuck], release_timeout_s=0.3)
    ep = ts.episode()
    try:
        await ep.call("stuck", {})
        await within(ep.aclose(), "the release deadline did not fire")
        await asyncio.sleep(ABANDON_GRACE_S + 0.2)  # the abandon check runs first (timer order)
        m = ts.metrics()
        assert m["tools/stuck/release_errors"] == 1 and m["tools/stuck/abandoned"] == 1
    finally:
        stuck.stop.set()
    await until(lambda: stuck.finished, "the released release did not finish")


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
    try:
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
            env={"PYTHONPATH": str(Path(__file__).resolve().parents[3]), "OMP_NUM_THREADS": "1"},
            cwd=str(tmp_path),
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("hung: the process did not exit (a hung tool thread kept it alive)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "error: tool 'hung' timed out after 0.2 s"
