"""Splitting the trainer's batch: micro-batches that fit a token budget, and shards that spread
it evenly over data-parallel ranks.

Why it exists: a forward pass over the whole batch rarely fits, and rows differ in length, so
the batch is cut into micro-batches by padded-token cost, and per-row results are merged back in
batch order; with several trainer ranks, rows are assigned so that token loads are equal.
Trimming uses the declared alignment of each key (:data:`~agentrl.batch.schema.BATCH_SCHEMA`):
prompt-aligned keys lose leading padding columns, response-aligned ones trailing columns.

Guarantees: :func:`split_by_token_budget` never puts more than ``max_tokens`` padded tokens in a
micro-batch unless a single row alone is over budget (that row gets its own micro-batch);
:func:`split_by_prompt_groups` keeps the rows of one prompt together for a forward that runs the
prompt once, within the same budget counted that way;
:func:`balance_across_ranks` assigns every index exactly once.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch
from tensordict import TensorDict

from agentrl.batch.schema import BATCH_SCHEMA, BatchError

__all__ = [
    "balance_across_ranks",
    "merge_micro_batches",
    "prompt_group_rows",
    "prompt_groups",
    "select_rows",
    "shard_for_ranks",
    "split_by_count",
    "split_by_prompt_groups",
    "split_by_token_budget",
    "trim_padding",
]


def _prompt_and_response_lengths(batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid prompt and response lengths per row, ``[B]`` each."""
    p_len = batch["prompts"].shape[1]
    attn = batch["attention_mask"]
    return attn[:, :p_len].sum(dim=1), attn[:, p_len:].sum(dim=1)


def trim_padding(batch: TensorDict) -> TensorDict:
    """Drop prompt columns that are padding in every row (left) and response columns (right).

    Prompt-aligned keys lose leading columns, response-aligned keys trailing ones, and
    full-sequence keys both; ``position_ids`` stay valid because only padding is removed.
    A key's alignment is its declared shape; a key outside the schema is response-aligned when
    it is 2-D with the width of ``responses``, and kept whole otherwise.
    """
    if batch.batch_size[0] == 0:
        return batch
    p_len = batch["prompts"].shape[1]
    r_len = batch["responses"].shape[1]
    prompt_lens, resp_lens = _prompt_and_response_lengths(batch)
    p_keep = max(1, int(prompt_lens.max()))
    r_keep = max(1, int(resp_lens.max()))
    if p_keep == p_len and r_keep == r_len:
        return batch
    out = batch.empty()
    for key, value in batch.items():
        width = _width(key, value, r_len)
        if width == "P":
            out.set(key, value[:, p_len - p_keep :])
        elif width == "P+R":
            out.set(key, value[:, p_len - p_keep : p_len + r_keep])
        elif width == "R":
            out.set(key, value[:, :r_keep])
        else:
            out.set(key, value)
    return out


def _width(key: str, value: object, r_len: int) -> str | None:
    """What the columns of ``value`` are aligned with: ``P``, ``R``, ``P+R``, or None (no columns
    to trim: a per-row string, a 1-D tensor, a key outside the schema of another width)."""
    spec = BATCH_SCHEMA.get(key)
    if spec is not None:
        return spec.shape[1] if spec.is_tensor and len(spec.shape) == 2 else None
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == r_len:
        return "R"
    return None


def select_rows(batch: TensorDict, rows: Sequence[int], trim: bool = True) -> TensorDict:
    """Rows ``rows`` of ``batch`` (in that order), trimmed to their own padding by default."""
    sub = batch[torch.as_tensor(list(rows), dtype=torch.long)]
    return trim_padding(sub) if trim else sub


def split_by_count(batch: TensorDict, n: int, trim: bool = True) -> list[TensorDict]:
    """Consecutive micro-batches of at most ``n`` rows each (the last may be smaller)."""
    if n < 1:
        raise BatchError(f"split_by_count: n must be >= 1, got {n}")
    size = batch.batch_size[0]
    return [select_rows(batch, range(s, min(s + n, size)), trim) for s in range(0, size, n)]


