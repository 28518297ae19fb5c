"""Off-policy diagnostics: how far the training policy has drifted from the rollout policy.

Reference: Liu, Li et al., "When Speed Kills Stability" (2025): χ² bounds the variance of IS
estimators, KL/perplexity gaps reveal a training-inference mismatch before rewards collapse.

All metrics are computed over valid tokens (``response_mask == 1``); sequence-level ones average over
sequences with at least one valid token. Names carry no prefix (the trainer logs them under
``rollout_corr/``). With ℓ = log π_train − log π_rollout and ρ = exp ℓ:
- ``kl``: masked mean of log π_rollout − log π_train (k1 estimate of KL(π_rollout ‖ π_train))
- ``k3_kl``: masked mean of ρ − 1 − ℓ (k3 estimate: non-negative, low variance)
- ``training_ppl``, ``rollout_ppl``: batch mean of per-sequence exp(−mean log-prob)
- ``log_ppl_diff``: mean over sequences of log ppl_train − log ppl_rollout (= −mean_t ℓ)
- ``log_ppl_abs_diff``: mean over sequences of |log ppl_train − log ppl_rollout|
- ``ppl_ratio``: mean over sequences of ppl_train / ppl_rollout
- ``chi2_token``: E_token[ρ²] − 1;  ``chi2_seq``: E_seq[(Π_t ρ_t)²] − 1
"""

from __future__ import annotations

import torch

from correction._common import metrics_to_floats
from correction._engine import correction_pass
from correction._metrics import DIAGNOSTIC_NAMES

__all__ = ["DIAGNOSTIC_NAMES", "offpolicy_metrics"]


def offpolicy_metrics(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Diagnostics of the train/rollout mismatch (names in ``DIAGNOSTIC_NAMES``).

    Args:
        train_log_probs: ``[B, T]`` log π_train of the sampled tokens (π_old or π_θ).
        rollout_log_probs: ``[B, T]`` log π_rollout from the inference server.
        response_mask: ``[B, T]`` 0/1.

    Non-finite values on response tokens raise ``ValueError`` naming the tensor and position;
    padding values are ignored. With no valid token every metric is 0.0.
    """
    result = correction_pass(
        None, response_mask, train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs
    )
    return metrics_to_floats(result.metrics)
