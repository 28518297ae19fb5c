"""Off-policy sequence masking (OPSM): drop the stale samples that would teach the wrong lesson.

Reference: DeepSeek-AI, "DeepSeek-V3.2" (arXiv 2512.02556), equation 9, as implemented by slime
(``--use-opsm``, ``--opsm-delta``; ``slime/utils/ppo_utils.py::compute_opsm_mask``) and TRL
(``GRPOConfig.off_policy_mask_threshold``; ``GRPOTrainer.get_off_policy_mask``).

A sample with a negative advantage pushes the probability of its tokens down. When the sample is
far off-policy, those tokens may already be unlikely under the current policy, and pushing them
down further mostly adds noise. OPSM removes exactly those: with the sequence's mean k1 divergence

    KL_i = Σ_t m_t (log π_rollout − log π_train) / Σ_t m_t = −(Σ_t m_t ℓ_t) / Σ_t m_t,

token t of sequence i is masked iff A_{i,t} < 0 and KL_i > δ. Samples with A ≥ 0 are always kept.
With the per-sequence advantages of GRPO (constant over a row) this masks whole sequences (TRL's
form, a ``[B, 1]`` mask); with per-token advantages it masks the negative-advantage tokens of a
divergent sequence (slime's form). ℓ is the correction's log-ratio: log π_old − log π_rollout in
decoupled mode (TRL compares π_θ with the sampling policy, which is π_old at the first step), or
log π_θ − log π_rollout in bypass mode (slime with ``--use-rollout-logprobs``).

TRL and slime multiply the per-token loss by the mask and keep the loss normalizer; here the mask
replaces the response mask like every rejection mask of this package, so masked tokens leave the
normalizer too.
"""

from __future__ import annotations

import math

import torch

from correction._common import check_finite, check_pair

__all__ = ["opsm_mask"]


def _check_delta(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, int | float):
        raise ValueError(f"opsm threshold must be a number >= 0 (e.g. 0.05), got {threshold!r}")
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"opsm threshold must be finite and >= 0 (e.g. 0.05), got {threshold!r}")
    return float(threshold)


def _row_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``advantages`` as ``[B, T]``: a ``[B]`` or ``[B, 1]`` tensor is broadcast over the row."""
    shaped = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    if shaped.dim() != 2 or shaped.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; use [B, T], [B, 1] or [B] with "
            f"B = {response_mask.shape[0]}"
        )
    return shaped.expand_as(response_mask)


def opsm_mask(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The OPSM mask (see the module docstring).

    Args:
        log_ratio: ``[B, T]`` ℓ = log π_train − log π_rollout (padding ignored; non-finite values
            on response tokens raise ``ValueError``).
        advantages: ``[B, T]`` (or ``[B]`` / ``[B, 1]``, one per sequence).
        response_mask: ``[B, T]`` 0/1.
        threshold: δ ≥ 0, the bound on the sequence's mean k1 divergence.

    Returns:
        ``(mask, metrics)``: ``mask`` ``[B, T]`` in ``response_mask``'s dtype (a subset of it).
        Metrics: ``opsm_masked_frac_token`` (of valid tokens), ``opsm_masked_frac_seq`` (valid
        sequences that lost ≥ 1 token), ``opsm_seq_kl_mean`` and ``opsm_seq_kl_max`` (KL_i over
        valid sequences), ``opsm_neg_adv_frac_seq`` (valid sequences with a negative advantage on
        some token).

    Example::

        keep, m = opsm_mask(old_lp - rollout_lp, advantages, response_mask, threshold=0.05)
    """
    check_pair("log_ratio", log_ratio, response_mask)
    delta = _check_delta(threshold)
    adv = _row_advantages(advantages.detach(), response_mask)
    valid = response_mask > 0
    check_finite("log_ratio", log_ratio, valid)
    check_finite("advantages", adv, valid)
    m = valid.to(torch.float64)
    ell = torch.where(valid, log_ratio.detach().to(torch.float64), 0.0)
    lengths = m.sum(dim=1)
    seq_kl = -(ell * m).sum(dim=1) / lengths.clamp(min=1.0)
    drop = valid & (adv < 0) & (seq_kl > delta).unsqueeze(1)
    keep = valid & ~drop
    rows = lengths > 0
    n_rows = max(int(rows.sum()), 1)
    metrics = {
        "opsm_masked_frac_token": float(drop.sum()) / max(int(valid.sum()), 1),
        "opsm_masked_frac_seq": float(drop.any(dim=1).sum()) / n_rows,
        "opsm_seq_kl_mean": float(seq_kl[rows].mean()) if bool(rows.any()) else 0.0,
        "opsm_seq_kl_max": float(seq_kl[rows].max()) if bool(rows.any()) else 0.0,
        "opsm_neg_adv_frac_seq": float((valid & (adv < 0)).any(dim=1).sum()) / n_rows,
    }
    return keep.to(response_mask.dtype), metrics
