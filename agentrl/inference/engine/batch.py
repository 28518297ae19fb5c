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
  a prefill that starts from cached prefixes (:mod:`~agentrl.inference.engine.prefix_cache`)
  runs with a gap between each row's prefix and its suffix, then moves each row's columns
  together before it joins (:func:`prefill_forward`), so the batch never sees a gap;
- :meth:`RunningBatch.decode` commits the new mask, cache and positions only when the forward
  returned; when it raises, the cache may be half-updated and the caller resets the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentrl.inference.engine.forward import KV
from agentrl.inference.engine.prefix_cache import PrefixCache
from agentrl.inference.engine.request import EngineRequest

__all__ = ["Prefill", "RunningBatch", "left_pad", "prefill_forward", "select_rows"]

Forward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "KV | None"], tuple[torch.Tensor, "KV"]
]
"""``(ids [N, S], positions [N, S], mask [N, P + S], past) -> (logits [N, V], kv)``
(:mod:`~agentrl.inference.engine.forward`)."""


class RunningBatch:
    """The requests being decoded together, their KV cache, mask and next positions."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[EngineRequest] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        """``[B, T]``: 1 where a row has a token, 0 on its left padding."""
        self.kv: KV = []
        """The per-layer KV cache ``[B, H_kv, T, D]`` (empty with no rows)."""
        self.next_pos: list[int] = []
        """Per row, the position of the token the next decode step feeds."""

    def reset(self) -> None:
        """Drop every row and the cache."""
        self.rows = []
        self.next_pos = []
        self.kv = []
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)

    def keep(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (trimming all-padding leading columns)."""
        if not keep:
            self.reset()
            return
        self.kv, self.mask = select_rows(self.kv, self.mask, keep)
        self.rows = [self.rows[i] for i in keep]
        self.next_pos = [self.next_pos[i] for i in keep]

    def join(self, reqs: list[EngineRequest], pre: Prefill, keep: list[int]) -> None:
        """Add rows ``keep`` of the prefill ``pre`` of ``reqs`` to the batch, their cache
        left-padded to the batch's width."""
        new_kv, mask = pre.kv, pre.mask
        if len(keep) < len(reqs):
            new_kv, mask = select_rows(new_kv, mask, keep)
        if self.rows:
            new_kv, mask = self._widen_with(new_kv, mask)
        self.kv = new_kv
        self.mask = mask
        self.rows.extend(reqs[i] for i in keep)
        self.next_pos.extend(len(pre.seqs[i]) for i in keep)

    def row_kv(self, i: int) -> KV | None:
        """Row ``i``'s KV per layer ``(keys, values)`` ``[H_kv, n, D]``, ``n`` = the tokens fed
        so far (prompt + output but the last token); None if the row's mask disagrees."""
        n = int(self.mask[i].sum().item())
        if n != self.next_pos[i] or n == 0:
            return None
        return [(k[i, :, -n:], v[i, :, -n:]) for k, v in self.kv]

    def _widen_with(self, new_kv: KV, mask: torch.Tensor) -> tuple[KV, torch.Tensor]:
        """The batch's cache and mask with ``new_kv``/``mask`` appended below, both left-padded
        to the wider of the two."""
        old_kv = self.kv
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
    def decode(self, forward: Forward) -> torch.Tensor:
        """One decode step over every row (each feeds its last output token): the raw logits of
        the next token ``[B, V]``. Commits the cache, mask and positions only on success."""
        b = len(self.rows)
        ids = torch.tensor(
            [[r.output_ids[-1]] for r in self.rows], dtype=torch.long, device=self.device
        )
        mask = torch.cat([self.mask, torch.ones(b, 1, dtype=torch.long, device=self.device)], 1)
        pos = torch.tensor(self.next_pos, dtype=torch.long, device=self.device)[:, None]
        logits, kv = forward(ids, pos, mask, self.kv)
        self.mask = mask
        self.kv = kv
        self.next_pos = [p + 1 for p in self.next_pos]
        return logits


