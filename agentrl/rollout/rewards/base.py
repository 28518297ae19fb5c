"""The reward-function contract: what a reward function is, what it returns, how it fails.

A reward function is plain Python, sync or async::

    def my_reward(traj: Trajectory, task: Task) -> float | dict: ...
    async def my_judge(traj: Trajectory, task: Task) -> float | dict: ...

It returns a score, or a dict with a required ``score``, an optional ``turn_rewards`` (one
float per model turn, ``traj.num_turns`` of them) and anything else, which lands in
``Trajectory.reward_info``::

    {"score": 1.0, "turn_rewards": [0.0, 0.5], "rationale": "right number, one wasted call"}

:func:`normalize_result` is the one place that checks a result against this contract. The
errors: :class:`RewardConfigError` (the configuration is wrong, found when the manager is
built), :class:`RewardError` (one call failed: raised, malformed or late), and its subclass
:class:`RewardTimeoutError` (late). A :class:`RewardError` pickles with its ``source``, so it
crosses process boundaries (a Ray reward actor).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeAlias

from agentrl.types import Task, Trajectory

__all__ = [
    "RewardConfigError",
    "RewardError",
    "RewardFn",
    "RewardResult",
    "RewardTimeoutError",
    "normalize_result",
]

RewardResult: TypeAlias = float | int | bool | dict[str, Any]
"""What a reward function returns: a score, or a dict with ``score`` (module docstring)."""
RewardFn: TypeAlias = Callable[[Trajectory, Task], RewardResult | Awaitable[RewardResult]]
"""``fn(traj, task) -> float | dict`` (sync or async); see the module docstring."""


class RewardConfigError(ValueError):
    """The reward configuration is wrong (unknown name, bad path, unpicklable function)."""


class RewardError(RuntimeError):
    """A reward function failed: it raised, returned something malformed, or timed out.

    ``source`` is the task's ``data_source``. Raised by
    :meth:`~agentrl.rollout.rewards.RewardManager.score` after the failure is counted; the
    caller decides what happens to the trajectory.
    """

    def __init__(self, message: str, *, source: str) -> None:
        super().__init__(message)
        self.source = source

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses process boundaries (a Ray reward actor): keep the keyword-only ``source``.
        return (_rebuild_reward_error, (type(self), str(self), self.source))


def _rebuild_reward_error(cls: type[RewardError], message: str, source: str) -> RewardError:
    return cls(message, source=source)


class RewardTimeoutError(RewardError):
    """A reward function ran past ``timeout_s`` (it was abandoned, or its worker killed)."""


def normalize_result(result: Any, traj: Trajectory) -> tuple[float, list[float] | None, dict]:
    """``(score, turn_rewards or None, extra info)`` of a reward function's ``result``; raises
    ValueError naming what is wrong (no ``score``, not a number, not finite, ``turn_rewards``
    of the wrong length)."""
    if isinstance(result, bool | int | float):
        score, turn_rewards, info = float(result), None, {}
    elif isinstance(result, Mapping):
        score, turn_rewards, info = _from_dict(result, traj)
    else:
        raise ValueError(
            f"reward function returned {type(result).__name__}; return a float or a dict with 'score'"
        )
    if not math.isfinite(score):
        raise ValueError(f"reward score is {score}; it must be finite")
    return score, turn_rewards, info


def _from_dict(
    result: Mapping[str, Any], traj: Trajectory
) -> tuple[float, list[float] | None, dict]:
    """The parts of a dict result (``score`` required, ``turn_rewards`` one per model turn)."""
    if "score" not in result:
        raise ValueError(
            f"reward dict has no 'score' (keys: {sorted(result)}); return {{'score': float, ...}}"
        )
    info = {k: v for k, v in result.items() if k not in ("score", "turn_rewards")}
    try:
        score = float(result["score"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"reward 'score' = {result['score']!r} is not a number") from exc
    turn_rewards = result.get("turn_rewards")
    if turn_rewards is None:
        return score, None, info
    try:
        turn_rewards = [float(r) for r in turn_rewards]
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"reward 'turn_rewards' = {turn_rewards!r} must be a list of numbers"
        ) from exc
    if traj.num_turns and len(turn_rewards) != traj.num_turns:
        raise ValueError(
            f"reward 'turn_rewards' has {len(turn_rewards)} entries but the episode has "
            f"{traj.num_turns} model turns; give one per model turn"
        )
    return score, turn_rewards, info
