"""Input validation, the log-ratio bound and metric conversion shared by the correction modules.

Guarantees:
- Values at padding positions (``response_mask == 0``) never affect a result: they may be NaN or ±inf.
- A non-finite value at a response position raises ``ValueError`` naming the tensor and the first
  bad ``[b, t]`` (see ``check_finite``).
- The log-ratio is clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` wherever it is exponentiated
  (per token, or the per-sequence sum/mean), so no weight, statistic or gradient overflows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["LOG_RATIO_BOUND", "check_finite"]

LOG_RATIO_BOUND = 20.0
"""|ℓ| is clamped to this before any exp (exp(20) ≈ 4.9e8)."""


def check_finite(
    name: str, tensor: torch.Tensor, mask: torch.Tensor | None = None, *, row_offset: int = 0
) -> None:
    """Raise ``ValueError`` if ``tensor`` holds NaN/±inf where ``mask`` is 1 (anywhere if no mask).

    Args:
        name: the tensor's name as the caller knows it (e.g. ``"rollout_log_probs"``).
        tensor: any shape, usually ``[B, T]``.
        mask: same shape, 0/1 or bool; positions where it is 0 are ignored.

    The message names the tensor, the bad value and the first offending index, e.g.
    ``rollout_log_probs has a non-finite value (-inf) at [b, t] = [3, 17] ...``. ``row_offset`` is
    added to the first index (for callers that pass a block of rows).
    """
    values = tensor.detach()
    bad = ~torch.isfinite(values)
    if mask is not None:
        bad &= mask.bool()
    if not bool(bad.any()):
        return
    index = [int(i) for i in bad.nonzero()[0]]
    value = float(values[tuple(index)])
    if index:
        index[0] += row_offset
    where = "[b, t]" if values.dim() == 2 else "index"
    raise ValueError(
        f"{name} has a non-finite value ({value}) at {where} = {index}"
        + (" where response_mask is 1" if mask is not None else "")
        + f"; {int(bad.sum())} such position(s) in all. Log-probabilities of response tokens must be "
        "finite: -inf usually means the token lies outside the support the logprobs were computed "
        "with (top-k/top-p mask, temperature mismatch); NaN means the forward pass diverged."
    )


def check_pair(name: str, tensor: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Both tensors must be ``[B, T]`` and of the same shape."""
    if tensor.dim() != 2 or tensor.shape != response_mask.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} and response_mask {tuple(response_mask.shape)}; "
            "both must be [B, T] with the same shape"
        )


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is computed in float32."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def metrics_to_floats(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Convert a dict of 0-dim tensors (and floats) to Python floats, one sync per device."""
    out: dict[str, float] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append((key, value))
        else:
            out[key] = float(value)
    for items in by_device.values():
        tensors = [t for _, t in items]
        # the engine's metrics already are float64 scalars: no per-metric copies then
        if not all(
            t.dtype == torch.float64 and t.dim() == 0 and not t.requires_grad for t in tensors
        ):
            tensors = [t.detach().to(torch.float64).reshape(()) for t in tensors]
        out.update(zip((k for k, _ in items), torch.stack(tensors).tolist(), strict=True))
    return {k: out[k] for k in metrics}
