"""Pure on-policy distillation: an advantage estimator that ignores the task reward.

With ``teacher.mode: advantage`` the train step adds ``-coef * (logp_student - logp_teacher)``
to whatever this returns, so returning zeros leaves the teacher's per-token reverse KL as the only
signal (Thinking Machines' "On-Policy Distillation" recipe). The task reward is still computed and
logged, and held-out accuracy is still measured with it.
"""

from __future__ import annotations

import torch


def zero_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of zero: ``[B, T]`` each."""
    zeros = torch.zeros_like(token_level_rewards) * response_mask
    return zeros, zeros
