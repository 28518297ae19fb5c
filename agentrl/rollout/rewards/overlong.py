"""DAPO's soft overlong punishment, as reward shaping added to an episode's score.

Why it exists: a response cut by the length budget gets a noisy reward (its answer was never
finished); DAPO (Yu et al. 2025, arXiv:2503.14476, eq. 13) instead punishes length softly in
the last ``L_cache`` tokens before the budget ``L_max``, so the model learns to finish in time.
The formula is verl's (``recipe/dapo`` reward manager, ``reward_model.overlong_buffer``)::

    expected = L_max - L_cache
    penalty  = min(-(length - expected) / L_cache * factor, 0)

0 up to ``L_max - L_cache`` tokens, then linear down to ``-factor`` at ``L_max`` (and past it).

In agentrl ``L_max`` is the episode budget ``agent.max_response_tokens`` and ``length`` the
episode's response length, model and tool tokens together: the count that budget cuts.

Example::

    shaping = OverlongPenalty(max_len=512, buffer_len=128)
    shaping.penalty(384), shaping.penalty(448), shaping.penalty(512)   # 0.0, -0.5, -1.0
"""

from __future__ import annotations

from dataclasses import dataclass

from agentrl.types import Trajectory

__all__ = ["OverlongPenalty"]


@dataclass(frozen=True)
class OverlongPenalty:
    """The soft overlong punishment of responses of at most ``max_len`` tokens (plain data)."""

    max_len: int
    """``L_max``: the response budget (``agent.max_response_tokens``)."""
    buffer_len: int
    """``L_cache``: the punished last tokens before ``max_len`` (``reward.overlong_buffer_len``)."""
    factor: float = 1.0
    """The penalty at ``max_len`` is ``-factor`` (``reward.overlong_penalty_factor``)."""

    def __post_init__(self) -> None:
        if not 0 < self.buffer_len <= self.max_len:
            raise ValueError(
                f"reward.overlong_buffer_len={self.buffer_len} must be in 1..agent."
                f"max_response_tokens ({self.max_len}); lower it, or set 0 to turn the "
                "overlong penalty off"
            )
        if self.factor < 0:
            raise ValueError(
                f"reward.overlong_penalty_factor={self.factor} must be >= 0 (the penalty is "
                "-factor at the budget)"
            )

    def penalty(self, length: int) -> float:
        """The (non-positive) reward term of a response of ``length`` tokens."""
        exceed = length - (self.max_len - self.buffer_len)
        return min(-exceed / self.buffer_len * self.factor, 0.0)

    def apply(self, traj: Trajectory) -> Trajectory:
        """``traj`` with the penalty added to its ``reward`` and recorded as
        ``reward_info["overlong_penalty"]`` (the unshaped score stays in ``reward_info["score"]``
        when the reward put it there)."""
        pen = self.penalty(traj.response_length)
        return traj.model_copy(
            update={
                "reward": traj.reward + pen,
                "reward_info": {**traj.reward_info, "overlong_penalty": pen},
            }
        )
