"""Slow, obviously-correct reference implementations (Python loops, float64) for the tests.

They follow docs/correction.md formula by formula and share no code with the package.
"""

from __future__ import annotations

import math

import torch

BOUND = 20.0


def _clamp(x: float) -> float:
    return max(-BOUND, min(BOUND, x))


def rows(log_ratio: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """The valid log-ratios of each sequence."""
    out = []
    for b in range(log_ratio.shape[0]):
        out.append([float(log_ratio[b, t]) for t in range(log_ratio.shape[1]) if mask[b, t] > 0])
    return out


def is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, c: float, normalize: bool = False
) -> torch.Tensor:
    w = torch.zeros(log_ratio.shape, dtype=torch.float64)
    seq_ws = []
    for b, seq in enumerate(rows(log_ratio, mask)):
        if level == "sequence" and seq:
            seq_ws.append(min(math.exp(_clamp(sum(seq))), c))
        elif level == "geometric" and seq:
            seq_ws.append(min(math.exp(_clamp(sum(seq) / len(seq))), c))
        for t in range(log_ratio.shape[1]):
            if mask[b, t] > 0:
                if level == "token":
                    w[b, t] = min(math.exp(_clamp(float(log_ratio[b, t]))), c)
                else:
                    w[b, t] = seq_ws[-1]
    if normalize:
        if level == "token":
            valid = [
                float(w[b, t])
                for b in range(w.shape[0])
                for t in range(w.shape[1])
                if mask[b, t] > 0
            ]
            mean = sum(valid) / len(valid)
        else:
            mean = sum(seq_ws) / len(seq_ws)
        w = w / mean
    return w


def k_stats(x: float) -> tuple[float, float, float]:
    """(k1, k2, k3) of one token with log-ratio x = log π_train − log π_rollout."""
    return -x, 0.5 * x * x, math.exp(_clamp(x)) - 1.0 - _clamp(x)


def rs_keep(
    log_ratio: torch.Tensor, mask: torch.Tensor, option: str, upper: float, lower: float | None
) -> torch.Tensor:
    """0/1 keep mask of one rule, already ANDed with the response mask."""
    keep = torch.zeros(log_ratio.shape, dtype=torch.float64)
    kind = option[-1]
    idx = {"1": 0, "2": 1, "3": 2}[kind]
    lo = math.log(lower if lower is not None else 1.0 / upper) if kind == "1" else None
    hi = math.log(upper) if kind == "1" else upper

    def ok(stat: float) -> bool:
        return (lo <= stat <= hi) if lo is not None else stat <= hi

    for b in range(log_ratio.shape[0]):
        valid = [t for t in range(log_ratio.shape[1]) if mask[b, t] > 0]
        stats = [k_stats(float(log_ratio[b, t]))[idx] for t in valid]
        if option.startswith("token"):
            for t, stat in zip(valid, stats, strict=True):
                keep[b, t] = float(ok(stat))
            continue
        if not valid:
            continue
        if option.startswith("seq_sum"):
            agg = sum(stats)
        elif option.startswith("seq_mean"):
            agg = sum(stats) / len(stats)
        else:
            agg = max(stats)
        for t in valid:
            keep[b, t] = float(ok(agg))
    return keep


def diagnostics(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    lr_rows = rows(train - rollout, mask)
    tr_rows = rows(train, mask)
    ro_rows = rows(rollout, mask)
    tokens = [x for r in lr_rows for x in r]
    n = len(tokens)
    seqs = [i for i, r in enumerate(lr_rows) if r]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    train_ppl = [math.exp(-mean(tr_rows[i])) for i in seqs]
    rollout_ppl = [math.exp(-mean(ro_rows[i])) for i in seqs]
    diff = [mean(ro_rows[i]) - mean(tr_rows[i]) for i in seqs]
    return (
        {
            "kl": mean([-x for x in tokens]),
            "k3_kl": mean([math.exp(x) - 1 - x for x in tokens]),
            "training_ppl": mean(train_ppl),
            "rollout_ppl": mean(rollout_ppl),
            "log_ppl_diff": mean(diff),
            "log_ppl_abs_diff": mean([abs(d) for d in diff]),
            "ppl_ratio": mean([math.exp(d) for d in diff]),
            "chi2_token": mean([math.exp(2 * x) for x in tokens]) - 1.0,
            "chi2_seq": mean([math.exp(2 * _clamp(sum(lr_rows[i]))) for i in seqs]) - 1.0,
        }
        if n
        else {}
    )
