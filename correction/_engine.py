"""The single pass behind every public function: IS weights, RS mask and diagnostics together.

Why one engine: the three share their inputs (the masked log-ratio ℓ, ``exp(ℓ)``, per-sequence
sums and lengths), so computing them together reads each ``[B, T]`` tensor once per batch.

Two implementations of the same per-token work, chosen once per call:
- the fused C kernel (``correction/_native.c``, built and loaded by ``correction._native``) for
  CPU, float32, contiguous, non-empty inputs: one loop per row computes −ℓ, ρ, the token IS
  weights, the token-rule keep mask and every per-row statistic (float64) at once. If it reports
  a non-finite input (at a response token, or NaN/inf in padding) or a mask value other than 0/1,
  the call is recomputed by the torch path, which raises the usual error or masks the padding;
- the eager torch path (every other device/dtype, ``AGENTRL_CORRECTION_NATIVE=0``, no compiler).
Sequence-level IS weights, sequence-scope rules and all metrics are computed from the per-row
``[B]`` statistics by the same Python code for both.

How the torch path stays fast on CPU: sequences are independent, so the batch is processed in
blocks of rows small enough (``CPU_BLOCK_ELEMENTS``) that every temporary stays in cache; each
block yields its slice of the outputs plus per-sequence ``[B]`` statistics, and all metrics are
computed afterwards from those ``[B]`` vectors. On accelerators the whole batch is one block. The
loop is over row blocks, never over tokens. The mask is used as a float multiplier (bool tensors
and ``where`` are slow on CPU); values at padding are zeroed by that multiply and only re-read with
``where`` when it produced a non-finite sum (NaN/inf sitting in padding).

Numerics: the shared per-token primitive is ``em1 = ρ − 1 = exp(ℓ) − 1`` (exactly 0 on padding,
so plain sums are masked sums); ``k3 = em1 − ℓ`` and ``ρ² − 1 = 2·em1 + em1²`` are formed from it.
``exp`` is used rather than ``expm1`` (twice as fast on CPU); in float32 this leaves an absolute
error of about 1e-7 per token in em1 (the C kernel's exp: relative error < 1e-7 over the clamped
range), far below any threshold in use, and exactly 0 where ℓ = 0 (pass float64 inputs for
bit-exact on-policy checks). ℓ is clamped to ±LOG_RATIO_BOUND where it is exponentiated (per
token, and per-sequence sums/means). Per-sequence vectors are float64.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from correction import _native
from correction._common import LOG_RATIO_BOUND, check_finite, check_pair, compute_dtype
from correction.types import ISLevel, RejectionRule, RSOption

CPU_BLOCK_ELEMENTS = 1 << 18
"""Elements per row block on CPU (1 MiB of float32): temporaries stay in L2/L3 cache."""

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

_F64 = torch.float64
Metrics = dict[str, torch.Tensor | float]


@dataclass
class PassResult:
    """Outputs of :func:`correction_pass`.

    weights: ``[B, T]`` IS weights (0 on padding and on RS-rejected tokens), or None.
    keep: ``[B, T]`` float 0/1 mask after RS (compute dtype), or None when no rule was given.
    metrics: 0-dim tensors or floats, converted by the caller with ``metrics_to_floats``.
    """

    weights: torch.Tensor | None
    keep: torch.Tensor | None
    metrics: Metrics


_WORKSPACES = threading.local()


def _workspace(
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


def _row_blocks(batch: int, length: int, device: torch.device) -> Iterator[tuple[int, int]]:
    if device.type != "cpu" or batch * length <= CPU_BLOCK_ELEMENTS:
        yield 0, batch
        return
    rows = max(1, CPU_BLOCK_ELEMENTS // max(length, 1))
    for start in range(0, batch, rows):
        yield start, min(batch, start + rows)


def _k3_of(lr: torch.Tensor) -> torch.Tensor:
    clamped = torch.clamp(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.expm1(clamped) - clamped


def _seq_stat(option: RSOption, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[rows]`` the per-sequence statistic of a sequence-scope option (float64)."""
    length = rows["seq_len"].clamp(min=1.0)
    if option is RSOption.SEQ_MAX_K2:  # padding zeros never raise a max of a statistic >= 0
        lo, hi = rows["lr_min"], rows["lr_max"]
        return 0.5 * torch.maximum(lo * lo, hi * hi)
    if option is RSOption.SEQ_MAX_K3:  # k3 grows monotonically with |ℓ| on each side of 0
        return torch.maximum(_k3_of(rows["lr_min"]), _k3_of(rows["lr_max"]))
    if option.is_k1:
        total = -rows["seq_sum"]
    else:
        total = rows["k2_sum"] if option.value.endswith("k2") else rows["k3_sum"]
    return total if option.value.startswith("seq_sum") else total / length


