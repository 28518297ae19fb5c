"""The eager torch block kernel of the correction pass (any device and dtype).

Why it exists: where the C kernel cannot run (accelerators, float64/bfloat16, non-contiguous
inputs, ``AGENTRL_CORRECTION_NATIVE=0``, no compiler) the same per-token work is done with torch
ops, block by block: :class:`TorchPass` holds one call's per-row statistics, per-block sums and
scratch buffers, and each of its steps works on one row block ``[r0, r1)`` with ``out=`` ops.

What it guarantees: the same :data:`correction._plan.Found` as the C kernel for the same plan;
values at padding never reach a result (zeroed by the mask multiply, and re-read with ``where``
only when that produced a non-finite sum); a non-finite value at a response token raises
``ValueError`` naming the tensor and the first bad ``[b, t]``.

How it stays fast on CPU: blocks are small enough that every temporary stays in cache, scratch
buffers are reused across blocks and calls (:func:`workspace`), the mask is a float multiplier
(bool tensors and ``where`` are slow on CPU), and ρ is ``exp2`` of one multiply
(:func:`exp_of_neg`).
"""

from __future__ import annotations

import math
import threading

import torch

from correction._common import LOG_RATIO_BOUND, check_finite, compute_dtype
from correction._plan import BLOCK_SUMS, EM1_SQ, F64, N_TRUNC, W_SQ, W_SUM, Found, Plan
from correction._sequences import seq_weights
from correction.types import ISLevel, RejectionRule, RSOption

__all__ = ["TorchPass", "exp_of_neg", "log_ratio_range", "workspace"]


_WORKSPACES = threading.local()