def split_by_token_budget(
    batch: TensorDict, max_tokens: int, trim: bool = True
) -> tuple[list[TensorDict], list[list[int]]]:
    """Dynamic batch size: pack rows into micro-batches of at most ``max_tokens`` padded tokens.

    The cost of a micro-batch is what the forward pass computes: ``rows × (longest prompt +
    longest response)`` among its rows, after trimming. Rows are packed first-fit in order of
    decreasing valid length (so similar lengths share a micro-batch and little is padding). A
    row whose own length exceeds the budget gets a micro-batch of its own.

    Returns:
        ``(micro_batches, indices)``: ``indices[i]`` lists the original rows of
        ``micro_batches[i]`` in its row order; use :func:`merge_micro_batches` to put
        per-row results back in batch order.
    """
    if max_tokens < 1:
        raise BatchError(f"split_by_token_budget: max_tokens must be >= 1, got {max_tokens}")
    prompt_lens, resp_lens = _prompt_and_response_lengths(batch)
    p_list = [max(1, int(x)) for x in prompt_lens.tolist()]
    r_list = [max(1, int(x)) for x in resp_lens.tolist()]
    order = sorted(range(len(p_list)), key=lambda i: (-(p_list[i] + r_list[i]), i))
    bins: list[list[int]] = []
    shapes: list[tuple[int, int]] = []  # (max prompt, max response) per bin
    for i in order:
        placed = False
        for b, (bp, br) in enumerate(shapes):
            p, r = max(bp, p_list[i]), max(br, r_list[i])
            if (len(bins[b]) + 1) * (p + r) <= max_tokens:
                bins[b].append(i)
                shapes[b] = (p, r)
                placed = True
                break
        if not placed:
            bins.append([i])
            shapes.append((p_list[i], r_list[i]))
    for b in bins:
        b.sort()
    bins.sort(key=lambda b: b[0])
    return [select_rows(batch, b, trim) for b in bins], bins


