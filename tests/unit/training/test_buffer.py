"""TrajectoryBuffer accounting (admission is agentrl.rollout.manager.StalenessAdmission)."""

from __future__ import annotations

import asyncio
import random

import pytest

from agentrl.training.buffer import BufferClosed, TrajectoryBuffer
from agentrl.types import StopReason, Trajectory
from tests.waiting import within


def _traj(uid: str, version: int, reward: float = 0.0, index: int = 0) -> Trajectory:
    return Trajectory(
        prompt_ids=[1],
        response_ids=[5, 6],
        loss_mask=[1, 1],
        rollout_logprobs=[-0.5, -0.5],
        policy_version=[version, version],
        uid=uid,
        index=index,
        reward=reward,
        stop_reason=StopReason.EOS,
    )


async def test_buffer_groups_and_drops_stale() -> None:
    buf = TrajectoryBuffer(group_size=2, max_staleness=1)
    await buf.put(_traj("a", 0))
    assert buf.ready_groups() == 0
    await buf.put(_traj("a", 0, index=1))
    await buf.put(_traj("b", 2))
    await buf.put(_traj("b", 2, index=1))
    groups = await buf.get_groups(1, current_version=2)
    # group "a" (version 0) is 2 versions old at version 2 > η = 1: dropped and counted
    assert [g[0].uid for g in groups] == ["b"]
    assert buf.dropped["stale"] == 2
    assert buf.consumed == 2


async def test_buffer_dynamic_sampling_drops_uniform_groups() -> None:
    buf = TrajectoryBuffer(group_size=2, max_staleness=0, drop_uniform_reward_groups=True)
    for uid, rewards in (("same", (1.0, 1.0)), ("diff", (0.0, 1.0))):
        for i, r in enumerate(rewards):
            await buf.put(_traj(uid, 0, reward=r, index=i))
    groups = await buf.get_groups(1, current_version=0)
    assert groups[0][0].uid == "diff"
    assert buf.dropped["uniform_reward"] == 2


async def test_buffer_close_wakes_waiter() -> None:
    buf = TrajectoryBuffer(group_size=1, max_staleness=0)
    getter = asyncio.create_task(buf.get_groups(1, 0))
    await asyncio.sleep(0.01)  # its first step (up to the wait) runs before this timer ends
    await buf.close()
    with pytest.raises(BufferClosed):
        await within(getter, "close() did not wake the waiting reader")


async def test_every_trajectory_is_consumed_or_dropped_once() -> None:
    rng = random.Random(0)
    buf = TrajectoryBuffer(group_size=3, max_staleness=1, drop_uniform_reward_groups=True)
    n_groups = 40
    for g in range(n_groups):
        version = rng.randint(0, 4)
        for i in range(3):
            await buf.put(_traj(f"g{g}", version, reward=float(rng.randint(0, 1)), index=i))
    await buf.close()
    seen = 0
    version = 4
    while True:
        try:
            groups = await buf.get_groups(1, version)
        except BufferClosed:
            break
        for g in groups:
            assert all(t.staleness(version) <= 1 for t in g)
            seen += len(g)
    assert seen + sum(buf.dropped.values()) == buf.put_count == n_groups * 3


async def test_dropped_groups_report_their_task_ids_once() -> None:
    buf = TrajectoryBuffer(group_size=2, max_staleness=0, drop_uniform_reward_groups=True)
    for uid, version, rewards in (("a", 0, (1.0, 1.0)), ("b", 0, (0.0, 1.0))):
        for i, r in enumerate(rewards):
            t = _traj(uid, version, reward=r, index=i)
            t.task_id = f"task-{uid}"
            await buf.put(t)
    c = _traj("c", 0)
    c.task_id = "task-c"
    await buf.put(c)
    groups = await buf.get_groups(1, current_version=0)
    assert groups[0][0].uid == "b"
    assert await buf.discard_group("c") == 1
    assert buf.pop_dropped_task_ids() == ["task-a", "task-c"]
    assert buf.pop_dropped_task_ids() == []


async def test_the_group_of_the_oldest_policy_goes_first_so_slow_groups_are_not_starved() -> None:
    """A slow group (a multi-turn episode, sampled at version 1) completes after a fast one
    (version 2). Taken in completion order, the fast one fills step 2's batch and the slow one
    is 2 versions old at step 3: dropped, with the behaviour that made it slow. Oldest policy
    first, both are trained on."""
    buf = TrajectoryBuffer(group_size=2, max_staleness=1)
    for uid, version in (("fast", 2), ("slow", 1)):
        for i in range(2):
            await buf.put(_traj(uid, version, index=i))
    assert [g[0].uid for g in await buf.get_groups(1, current_version=2)] == ["slow"]
    assert [g[0].uid for g in await buf.get_groups(1, current_version=3)] == ["fast"]
    assert buf.dropped["stale"] == 0


async def test_groups_of_the_same_policy_go_in_completion_order() -> None:
    buf = TrajectoryBuffer(group_size=1, max_staleness=2)
    for uid in ("first", "second", "third"):
        await buf.put(_traj(uid, 1))
    groups = await buf.get_groups(3, current_version=1)
    assert [g[0].uid for g in groups] == ["first", "second", "third"]
