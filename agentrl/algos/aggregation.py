"""Loss aggregation for the trainer: the same function as ``correction.agg_loss``.

One implementation serves both packages so the policy losses here and the bypass losses in
``correction`` can never disagree; this module re-exports it and adds
:func:`loss_normalizers`, which computes the global counts once per mini-batch.

Four modes (verl's names; ``m`` the loss mask, ``ℓ`` the per-token loss):

- ``token-mean``: Σ m·ℓ / N_tokens — every sampled token weighs the same (DAPO).
- ``seq-mean-token-sum``: (1/N_seqs) Σ_i Σ_t m·ℓ — long sequences weigh more.
- ``seq-mean-token-mean``: (1/N_seqs) Σ_i (Σ_t m·ℓ / n_i) — GRPO's original per-sample mean.
- ``seq-mean-token-sum-norm``: (1/N_seqs) Σ_i Σ_t m·ℓ / K with a constant K (Dr.GRPO).

Gradient accumulation: pass ``global_tokens`` / ``global_seqs`` (counts over the whole
mini-batch, all-reduced over data-parallel ranks) and a constant ``loss_scale_factor`` K; the
micro-batch losses then *sum* to the mini-batch loss, so plain ``loss.backward()`` per
micro-batch accumulates exactly the full-batch gradient. Under DDP/FSDP, which average
gradients over ranks, multiply the loss by the world size.

Pass float32 loss matrices (every loss in :mod:`agentrl.algos.losses` does): the function sums
in the dtype of ``loss_mat``.
"""

from __future__ import annotations

import torch

from correction import LOSS_AGG_MODES, LossAggMode, agg_loss

__all__ = ["AGG_MODES", "LossAggMode", "agg_loss", "loss_normalizers"]

AGG_MODES: tuple[str, ...] = LOSS_AGG_MODES


def loss_normalizers(loss_mask: torch.Tensor) -> tuple[int, int]:
    """``(global_tokens, global_seqs)`` of a whole mini-batch mask ``[B, T]``.

    Compute these once on the full mini-batch (all-reduce them across data-parallel ranks) and
    pass them to :func:`agg_loss` / :func:`agentrl.algos.policy_loss` for every micro-batch.
    ``global_seqs`` counts rows with at least one mask-1 token.
    """
    m = loss_mask.float()
    return int(m.sum().item()), int((m.sum(dim=-1) > 0).sum().item())
