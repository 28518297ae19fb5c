"""Off-policy diagnostics: how far the training policy has drifted from the rollout policy.

Reference: Liu, Li et al., "When Speed Kills Stability" (2025): χ² bounds the variance of IS
estimators, KL/perplexity gaps reveal training-inference mismatch before rewards collapse.

All metrics are computed over valid tokens (``response_mask == 1``); sequence-level ones average over
sequences with at least one valid token. Names carry no prefix; the trainer logs them under
``rollout_corr/``. With ℓ = log π_train − log π_rollout and ρ = exp ℓ:
- ``kl``: masked mean of log π_rollout − log π_train (k1 estimate of KL(π_rollout ‖ π_train))
- ``k3_kl``: masked mean of ρ − 1 − ℓ (k3 estimate, non-negative, low variance)
- ``training_ppl``, ``rollout_ppl``: batch mean of per-sequence exp(−mean log-prob)
- ``log_ppl_diff``: mean over sequences of log ppl_train − log ppl_rollout = −mean_t ℓ
- ``log_ppl_abs_diff``: mean over sequences of |log ppl_train − log ppl_rollout|
- ``ppl_ratio``: mean over sequences of ppl_train / ppl_rollout
- ``chi2_token``: E_token[ρ²] − 1;  ``chi2_seq``: E_seq[(Π_t ρ_t)²] − 1
"""

from __future__ import annotations

import torch

from correction._common import LOG_RATIO_BOUND, _Stats, check_finite, check_pair, compute_dtype
from correction._common import metrics_to_floats as _to_floats

__all__ = ["DIAGNOSTIC_NAMES", "offpolicy_metrics"]

DIAGNOSTIC_NAMES: tuple[str, ...] = (
    "kl",
    "k3_kl",
    "training_ppl",
    "rollout_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
)


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
    check_pair("train_log_probs", train_log_probs, response_mask)
    check_pair("rollout_log_probs", rollout_log_probs, response_mask)
    dtype = compute_dtype(train_log_probs)
    mask = response_mask.bool()
    train = train_log_probs.detach().to(dtype)
    rollout = rollout_log_probs.detach().to(dtype)
    # A bad log-prob would surface as a bad log-ratio; check the inputs first so the error names
    # the tensor that is actually wrong.
    for name, tensor in (("train_log_probs", train), ("rollout_log_probs", rollout)):
        if not bool(torch.isfinite(torch.where(mask, tensor, 0.0).sum())):
            check_finite(name, tensor, mask)
    stats = _Stats(train - rollout, mask)
    return _to_floats(diagnostics_from_stats(stats, rollout))


def diagnostics_from_stats(
    stats: _Stats, rollout_log_probs: torch.Tensor
) -> dict[str, torch.Tensor | float]:
    """The work of :func:`offpolicy_metrics`, reusing ``stats`` (ℓ = train − rollout)."""
    if stats.n_tok_int == 0:
        return dict.fromkeys(DIAGNOSTIC_NAMES, 0.0)
    rollout = torch.where(stats.mask, rollout_log_probs.detach().to(stats.lr.dtype), 0.0)
    rollout_seq_sum = rollout.sum(dim=-1).to(torch.float64)
    if not bool(torch.isfinite(rollout_seq_sum).all()):
        check_finite("rollout_log_probs", rollout_log_probs, stats.mask)
    rollout_mean = stats.seq_mean_of(rollout_seq_sum)  # [B] mean log π_rollout
    train_mean = rollout_mean + stats.seq_mean  # [B] mean log π_train
    log_ppl_diff = rollout_mean - train_mean  # = log ppl_train − log ppl_rollout
    em1 = stats.em1.view(-1)
    per_seq_mean = stats.seq_mean_over_batch
    chi2_seq_terms = torch.exp(2.0 * torch.clamp(stats.seq_sum, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return {
        "kl": -stats.token_mean(stats.seq_sum.sum()),
        "k3_kl": stats.token_mean(stats.seq_sum_k3.sum()),
        "training_ppl": per_seq_mean(torch.exp(-train_mean)),
        "rollout_ppl": per_seq_mean(torch.exp(-rollout_mean)),
        "log_ppl_diff": per_seq_mean(log_ppl_diff),
        "log_ppl_abs_diff": per_seq_mean(log_ppl_diff.abs()),
        "ppl_ratio": per_seq_mean(
            torch.exp(torch.clamp(log_ppl_diff, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        ),
        # ρ² − 1 = 2(ρ − 1) + (ρ − 1)², accurate for ρ ≈ 1 and 0 on padding.
        "chi2_token": stats.token_mean(2.0 * em1.sum().to(torch.float64) + torch.dot(em1, em1)),
        "chi2_seq": per_seq_mean(chi2_seq_terms) - 1.0,
    }
