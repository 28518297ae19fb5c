"""Logprobs and entropy from logits, memory-aware.

:func:`logprobs_from_logits` is THE logprob convention of agentrl: log-softmax of
``logits / temperature`` (no top-k/top-p mask), gathered at the sampled token. Inference
servers report the same quantity (vLLM with ``--logprobs-mode processed_logprobs``), so the
trainer's π_old and the server's π_rollout are comparable token by token.

Both functions compute in float32 and never materialize a float32 copy of a whole ``[B, T, V]``
tensor when it is in half precision: they work one chunk of rows at a time. Chunking bounds the
*forward* working memory; under autograd the tensors saved for backward still scale with
B·T·V, so compute entropy for logging under ``torch.no_grad()`` when you do not need its gradient.
"""

from __future__ import annotations

import torch

__all__ = ["entropy_from_logits", "logits_disagreement", "logprobs_from_logits"]

# Rows per chunk for half-precision inputs: bounds the float32 working copy to chunk × V.
_DEFAULT_CHUNK_ROWS = 1024


def _row_chunks(flat: torch.Tensor, chunk_size: int | None) -> list[torch.Tensor]:
    if chunk_size is None:
        return [flat]
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    return list(flat.split(chunk_size, dim=0))


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: ``[..., V] -> [...]`` (float32).

    H = logsumexp(z) − Σ softmax(z)·z, which is stable for any finite logits.

    Args:
        logits: ``[..., V]``.
        chunk_size: rows (positions) per chunk; bounds peak memory to ``chunk_size × V``
            float32. None processes everything at once (float32 inputs) or in chunks of 1024
            rows (half-precision inputs).
    """
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    if chunk_size is None and flat.dtype not in (torch.float32, torch.float64):
        chunk_size = _DEFAULT_CHUNK_ROWS
    outs = []
    for chunk in _row_chunks(flat, chunk_size):
        z = chunk.float()
        lse = torch.logsumexp(z, dim=-1)
        p = torch.softmax(z, dim=-1)
        outs.append(lse - (p * z).sum(dim=-1))
    return torch.cat(outs).reshape(lead)


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log softmax(logits / temperature) at ``labels``: ``[B, T, V], [B, T] -> [B, T]`` (float32).

    Computed as ``z[label] − logsumexp(z)`` so no ``[B, T, V]`` log-softmax is kept.

    Args:
        logits: ``[..., V]`` raw logits aligned with ``labels`` (logits at position t score
            ``labels[t]``; shift before calling).
        labels: ``[...]`` token ids.
        temperature: the sampling temperature (> 0) the inference server used.
        chunk_size: rows per chunk, as in :func:`entropy_from_logits`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} plus a vocab dim"
        )
    lead = labels.shape
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    if chunk_size is None and flat.dtype not in (torch.float32, torch.float64):
        chunk_size = _DEFAULT_CHUNK_ROWS
    outs = []
    start = 0
    for chunk in _row_chunks(flat, chunk_size):
        rows = chunk.shape[0]
        z = chunk.float()
        if temperature != 1.0:
            z = z / temperature
        lab = flat_labels[start : start + rows].unsqueeze(-1).long()
        outs.append(z.gather(-1, lab).squeeze(-1) - torch.logsumexp(z, dim=-1))
        start += rows
    return torch.cat(outs).reshape(lead)


def logits_disagreement(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None when two computations of the same logits agree within float rounding of ``dtype``
    (1e-4 in float32, 5e-2 in a half type, relative to the largest ``want`` logit, at least 1),
    else by how much they differ. The one rule for "the same forward, computed another way"
    (the engine's lean forward, the trainer's shared prompts)."""
    x, y = got.float(), want.float()
    if x.numel() == 0:
        return None
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    scale = max(1.0, float(y.abs().max()))
    diff = float((x - y).abs().max())
    return None if diff <= tol * scale else f"logits differ by {diff:.3g}"
