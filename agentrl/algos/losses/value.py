"""The critic's loss: PPO's clipped value loss (for the ``gae`` estimator).

Why it exists: the one loss that is not a policy loss and not in the registry; the critic
calls it directly. Same aggregation (and global counts) as the policy losses.
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.algos.aggregation import agg_loss
from agentrl.algos.utils import masked_mean

__all__ = ["value_loss"]


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    global_tokens: Any = None,
    global_seqs: Any = None,
    loss_scale_factor: Any = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped critic loss of PPO (for ``gae``): ½ · agg(max((V − R)², (V_clip − R)²)).

    Args:
        vpreds: ``[B, T]`` current critic predictions (carry the gradient).
        returns: ``[B, T]`` targets from :func:`agentrl.algos.compute_advantage` (``gae``).
        values: ``[B, T]`` the critic's predictions when the batch was collected.
        response_mask: ``[B, T]`` 0/1.
        cliprange_value: V_clip = values + clip(vpreds − values, ±cliprange_value).

    Returns:
        ``(loss, {"vf_clipfrac": fraction of tokens where the clipped term is larger})``.
    """
    v = vpreds.float()
    old = values.float()
    ret = returns.float()
    v_clipped = old + (v - old).clamp(-cliprange_value, cliprange_value)
    unclipped = (v - ret) ** 2
    clipped = (v_clipped - ret) ** 2
    losses = 0.5 * torch.maximum(unclipped, clipped)
    loss = agg_loss(
        losses, response_mask, loss_agg_mode, global_tokens, global_seqs, loss_scale_factor
    )
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), response_mask).item()
    return loss, {"vf_clipfrac": clipfrac}