def prompt_groups(prompts: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor | None:
    """For left-padded prompts ``[b, P]``, the group of each row ``[b]`` (rows whose prompt
    tokens and padding are identical share a group, numbered 0..g-1), or None when every row's
    prompt is distinct (nothing to share)."""
    key = prompts.masked_fill(prompt_mask == 0, -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    if inverse.numel() == 0 or int(inverse.max()) + 1 == prompts.shape[0]:
        return None
    return inverse


def prompt_group_rows(batch: TensorDict) -> list[list[int]] | None:
    """The rows of each distinct prompt of ``batch`` (:func:`prompt_groups`), each list in row
    order, the lists in order of their first row; None when every prompt is distinct."""
    p_width = batch["prompts"].shape[1]
    groups = prompt_groups(batch["prompts"], batch["attention_mask"][:, :p_width])
    if groups is None:
        return None
    members: dict[int, list[int]] = {}
    for row, g in enumerate(groups.tolist()):
        members.setdefault(g, []).append(row)
    return list(members.values())


def split_by_prompt_groups(
    batch: TensorDict, max_tokens: int, trim: bool = True
) -> tuple[list[TensorDict], list[list[int]]]:
    """:func:`split_by_token_budget` for a forward that runs each distinct prompt once
    (``trainer.share_prompts``): the rows of one prompt stay in one micro-batch (split into
    chunks only when they are over budget together), and a micro-batch costs its distinct
    prompts x the longest prompt + its rows x the longest response. Same return value."""
    if max_tokens < 1:
        raise BatchError(f"split_by_prompt_groups: max_tokens must be >= 1, got {max_tokens}")
    members = prompt_group_rows(batch)
    if members is None:
        return split_by_token_budget(batch, max_tokens, trim)
    prompt_lens, resp_lens = _prompt_and_response_lengths(batch)
    p_list = [max(1, int(x)) for x in prompt_lens.tolist()]
    r_list = [max(1, int(x)) for x in resp_lens.tolist()]
    units = _group_units(members, p_list, r_list, max_tokens)
    units.sort(key=lambda u: (-(p_list[u[0]] + max(r_list[i] for i in u)), u[0]))
    bins: list[list[int]] = []
    shapes: list[tuple[int, int, int]] = []  # (max prompt, max response, prompts) per bin
    for unit in units:
        up, ur = p_list[unit[0]], max(r_list[i] for i in unit)
        for b, (bp, br, bg) in enumerate(shapes):
            p, r = max(bp, up), max(br, ur)
            if (bg + 1) * p + (len(bins[b]) + len(unit)) * r <= max_tokens:
                bins[b].extend(unit)
                shapes[b] = (p, r, bg + 1)
                break
        else:
            bins.append(list(unit))
            shapes.append((up, ur, 1))
    for b in bins:
        b.sort()
    bins.sort(key=lambda b: b[0])
    return [select_rows(batch, b, trim) for b in bins], bins


def _group_units(
    members: list[list[int]], p_list: list[int], r_list: list[int], max_tokens: int
) -> list[list[int]]:
    """The rows of each prompt group, in chunks whose shared forward (the prompt once, every
    row's response) fits ``max_tokens``; a row over budget alone is a chunk of its own."""
    units: list[list[int]] = []
    for rows in members:
        chunk: list[int] = []
        for row in sorted(rows, key=lambda i: (-r_list[i], i)):
            r = max([r_list[i] for i in chunk] + [r_list[row]])
            if chunk and p_list[row] + (len(chunk) + 1) * r > max_tokens:
                units.append(chunk)
                chunk = []
            chunk.append(row)
        units.append(chunk)
    return units


def merge_micro_batches(
    outputs: Sequence[torch.Tensor],
    indices: Sequence[Sequence[int]],
    width: int | None = None,
    pad_value: float = 0.0,
) -> torch.Tensor:
    """Per-micro-batch results back into batch row order.

    Args:
        outputs: one tensor per micro-batch, ``[b_i]`` or ``[b_i, T_i]`` (right-padded,
            e.g. log-probs of a trimmed micro-batch).
        indices: the ``indices`` returned by :func:`split_by_token_budget` (or any split).
        width: the batch's width ``T`` for 2-D outputs (None = the widest output).
        pad_value: fill for columns past a micro-batch's own width.

    Returns:
        ``[B]`` or ``[B, T]`` with row ``indices[i][j]`` = ``outputs[i][j]``.
    """
    if len(outputs) != len(indices):
        raise BatchError(
            f"merge_micro_batches: {len(outputs)} outputs but {len(indices)} index lists"
        )
    rows = sum(len(ix) for ix in indices)
    first = outputs[0]
    if first.dim() == 1:
        merged = first.new_full((rows,), pad_value)
    else:
        t = width if width is not None else max(o.shape[1] for o in outputs)
        merged = first.new_full((rows, t), pad_value)
    for out, ix in zip(outputs, indices, strict=True):
        if out.shape[0] != len(ix):
            raise BatchError(
                f"merge_micro_batches: an output has {out.shape[0]} rows but its indices {len(ix)}"
            )
        index = torch.as_tensor(list(ix), dtype=torch.long, device=out.device)
        if out.dim() == 1:
            merged[index] = out
        else:
            merged[index, : out.shape[1]] = out
    return merged


def balance_across_ranks(
    lengths: Sequence[int | float], n_ranks: int, equal_size: bool = False
) -> tuple[list[list[int]], float]:
    """Spread sequences over ``n_ranks`` so that token loads are as equal as possible.

    Karmarkar–Karp largest differencing for k-way partitioning: each item starts as a
    k-partition with the item in one part; the two partitions with the largest spread
    (max − min part load) are merged largest-part-with-smallest-part, until one remains.

    Args:
        lengths: token count of each sequence (``>= 0``).
        n_ranks: number of data-parallel ranks (``>= 1``).
        equal_size: give every rank the same number of sequences (``len(lengths)`` must be a
            multiple of ``n_ranks``); the start states are then consecutive ``n_ranks``-tuples
            of the length-sorted items, one item per part.

    Returns:
        ``(assignment, max_min_ratio)``: ``assignment[r]`` are the indices for rank ``r``
        (ascending; every index exactly once); the ratio is max load / min load over ranks
        (1.0 = perfect; ``inf`` when a rank gets no tokens while another does).
    """
    if n_ranks < 1:
        raise BatchError(f"balance_across_ranks: n_ranks must be >= 1, got {n_ranks}")
    if any(x < 0 for x in lengths):
        raise BatchError("balance_across_ranks: lengths must be >= 0")
    counter = itertools.count()
    # heap of (-spread, tiebreak, parts) where parts = [(load, [indices]), ...] sorted by load desc
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    if equal_size:
        if len(lengths) % n_ranks:
            raise BatchError(
                f"balance_across_ranks: equal_size needs a multiple of n_ranks={n_ranks} "
                f"sequences, got {len(lengths)}"
            )
        order = sorted(range(len(lengths)), key=lambda i: -float(lengths[i]))
        for start in range(0, len(order), n_ranks):
            parts = [(float(lengths[i]), [i]) for i in order[start : start + n_ranks]]
            heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), next(counter), parts))
    else:
        for i, length in enumerate(lengths):
            parts = [(float(length), [i])] + [(0.0, []) for _ in range(n_ranks - 1)]
            heapq.heappush(heap, (-float(length), next(counter), parts))
    if not heap:
        return [[] for _ in range(n_ranks)], 1.0
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a, b sorted by load descending: pair a's largest with b's smallest
        merged = [(la + lb, ia + ib) for (la, ia), (lb, ib) in zip(a, reversed(b), strict=True)]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(counter), merged))
    parts = heap[0][2]
    assignment = sorted((sorted(ix) for _, ix in parts), key=lambda ix: ix[0] if ix else 1 << 62)
    loads = [sum(float(lengths[i]) for i in ix) for ix in assignment]
    hi, lo = max(loads), min(loads)
    ratio = 1.0 if hi == 0 else (float("inf") if lo == 0 else hi / lo)
    return assignment, ratio


def shard_for_ranks(
    batch: TensorDict, n_ranks: int, equal_size: bool = False, trim: bool = True
) -> tuple[list[TensorDict], list[list[int]], float]:
    """Split ``batch`` into one shard per data-parallel rank, balanced by valid token count.

    Returns:
        ``(shards, indices, max_min_ratio)`` as in :func:`balance_across_ranks`; ``shards[r]``
        holds rows ``indices[r]`` (trimmed to their own padding by default). A rank with no
        rows gets an empty shard (batch size 0).
    """
    lengths = [int(x) for x in batch["attention_mask"].sum(dim=1).tolist()]
    indices, ratio = balance_across_ranks(lengths, n_ranks, equal_size=equal_size)
    shards = [select_rows(batch, ix, trim) for ix in indices]
    return shards, indices, ratio
