"""Trajectories <-> the trainer's TensorDict, micro-batches and data-parallel balancing.

Why it exists: the trainer sees one padded batch (DESIGN section 3), never lists of
trajectories, and must split it into micro-batches that fit a token budget and spread it evenly
over data-parallel ranks. This module is the only place where padding is decided.

Layout of :func:`trajectories_to_batch` (``B`` trajectories, ``P`` = longest prompt, ``R`` =
longest response)::

    prompts          [B, P]    int64    left-padded with pad_token_id
    responses        [B, R]    int64    right-padded with pad_token_id
    input_ids        [B, P+R]  int64    cat(prompts, responses)
    attention_mask   [B, P+R]  int64    1 on real tokens (prompt and response), 0 on padding
    position_ids     [B, P+R]  int64    cumsum(attention_mask) - 1, clipped at 0
    response_mask    [B, R]    int64    the loss mask (1 = policy-sampled), 0 on padding
    rollout_log_probs[B, R]    float32  log π_rollout, 0.0 where response_mask is 0
    policy_version   [B, R]    int64    weight version per token, -1 where response_mask is 0
    token_level_scores [B, R]  float32  rewards placed on tokens (see below)
    uid, agent, data_source    non-tensor (NonTensorStack), one str per row; slices with the batch

Reward placement: the episode ``reward`` sits on the last sampled token (``loss_mask == 1``) of
the response; a response with no sampled token puts it on its last token (an empty response:
on column 0, which is padding, so it counts in group statistics but trains nothing); with
``turn_rewards``, reward k is added on the last token of model turn k (a model turn is a maximal
run of sampled tokens), so a row's score sum is ``reward + sum(turn_rewards)``.

Guarantees: a trajectory longer than ``max_prompt_len``/``max_response_len`` is an error naming
it, unless ``truncate=True`` (prompts keep their last tokens, responses their first); token
fields round-trip through :func:`batch_to_trajectories`; :func:`split_by_token_budget` never
puts more than ``max_tokens`` padded tokens in a micro-batch unless a single row alone is over
budget (that row gets its own micro-batch); :func:`balance_across_ranks` assigns every index
exactly once.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch
from tensordict import NonTensorStack, TensorDict

from agentrl.types import Trajectory

__all__ = [
    "FULL_KEYS",
    "NON_TENSOR_KEYS",
    "PROMPT_KEYS",
    "BatchError",
    "balance_across_ranks",
    "batch_to_trajectories",
    "merge_micro_batches",
    "non_tensor_list",
    "select_rows",
    "shard_for_ranks",
    "split_by_count",
    "split_by_token_budget",
    "trajectories_to_batch",
    "trim_padding",
]

PROMPT_KEYS = frozenset({"prompts"})
"""Keys aligned with the (left-padded) prompt: ``[B, P]``."""
FULL_KEYS = frozenset({"input_ids", "attention_mask", "position_ids"})
"""Keys aligned with the whole sequence: ``[B, P+R]``. Other 2-D keys of width R are response-aligned."""
NON_TENSOR_KEYS = ("uid", "agent", "data_source")
"""Per-row strings carried alongside the tensors."""


class BatchError(ValueError):
    """A batch cannot be built or split as asked; the message names the trajectory or argument."""


# ---------------------------------------------------------------------------------------------
# Trajectories -> TensorDict
# ---------------------------------------------------------------------------------------------


def _model_turn_ends(loss_mask: Sequence[int]) -> list[int]:
    """Positions of the last token of each maximal run of 1s in ``loss_mask``."""
    ends = []
    for t, m in enumerate(loss_mask):
        if m and (t + 1 == len(loss_mask) or not loss_mask[t + 1]):
            ends.append(t)
    return ends


def _name(traj: Trajectory, row: int) -> str:
    return f"trajectory {row} (uid={traj.uid!r}, index={traj.index}, task_id={traj.task_id!r})"


def trajectories_to_batch(
    trajs: Sequence[Trajectory],
    pad_token_id: int,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
    truncate: bool = False,
) -> TensorDict:
    """Pad trajectories into the trainer's batch (layout in the module docstring).

    Args:
        trajs: the episodes, in row order (at least one).
        pad_token_id: id written into padding positions (never attended: attention_mask is 0).
        max_prompt_len: longest allowed prompt (None = no limit).
        max_response_len: longest allowed response (None = no limit).
        truncate: cut over-long prompts (keep the last tokens) and responses (keep the first)
            instead of raising.

    Returns:
        A TensorDict with batch size ``[B]``; ``P`` and ``R`` are the longest (possibly
        truncated) prompt and response, at least 1 each.
    """
    if not trajs:
        raise BatchError("trajectories_to_batch got no trajectories; a batch needs at least one")
    fitted = [
        _fit(traj, row, max_prompt_len, max_response_len, truncate)
        for row, traj in enumerate(trajs)
    ]
    p_max = max(1, max(len(p_ids) for p_ids, _ in fitted))
    r_max = max(1, max(r_len for _, r_len in fitted))
    cols = _padded_columns(len(trajs), p_max, r_max, pad_token_id)
    for row, (traj, (p_ids, r_len)) in enumerate(zip(trajs, fitted, strict=True)):
        _fill_row(cols, row, traj, p_ids, r_len)
    prompt_attn, resp_attn = cols.pop("prompt_attention"), cols.pop("response_attention")
    attention_mask = torch.cat([prompt_attn, resp_attn], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    batch = TensorDict(
        {
            "prompts": cols["prompts"],
            "responses": cols["responses"],
            "input_ids": torch.cat([cols["prompts"], cols["responses"]], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": cols["response_mask"],
            "rollout_log_probs": cols["rollout_log_probs"],
            "policy_version": cols["policy_version"],
            "token_level_scores": cols["token_level_scores"],
        },
        batch_size=[len(trajs)],
    )
    batch["uid"] = _string_stack([t.uid for t in trajs])
    batch["agent"] = _string_stack([t.agent for t in trajs])
    batch["data_source"] = _string_stack([t.data_source for t in trajs])
    return batch


def _fit(
    traj: Trajectory,
    row: int,
    max_prompt_len: int | None,
    max_response_len: int | None,
    truncate: bool,
) -> tuple[list[int], int]:
    """The prompt ids and response length of ``traj`` within the limits (cut when ``truncate``:
    the prompt keeps its last tokens, the response its first); an over-long one is an error."""
    p_ids = traj.prompt_ids
    r_len = traj.response_length
    if max_prompt_len is not None and len(p_ids) > max_prompt_len:
        if not truncate:
            raise BatchError(
                f"{_name(traj, row)} has a {len(p_ids)}-token prompt, over max_prompt_len="
                f"{max_prompt_len}; raise the limit or pass truncate=True"
            )
        p_ids = p_ids[len(p_ids) - max_prompt_len :]
    if max_response_len is not None and r_len > max_response_len:
        if not truncate:
            raise BatchError(
                f"{_name(traj, row)} has a {r_len}-token response, over max_response_len="
                f"{max_response_len}; raise the limit or pass truncate=True"
            )
        r_len = max_response_len
    return p_ids, r_len


def _padded_columns(
    batch_size: int, p_max: int, r_max: int, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """The batch's columns filled with their padding values (prompt ``[B, P]``, others
    ``[B, R]``), plus the prompt and response halves of the attention mask."""
    return {
        "prompts": torch.full((batch_size, p_max), pad_token_id, dtype=torch.long),
        "prompt_attention": torch.zeros((batch_size, p_max), dtype=torch.long),
        "responses": torch.full((batch_size, r_max), pad_token_id, dtype=torch.long),
        "response_attention": torch.zeros((batch_size, r_max), dtype=torch.long),
        "response_mask": torch.zeros((batch_size, r_max), dtype=torch.long),
        "rollout_log_probs": torch.zeros((batch_size, r_max), dtype=torch.float32),
        "policy_version": torch.full((batch_size, r_max), -1, dtype=torch.long),
        "token_level_scores": torch.zeros((batch_size, r_max), dtype=torch.float32),
    }


def _fill_row(
    cols: dict[str, torch.Tensor], row: int, traj: Trajectory, p_ids: list[int], r_len: int
) -> None:
    """Write ``traj`` (prompt ``p_ids``, first ``r_len`` response tokens) into row ``row``:
    the prompt left-padded, the response fields right-padded, the rewards on their tokens."""
    p_max = cols["prompts"].shape[1]
    if p_ids:
        cols["prompts"][row, p_max - len(p_ids) :] = torch.tensor(p_ids, dtype=torch.long)
        cols["prompt_attention"][row, p_max - len(p_ids) :] = 1
    scores = cols["token_level_scores"]
    if r_len == 0:
        # nothing to train on, but the score still counts in its group's statistics
        scores[row, 0] = float(traj.reward) + float(sum(traj.turn_rewards))
        return
    cols["responses"][row, :r_len] = torch.tensor(traj.response_ids[:r_len], dtype=torch.long)
    cols["response_attention"][row, :r_len] = 1
    mask = traj.loss_mask[:r_len]
    cols["response_mask"][row, :r_len] = torch.tensor(mask, dtype=torch.long)
    cols["rollout_log_probs"][row, :r_len] = torch.tensor(
        traj.rollout_logprobs[:r_len], dtype=torch.float32
    )
    cols["policy_version"][row, :r_len] = torch.tensor(
        traj.policy_version[:r_len], dtype=torch.long
    )
    _place_rewards(scores[row], row, traj, mask, r_len)


def _place_rewards(
    scores: torch.Tensor, row: int, traj: Trajectory, mask: list[int], r_len: int
) -> None:
    """Add the rewards of ``traj`` to its ``[R]`` score row: turn reward k on the last token of
    model turn k (turns cut away by truncation lose theirs), the episode reward on the last
    sampled token (or on the last kept token when none was sampled)."""
    ends = _model_turn_ends(mask)
    if traj.turn_rewards:
        full_ends = _model_turn_ends(traj.loss_mask)
        if len(traj.turn_rewards) != len(full_ends):
            raise BatchError(
                f"{_name(traj, row)} has {len(traj.turn_rewards)} turn_rewards but "
                f"{len(full_ends)} model turns (runs of loss_mask 1); give one reward per turn"
            )
        for pos, turn_reward in zip(ends, traj.turn_rewards, strict=False):
            scores[pos] += float(turn_reward)
    scores[ends[-1] if ends else r_len - 1] += float(traj.reward)


def _string_stack(values: list[str]) -> NonTensorStack:
    """One string per row, stored so that slicing/indexing the batch slices it too."""
    # from_list is annotated for mappings but documented for any non-tensor values
    return NonTensorStack.from_list(values)  # pyright: ignore[reportArgumentType]


def non_tensor_list(batch: TensorDict, key: str) -> list[str]:
    """The per-row strings stored under ``key`` (``uid``, ``agent``, ``data_source``)."""
    value = batch.get(key)
    if isinstance(value, NonTensorStack):
        return [str(v) for v in value.tolist()]
    data = getattr(value, "data", value)
    return [str(data)] * batch.batch_size[0]


def batch_to_trajectories(batch: TensorDict) -> list[Trajectory]:
    """Undo :func:`trajectories_to_batch` for the token fields.

    Recovers ``prompt_ids``, ``response_ids``, ``loss_mask``, ``rollout_logprobs``,
    ``policy_version``, ``uid``, ``agent``, ``data_source``; ``reward`` is the row's score sum
    (exact when the trajectory had no ``turn_rewards``). Works on trimmed micro-batches too.
    """
    prompts = batch["prompts"]
    p_len = prompts.shape[1]
    attn = batch["attention_mask"]
    responses = batch["responses"]
    uids = non_tensor_list(batch, "uid")
    agents = non_tensor_list(batch, "agent")
    sources = non_tensor_list(batch, "data_source")
    out = []
    for row in range(batch.batch_size[0]):
        p_keep = attn[row, :p_len].bool()
        r_keep = attn[row, p_len:].bool()
        out.append(
            Trajectory(
                prompt_ids=prompts[row][p_keep].tolist(),
                response_ids=responses[row][r_keep].tolist(),
                loss_mask=batch["response_mask"][row][r_keep].tolist(),
                rollout_logprobs=batch["rollout_log_probs"][row][r_keep].tolist(),
                policy_version=batch["policy_version"][row][r_keep].tolist(),
                reward=float(batch["token_level_scores"][row].sum()),
                uid=uids[row],
                agent=agents[row],
                data_source=sources[row],
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Micro-batches
# ---------------------------------------------------------------------------------------------


def _prompt_and_response_lengths(batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid prompt and response lengths per row, ``[B]`` each."""
    p_len = batch["prompts"].shape[1]
    attn = batch["attention_mask"]
    return attn[:, :p_len].sum(dim=1), attn[:, p_len:].sum(dim=1)


def trim_padding(batch: TensorDict) -> TensorDict:
    """Drop prompt columns that are padding in every row (left) and response columns (right).

    Prompt-aligned keys lose leading columns, response-aligned keys trailing ones, and
    full-sequence keys both; ``position_ids`` stay valid because only padding is removed.
    Response-aligned keys are every other 2-D key whose width equals ``responses``'s.
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
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            out.set(key, value)
        elif key in PROMPT_KEYS:
            out.set(key, value[:, p_len - p_keep :])
        elif key in FULL_KEYS:
            out.set(key, value[:, p_len - p_keep : p_len + r_keep])
        elif value.shape[1] == r_len:
            out.set(key, value[:, :r_keep])
        else:
            out.set(key, value)
    return out


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


# ---------------------------------------------------------------------------------------------
# Data-parallel balancing
# ---------------------------------------------------------------------------------------------


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
