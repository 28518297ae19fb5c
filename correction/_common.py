"""Input validation and the per-batch statistics every correction step shares.

Why: IS weights, RS masks and diagnostics all need the same few tensors (the masked log-ratio, its
``expm1``, per-sequence sums and lengths). ``_Stats`` computes each of them at most once per batch, so
one ``apply_correction`` call touches the ``[B, T]`` data a small, fixed number of times.

Guarantees:
- Values at padding positions (``response_mask == 0``) are never read: they may be NaN or ±inf.
- A non-finite value at a response position raises ``ValueError`` naming the tensor and the first
  bad ``[b, t]`` (see ``check_finite``).
- The log-ratio is clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` wherever it is exponentiated
  (per token, or the per-sequence sum/mean), so no weight, statistic or gradient overflows.
- ``expm1`` rather than ``exp`` is the shared primitive: ``k3 = expm1(ℓ) - ℓ`` and
  ``ρ² - 1 = 2·expm1(ℓ) + expm1(ℓ)²`` stay accurate for the tiny log-ratios of on-policy data, where
  ``exp(ℓ) - 1 - ℓ`` in float32 would be pure rounding noise. It is also exactly 0 on padding, so
  sums over the whole tensor are already masked sums.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property

import torch

__all__ = ["LOG_RATIO_BOUND", "check_finite"]

LOG_RATIO_BOUND = 20.0
"""|ℓ| is clamped to this before any exp (exp(20) ≈ 4.9e8)."""


def check_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` if ``tensor`` holds NaN/±inf where ``mask`` is 1 (anywhere if no mask).

    Args:
        name: the tensor's name as the caller knows it (e.g. ``"rollout_log_probs"``).
        tensor: any shape, usually ``[B, T]``.
        mask: same shape, 0/1 or bool; positions where it is 0 are ignored.

    The message names the tensor, the bad value and the first offending index, e.g.
    ``rollout_log_probs has a non-finite value (-inf) at [b, t] = [3, 17] ...``.
    """
    values = tensor.detach()
    bad = ~torch.isfinite(values)
    if mask is not None:
        bad &= mask.bool()
    if not bool(bad.any()):
        return
    index = [int(i) for i in bad.nonzero()[0]]
    value = float(values[tuple(index)])
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


class _Stats:
    """Lazily computed, cached statistics of one batch's log-ratio ``ℓ`` (``[B, T]``).

    Per-token tensors are ``[B, T]`` in the compute dtype and exactly 0 on padding; per-sequence
    vectors are ``[B]`` in float64 (cheap, and ``exp`` of them cannot overflow).
    """

    def __init__(
        self, log_ratio: torch.Tensor, response_mask: torch.Tensor, name: str = "log_ratio"
    ) -> None:
        check_pair(name, log_ratio, response_mask)
        self.name = name
        self.mask = response_mask if response_mask.dtype == torch.bool else response_mask.bool()
        values = log_ratio.detach()
        dtype = compute_dtype(values)
        values = values.to(dtype)
        self.empty = values.numel() == 0
        # ℓ with exact zeros on padding: masked sums below are plain sums.
        self.lr = torch.where(self.mask, values, torch.zeros((), dtype=dtype))
        self.seq_len = self.mask.sum(dim=-1).to(torch.float64)
        self.seq_sum = self.lr.sum(dim=-1).to(torch.float64)
        if not bool(torch.isfinite(self.seq_sum).all()):
            check_finite(name, log_ratio, self.mask)
        self.seq_valid = self.seq_len > 0
        self.n_tok = self.seq_len.sum()
        self.n_seq = self.seq_valid.sum().to(torch.float64)
        self.n_tok_int = int(self.n_tok)
        self.has_padding = self.n_tok_int < values.numel()

    @cached_property
    def lr_c(self) -> torch.Tensor:
        """``[B, T]`` ℓ clamped to ±LOG_RATIO_BOUND (0 on padding)."""
        return torch.clamp(self.lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)

    @cached_property
    def em1(self) -> torch.Tensor:
        """``[B, T]`` ρ − 1 = expm1(clamped ℓ) (0 on padding)."""
        return torch.expm1(self.lr_c)

    @cached_property
    def k3(self) -> torch.Tensor:
        """``[B, T]`` k3 = ρ − 1 − ℓ ≥ 0 (0 on padding)."""
        return self.em1 - self.lr_c

    @cached_property
    def lr_minmax(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sequence ``([B], [B])`` min and max of ℓ; padding contributes 0."""
        if self.lr.shape[-1] == 0:
            zeros = torch.zeros(self.lr.shape[0], dtype=torch.float64)
            return zeros, zeros
        lo, hi = torch.aminmax(self.lr, dim=-1)
        return lo.to(torch.float64), hi.to(torch.float64)

    @cached_property
    def seq_mean(self) -> torch.Tensor:
        """``[B]`` masked mean of ℓ per sequence (0 for an empty sequence)."""
        return self.seq_sum / self.seq_len.clamp(min=1.0)

    @cached_property
    def seq_sum_k2(self) -> torch.Tensor:
        """``[B]`` Σ_t ½ℓ_t² (a batched dot product: one pass, no temporary)."""
        lr = self.lr
        return 0.5 * torch.bmm(lr.unsqueeze(1), lr.unsqueeze(2)).view(-1).to(torch.float64)

    @cached_property
    def seq_sum_k3(self) -> torch.Tensor:
        """``[B]`` Σ_t k3_t."""
        return self.k3.sum(dim=-1).to(torch.float64)

    def seq_mean_of(self, seq_sum: torch.Tensor) -> torch.Tensor:
        return seq_sum / self.seq_len.clamp(min=1.0)

    def token_mean(self, total: torch.Tensor) -> torch.Tensor:
        """A sum over valid tokens divided by their count (0 when there are none)."""
        return total.to(torch.float64) / self.n_tok.clamp(min=1.0)

    def seq_mean_over_batch(self, per_seq: torch.Tensor) -> torch.Tensor:
        """Mean of a ``[B]`` vector over sequences with ≥ 1 valid token (0 when there are none)."""
        return torch.where(self.seq_valid, per_seq, 0.0).sum() / self.n_seq.clamp(min=1.0)


def metrics_to_floats(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Convert a dict of 0-dim tensors to Python floats with a single device sync."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        stacked = torch.stack([metrics[k].detach().to(torch.float64).reshape(()) for k in keys])  # type: ignore[union-attr]  # keys holds only tensor entries
        out.update(zip(keys, stacked.tolist(), strict=True))
    return {k: out[k] for k in metrics}
