"""Rejection sampling (RS): a hard trust region that removes tokens or whole sequences from the loss.

Reference: Liu, Li et al., "When Speed Kills Stability" (2025) for the k1/k2/k3 family and geometric
RS; "IcePop" (Ling team, 2025) for token-level k1 masking.

Per-token statistics of ℓ_t = log π_train − log π_rollout:
  k1_t = log π_rollout − log π_train = −ℓ_t,   k2_t = ½ ℓ_t²,   k3_t = exp(ℓ_t) − 1 − ℓ_t.
An option (:class:`correction.RSOption`) picks a statistic and a scope: the token itself, or the
masked sum, mean or max over the sequence. k1 options keep iff ``log L ≤ stat ≤ log U`` (bounds in
ratio space; one number U means ``[1/U, U]``); k2/k3 options keep iff ``stat ≤ U``. A sequence-scope
rejection drops every token of the sequence. Rules combine with AND. Only the mask changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from correction._common import metrics_to_floats
from correction._engine import correction_pass
from correction.types import RejectionRule, as_rules

__all__ = ["rejection_mask"]


def rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rules: RejectionRule | Sequence[RejectionRule],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Apply RS rules (AND-combined) to the response mask.

    Args:
        log_ratio: ``[B, T]`` ℓ = log π_train − log π_rollout (padding values ignored).
        response_mask: ``[B, T]`` 0/1 (any dtype).
        rules: one rule or a sequence of rules (at most one per option); empty keeps everything.

    Returns:
        ``(new_mask [B, T], metrics)``: ``new_mask`` has ``response_mask``'s dtype and equals
        ``response_mask AND every rule's keep mask``. Metrics: ``rs_masked_frac_token/<option>`` and
        ``rs_masked_frac_seq/<option>`` per rule, and the combined ``rs_masked_frac_token`` and
        ``rs_masked_frac_seq`` (fractions of valid tokens / of sequences with ≥ 1 valid token that
        lost at least one token).

    Example::

        mask, m = rejection_mask(lr, mask, [RejectionRule("token_k1", 2.0),
                                            RejectionRule("seq_max_k2", 0.5)])
    """
    result = correction_pass(log_ratio, response_mask, rules=as_rules(rules))
    keep = response_mask if result.keep is None else result.keep.to(response_mask.dtype)
    return keep, metrics_to_floats(result.metrics)
