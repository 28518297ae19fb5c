"""The trainer's batch: its declared layout, building it from trajectories, splitting it.

Why it exists: the trainer sees one padded ``TensorDict`` (DESIGN section 3), never lists of
trajectories. ``schema`` declares every key (shape in ``B``/``P``/``R``, dtype, required or
filled in later) and checks a batch against it; ``collate`` builds the batch from trajectories
(and back) and is the only place where padding is decided; ``split`` cuts it into micro-batches
that fit a token budget and into balanced shards for data-parallel ranks. Import names from
this package::

    batch = trajectories_to_batch(trajs, pad_token_id=0)        # checked against BATCH_SCHEMA
    micro, rows = split_by_token_budget(batch, max_tokens=4096)
    check_batch(batch, "my trainer", require=("advantages",))   # BatchSchemaError names the key
"""

from __future__ import annotations

from agentrl.batch.collate import batch_to_trajectories, non_tensor_list, trajectories_to_batch
from agentrl.batch.schema import (
    BATCH_SCHEMA,
    FULL_KEYS,
    NON_TENSOR_KEYS,
    PROMPT_KEYS,
    BatchError,
    BatchKey,
    BatchSchemaError,
    check_batch,
)
from agentrl.batch.split import (
    balance_across_ranks,
    merge_micro_batches,
    prompt_group_rows,
    prompt_groups,
    select_rows,
    shard_for_ranks,
    split_by_count,
    split_by_prompt_groups,
    split_by_token_budget,
    trim_padding,
)

__all__ = [
    "BATCH_SCHEMA",
    "FULL_KEYS",
    "NON_TENSOR_KEYS",
    "PROMPT_KEYS",
    "BatchError",
    "BatchKey",
    "BatchSchemaError",
    "balance_across_ranks",
    "batch_to_trajectories",
    "check_batch",
    "merge_micro_batches",
    "non_tensor_list",
    "prompt_group_rows",
    "prompt_groups",
    "select_rows",
    "shard_for_ranks",
    "split_by_count",
    "split_by_prompt_groups",
    "split_by_token_budget",
    "trajectories_to_batch",
    "trim_padding",
]
