"""The masks a config adds beyond its RS rules (M2PO, staleness-adaptive RS), combined.

Why a module of its own: :func:`correction.apply_correction` runs the fused IS/RS pass of
``correction._engine``; these masks need the whole batch at once (M2PO sorts every token, the
staleness bound takes a batch median), so they run after that pass on the same log-ratio and are
AND-combined with the RS mask. OPSM is not here: it needs the advantages, which the trainer
computes after the correction (``correction.opsm``).
"""

from __future__ import annotations

import torch

from correction.config import CorrectionConfig
from correction.m2po import m2po_mask
from correction.staleness_bound import staleness_bound_mask

__all__ = ["batch_masks"]


def batch_masks(
    config: CorrectionConfig,
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    staleness: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The AND of ``config``'s M2PO and staleness masks, or None when it has neither.

    Both are computed on ``response_mask`` (the mask before any rejection), like the RS rules.
    ``staleness`` (``[B]``) is required when ``config.stale_rs_multiplier`` is set.
    """
    keep: torch.Tensor | None = None
    metrics: dict[str, float] = {}
    if config.m2po_threshold is not None:
        keep, m = m2po_mask(log_ratio, response_mask, config.m2po_threshold)
        metrics.update(m)
    if config.stale_rs_multiplier is not None:
        if staleness is None:
            raise ValueError(
                "CorrectionConfig.stale_rs_multiplier is set but no staleness was given: pass "
                "staleness=[B] (trainer version - the oldest policy version of each sequence)"
            )
        stale_keep, m = staleness_bound_mask(
            log_ratio,
            response_mask,
            staleness,
            floor=config.stale_rs_floor,
            multiplier=config.stale_rs_multiplier,
        )
        keep = stale_keep if keep is None else keep * stale_keep
        metrics.update(m)
    return keep, metrics
