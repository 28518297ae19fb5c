"""The one call the trainer makes per batch: IS weights + RS mask + diagnostics from one config.

All three come out of one blocked pass over the batch (``correction._engine``), so the full
correction reads each ``[B, T]`` tensor once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from correction._common import metrics_to_floats
from correction._engine import correction_pass
from correction.config import CorrectionConfig
from correction.masks import batch_masks

__all__ = ["CorrectionOutput", "apply_correction"]


@dataclass(frozen=True)
class CorrectionOutput:
    """What :func:`apply_correction` returns.

    Attributes:
        weights: ``[B, T]`` detached IS weights (0 on padding and on rejected tokens), or None when
            the config has no IS level.
        response_mask: ``[B, T]`` the response mask after RS, in the input mask's dtype.
        metrics: flat ``dict[str, float]`` without prefix (the trainer adds ``rollout_corr/``).
    """

    weights: torch.Tensor | None
    response_mask: torch.Tensor
    metrics: dict[str, float]


def apply_correction(
    config: CorrectionConfig,
    log_ratio: torch.Tensor | None,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None = None,
    *,
    train_log_probs: torch.Tensor | None = None,
    staleness: torch.Tensor | None = None,
) -> CorrectionOutput:
    """Compute IS weights, the RS mask and their metrics for one batch.

    Args:
        config: what to do (see :class:`correction.CorrectionConfig` and :func:`correction.preset`).
        log_ratio: ``[B, T]`` log π_old − log π_rollout (decoupled) or log π_θ.detach() −
            log π_rollout (bypass). Padding values are ignored.
        response_mask: ``[B, T]`` 0/1.
        rollout_log_probs: ``[B, T]`` log π_rollout. When given, the off-policy diagnostics
            (``kl``, ``k3_kl``, perplexities, χ²; see ``DIAGNOSTIC_NAMES``) are added to the metrics,
            computed from the same statistics (π_train = π_rollout · exp ℓ).
        train_log_probs: ``[B, T]`` log π_train. With ``log_ratio=None`` and both log-prob tensors
            given, ℓ = train − rollout is formed block by block inside the pass (never as a
            ``[B, T]`` tensor): the fastest way to run the full correction.
        staleness: ``[B]`` staleness of each sequence; required by ``stale_rs_multiplier``.

    Returns:
        :class:`CorrectionOutput`. IS is computed on the original response mask (its statistics
        and batch normalization cover every response token), then zeroed where RS (or M2PO, or
        the staleness bound: ``correction.masks``) rejected.
    """
    result = correction_pass(
        log_ratio,
        response_mask,
        is_level=config.is_level,
        threshold=config.is_threshold,
        batch_normalize=config.is_batch_normalize,
        rules=config.rs_rules,
        rollout_log_probs=rollout_log_probs,
        train_log_probs=train_log_probs,
    )
    new_mask = response_mask if result.keep is None else result.keep.to(response_mask.dtype)
    metrics = metrics_to_floats(result.metrics)
    weights = result.weights
    if config.m2po_threshold is not None or config.stale_rs_multiplier is not None:
        ratio = log_ratio
        if ratio is None:
            assert train_log_probs is not None and rollout_log_probs is not None
            ratio = train_log_probs - rollout_log_probs
        keep, extra = batch_masks(config, ratio, response_mask, staleness)
        assert keep is not None
        new_mask = new_mask * keep
        weights = None if weights is None else weights * keep.to(weights.dtype)
        metrics.update(extra)
    return CorrectionOutput(weights, new_mask, metrics)
