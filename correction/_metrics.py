"""The metric assembly of a correction pass: IS, RS and diagnostic metrics from the per-row
statistics and the batch sums.

Why it exists: every metric is a function of ``[B]`` per-sequence vectors and a few batch sums
(:data:`correction._plan.Found`), whichever block kernel produced them; computing them here, once,
keeps the two kernels' results identical by construction.

What it guarantees: metrics are 0-dim float64 tensors (or floats when there is nothing to
measure), over valid tokens; sequence-level ones average over sequences with at least one valid
token; an empty batch gives 0.0, never NaN.
"""

from __future__ import annotations

import math

import torch

from correction._common import LOG_RATIO_BOUND
from correction._plan import EM1_SQ, F64, N_TRUNC, W_SQ, W_SUM
from correction.types import ISLevel, RejectionRule

__all__ = ["DIAGNOSTIC_NAMES", "Metrics", "diagnostics", "is_metrics", "rs_metrics"]

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
Metrics = dict[str, torch.Tensor | float]


def is_metrics(
    level: ISLevel,
    threshold: float,
    totals: torch.Tensor,
    extremes: tuple[float, float],
    cat: dict[str, torch.Tensor],
    n_tok: torch.Tensor,
    n_seq: torch.Tensor,
    valid: torch.Tensor,
) -> Metrics:
    """IS weight mean, max, min, std, truncated fraction and ESS, over tokens or sequences.

    ``totals``: ``[len(BLOCK_SUMS)]`` float64 batch sums; ``extremes``: token-level (max, min).
    """
    device = valid.device
    zero = torch.zeros((), dtype=F64, device=device)
    if level is ISLevel.TOKEN:
        n = n_tok
        w_sum, w_sq, n_trunc = totals[W_SUM], totals[W_SQ], totals[N_TRUNC]
        w_max = torch.tensor(extremes[0], dtype=F64, device=device)
        w_min = torch.tensor(extremes[1], dtype=F64, device=device)
    else:
        n = n_seq
        seq_w = cat.get("seq_w", torch.zeros(0, dtype=F64, device=device))
        w_sum, w_sq = seq_w.sum(), torch.dot(seq_w, seq_w)
        n_trunc = cat["seq_trunc"].sum().to(F64) if "seq_trunc" in cat else zero
        w_max = seq_w.max() if seq_w.numel() else zero
        w_min = torch.where(valid, seq_w, math.inf).min() if seq_w.numel() else w_max
    w_max = torch.where(n > 0, w_max, 0.0)
    w_min = torch.where(n > 0, w_min, 0.0)
    n_safe = n.clamp(min=1.0)
    mean = w_sum / n_safe
    var = torch.clamp(w_sq / n_safe - mean * mean, min=0.0)
    return {
        "is_weight_mean": mean,
        "is_weight_max": w_max,
        "is_weight_min": w_min,
        "is_weight_std": torch.sqrt(var),
        "is_frac_truncated": n_trunc.to(F64) / n_safe,
        # ESS = 1 / E[(w / E w)²] = (Σw)² / (n Σw²), a fraction in (0, 1].
        "is_ess": torch.where(w_sq > 0, w_sum * w_sum / (n_safe * w_sq), 0.0),
    }


def rs_metrics(
    rules: tuple[RejectionRule, ...],
    cat: dict[str, torch.Tensor],
    n_tok: torch.Tensor,
    n_seq: torch.Tensor,
    valid: torch.Tensor,
) -> Metrics:
    """Masked fractions per rule (``rs_masked_frac_{token,seq}/<option>``) and of all rules
    together (``kept``: ``[B]`` tokens kept per sequence after every rule)."""
    if not rules:
        return {"rs_masked_frac_token": 0.0, "rs_masked_frac_seq": 0.0}
    seq_len = cat["seq_len"]
    n_tok_safe, n_seq_safe = n_tok.clamp(min=1.0), n_seq.clamp(min=1.0)
    metrics: Metrics = {}
    for rule in rules:
        name = rule.option.value
        if rule.option.is_token:
            kept = cat[f"kept/{name}"]
            metrics[f"rs_masked_frac_token/{name}"] = (n_tok - kept.sum()) / n_tok_safe
            metrics[f"rs_masked_frac_seq/{name}"] = (kept < seq_len).sum().to(F64) / n_seq_safe
        else:
            dropped = ~cat[f"seq_keep/{name}"]
            metrics[f"rs_masked_frac_token/{name}"] = (
                torch.where(dropped, seq_len, 0.0).sum() / n_tok_safe
            )
            metrics[f"rs_masked_frac_seq/{name}"] = dropped.sum().to(F64) / n_seq_safe
    kept = cat["kept"]
    metrics["rs_masked_frac_token"] = (n_tok - kept.sum()) / n_tok_safe
    metrics["rs_masked_frac_seq"] = ((kept < seq_len) & valid).sum().to(F64) / n_seq_safe
    return metrics


def diagnostics(
    totals: torch.Tensor,
    cat: dict[str, torch.Tensor],
    n_tok: torch.Tensor,
    n_seq: torch.Tensor,
    valid: torch.Tensor,
) -> Metrics:
    """The off-policy diagnostics (``DIAGNOSTIC_NAMES``; formulas in ``correction.diagnostics``)."""
    if float(n_tok) == 0:
        return dict.fromkeys(DIAGNOSTIC_NAMES, 0.0)
    length = cat["seq_len"].clamp(min=1.0)
    n_tok_safe, n_seq_safe = n_tok.clamp(min=1.0), n_seq.clamp(min=1.0)

    def seq_mean(per_seq: torch.Tensor) -> torch.Tensor:
        """Mean of a ``[B]`` per-sequence value over the sequences with valid tokens."""
        return torch.where(valid, per_seq, 0.0).sum() / n_seq_safe

    rollout_mean = cat["rollout_sum"] / length  # [B] mean log π_rollout
    lr_mean = cat["seq_sum"] / length
    train_mean = rollout_mean + lr_mean  # [B] mean log π_train
    log_ppl_diff = -lr_mean  # log ppl_train − log ppl_rollout
    bounded_sum = torch.clamp(cat["seq_sum"], -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return {
        "kl": -cat["seq_sum"].sum() / n_tok_safe,
        "k3_kl": cat["k3_sum"].sum() / n_tok_safe,
        "training_ppl": seq_mean(torch.exp(-train_mean)),
        "rollout_ppl": seq_mean(torch.exp(-rollout_mean)),
        "log_ppl_diff": seq_mean(log_ppl_diff),
        "log_ppl_abs_diff": seq_mean(log_ppl_diff.abs()),
        "ppl_ratio": seq_mean(
            torch.exp(torch.clamp(log_ppl_diff, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        ),
        # ρ² − 1 = 2(ρ − 1) + (ρ − 1)²: accurate for ρ ≈ 1.
        "chi2_token": (2.0 * cat["em1_sum"].sum() + totals[EM1_SQ]) / n_tok_safe,
        "chi2_seq": seq_mean(torch.exp(2.0 * bounded_sum)) - 1.0,
    }
