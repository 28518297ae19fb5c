"""Loss aggregation: turn a per-token loss matrix into the scalar the optimizer sees.

Four modes (verl's names):

- ``token-mean``: Σ m·ℓ / N_tokens — every sampled token weighs the same (DAPO).
- ``seq-mean-token-sum``: (1/N_seqs) Σ_i Σ_t m·ℓ — every sequence is a sum (long ones weigh more).
- ``seq-mean-token-mean``: (1/N_seqs) Σ_i (Σ_t m·ℓ / n_i) — original GRPO/PPO-per-sample.
- ``seq-mean-token-sum-norm``: (1/N_seqs) Σ_i Σ_t m·ℓ / L with a constant L (Dr.GRPO).

Guarantee under gradient accumulation: the normalizers are global. Pass ``global_tokens`` (the
number of mask-1 tokens in the whole mini-batch) and ``global_seqs`` (the number of sequences
with at least one mask-1 token in the whole mini-batch), and the *sum* of the micro-batch losses
equals the full mini-batch loss, so summing their gradients (plain ``loss.backward()`` per
micro-batch, no extra scaling) gives the full-batch gradient. Under data parallelism, where
DDP/FSDP *average* gradients over ranks, count globally over all ranks and multiply the loss
by the world size.

A batch with nothing to train on gives a zero loss that still carries the graph (never NaN).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["AGG_MODES", "AggMode", "agg_loss", "loss_normalizers"]

AggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def loss_normalizers(loss_mask: torch.Tensor) -> tuple[int, int]:
    """``(global_tokens, global_seqs)`` of a whole mini-batch mask ``[B, T]``.

    Compute these once on the full mini-batch (all-reduce them across data-parallel ranks)
    and pass them to :func:`agg_loss` for every micro-batch.
    """
    m = loss_mask.float()
    return int(m.sum().item()), int((m.sum(dim=-1) > 0).sum().item())


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    norm_length: int | float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` ``[B, T]`` under ``loss_mask`` ``[B, T]`` into a float32 scalar.

    Args:
        loss_mat: per-token loss ``[B, T]`` (any float dtype; summed in float32).
        loss_mask: ``[B, T]`` 0/1; only mask-1 tokens count.
        mode: one of :data:`AGG_MODES`.
        global_tokens: token normalizer for ``token-mean``; default: this batch's mask sum.
        global_seqs: sequence normalizer for the ``seq-mean-*`` modes; default: the number
            of rows of this batch with at least one mask-1 token.
        norm_length: the constant L of ``seq-mean-token-sum-norm`` (Dr.GRPO's max response
            length); default ``T``. Pass the configured max response length when micro-batches
            are padded to different lengths, or the micro-batch losses will not add up.

    Returns:
        A 0-dim float32 tensor.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} must have the same [B, T] shape"
        )
    mat = loss_mat.float()
    mask = loss_mask.to(device=mat.device, dtype=torch.float32)
    masked = mat * mask
    zero = masked.sum() * 0.0  # keeps the autograd graph when there is nothing to normalize

    if mode == "token-mean":
        denom = (
            mask.sum()
            if global_tokens is None
            else torch.as_tensor(global_tokens, dtype=torch.float32)
        )
        if float(denom) <= 0:
            return zero
        return masked.sum() / denom

    tokens_per_seq = mask.sum(dim=-1)
    seq_denom = (
        (tokens_per_seq > 0).float().sum()
        if global_seqs is None
        else torch.as_tensor(global_seqs, dtype=torch.float32)
    )
    if float(seq_denom) <= 0:
        return zero
    seq_sums = masked.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / seq_denom
    if mode == "seq-mean-token-mean":
        return (seq_sums / tokens_per_seq.clamp(min=1.0)).sum() / seq_denom
    length = float(loss_mask.shape[-1] if norm_length is None else norm_length)
    if length <= 0:
        raise ValueError(f"norm_length must be > 0 (the max response length), got {norm_length}")
    return seq_sums.sum() / (seq_denom * length)
