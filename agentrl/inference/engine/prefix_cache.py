"""Automatic prefix caching: the KV of token prefixes already computed, reused by later prompts.

Why it exists: an agent's prompts repeat themselves. Every sample of a task starts with the same
system prompt and tool block (~570 tokens on the quickstart), and each turn's prompt is the last
turn's prompt + its output + the tool's answer. Without a cache each of them is prefilled again
from the first token: on the quickstart that was most of a server's time. vLLM's automatic prefix
caching does the same; this is the embedded engine's own, sized for a CPU or one GPU.

Layout: a sequence is cut into blocks of :data:`BLOCK` tokens. A block is keyed by *(the key of
the block before it, its own tokens)*, so a key names the whole prefix up to the end of its
block, exactly (tuples compare by value: no hash can collide). A block holds, per layer,
``(keys, values)`` of shape ``[H_kv, BLOCK, D]``, copied out of the batch that computed them.

Invariants:

- every block was computed by the weights served now: the engine's weight store counts each
  change of the weights (:attr:`~agentrl.inference.engine.weight_store.WeightStore.generation`:
  every load, rollback or restore) and a cache that sees a new count empties itself before it
  answers or stores anything; ``/reset_prefix_cache`` empties it too;
- a match never covers a prompt's last token (its logits are what the prefill is for), so a
  prefill always runs at least one token;
- it holds at most ``max_bytes`` of KV; the least recently used block goes first, and a match
  touches its blocks from the last to the first, so a prefix outlives the blocks that extend it;
- only the engine thread uses it (no lock);
- its numbers live in the engine's one counter mapping (``/metrics`` reads it):
  ``prefix_cache_hit_tokens``, ``prefix_cache_tokens`` (held now), ``prefix_cache_bytes`` (held
  now), ``prefix_cache_inserted_blocks``, ``prefix_cache_evicted_blocks``,
  ``prefix_cache_resets``.
"""

from __future__ import annotations

import collections
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "PrefixCache"]

BLOCK = 16
"""Tokens per cached block (vLLM's default block size)."""

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(keys, values)``."""
Key = tuple[int, tuple[int, ...]]
"""``(id of the block before, this block's tokens)``; the first block's parent id is 0."""


@dataclass
class _Block:
    id: int
    kv: KV
    """Per layer ``(keys, values)``, each ``[H_kv, BLOCK, D]``."""
    nbytes: int


class PrefixCache:
    """The KV of token prefixes, in blocks, for the weights served now.

    Args:
        max_bytes: most bytes of KV held (``0`` holds nothing: every match is empty).
        stats: the counters it adds to (the engine's); a fresh mapping when None.
    """

    def __init__(self, max_bytes: int, stats: MutableMapping[str, int] | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"prefix cache max_bytes={max_bytes}; it must be >= 0")
        self.max_bytes = int(max_bytes)
        self.blocks: collections.OrderedDict[Key, _Block] = collections.OrderedDict()
        """Least recently used first."""
        self.nbytes = 0
        self.generation = 0
        """The weight store's generation the blocks were computed with."""
        self._ids = 1
        self.stats: MutableMapping[str, int] = stats if stats is not None else collections.Counter()
        """The ``prefix_cache_*`` counters (see the module's invariants)."""

    @property
    def enabled(self) -> bool:
        """False when it may hold nothing."""
        return self.max_bytes > 0

    @property
    def num_tokens(self) -> int:
        """Tokens held."""
        return len(self.blocks) * BLOCK

    def clear(self) -> None:
        """Drop every block."""
        if self.blocks:
            self._count("prefix_cache_resets")
        self.blocks.clear()
        self.nbytes = 0
        self._held()

    def _count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def _held(self) -> None:
        self.stats["prefix_cache_tokens"] = self.num_tokens
        self.stats["prefix_cache_bytes"] = self.nbytes

    def sync(self, generation: int) -> None:
        """Empty the cache if the weights changed since its blocks were computed."""
        if generation != self.generation:
            self.clear()
            self.generation = generation

    def peek(self, tokens: Sequence[int], generation: int) -> int:
        """How many leading tokens of ``tokens`` are cached (in full blocks); nothing is
        touched or counted."""
        self.sync(generation)
        parent, n = 0, 0
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            block = self.blocks.get((parent, tuple(tokens[start : start + BLOCK])))
            if block is None:
                break
            parent, n = block.id, n + BLOCK
        return n

    def match(self, tokens: Sequence[int], generation: int) -> tuple[int, KV | None]:
        """The longest cached prefix of ``tokens`` that leaves at least its last token out:
        ``(n, kv)``, ``kv`` per layer ``(keys, values)`` ``[H_kv, n, D]`` (``(0, None)`` on a
        miss)."""
        self.sync(generation)
        if not self.enabled:
            return 0, None
        found: list[tuple[Key, _Block]] = []
        parent = 0
        for start in range(0, len(tokens) - BLOCK, BLOCK):  # a full block, and a token after it
            key = (parent, tuple(tokens[start : start + BLOCK]))
            block = self.blocks.get(key)
            if block is None:
                break
            found.append((key, block))
            parent = block.id
        if not found:
            return 0, None
        self._touch([key for key, _ in found])
        n = len(found) * BLOCK
        self._count("prefix_cache_hit_tokens", n)
        layers = len(found[0][1].kv)
        kv = [
            (
                torch.cat([b.kv[i][0] for _, b in found], dim=1),
                torch.cat([b.kv[i][1] for _, b in found], dim=1),
            )
            for i in range(layers)
        ]
        return n, kv

    def insert(self, tokens: Sequence[int], kv: KV, generation: int) -> int:
        """Store the full blocks of ``tokens`` not held yet; ``kv`` per layer ``(keys, values)``
        ``[H_kv, len(tokens), D]`` is the KV of exactly those tokens. How many blocks were
        added. Nothing is stored when ``generation`` is not the weights' (the KV is stale)."""
        if not self.enabled or generation != self.generation:
            return 0
        path: list[Key] = []
        parent, added = 0, 0
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            key = (parent, tuple(tokens[start : start + BLOCK]))
            block = self.blocks.get(key)
            if block is None:
                self._touch(path)  # what this block extends must not be evicted for it
                block = self._store(key, [_copy(k, v, start) for k, v in kv])
                if block is None or (path and path[-1] not in self.blocks):
                    break  # the cache is smaller than this prefix
                added += 1
            path.append(key)
            parent = block.id
        self._touch(path)
        self._held()
        return added

    def _touch(self, path: list[Key]) -> None:
        """Make ``path``'s blocks the most recent, its first block last (evicted last)."""
        for key in reversed(path):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def _store(self, key: Key, kv: KV) -> _Block | None:
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.max_bytes:
            return None
        while self.nbytes + nbytes > self.max_bytes:
            _, old = self.blocks.popitem(last=False)
            self.nbytes -= old.nbytes
            self._count("prefix_cache_evicted_blocks")
        block = _Block(self._ids, kv, nbytes)
        self._ids += 1
        self.blocks[key] = block
        self.nbytes += nbytes
        self._count("prefix_cache_inserted_blocks")
        return block


def _copy(k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ``[start, start + BLOCK)`` of ``k``/``v`` ``[H, T, D]``, copied (the cache must not
    keep a whole batch's cache alive)."""
    return k[:, start : start + BLOCK].clone(), v[:, start : start + BLOCK].clone()
