"""Off-policy correction for asynchronous RL: IS weights, RS masks, bypass losses, diagnostics.

The trainer samples with π_rollout (the inference server, possibly a few versions stale) and trains
π_θ. This package holds the pure math that corrects for that gap; see ``docs/correction.md`` for
every formula, metric name and preset. It imports only torch (and the standard library), so it can be
used and tested alone.

Typical use::

    import correction
    cfg = correction.preset("decoupled_token_is")
    out = correction.apply_correction(cfg, old_log_probs - rollout_log_probs, response_mask,
                                      rollout_log_probs=rollout_log_probs)
    # out.weights [B, T] multiplies the per-token policy loss; out.response_mask replaces the mask.

Passing ``log_ratio=None, train_log_probs=old_log_probs`` (with ``rollout_log_probs``) forms ℓ inside
the pass instead, which is faster and reports bad values against the log-prob tensor that holds them.
"""

from correction._agg import LOSS_AGG_MODES, LossAggMode, agg_loss
from correction._common import LOG_RATIO_BOUND, check_finite
from correction.apply import CorrectionOutput, apply_correction
from correction.bypass import bypass_ppo_clip_loss, bypass_reinforce_loss
from correction.config import PRESETS, CorrectionConfig, LossType, ProximalMethod, preset
from correction.diagnostics import DIAGNOSTIC_NAMES, offpolicy_metrics
from correction.m2po import m2po_mask
from correction.opsm import opsm_mask
from correction.proximal import loglinear_alpha, loglinear_proximal
from correction.rejection import rejection_mask
from correction.staleness_bound import staleness_bound_mask
from correction.types import ISLevel, RejectionRule, RSOption
from correction.weights import is_weights

__all__ = [
    "DIAGNOSTIC_NAMES",
    "LOG_RATIO_BOUND",
    "LOSS_AGG_MODES",
    "PRESETS",
    "CorrectionConfig",
    "CorrectionOutput",
    "ISLevel",
    "LossAggMode",
    "LossType",
    "ProximalMethod",
    "RSOption",
    "RejectionRule",
    "agg_loss",
    "apply_correction",
    "bypass_ppo_clip_loss",
    "bypass_reinforce_loss",
    "check_finite",
    "is_weights",
    "loglinear_alpha",
    "loglinear_proximal",
    "m2po_mask",
    "offpolicy_metrics",
    "opsm_mask",
    "preset",
    "rejection_mask",
    "staleness_bound_mask",
]
