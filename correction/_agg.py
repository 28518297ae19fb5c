"""Loss aggregation: turn a per-token loss matrix into one scalar, correctly under gradient accumulation.

Why here: ``correction`` may import only torch, yet its bypass losses need the same four aggregation
modes as the trainer's policy losses. ``agentrl.algos.agg_loss`` reuses this function, so both agree.

Guarantees:
- Only tokens with ``loss_mask == 1`` contribute; padding never moves the loss or its gradient.
- A micro-batch with zero valid tokens gives a zero loss that is still attached to the graph
  (``backward()`` works and yields zero gradients), never NaN.
- With gradient accumulation, pass ``global_tokens`` / ``global_seqs`` (the counts over the whole
  mini-batch); the micro-batch losses then *sum* to the loss of the full mini-batch, so summing their
  gradients gives exactly the full-batch gradient.

Modes (``M`` = loss_mask, ``L`` = loss_mat, ``S`` = sequences with at least one valid token):
- ``token-mean``: Σ_{b,t} M·L / N_tok, N_tok = ``global_tokens`` or Σ M.
- ``seq-mean-token-sum``: Σ_{b∈S} (Σ_t M·L) / N_seq, N_seq = ``global_seqs`` or |S|.
- ``seq-mean-token-mean``: Σ_{b∈S} (Σ_t M·L / Σ_t M) / N_seq.
- ``seq-mean-token-sum-norm`` (Dr. GRPO): Σ_{b∈S} (Σ_t M·L / K) / N_seq, K = ``loss_scale_factor``
  or T (the padded length). Under gradient accumulation pass a constant K (e.g. the maximum response
  length), since T differs between micro-batches.
"""

from __future__ import annotations

from enum import StrEnum

import torch

__all__ = ["LOSS_AGG_MODES", "LossAggMode", "agg_loss"]


class LossAggMode(StrEnum):
    """How a ``[B, T]`` loss matrix is reduced to a scalar (names as in verl)."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


LOSS_AGG_MODES: tuple[str, ...] = tuple(m.value for m in LossAggMode)


def _as_mode(mode: str | LossAggMode) -> LossAggMode:
    if isinstance(mode, LossAggMode):
        return mode
    try:
        return LossAggMode(mode)
    except ValueError:
        raise ValueError(
            f"loss_agg_mode={mode!r} is not a known mode; use one of {list(LOSS_AGG_MODES)}"
        ) from None


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str | LossAggMode = "token-mean",
    global_tokens: float | int | torch.Tensor | None = None,
    global_seqs: float | int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar.

    Args:
        loss_mat: ``[B, T]`` per-token loss.
        loss_mask: ``[B, T]`` 0/1 (any dtype); 1 marks tokens that count.
        mode: one of ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
            ``seq-mean-token-sum-norm``.
        global_tokens: number of valid tokens in the whole mini-batch (gradient accumulation);
            default: the valid tokens of this call. Used by ``token-mean``.
        global_seqs: number of sequences with at least one valid token in the whole mini-batch;
            default: those of this call. Used by the ``seq-mean-*`` modes.
        loss_scale_factor: the constant K of ``seq-mean-token-sum-norm``; default T.

    Returns:
        A 0-dim tensor. Zero (attached to ``loss_mat``'s graph) when there is nothing to average.
    """
    agg = _as_mode(mode)
    if loss_mat.shape != loss_mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} must both be [B, T]"
        )
    mask = loss_mask.to(loss_mat.dtype)
    # where() rather than multiply: a NaN/inf loss on a padded token must not leak into the sum.
    masked = torch.where(
        mask > 0, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    )
    if agg is LossAggMode.TOKEN_MEAN:
        denom = mask.sum() if global_tokens is None else torch.as_tensor(global_tokens)
        return masked.sum() / torch.clamp(denom.to(loss_mat.dtype), min=1.0)

    tokens_per_seq = mask.sum(dim=-1)
    seq_valid = tokens_per_seq > 0
    seq_sum = masked.sum(dim=-1)
    if agg is LossAggMode.SEQ_MEAN_TOKEN_SUM:
        seq_loss = seq_sum
    elif agg is LossAggMode.SEQ_MEAN_TOKEN_MEAN:
        seq_loss = seq_sum / torch.clamp(tokens_per_seq, min=1.0)
    else:
        scale = float(loss_mat.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
        if scale <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor}")
        seq_loss = seq_sum / scale
    denom = seq_valid.sum() if global_seqs is None else torch.as_tensor(global_seqs)
    return seq_loss.sum() / torch.clamp(denom.to(loss_mat.dtype), min=1.0)
