"""What one correction pass computes, and what its block kernels hand back.

Why it exists: the pass has two block kernels (the fused C kernel and the eager torch path) and
one metric assembly; this module is their shared contract. A :class:`Plan` is decided once per
call from its options (which per-row statistics the rules and diagnostics read); a
:data:`Found` is what either kernel returns; the ``W_SUM``... indices name the batch sums.

What it guarantees: both kernels return the same keys for the same plan, per-sequence vectors in
float64 (``seq_len``, ``seq_sum``, ``rollout_sum``, ``k3_sum``, ``kept/<option>``...), so the
metric code never knows which kernel ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from correction.types import ISLevel, RejectionRule, RSOption

__all__ = ["BLOCK_SUMS", "EM1_SQ", "F64", "N_TRUNC", "W_SQ", "W_SUM", "Found", "Plan"]

F64 = torch.float64


@dataclass
class Plan:
    """What one call computes (decided once per call from its options)."""

    is_level: ISLevel | None
    threshold: float
    token_rules: list[RejectionRule]
    diag: bool
    need_k3_rows: bool
    need_k2_rows: bool
    need_minmax: bool
    need_k3_tok: bool

    @classmethod
    def of(
        cls,
        is_level: ISLevel | None,
        threshold: float,
        rules: tuple[RejectionRule, ...] | None,
        *,
        diag: bool,
    ) -> Plan:
        """The plan of a call: which per-row statistics its rules and diagnostics read."""
        options = {r.option for r in rules or ()}
        return cls(
            is_level=is_level,
            threshold=threshold,
            token_rules=[r for r in rules or () if r.option.is_token],
            diag=diag,
            need_k3_rows=diag or bool(options & {RSOption.SEQ_SUM_K3, RSOption.SEQ_MEAN_K3}),
            need_k2_rows=bool(options & {RSOption.SEQ_SUM_K2, RSOption.SEQ_MEAN_K2}),
            need_minmax=bool(options & {RSOption.SEQ_MAX_K2, RSOption.SEQ_MAX_K3}),
            need_k3_tok=RSOption.TOKEN_K3 in options,
        )


Found = tuple[dict[str, torch.Tensor], torch.Tensor, tuple[list[float], list[float]]]
"""(per-sequence float64 statistics by key, ``[4]`` float64 block totals, token w max/min)."""


W_SUM, W_SQ, N_TRUNC, EM1_SQ = range(4)
"""Indices of the ``[4]`` batch sums: token IS weights, their squares, truncations, (ρ − 1)²."""
BLOCK_SUMS = ("w_sum", "w_sq", "n_trunc", "em1_sq")