@dataclass
class Prefill:
    """A prefill forward over N requests, its cache left-padded to one width ``T``."""

    logits: torch.Tensor
    """``[N, V]``: the raw logits after each row's last token."""
    kv: KV
    """Per layer ``(keys, values)`` ``[N, H_kv, T, D]``; padded positions hold zeros."""
    mask: torch.Tensor
    """``[N, T]``: 1 where a row has a token (left padding 0)."""
    seqs: list[list[int]]
    """Each row's tokens (prompt + output but its last token), all of them with KV."""
    cached: list[int]
    """Per row, the leading tokens whose KV came from the prefix cache (not recomputed)."""

    @property
    def lens(self) -> list[int]:
        """Tokens per row."""
        return [len(x) for x in self.seqs]

    def row_kv(self, i: int) -> KV:
        """Row ``i``'s KV per layer, ``[H_kv, lens[i], D]``."""
        n = len(self.seqs[i])
        return [(k[i, :, -n:], v[i, :, -n:]) for k, v in self.kv]


@torch.no_grad()
def prefill_forward(
    forward: Forward,
    device: torch.device,
    reqs: list[EngineRequest],
    cache: PrefixCache | None = None,
    generation: int = 0,
) -> Prefill:
    """The forward over ``reqs`` left-padded to one width. A recomputed row (its batch's
    forward failed) re-prefills prompt + output so far, without the last output token, which
    the next decode step feeds. With a ``cache`` (of the weights' ``generation``), each row
    starts from its longest cached prefix and only the rest is computed."""
    seqs = [req.prompt_ids + req.output_ids[:-1] for req in reqs]
    hits = [cache.match(x, generation) for x in seqs] if cache is not None else []
    if any(n for n, _ in hits):
        return _prefill_after_prefixes(forward, device, seqs, hits)
    lens = [len(x) for x in seqs]
    width = max(lens)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[i, width - len(x) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    logits, kv = forward(ids, (mask.cumsum(-1) - 1).clamp_(min=0), mask, None)
    return Prefill(logits, _zero_padding(kv, mask), mask, seqs, [0] * len(seqs))


def _prefill_after_prefixes(
    forward: Forward, device: torch.device, seqs: list[list[int]], hits: list[tuple[int, KV | None]]
) -> Prefill:
    """The prefill of ``seqs`` whose first ``hits[i][0]`` tokens have cached KV: one forward
    over the uncached suffixes on top of the cached prefixes, then each row's columns moved
    together (left-padded again)."""
    n = len(seqs)
    cached = [h for h, _ in hits]
    lens = [len(x) for x in seqs]
    p, s = max(cached), max(ln - c for ln, c in zip(lens, cached, strict=True))
    sample = next(kv for _, kv in hits if kv is not None)
    past: KV = []
    for k0, v0 in sample:
        shape = (n, k0.shape[0], p, k0.shape[-1])
        past.append((k0.new_zeros(shape), v0.new_zeros(shape)))
    ids = torch.zeros(n, s, dtype=torch.long)
    pos = torch.zeros(n, s, dtype=torch.long)
    mask = torch.zeros(n, p + s, dtype=torch.long)
    for i, (x, c, (_, kv)) in enumerate(zip(seqs, cached, hits, strict=True)):
        for (k, v), (pk, pv) in zip(kv or [], past, strict=False):
            pk[i, :, p - c :] = k
            pv[i, :, p - c :] = v
        suffix = len(x) - c
        ids[i, s - suffix :] = torch.tensor(x[c:], dtype=torch.long)
        pos[i, s - suffix :] = torch.arange(c, len(x))
        mask[i, p - c : p] = 1
        mask[i, p + s - suffix :] = 1
    past = [(k.to(device), v.to(device)) for k, v in past]
    mask = mask.to(device)
    logits, kv = forward(ids.to(device), pos.to(device), mask, past)
    kv, mask = _left_align(kv, mask, max(lens))
    return Prefill(logits, _zero_padding(kv, mask), mask, seqs, cached)


def _left_align(kv: KV, mask: torch.Tensor, width: int) -> tuple[KV, torch.Tensor]:
    """Move each row's real columns (``mask`` 1, in order) to the right end, keeping the last
    ``width`` columns: a cache with holes becomes a left-padded one."""
    order = torch.sort(mask, dim=1, stable=True).indices[:, -width:]  # 0s first, order kept
    mask = mask.gather(1, order)
    out = []
    for k, v in kv:
        idx = order[:, None, :, None].expand(k.shape[0], k.shape[1], width, k.shape[3])
        out.append((k.gather(2, idx), v.gather(2, idx)))
    return out, mask


def _zero_padding(kv: KV, mask: torch.Tensor) -> KV:
    """``kv`` with zeros where ``mask`` ``[N, T]`` is 0 (as the running batch's padding)."""
    pad = (mask == 0)[:, None, :, None]
    return [(k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)) for k, v in kv]


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
