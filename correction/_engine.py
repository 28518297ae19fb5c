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

The pieces, one per module: this driver (``correction_pass``: checks the inputs, picks the
kernel and the row blocks, applies the sequence-scope rules, hands the statistics to the
metrics); the plan both kernels follow and what they return (``_plan``); the two block kernels
(``_native_pass``, ``_torch_pass``); sequence weights and sequence-scope rules from per-row
statistics (``_sequences``); the metric assembly (``_metrics``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

import correction._native as _native
from correction._common import LOG_RATIO_BOUND, check_pair, compute_dtype
from correction._metrics import Metrics, diagnostics, is_metrics, rs_metrics
from correction._native_pass import native_blocks
from correction._plan import F64, Found, Plan
from correction._sequences import seq_keep
from correction._torch_pass import TorchPass, log_ratio_range
from correction.types import ISLevel, RejectionRule

__all__ = ["CPU_BLOCK_ELEMENTS", "PassResult", "correction_pass"]

CPU_BLOCK_ELEMENTS = 1 << 18
"""Elements per row block on CPU (1 MiB of float32): temporaries stay in L2/L3 cache."""


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


def _row_blocks(batch: int, length: int, device: torch.device) -> Iterator[tuple[int, int]]:
    """``[r0, r1)`` row blocks of at most ``CPU_BLOCK_ELEMENTS`` elements (CPU); one on devices."""
    if device.type != "cpu" or batch * length <= CPU_BLOCK_ELEMENTS:
        yield 0, batch
        return
    rows = max(1, CPU_BLOCK_ELEMENTS // max(length, 1))
    for start in range(0, batch, rows):
        yield start, min(batch, start + rows)


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
    plan = Plan.of(is_level, threshold, rules, diag=rollout_log_probs is not None)
    tensors = (log_ratio, response_mask, rollout_log_probs, train_log_probs, weights, keep)
    native = _native_kernel(log_ratio, response_mask, rollout_log_probs, train_log_probs)
    found = native_blocks(native, plan, *tensors) if native is not None else None
    if found is None:  # torch path (also when the kernel reported a non-finite value: it raises)
        found = _torch_blocks(plan, *tensors, name)
    cat, totals, extremes = found
    if keep is not None:
        seq_rules = [r for r in rules or () if not r.option.is_token]
        cat["kept"] = _apply_sequence_rules(seq_rules, cat, keep, weights)
    seq_len = cat["seq_len"]
    n_tok = seq_len.sum()
    valid = seq_len > 0
    n_seq = valid.sum().to(F64)
    metrics: Metrics = {}
    if is_level is not None:
        assert weights is not None
        w_max, w_min = extremes
        token_extremes = (max(w_max), min(w_min)) if w_max else (0.0, 0.0)
        metrics.update(
            is_metrics(is_level, threshold, totals, token_extremes, cat, n_tok, n_seq, valid)
        )
        if batch_normalize:
            metrics["is_batch_norm_factor"] = _batch_normalize(weights, metrics)
    if rules is not None:
        metrics.update(rs_metrics(rules, cat, n_tok, n_seq, valid))
    if plan.diag:
        metrics.update(diagnostics(totals, cat, n_tok, n_seq, valid))
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
        ok = seq_keep(rule, cat)
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


def _torch_blocks(
    plan: Plan,
    log_ratio: torch.Tensor | None,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    train_log_probs: torch.Tensor | None,
    weights: torch.Tensor | None,
    keep: torch.Tensor | None,
    name: str,
) -> Found:
    """The eager torch pass over cache-sized row blocks (any device and dtype).

    Per block, in this order: −ℓ and the rollout sums; the block's range of ℓ (and the clamp);
    ρ with the token IS weights; the per-row sums; the sequence IS weights; the token RS rules.
    """
    first = train_log_probs if log_ratio is None else log_ratio
    assert first is not None
    batch, length = first.shape
    run = TorchPass(plan, first, weights, keep, list(_row_blocks(batch, length, first.device)))
    for j, (r0, r1) in enumerate(run.blocks):
        run.rows.r0, run.rows.r1 = r0, r1
        mask = response_mask[r0:r1].detach().to(run.dtype)
        nlr = run.neg_log_ratio(r0, r1, mask, log_ratio, rollout_log_probs, train_log_probs, name)
        lr_lo, lr_hi = log_ratio_range(nlr)
        clamped = lr_lo < -LOG_RATIO_BOUND or lr_hi > LOG_RATIO_BOUND
        nlr_c = torch.clamp(nlr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND) if clamped else nlr
        em1 = run.rho_and_token_weights(j, r0, r1, mask, nlr_c, lr_lo, lr_hi)
        run.row_sums(j, nlr, nlr_c, em1, clamped)
        run.sequence_weights(r0, r1, mask)
        run.token_rules(r0, r1, mask, nlr, nlr_c, em1)
    return run.finish()


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
