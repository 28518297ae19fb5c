"""The fused C block kernel of the correction pass (CPU, float32): the adapter between the pass
and ``correction._native``.

Why it exists: on CPU float32 one C loop per row computes −ℓ, ρ, the token IS weights, the
token-rule keep mask and every per-row statistic (float64) at once, 2-3x faster than the eager
torch path (docs/correction.md). This module packs the plan into the kernel's parameters and
unpacks its statistics into the same :data:`correction._plan.Found` the torch path returns.

What it guarantees: it returns None, and writes nothing the torch path will not overwrite, when
the kernel reports a non-finite input or a mask value other than 0/1 (the driver then runs the
torch path, which raises the usual error or masks the padding).
"""

from __future__ import annotations

import math

import torch

import correction._native as _native
from correction._plan import F64, Found, Plan
from correction._sequences import seq_weights
from correction.types import ISLevel, RSOption

__all__ = ["native_blocks"]


def native_blocks(
    native: _native.NativeKernel,
    plan: Plan,
    log_ratio: torch.Tensor | None,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    train_log_probs: torch.Tensor | None,
    weights: torch.Tensor | None,
    keep: torch.Tensor | None,
) -> Found | None:
    """The fused pass (one C loop per row, float64 row statistics); None if the kernel reported
    a non-finite input or a mask value other than 0/1 (the caller then runs the torch path)."""
    batch = response_mask.shape[0]
    mask = response_mask.detach().to(torch.float32).contiguous()
    bounds = {r.option: r for r in plan.token_rules}
    inf = math.inf
    k1, k2, k3 = (bounds.get(o) for o in (RSOption.TOKEN_K1, RSOption.TOKEN_K2, RSOption.TOKEN_K3))
    params = torch.tensor(
        [
            plan.threshold,
            math.log(k1.lower) if k1 is not None and k1.lower is not None else -inf,
            math.log(k1.upper) if k1 is not None else inf,
            math.sqrt(2.0 * k2.upper) if k2 is not None else inf,
            k3.upper if k3 is not None else inf,
        ],
        dtype=torch.float32,
    )
    stats = torch.empty((_native.N_STATS, batch), dtype=F64)
    sums = torch.tensor([0.0, 0.0, 0.0, 0.0, -inf, inf], dtype=F64)
    token_is = plan.is_level is ISLevel.TOKEN
    code = native.rows(
        train_log_probs.detach() if log_ratio is None and train_log_probs is not None else None,
        rollout_log_probs.detach() if rollout_log_probs is not None else None,
        log_ratio.detach() if log_ratio is not None else None,
        mask,
        params,
        weights if token_is else None,
        keep,
        stats,
        sums,
        threads=torch.get_num_threads(),
    )
    if code:
        return None
    cat = dict(zip(_native.STAT_KEYS, stats.unbind(0), strict=True))
    cat["seq_sum"] = -cat["neg_sum"]
    cat["k3_sum"] = torch.clamp(cat["k3_sum"], min=0.0)  # rounding sign-noise when on-policy
    cat["k2_sum"] = 0.5 * cat.pop("k2x2_sum")
    cat["lr_min"], cat["lr_max"] = -cat["neg_max"], -cat["neg_min"]
    if len(plan.token_rules) <= 1:
        # kept_token is absent without token rules, the single rule's count with one (torch path)
        del cat["kept_token"]
        if plan.token_rules:
            cat["kept_token"] = cat[f"kept/{plan.token_rules[0].option.value}"]
    if weights is not None and not token_is:
        assert plan.is_level is not None
        cat["seq_w"], cat["seq_trunc"] = seq_weights(
            plan.is_level, plan.threshold, cat["seq_sum"], cat["seq_len"]
        )
        torch.mul(cat["seq_w"].to(torch.float32).unsqueeze(-1), mask, out=weights)
        if keep is not None and plan.token_rules:
            weights.mul_(keep)
    w_hi, w_lo = float(sums[4]), float(sums[5])
    extremes = ([w_hi], [w_lo]) if math.isfinite(w_hi) and math.isfinite(w_lo) else ([], [])
    return cat, sums[:4].clone(), extremes
