"""The training loop's rollout feed never trains on an episode whose agent raised (issue 22).

A real :class:`AgentLoopManager` (scripted policy, the built-in single-turn agent) feeds the
loop's :class:`RolloutFeed`; the policy raises on one task's prompts, so that task's agent
raises and its episodes end with ``stop_reason=error``. The feed must drop them with their
group, count them ``rollout/dropped/agent_error``, and fill the batch with other tasks.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from agentrl.config import load_config
from agentrl.inference.tiny_model import build_tiny_tokenizer
from agentrl.rollout.manager import AgentLoopManager, WorkerConfig
from agentrl.rollout.rewards import RewardManager
from agentrl.training.loop import RolloutFeed
from agentrl.training.state import RunState
from agentrl.types import SamplingParams, StopReason, Task
from tests.fakes import ScriptedPolicy


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tiny_tokenizer()


def _run(tok: Any, servers: Any = None, delay_s: float = 0.0) -> SimpleNamespace:
    """What RolloutFeed reads of a built run: the config, the plan, a manager factory, the
    run's servers (None: nothing watches them)."""
    cfg = load_config(None, ["data.batch_size=2", "data.n_samples=2", "trainer.max_staleness=0"])

    def script(prompt_ids: list[int], k: int) -> Any:
        if "broken" in tok.decode(prompt_ids):
            return RuntimeError("the agent's service is down")
        return "\\boxed{1}"

    def make_manager(*, admission: Any, greedy_baseline: bool) -> AgentLoopManager:
        return AgentLoopManager(
            ScriptedPolicy(tok, script, delay_s=delay_s),
            tok,
            reward=RewardManager({"s": "numeric_match"}),
            config=WorkerConfig(sampling=SamplingParams(max_tokens=16)),
            admission=admission,
        )

    plan = SimpleNamespace(advantage=SimpleNamespace(needs_greedy_baseline=False))
    return SimpleNamespace(
        cfg=cfg, resolved=SimpleNamespace(plan=plan), make_manager=make_manager, servers=servers
    )


async def test_an_agent_that_raises_is_a_counted_drop_never_trained_on(tok: Any) -> None:
    tasks = [
        Task(
            id=name,
            prompt=f"{name}: 0+1?",
            agent="single_turn",
            data_source="s",
            reward_spec={"ground_truth": "1"},
        )
        for name in ("ok0", "broken", "ok1", "ok2")
    ]
    feed = RolloutFeed(_run(tok), RunState.fresh(), tasks)  # type: ignore[arg-type]
    try:
        groups, _ = await feed.next_batch(0)
    finally:
        await feed.close()
    assert sorted(g[0].task_id for g in groups) == ["ok0", "ok1"]
    assert all(t.stop_reason is not StopReason.ERROR for g in groups for t in g)
    counts = feed.counts()
    assert counts["rollout/dropped/agent_error"] == 2.0
    assert counts["rollout/errors"] == 2.0  # the worker's count of agents that raised


async def test_a_run_whose_servers_are_all_gone_stops_with_their_message(tok: Any) -> None:
    """``run.servers`` reports every server gone for good while the loop waits for a batch:
    the wait ends with RunFailed and that message (never a hang)."""
    import asyncio

    from agentrl.training.loop import RunFailed

    lost: list[Any] = []
    servers = SimpleNamespace(on_lost=lost.append)
    task = Task(id="t", prompt="0+1?", agent="single_turn", data_source="s", reward_spec={})
    feed = RolloutFeed(_run(tok, servers, delay_s=3600), RunState.fresh(), [task] * 4)  # type: ignore[arg-type]
    try:
        (callback,) = lost
        asyncio.get_running_loop().call_later(0.2, callback, "every inference server is gone")
        with pytest.raises(RunFailed, match="every inference server is gone"):
            await asyncio.wait_for(feed.next_batch(0), timeout=10)
    finally:
        await feed.close()