def _seq_keep(rule: RejectionRule, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[rows]`` bool: the sequence passes the rule (sequences without valid tokens pass)."""
    stat = _seq_stat(rule.option, rows)
    if rule.option.is_k1:
        assert rule.lower is not None  # resolved in RejectionRule.__post_init__
        ok = (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
    else:
        ok = stat <= rule.upper
    return ok | (rows["seq_len"] == 0)


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


class _Rows:
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
        as64 = self.buffer.to(_F64)
        return {key: as64[i] for key, i in self.index.items()}


def correction_pass(
    log_ratio: torch.Tensor | None,
    response_mask: torch.Tensor,
    *,
    is_level: ISLevel | None = None,
    threshold: float = 2.0,
    batch_normalize: bool = False,
    rules: tuple[RejectionRule, ...] | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    train_log_probs: torch.Tensor | None = None,
    name: str = "log_ratio",
) -> PassResult:
    """IS weights (if ``is_level``), RS mask and metrics (if ``rules`` is not None) and diagnostics
    (if ``rollout_log_probs``) for ``[B, T]`` inputs, in one blocked pass. See the module docstring.

    ``log_ratio`` may be None when both ``train_log_probs`` and ``rollout_log_probs`` are given:
    ℓ is then formed block by block and never materialized as a ``[B, T]`` tensor.
    """
    first = _checked_inputs(log_ratio, response_mask, rollout_log_probs, train_log_probs, name)
    dtype = compute_dtype(first)
    shape = tuple(first.shape)
    weights = torch.empty(shape, dtype=dtype, device=first.device) if is_level else None
    keep = torch.empty(shape, dtype=dtype, device=first.device) if rules else None
    plan = _Plan.of(is_level, threshold, rules, diag=rollout_log_probs is not None)
    tensors = (log_ratio, response_mask, rollout_log_probs, train_log_probs, weights, keep)
    native = _native_kernel(log_ratio, response_mask, rollout_log_probs, train_log_probs)
    found = _native_blocks(native, plan, *tensors) if native is not None else None
    if found is None:  # torch path (also when the kernel reported a non-finite value: it raises)
        found = _torch_blocks(plan, *tensors, name)
    cat, totals, extremes = found
    if keep is not None:
        seq_rules = [r for r in rules or () if not r.option.is_token]
        cat["kept"] = _apply_sequence_rules(seq_rules, cat, keep, weights)
    seq_len = cat["seq_len"]
    n_tok = seq_len.sum()
    valid = seq_len > 0
    n_seq = valid.sum().to(_F64)
    metrics: Metrics = {}
    if is_level is not None:
        assert weights is not None
        w_max, w_min = extremes
        token_extremes = (max(w_max), min(w_min)) if w_max else (0.0, 0.0)
        metrics.update(
            _is_metrics(is_level, threshold, totals, token_extremes, cat, n_tok, n_seq, valid)
        )
        if batch_normalize:
            metrics["is_batch_norm_factor"] = _batch_normalize(weights, metrics)
    if rules is not None:
        metrics.update(_rs_metrics(rules, cat, n_tok, n_seq, valid))
    if plan.diag:
        metrics.update(_diagnostics(totals, cat, n_tok, n_seq, valid))
    return PassResult(weights, keep, metrics)


def _checked_inputs(
    log_ratio: torch.Tensor | None,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    train_log_probs: torch.Tensor | None,
    name: str,
) -> torch.Tensor:
    """Check every given ``[B, T]`` input against the mask; return the one ℓ is read from."""
    if rollout_log_probs is not None:
        check_pair("rollout_log_probs", rollout_log_probs, response_mask)
    if log_ratio is not None:
        check_pair(name, log_ratio, response_mask)
        return log_ratio
    if train_log_probs is None or rollout_log_probs is None:
        raise ValueError("pass log_ratio, or both train_log_probs and rollout_log_probs to form it")
    check_pair("train_log_probs", train_log_probs, response_mask)
    return train_log_probs


def _apply_sequence_rules(
    seq_rules: list[RejectionRule],
    cat: dict[str, torch.Tensor],
    keep: torch.Tensor,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """Zero the rows of ``keep`` (and ``weights``) that a sequence-scope rule drops; return the
    ``[B]`` count of kept tokens per sequence. Records ``seq_keep/<option>`` in ``cat``.

    Sequence-scope rules need only ``[B]`` statistics: decide once, then zero just the rows that
    were dropped (``index_fill`` touches those rows only).
    """
    seq_len = cat["seq_len"]
    kept = cat.get("kept_token", seq_len)
    if not seq_rules:
        return kept
    seq_keep_all = torch.ones_like(seq_len, dtype=torch.bool)
    for rule in seq_rules:
        ok = _seq_keep(rule, cat)
        cat[f"seq_keep/{rule.option.value}"] = ok
        seq_keep_all &= ok
    dropped = (~seq_keep_all).nonzero().view(-1)
    if dropped.numel():
        keep.index_fill_(0, dropped, 0.0)
        if weights is not None:
            weights.index_fill_(0, dropped, 0.0)
    return torch.where(seq_keep_all, kept, 0.0)


def _batch_normalize(weights: torch.Tensor, metrics: Metrics) -> torch.Tensor:
    """Divide ``weights`` in place by the batch mean IS weight (1 when that mean is 0); return
    the factor used."""
    mean = metrics["is_weight_mean"]
    assert isinstance(mean, torch.Tensor)
    factor = torch.where(mean > 0, mean, 1.0)
    weights.div_(factor.to(weights.dtype))
    return factor


@dataclass
class _Plan:
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
    ) -> _Plan:
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


_Found = tuple[dict[str, torch.Tensor], torch.Tensor, tuple[list[float], list[float]]]
"""(per-sequence float64 statistics by key, ``[4]`` float64 block totals, token w max/min)."""


def _torch_blocks(
    plan: _Plan,
    log_ratio: torch.Tensor | None,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    train_log_probs: torch.Tensor | None,
    weights: torch.Tensor | None,
    keep: torch.Tensor | None,
    name: str,
) -> _Found:
    """The eager torch pass over cache-sized row blocks (any device and dtype).

    Per block, in this order: −ℓ and the rollout sums; the block's range of ℓ (and the clamp);
    ρ with the token IS weights; the per-row sums; the sequence IS weights; the token RS rules.
    """
    first = train_log_probs if log_ratio is None else log_ratio
    assert first is not None
    run = _TorchPass(plan, first, weights, keep)
    for j, (r0, r1) in enumerate(run.blocks):
        run.rows.r0, run.rows.r1 = r0, r1
        mask = response_mask[r0:r1].detach().to(run.dtype)
        nlr = run.neg_log_ratio(r0, r1, mask, log_ratio, rollout_log_probs, train_log_probs, name)
        lr_lo, lr_hi = _log_ratio_range(nlr)
        clamped = lr_lo < -LOG_RATIO_BOUND or lr_hi > LOG_RATIO_BOUND
        nlr_c = torch.clamp(nlr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND) if clamped else nlr
        em1 = run.rho_and_token_weights(j, r0, r1, mask, nlr_c, lr_lo, lr_hi)
        run.row_sums(j, nlr, nlr_c, em1, clamped)
        run.sequence_weights(r0, r1, mask)
        run.token_rules(r0, r1, mask, nlr, nlr_c, em1)
    return run.finish()


def _log_ratio_range(nlr: torch.Tensor) -> tuple[float, float]:
    """(min ℓ, max ℓ) of a block from ``nlr = −ℓ`` (0 on padding; (0, 0) when empty)."""
    if not nlr.numel():
        return 0.0, 0.0
    neg_lo, neg_hi = torch.aminmax(nlr)
    return -float(neg_hi), -float(neg_lo)


class _TorchPass:
    """The state of one eager torch pass: per-row statistics, per-block sums and scratch buffers.

    Each step method works on one row block ``[r0, r1)`` (``rows.r0``/``rows.r1`` are set by the
    caller) and writes its slice of the outputs with ``out=`` ops; ``finish`` turns the per-row
    buffer into the float64 statistics that every metric is computed from.
    """

    def __init__(
        self,
        plan: _Plan,
        first: torch.Tensor,
        weights: torch.Tensor | None,
        keep: torch.Tensor | None,
    ) -> None:
        self.plan, self.weights, self.keep = plan, weights, keep
        self.dtype = dtype = compute_dtype(first)
        batch, self.length = first.shape
        device = first.device
        self.token_is = plan.is_level is ISLevel.TOKEN
        self.rows = _Rows(self._row_keys(), batch, dtype, device)
        self.blocks = list(_row_blocks(batch, self.length, device))
        # Per-block scalars (compute dtype, like the per-block sums they are), summed in float64
        # after.
        self.block_sums = torch.zeros(
            (len(_BLOCK_SUMS), len(self.blocks)), dtype=dtype, device=device
        )
        self.w_max: list[float] = []
        self.w_min: list[float] = []
        self.seq_w_rows: list[torch.Tensor] = []
        self.seq_trunc_rows: list[torch.Tensor] = []
        # Scratch buffers reused by every block (out= ops): fresh allocations per block cost more
        # in page faults than the arithmetic they hold.
        need_em1 = self.token_is or plan.need_k3_rows or plan.need_k3_tok
        shape = (max(r1 - r0 for r0, r1 in self.blocks), self.length)
        self.ws_lr = _workspace(0, shape, dtype, device)
        self.ws_em1 = _workspace(1, shape, dtype, device) if need_em1 else None
        self.ws_tmp = _workspace(2, shape, dtype, device)

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
        rho = _exp_of_neg(nlr_c, out=self.ws_em1[:n_rows])  # ρ; exactly 1 on padding
        if self.token_is:
            # w = min(ρ, C) from ρ itself, not from ρ − 1 (which rounds tiny ρ to 0)
            assert self.weights is not None
            w = torch.clamp(rho, max=threshold, out=self.weights[r0:r1]).mul_(mask)
            flat_w = w.view(-1)
            torch.sum(flat_w, dim=0, out=self.block_sums[_W_SUM, j])
            torch.dot(flat_w, flat_w, out=self.block_sums[_W_SQ, j])
            if threshold < 1.0 or lr_hi > math.log(threshold) - _EXP_MARGIN:
                # float compare into scratch + sum: bool tensors are slow on CPU
                truncated = torch.gt(rho, threshold, out=self.ws_tmp[:n_rows])
                if threshold < 1.0:  # padding's ρ = 1 would count
                    truncated.mul_(mask)
                torch.sum(truncated.view(-1), dim=0, out=self.block_sums[_N_TRUNC, j])
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
                torch.dot(flat, flat, out=self.block_sums[_EM1_SQ, j])
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
        seq_w, seq_trunc = _seq_weights(
            self.plan.is_level,
            self.plan.threshold,
            -rows("neg_sum").to(_F64),
            rows("seq_len").to(_F64),
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

    def finish(self) -> _Found:
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
        return cat, self.block_sums.to(_F64).sum(dim=1), (self.w_max, self.w_min)


def _seq_weights(
    level: ISLevel, threshold: float, seq_sum: torch.Tensor, seq_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows]`` float64 sequence-level IS weights and their truncation flags (bool)."""
    log_w = seq_sum / seq_len.clamp(min=1.0) if level is ISLevel.GEOMETRIC else seq_sum
    log_w = torch.clamp(log_w, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    seq_w = torch.where(seq_len > 0, torch.clamp(torch.exp(log_w), max=threshold), 0.0)
    return seq_w, (log_w > math.log(threshold)) & (seq_len > 0)


def _native_kernel(
    log_ratio: torch.Tensor | None,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    train_log_probs: torch.Tensor | None,
) -> _native.NativeKernel | None:
    """The fused C kernel when this call can use it: CPU, float32, contiguous, non-empty inputs
    (and the kernel is enabled and built, see ``correction._native``); else None."""
    inputs = [t for t in (log_ratio, rollout_log_probs, train_log_probs) if t is not None]
    if not all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in inputs
    ):
        return None
    if response_mask.device.type != "cpu" or response_mask.numel() == 0:
        return None
    return _native.kernel()


def _native_blocks(
    native: _native.NativeKernel,
    plan: _Plan,
    log_ratio: torch.Tensor | None,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    train_log_probs: torch.Tensor | None,
    weights: torch.Tensor | None,
    keep: torch.Tensor | None,
) -> _Found | None:
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
    stats = torch.empty((_native.N_STATS, batch), dtype=_F64)
    sums = torch.tensor([0.0, 0.0, 0.0, 0.0, -inf, inf], dtype=_F64)
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
        cat["seq_w"], cat["seq_trunc"] = _seq_weights(
            plan.is_level, plan.threshold, cat["seq_sum"], cat["seq_len"]
        )
        torch.mul(cat["seq_w"].to(torch.float32).unsqueeze(-1), mask, out=weights)
        if keep is not None and plan.token_rules:
            weights.mul_(keep)
    w_hi, w_lo = float(sums[4]), float(sums[5])
    extremes = ([w_hi], [w_lo]) if math.isfinite(w_hi) and math.isfinite(w_lo) else ([], [])
    return cat, sums[:4].clone(), extremes


_W_SUM, _W_SQ, _N_TRUNC, _EM1_SQ = range(4)
_BLOCK_SUMS = ("w_sum", "w_sq", "n_trunc", "em1_sq")

_EXP_MARGIN = 1e-5
"""Relative rounding of the per-token exp is < 2e-6 for |ℓ| ≤ LOG_RATIO_BOUND: a block whose
max ℓ is this far below log C has no ρ > C."""


def _exp_of_neg(nlr: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = exp(ℓ)`` from ``nlr = −ℓ`` (``[rows, T]``), as ``exp2(−ℓ·(−log2 e))``.

    exp2 after one multiply is about 1.6x faster than exp on CPU (vectorized Sleef exp2 vs exp);
    the product's rounding adds a relative error of ≤ |ℓ|·6e-8 (float32), exactly 0 at ℓ = 0, and
    the multiply doubles as the sign flip.
    """
    return torch.mul(nlr, -_LOG2E, out=out).exp2_()


_LOG2E = 1.0 / math.log(2.0)


def _mask_nonfinite_padding(
    nlr: torch.Tensor,
    rows: _Rows,
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
    rows: _Rows,
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


def _is_metrics(
    level: ISLevel,
    threshold: float,
    totals: torch.Tensor,
    extremes: tuple[float, float],
    cat: dict[str, torch.Tensor],
    n_tok: torch.Tensor,
    n_seq: torch.Tensor,
    valid: torch.Tensor,
) -> Metrics:
    """``totals``: ``[len(_BLOCK_SUMS)]`` float64 batch sums; ``extremes``: token-level (max, min)."""
    device = valid.device
    zero = torch.zeros((), dtype=_F64, device=device)
    if level is ISLevel.TOKEN:
        n = n_tok
        w_sum, w_sq, n_trunc = totals[_W_SUM], totals[_W_SQ], totals[_N_TRUNC]
        w_max = torch.tensor(extremes[0], dtype=_F64, device=device)
        w_min = torch.tensor(extremes[1], dtype=_F64, device=device)
    else:
        n = n_seq
        seq_w = cat.get("seq_w", torch.zeros(0, dtype=_F64, device=device))
        w_sum, w_sq = seq_w.sum(), torch.dot(seq_w, seq_w)
        n_trunc = cat["seq_trunc"].sum().to(_F64) if "seq_trunc" in cat else zero
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
        "is_frac_truncated": n_trunc.to(_F64) / n_safe,
        # ESS = 1 / E[(w / E w)²] = (Σw)² / (n Σw²), a fraction in (0, 1].
        "is_ess": torch.where(w_sq > 0, w_sum * w_sum / (n_safe * w_sq), 0.0),
    }


def _rs_metrics(
    rules: tuple[RejectionRule, ...],
    cat: dict[str, torch.Tensor],
    n_tok: torch.Tensor,
    n_seq: torch.Tensor,
    valid: torch.Tensor,
) -> Metrics:
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
            metrics[f"rs_masked_frac_seq/{name}"] = (kept < seq_len).sum().to(_F64) / n_seq_safe
        else:
            dropped = ~cat[f"seq_keep/{name}"]
            metrics[f"rs_masked_frac_token/{name}"] = (
                torch.where(dropped, seq_len, 0.0).sum() / n_tok_safe
            )
            metrics[f"rs_masked_frac_seq/{name}"] = dropped.sum().to(_F64) / n_seq_safe
    kept = cat["kept"]
    metrics["rs_masked_frac_token"] = (n_tok - kept.sum()) / n_tok_safe
    metrics["rs_masked_frac_seq"] = ((kept < seq_len) & valid).sum().to(_F64) / n_seq_safe
    return metrics


def _diagnostics(
    totals: torch.Tensor,
    cat: dict[str, torch.Tensor],
    n_tok: torch.Tensor,
    n_seq: torch.Tensor,
    valid: torch.Tensor,
) -> Metrics:
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
        "chi2_token": (2.0 * cat["em1_sum"].sum() + totals[_EM1_SQ]) / n_tok_safe,
        "chi2_seq": seq_mean(torch.exp(2.0 * bounded_sum)) - 1.0,
    }
