"""Streaming rewards: score each episode the moment it ends, on a bounded pool.

A reward function is plain Python, sync or async::

    def my_reward(traj: Trajectory, task: Task) -> float | dict: ...
    async def my_judge(traj: Trajectory, task: Task) -> float | dict: ...

It returns a score, or a dict with a required ``score``, an optional ``turn_rewards`` (one
float per model turn) and anything else, which lands in ``Trajectory.reward_info``. The
answer a function grades is the content of the last assistant message in ``traj.messages``
(:func:`final_answer_text`). :class:`RewardManager` picks the function per task by
``task.data_source``, runs it under a deadline and counts every failure (a failed reward is a
:class:`RewardError` that the caller turns into a counted drop, never a 0.0).

The package, one noun per module, in the order a newcomer reads it:

- :mod:`~agentrl.rollout.rewards.base`: the contract (``RewardFn``, what it returns, the
  errors);
- :mod:`~agentrl.rollout.rewards.rules`: the built-in rule rewards (``exact_match``,
  ``numeric_match``, ``calculator``, ``tool_format``), reading answers with
  :mod:`agentrl.rollout.answers`;
- :mod:`~agentrl.rollout.rewards.registry`: reward functions by name (``@register_reward``,
  ``module:function`` specs);
- :mod:`~agentrl.rollout.rewards.sources`: which reward scores each data source (a function,
  a model reward of :mod:`agentrl.rollout.model_rewards`, or a mix), resolved at construction;
- :mod:`~agentrl.rollout.rewards.executor` and :mod:`~agentrl.rollout.rewards.processes`:
  where a call runs (event loop, daemon threads, spawned processes) and the deadline that holds
  whatever it does;
- :mod:`~agentrl.rollout.rewards.mix`: several rewards for one data source, concurrently;
- :mod:`~agentrl.rollout.rewards.counters`: the ``reward/...`` counters;
- :mod:`~agentrl.rollout.rewards.manager`: :class:`RewardManager`, which composes them.

Every name below is importable from ``agentrl.rollout.rewards`` (and ``module:function`` specs
such as ``agentrl.rollout.rewards:numeric_match`` resolve through it).
"""

from agentrl.rollout.answers import extract_answer, final_answer_text, parse_number
from agentrl.rollout.rewards.base import (
    RewardConfigError,
    RewardError,
    RewardFn,
    RewardResult,
    RewardTimeoutError,
)
from agentrl.rollout.rewards.executor import Executor
from agentrl.rollout.rewards.manager import RewardManager
from agentrl.rollout.rewards.registry import (
    BUILTIN_REWARDS,
    REWARDS,
    register_reward,
    resolve_reward_fn,
)
from agentrl.rollout.rewards.rules import calculator_reward, exact_match, numeric_match, tool_format

__all__ = [
    "BUILTIN_REWARDS",
    "REWARDS",
    "Executor",
    "RewardConfigError",
    "RewardError",
    "RewardFn",
    "RewardManager",
    "RewardResult",
    "RewardTimeoutError",
    "calculator_reward",
    "exact_match",
    "extract_answer",
    "final_answer_text",
    "numeric_match",
    "parse_number",
    "register_reward",
    "resolve_reward_fn",
    "tool_format",
]
