"""Truncated importance-sampling weights (TIS) at token, sequence or geometric level.

Reference: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS,
2025); Liu, Li et al., "When Speed Kills Stability" (2025) for the sequence/geometric levels.

With ℓ_t = log π_train − log π_rollout, response mask m_t and threshold C (the upper truncation):
- token:     w_t = min(exp ℓ_t, C)
- sequence:  w   = min(exp Σ_t m_t ℓ_t, C), shared by every token of the sequence
- geometric: w   = min(exp(Σ_t m_t ℓ_t / Σ_t m_t), C)
Weights are detached and exactly 0 on padding. Optional batch normalization divides by the masked
mean token weight (token level) or the mean sequence weight (sequence levels), so that mean is 1.
"""

from __future__ import annotations

import torch

from correction._common import metrics_to_floats
from correction._engine import correction_pass
from correction.types import ISLevel, as_is_level, check_threshold

__all__ = ["is_weights"]


def is_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    level: ISLevel | str = "token",
    threshold: float = 2.0,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights for off-policy tokens.

    Args:
        log_ratio: ``[B, T]`` ℓ = log π_train − log π_rollout (π_old in decoupled mode, π_θ.detach()
            in bypass mode). Values at padding are ignored; a non-finite value on a response token
            raises ``ValueError`` naming the position.
        response_mask: ``[B, T]`` 0/1 (any dtype).
        level: ``token``, ``sequence`` or ``geometric``.
        threshold: C, the upper truncation (> 0).
        batch_normalize: divide by the batch mean weight so it becomes 1 (weights may then
            exceed C).

    Returns:
        ``(weights [B, T], metrics)``; weights are detached, in the compute dtype (float32 unless
        the input is float64) and 0 on padding. Metrics: ``is_weight_mean``, ``is_weight_max``,
        ``is_weight_min``, ``is_weight_std``, ``is_frac_truncated``, ``is_ess`` (over valid tokens
        at token level, over sequences with ≥ 1 valid token otherwise; before normalization), and
        ``is_batch_norm_factor`` when normalizing.

    Example::

        w, m = is_weights(old_lp - rollout_lp, mask, "token", threshold=2.0)
        pg_loss_mat = pg_loss_mat * w
    """
    result = correction_pass(
        log_ratio,
        response_mask,
        is_level=as_is_level(level),
        threshold=check_threshold(threshold),
        batch_normalize=batch_normalize,
    )
    assert result.weights is not None
    return result.weights, metrics_to_floats(result.metrics)