def workspace(
    slot: int, shape: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A scratch tensor of ``shape``; on CPU a per-thread buffer reused across calls.

    Re-allocating block-sized scratch on every call costs more in page faults than the
    arithmetic it holds. Only CPU buffers are kept (at most 3 blocks per thread and dtype); on
    accelerators a block is the whole batch and is not worth holding on to.
    """
    numel = shape[0] * shape[1]
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    cache: dict[tuple[int, torch.dtype], torch.Tensor] = getattr(_WORKSPACES, "buffers", None) or {}
    _WORKSPACES.buffers = cache
    buffer = cache.get((slot, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(max(numel, 1), dtype=dtype)
        cache[(slot, dtype)] = buffer
    return buffer[:numel].view(shape)


def _token_keep_into(
    out: torch.Tensor,
    rule: RejectionRule,
    nlr: torch.Tensor,
    nlr_c: torch.Tensor,
    em1: torch.Tensor | None,
) -> torch.Tensor:
    """Write the float 0/1 keep mask of a token-scope rule into ``out`` (padding not yet masked).

    ``nlr`` is −ℓ (``[rows, T]``, 0 on padding) and ``nlr_c`` the same clamped to the bound.
    """
    if rule.option is RSOption.TOKEN_K1:
        assert rule.lower is not None  # resolved in RejectionRule.__post_init__
        # log L ≤ −ℓ ≤ log U  ⇔  clamp(−ℓ, log L, log U) == −ℓ
        return torch.clamp(nlr, math.log(rule.lower), math.log(rule.upper), out=out).eq_(nlr)
    if rule.option is RSOption.TOKEN_K2:  # ½ℓ² ≤ U  ⇔  |ℓ| ≤ √(2U)
        return torch.abs(nlr, out=out).le_(math.sqrt(2.0 * rule.upper))
    assert em1 is not None  # k3 = em1 − ℓ ≤ U
    return torch.add(em1, nlr_c, out=out).le_(rule.upper)


class Rows:
    """Per-sequence statistics of the blocked pass: one ``[n_keys, B]`` buffer in the compute dtype.

    Each block writes its slice with ``out=`` reductions; the buffer is converted to float64 once
    at the end (the values are the same compute-dtype row sums the per-block tensors held).
    """

    def __init__(self, keys: list[str], batch: int, dtype: torch.dtype, device: torch.device):
        self.index = {key: i for i, key in enumerate(keys)}
        self.buffer = torch.zeros((len(keys), batch), dtype=dtype, device=device)
        self.r0 = self.r1 = 0

    def __call__(self, key: str) -> torch.Tensor:
        """``[rows]`` the current block's slice of statistic ``key``."""
        return self.buffer[self.index[key], self.r0 : self.r1]

    def pair(self, first: str) -> torch.Tensor:
        """``[2, rows]`` statistic ``first`` and the next key (adjacent rows of the buffer)."""
        i = self.index[first]
        return self.buffer[i : i + 2, self.r0 : self.r1]

    def as_float64(self) -> dict[str, torch.Tensor]:
        """Every statistic as a float64 ``[B]`` vector, by key."""
        as64 = self.buffer.to(F64)
        return {key: as64[i] for key, i in self.index.items()}


def log_ratio_range(nlr: torch.Tensor) -> tuple[float, float]:
    """(min ℓ, max ℓ) of a block from ``nlr = −ℓ`` (0 on padding; (0, 0) when empty)."""
    if not nlr.numel():
        return 0.0, 0.0
    neg_lo, neg_hi = torch.aminmax(nlr)
    return -float(neg_hi), -float(neg_lo)


class TorchPass:
    """The state of one eager torch pass: per-row statistics, per-block sums and scratch buffers.

    Each step method works on one row block ``[r0, r1)`` (``rows.r0``/``rows.r1`` are set by the
    caller) and writes its slice of the outputs with ``out=`` ops; ``finish`` turns the per-row
    buffer into the float64 statistics that every metric is computed from.
    """

    def __init__(
        self,
        plan: Plan,
        first: torch.Tensor,
        weights: torch.Tensor | None,
        keep: torch.Tensor | None,
        blocks: list[tuple[int, int]],
    ) -> None:
        self.plan, self.weights, self.keep = plan, weights, keep
        self.dtype = dtype = compute_dtype(first)
        batch, self.length = first.shape
        device = first.device
        self.token_is = plan.is_level is ISLevel.TOKEN
        self.rows = Rows(self._row_keys(), batch, dtype, device)
        self.blocks = blocks
        # Per-block scalars (compute dtype, like the per-block sums they are), summed in float64
        # after.
        self.block_sums = torch.zeros(
            (len(BLOCK_SUMS), len(self.blocks)), dtype=dtype, device=device
        )
        self.w_max: list[float] = []
        self.w_min: list[float] = []
        self.seq_w_rows: list[torch.Tensor] = []
        self.seq_trunc_rows: list[torch.Tensor] = []
        # Scratch buffers reused by every block (out= ops): fresh allocations per block cost more
        # in page faults than the arithmetic they hold.
        need_em1 = self.token_is or plan.need_k3_rows or plan.need_k3_tok
        shape = (max(r1 - r0 for r0, r1 in self.blocks), self.length)
        self.ws_lr = workspace(0, shape, dtype, device)
        self.ws_em1 = workspace(1, shape, dtype, device) if need_em1 else None
        self.ws_tmp = workspace(2, shape, dtype, device)

    def _row_keys(self) -> list[str]:
        """The per-row statistics this plan needs, in buffer order."""
        plan = self.plan
        # "neg_sum" and "rollout_sum" are adjacent: one finiteness check covers both.
        keys = ["neg_sum", "rollout_sum", "seq_len"]
        keys += ["em1_sum", "neg_clamped_sum"] if plan.need_k3_rows else []
        keys += ["k2_sum"] if plan.need_k2_rows else []
        keys += ["neg_max", "neg_min"] if plan.need_minmax else []
        keys += [f"kept/{r.option.value}" for r in plan.token_rules]
        keys += ["kept_token"] if len(plan.token_rules) > 1 else []
        return keys

    def neg_log_ratio(
        self,
        r0: int,
        r1: int,
        mask: torch.Tensor,
        log_ratio: torch.Tensor | None,
        rollout_log_probs: torch.Tensor | None,
        train_log_probs: torch.Tensor | None,
        name: str,
    ) -> torch.Tensor:
        """``[rows, T]`` −ℓ of the block, 0 on padding (the sign that makes exp a single
        multiply), with the row sums of −ℓ, of m·log π_rollout and of the mask.

        The rollout block is read once for both of its uses.
        """
        rows, dtype, n_rows = self.rows, self.dtype, r1 - r0
        nlr = self.ws_lr[:n_rows]
        rollout = (
            rollout_log_probs[r0:r1].detach().to(dtype) if rollout_log_probs is not None else None
        )
        train = values = None
        if rollout is not None:
            rollout_masked = torch.mul(rollout, mask, out=self.ws_tmp[:n_rows])
            torch.sum(rollout_masked, dim=-1, out=rows("rollout_sum"))
        if log_ratio is None:
            assert train_log_probs is not None and rollout is not None
            train = train_log_probs[r0:r1].detach().to(dtype)
            # m·r − m·t: at response tokens exactly −(t − r); 0 on (finite) padding.
            torch.addcmul(self.ws_tmp[:n_rows], train, mask, value=-1.0, out=nlr)
        else:
            values = log_ratio[r0:r1].detach().to(dtype)
            torch.mul(values, mask, out=nlr).neg_()
        torch.sum(nlr, dim=-1, out=rows("neg_sum"))
        if not math.isfinite(float(rows.pair("neg_sum").sum())):
            _mask_nonfinite_padding(nlr, rows, mask, r0, name, values, train, rollout)
        torch.sum(mask, dim=-1, out=rows("seq_len"))
        return nlr

    def rho_and_token_weights(
        self,
        j: int,
        r0: int,
        r1: int,
        mask: torch.Tensor,
        nlr_c: torch.Tensor,
        lr_lo: float,
        lr_hi: float,
    ) -> torch.Tensor | None:
        """``[rows, T]`` em1 = ρ − 1 (exactly 0 on padding), or None when nothing reads ρ.

        With token-level IS, also writes the block's weights ``w = min(ρ, C)`` and its sums,
        truncation count and extremes.
        """
        if self.ws_em1 is None:
            return None
        threshold, n_rows = self.plan.threshold, r1 - r0
        rho = exp_of_neg(nlr_c, out=self.ws_em1[:n_rows])  # ρ; exactly 1 on padding
        if self.token_is:
            # w = min(ρ, C) from ρ itself, not from ρ − 1 (which rounds tiny ρ to 0)
            assert self.weights is not None
            w = torch.clamp(rho, max=threshold, out=self.weights[r0:r1]).mul_(mask)
            flat_w = w.view(-1)
            torch.sum(flat_w, dim=0, out=self.block_sums[W_SUM, j])
            torch.dot(flat_w, flat_w, out=self.block_sums[W_SQ, j])
            if threshold < 1.0 or lr_hi > math.log(threshold) - _EXP_MARGIN:
                # float compare into scratch + sum: bool tensors are slow on CPU
                truncated = torch.gt(rho, threshold, out=self.ws_tmp[:n_rows])
                if threshold < 1.0:  # padding's ρ = 1 would count
                    truncated.mul_(mask)
                torch.sum(truncated.view(-1), dim=0, out=self.block_sums[N_TRUNC, j])
            # else every ρ ≤ exp(max ℓ) < C: nothing truncated (the margin covers rounding)
            if flat_w.numel():
                _block_w_extremes(
                    w, mask, self.rows, lr_lo, lr_hi, threshold, self.w_max, self.w_min
                )
        return rho.sub_(1.0)  # ρ − 1, exactly 0 on padding

    def row_sums(
        self,
        j: int,
        nlr: torch.Tensor,
        nlr_c: torch.Tensor,
        em1: torch.Tensor | None,
        clamped: bool,
    ) -> None:
        """The per-row sums behind k3/k2 statistics and the ``[rows]`` min/max of ℓ."""
        plan, rows = self.plan, self.rows
        if em1 is not None and plan.need_k3_rows:
            torch.sum(em1, dim=-1, out=rows("em1_sum"))
            # Σk3 = Σ(ρ − 1) − Σℓ (from the clamped ℓ): two row sums instead of a k3 tensor.
            if clamped:
                torch.sum(nlr_c, dim=-1, out=rows("neg_clamped_sum"))
            else:
                rows("neg_clamped_sum").copy_(rows("neg_sum"))
            if plan.diag:
                flat = em1.view(-1)
                torch.dot(flat, flat, out=self.block_sums[EM1_SQ, j])
        if plan.need_k2_rows:
            torch.linalg.vecdot(nlr, nlr, out=rows("k2_sum"))  # 2·Σk2, halved in finish()
        if plan.need_minmax and self.length:
            torch.aminmax(nlr, dim=-1, out=(rows("neg_min"), rows("neg_max")))

    def sequence_weights(self, r0: int, r1: int, mask: torch.Tensor) -> None:
        """Sequence-level IS weights of the block (statistics over the original response mask)."""
        if self.weights is None or self.token_is:
            return
        assert self.plan.is_level is not None
        rows = self.rows
        seq_w, seq_trunc = seq_weights(
            self.plan.is_level,
            self.plan.threshold,
            -rows("neg_sum").to(F64),
            rows("seq_len").to(F64),
        )
        self.seq_w_rows.append(seq_w)
        self.seq_trunc_rows.append(seq_trunc)
        torch.mul(seq_w.to(self.dtype).unsqueeze(-1), mask, out=self.weights[r0:r1])

    def token_rules(
        self,
        r0: int,
        r1: int,
        mask: torch.Tensor,
        nlr: torch.Tensor,
        nlr_c: torch.Tensor,
        em1: torch.Tensor | None,
    ) -> None:
        """The block's keep mask from the token-scope RS rules (AND of all), applied to the IS
        weights; sequence-scope rules are applied after the pass."""
        if self.keep is None:
            return
        token_rules, rows = self.plan.token_rules, self.rows
        k = self.keep[r0:r1]
        for i, rule in enumerate(token_rules):
            target = k if i == 0 else self.ws_tmp[: r1 - r0]
            _token_keep_into(target, rule, nlr, nlr_c, em1).mul_(mask)
            torch.sum(target, dim=-1, out=rows(f"kept/{rule.option.value}"))
            if i:
                k.mul_(target)
        if not token_rules:
            k.copy_(mask)
        if len(token_rules) > 1:
            torch.sum(k, dim=-1, out=rows("kept_token"))
        if self.weights is not None and token_rules:
            self.weights[r0:r1].mul_(k)

    def finish(self) -> Found:
        """The float64 per-row statistics, the float64 block totals and the token w extremes."""
        plan = self.plan
        cat = self.rows.as_float64()
        cat["seq_sum"] = -cat["neg_sum"]
        if plan.need_k3_rows:
            # the clamp removes the rounding sign-noise on exactly on-policy rows
            cat["k3_sum"] = torch.clamp(cat["em1_sum"] + cat["neg_clamped_sum"], min=0.0)
        if plan.need_k2_rows:
            cat["k2_sum"] = 0.5 * cat["k2_sum"]
        if plan.need_minmax:
            cat["lr_min"], cat["lr_max"] = -cat["neg_max"], -cat["neg_min"]
        if self.seq_w_rows:
            cat["seq_w"] = torch.cat(self.seq_w_rows)
            cat["seq_trunc"] = torch.cat(self.seq_trunc_rows)
        if len(plan.token_rules) == 1:
            cat["kept_token"] = cat[f"kept/{plan.token_rules[0].option.value}"]
        return cat, self.block_sums.to(F64).sum(dim=1), (self.w_max, self.w_min)


_EXP_MARGIN = 1e-5
"""Relative rounding of the per-token exp is < 2e-6 for |ℓ| ≤ LOG_RATIO_BOUND: a block whose
max ℓ is this far below log C has no ρ > C."""


def exp_of_neg(nlr: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = exp(ℓ)`` from ``nlr = −ℓ`` (``[rows, T]``), as ``exp2(−ℓ·(−log2 e))``.

    exp2 after one multiply is about 1.6x faster than exp on CPU (vectorized Sleef exp2 vs exp);
    the product's rounding adds a relative error of ≤ |ℓ|·6e-8 (float32), exactly 0 at ℓ = 0, and
    the multiply doubles as the sign flip.
    """
    return torch.mul(nlr, -_LOG2E, out=out).exp2_()


_LOG2E = 1.0 / math.log(2.0)


def _mask_nonfinite_padding(
    nlr: torch.Tensor,
    rows: Rows,
    mask: torch.Tensor,
    r0: int,
    name: str,
    values: torch.Tensor | None,
    train: torch.Tensor | None,
    rollout: torch.Tensor | None,
) -> None:
    """Raise if a response token of this block is non-finite; otherwise the NaN/inf sat in padding
    (where the mask multiply turned it into NaN): rebuild −ℓ and the rollout sums with ``where``.
    """
    bool_mask = mask > 0
    zero = torch.zeros((), dtype=nlr.dtype, device=nlr.device)
    if rollout is not None:
        check_finite("rollout_log_probs", rollout, bool_mask, row_offset=r0)
        torch.sum(torch.where(bool_mask, rollout, zero), dim=-1, out=rows("rollout_sum"))
    if values is None:
        assert train is not None and rollout is not None
        check_finite("train_log_probs", train, bool_mask, row_offset=r0)
        values = train - rollout
    check_finite(name, values, bool_mask, row_offset=r0)
    torch.where(bool_mask, values.neg(), zero, out=nlr)
    torch.sum(nlr, dim=-1, out=rows("neg_sum"))


def _block_w_extremes(
    w: torch.Tensor,
    mask: torch.Tensor,
    rows: Rows,
    lr_lo: float,
    lr_hi: float,
    threshold: float,
    w_max: list[float],
    w_min: list[float],
) -> None:
    """Append the block's max and min token weight over valid tokens (``w`` is ``[rows, T]``)."""
    # ℓ is 0 on padding, so the block's max (min) of ℓ is a valid token's value whenever it is
    # > 0 (< 0) or the block has no padding; else one masked pass.
    has_padding: bool | None = None
    if lr_hi <= 0:
        has_padding = float(rows("seq_len").sum()) < w.numel()
    if lr_hi > 0 or not has_padding:
        w_max.append(min(math.exp(min(lr_hi, LOG_RATIO_BOUND)), threshold))
    else:  # valid weights are > 0 and padding is 0
        w_max.append(float(w.max()))
    if lr_lo >= 0 and has_padding is None:
        has_padding = float(rows("seq_len").sum()) < w.numel()
    if lr_lo < 0 or not has_padding:
        w_min.append(min(math.exp(max(lr_lo, -LOG_RATIO_BOUND)), threshold))
    else:
        w_min.append(float(torch.where(mask > 0, w, math.inf).min()))
