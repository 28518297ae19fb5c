"""The running batch: the requests decoded together and their left-padded per-layer KV cache.

Why it exists: continuous batching lets requests join between two decode steps and leave as
soon as they are done. This module owns the tensors that make that possible, so the scheduler
only decides *who* joins and leaves, never how the cache is reshaped.

Layout: per layer a KV cache ``[B, H_kv, T, D]``, a 2-D attention mask ``[B, T]`` (1 = a real
token) and explicit per-row positions (``next_pos``: the position of the row's next token). Rows
are left-padded: row ``i``'s tokens are the last ``mask[i].sum()`` columns.

Invariants (the batch is touched by the engine thread only):

- ``rows``, ``next_pos``, the mask's and every cache layer's first dimension have the same
  length, in the same order;
- padded positions hold zeros in the cache and 0 in the mask, so a padded column never changes
  an attention result; the first column has a real token in at least one row (all-padding
  leading columns are trimmed whenever rows leave);
- a prefilled request joins with its prompt's cache left-padded to the batch's width (or the
  batch is left-padded to its width), so each row's numbers equal a forward of that row alone;
- :meth:`RunningBatch.decode` commits the new mask, cache and positions only when the forward
  returned; when it raises, the cache may be half-updated and the caller resets the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.inference.engine.request import EngineRequest

__all__ = ["RunningBatch", "left_pad", "prefill_forward", "select_rows"]

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(keys, values)``, each ``[B, H_kv, T, D]``."""


class RunningBatch:
    """The requests being decoded together, their KV cache, mask and next positions."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[EngineRequest] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        """``[B, T]``: 1 where a row has a token, 0 on its left padding."""
        self.cache: Any = None
        """The per-layer KV cache (a ``transformers`` ``DynamicCache``), None when empty."""
        self.next_pos: list[int] = []
        """Per row, the position of the token the next decode step feeds."""

    def reset(self) -> None:
        """Drop every row and the cache."""
        self.rows = []
        self.next_pos = []
        self.cache = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)

    def keep(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (trimming all-padding leading columns)."""
        from transformers import DynamicCache

        if not keep:
            self.reset()
            return
        kv = [(layer.keys, layer.values) for layer in self.cache.layers]
        kv, self.mask = select_rows(kv, self.mask, keep)
        self.rows = [self.rows[i] for i in keep]
        self.next_pos = [self.next_pos[i] for i in keep]
        self.cache = DynamicCache(ddp_cache_data=kv)

    def join(
        self,
        reqs: list[EngineRequest],
        out: Any,
        mask: torch.Tensor,
        lens: list[int],
        keep: list[int],
    ) -> None:
        """Add rows ``keep`` of a prefill of ``reqs`` (:func:`prefill_forward`: its output, mask
        ``[N, T]`` and row lengths) to the batch, their cache left-padded to the batch's width."""
        from transformers import DynamicCache

        pad = (mask == 0)[:, None, :, None]
        new_kv = [
            (layer.keys.masked_fill(pad, 0.0), layer.values.masked_fill(pad, 0.0))
            for layer in out.past_key_values.layers
        ]  # padded positions hold zeros, as the running batch's left padding does
        if len(keep) < len(reqs):
            new_kv, mask = select_rows(new_kv, mask, keep)
        if self.rows:
            new_kv, mask = self._widen_with(new_kv, mask)
        self.cache = DynamicCache(ddp_cache_data=new_kv)
        self.mask = mask
        self.rows.extend(reqs[i] for i in keep)
        self.next_pos.extend(lens[i] for i in keep)

    def _widen_with(self, new_kv: KV, mask: torch.Tensor) -> tuple[KV, torch.Tensor]:
        """The batch's cache and mask with ``new_kv``/``mask`` appended below, both left-padded
        to the wider of the two."""
        old_kv = [(layer.keys, layer.values) for layer in self.cache.layers]
        width = max(self.mask.shape[1], mask.shape[1])
        kv = [
            (
                torch.cat([left_pad(k0, width), left_pad(k1, width)], dim=0),
                torch.cat([left_pad(v0, width), left_pad(v1, width)], dim=0),
            )
            for (k0, v0), (k1, v1) in zip(old_kv, new_kv, strict=True)
        ]
        both = torch.cat([left_pad(self.mask, width, dim=1), left_pad(mask, width, dim=1)], dim=0)
        return kv, both

    @torch.no_grad()
    def decode(self, model: Any) -> torch.Tensor:
        """One decode step over every row (each feeds its last output token): the raw logits of
        the next token ``[B, V]``. Commits the cache, mask and positions only on success."""
        b = len(self.rows)
        ids = torch.tensor(
            [[r.output_ids[-1]] for r in self.rows], dtype=torch.long, device=self.device
        )
        mask = torch.cat([self.mask, torch.ones(b, 1, dtype=torch.long, device=self.device)], 1)
        pos = torch.tensor(self.next_pos, dtype=torch.long, device=self.device)[:, None]
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.mask = mask
        self.cache = out.past_key_values
        self.next_pos = [p + 1 for p in self.next_pos]
        return out.logits[:, -1]


@torch.no_grad()
def prefill_forward(
    model: Any, device: torch.device, reqs: list[EngineRequest]
) -> tuple[Any, torch.Tensor, list[int]]:
    """The forward over ``reqs`` left-padded to one width: (output, mask ``[N, T]``, the length
    of each row). A recomputed row (its batch's forward failed) re-prefills prompt + output so
    far, without the last output token, which the next decode step feeds."""
    from transformers import DynamicCache

    seqs = [req.prompt_ids + req.output_ids[:-1] for req in reqs]
    lens = [len(x) for x in seqs]
    width = max(lens)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[i, width - len(x) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp_(min=0),
        past_key_values=DynamicCache(),
        use_cache=True,
        logits_to_keep=1,
    )
    return out, mask, lens


def select_rows(kv: KV, mask: torch.Tensor, keep: list[int]) -> tuple[KV, torch.Tensor]:
    """Rows ``keep`` of a left-padded KV cache and its mask, without all-padding leading
    columns."""
    idx = torch.tensor(keep, dtype=torch.long, device=mask.device)
    mask = mask.index_select(0, idx)
    first = int(mask.any(dim=0).long().argmax().item())
    kv = [
        (k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:]) for k, v in kv
    ]
    return kv, mask[:, first:]


def left_pad(x: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Left-pad ``x`` with zeros along ``dim`` to ``width`` (KV ``[B, H, T, D]``: dim 2)."""
    short = width - x.shape[dim]
    if short <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x.new_zeros(shape), x], dim=dim)
