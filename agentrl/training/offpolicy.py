"""The train step's side of the newer off-policy variants: staleness, OPSM, loglinear π_old.

Why it exists: ``correction`` holds the math as pure functions of tensors; the step must feed
them what only the trainer knows — each row's staleness (the trainer's version against the
tokens' ``policy_version``), the advantages (OPSM runs after them), and, for AReaL's log-linear
proximal policy, the interpolation weights the actor applies inside its update. Each stage here is
a small function of the batch, so :mod:`agentrl.training.step` chains them in a few lines.

Guarantees:

- a mask only ever removes tokens (``response_mask`` shrinks), and the IS weights are 0 wherever
  the mask is 0, whichever stage masked them;
- ``rollout_corr/masked_frac_token`` and ``rollout_corr/masked_frac_seq`` count what every
  correction mask together removed from the batch (a sequence counts when it has no token left),
  the numbers :class:`agentrl.training.masking.MaskingWatch` warns on;
- a stage that needs the trainer's version and did not get it raises, naming the option.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

import correction

__all__ = [
    "apply_opsm",
    "loglinear_diagnostics",
    "masked_totals",
    "prepare_loglinear",
    "row_staleness",
]


def _need_version(version: int | None, option: str) -> int:
    if version is None:
        raise ValueError(
            f"algorithm.correction.{option} needs the trainer's version: pass "
            "train_step(..., version=v) (the version of the weights being trained)"
        )
    return version


def row_staleness(batch: TensorDict, version: int | None) -> torch.Tensor:
    """``[B]`` staleness of each row: ``version`` − the oldest ``policy_version`` of its sampled
    tokens (0 for a row without any), as :meth:`agentrl.types.Trajectory.staleness` counts it."""
    v = _need_version(version, "stale_rs_multiplier")
    versions = batch["policy_version"]
    sampled = (batch["response_mask"] > 0) & (versions >= 0)
    oldest = torch.where(sampled, versions, torch.iinfo(versions.dtype).max).amin(dim=1)
    return torch.where(sampled.any(dim=1), v - oldest, 0).clamp(min=0)


def apply_opsm(
    batch: TensorDict, train_lp: torch.Tensor, plan_correction: correction.CorrectionConfig
) -> dict[str, float]:
    """Mask the rows OPSM drops (negative advantage, mean k1 divergence over δ); metrics under
    ``rollout_corr/``. Needs ``advantages``; ``train_lp`` is π_old (decoupled) or π_θ (bypass)."""
    delta = plan_correction.opsm_threshold
    assert delta is not None
    mask = batch["response_mask"]
    ratio = (train_lp - batch["rollout_log_probs"]) * (mask > 0)
    keep, metrics = correction.opsm_mask(ratio, batch["advantages"], mask.float(), delta)
    batch["response_mask"] = (mask.float() * keep).to(mask.dtype)
    if "rollout_is_weights" in batch:
        batch["rollout_is_weights"] = batch["rollout_is_weights"] * keep
    return {f"rollout_corr/{k}": v for k, v in metrics.items()}


def masked_totals(before: torch.Tensor, after: torch.Tensor) -> dict[str, float]:
    """The share of valid tokens, and of valid sequences (no token left), that every correction
    mask together removed (``before`` and ``after`` are ``[B, T]`` response masks)."""
    valid, kept = before > 0, after > 0
    rows = valid.any(dim=1)
    n_rows = max(int(rows.sum()), 1)
    return {
        "rollout_corr/masked_frac_token": float((valid & ~kept).sum()) / max(int(valid.sum()), 1),
        "rollout_corr/masked_frac_seq": float((rows & ~kept.any(dim=1)).sum()) / n_rows,
    }


def prepare_loglinear(batch: TensorDict, version: int | None) -> dict[str, float]:
    """Put AReaL's interpolation weights α (``prox_alpha`` ``[B, T]``) into the batch: the actor
    forms π_old = π_rollout + α (π_θ − π_rollout) from its own forward inside the update."""
    v = _need_version(version, "proximal=loglinear")
    alpha, metrics = correction.loglinear_alpha(
        batch["policy_version"], v, batch["response_mask"].float()
    )
    batch["prox_alpha"] = alpha
    return {f"rollout_corr/{k}": val for k, val in metrics.items()}


def loglinear_diagnostics(
    batch: TensorDict, theta: torch.Tensor, plan_correction: correction.CorrectionConfig
) -> dict[str, float]:
    """After a loglinear update: ``old_log_probs`` = the approximated π_old of the first pass, its
    IS statistics, and the usual diagnostics of π_θ (first pass) against π_rollout."""
    mask = batch["response_mask"].float()
    rollout = batch["rollout_log_probs"]
    prox = correction.loglinear_proximal(rollout, theta, batch["prox_alpha"]) * mask
    batch["old_log_probs"] = prox
    out = correction.apply_correction(plan_correction, (prox - rollout) * mask, mask)
    metrics = {f"rollout_corr/{k}": v for k, v in out.metrics.items()}
    diag = correction.offpolicy_metrics(theta, rollout, mask)
    metrics.update({f"rollout_corr/{k}": v for k, v in diag.items()})
    return metrics
