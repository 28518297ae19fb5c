"""The trainer's batch, declared: every key with its shape, dtype, kind and whether it is required.

Why it exists: the batch is a string-keyed ``TensorDict`` (DESIGN section 3) that several stages
fill in (the collator, π_old, the correction, the reference, the rewards, the critic, the
estimator) and the models consume. Without a declaration, a float64 advantage or a ``[B, P+R]``
tensor where ``[B, R]`` belongs travels silently until a broadcast hides it or a kernel fails
far from the cause. Here the layout is written once (:data:`BATCH_SCHEMA`) and checked where a
batch is made and where a model receives it (:func:`check_batch`)::

    check_batch(batch, "actor update", require=("old_log_probs", "advantages"))
    # BatchSchemaError: actor update: batch key 'advantages' has dtype torch.float64;
    #   expected torch.float32 [B, R]

Shapes are in terms of ``B`` (rows), ``P`` (the width of ``prompts``: the longest prompt, left
padded) and ``R`` (the width of ``responses``: the longest response, right padded).

Guarantees: :func:`check_batch` raises :class:`BatchSchemaError` naming the key, what was
expected and what was found, for a missing required key, a tensor where one string per row
belongs (or the reverse), a wrong dtype or a wrong shape; keys outside the schema are the
caller's own and pass unchecked. Checking never changes the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from tensordict import TensorDict, is_non_tensor

__all__ = [
    "BATCH_SCHEMA",
    "FULL_KEYS",
    "NON_TENSOR_KEYS",
    "PROMPT_KEYS",
    "BatchError",
    "BatchKey",
    "BatchSchemaError",
    "check_batch",
]


class BatchError(ValueError):
    """A batch cannot be built or split as asked; the message names the trajectory or argument."""


class BatchSchemaError(BatchError):
    """A batch breaks :data:`BATCH_SCHEMA`; the message names the key, expected and actual."""


@dataclass(frozen=True)
class BatchKey:
    """One key of the batch: its shape in ``B``/``P``/``R``, its dtype (None: one string per row,
    stored as a non-tensor), whether every batch built from trajectories has it, and what it is."""

    name: str
    shape: tuple[str, ...]
    dtype: torch.dtype | None
    required: bool
    doc: str

    @property
    def is_tensor(self) -> bool:
        """False for the per-row strings (``uid``, ``agent``, ``data_source``)."""
        return self.dtype is not None

    def describe(self) -> str:
        """``torch.float32 [B, R]``, or ``one str per row (non-tensor)``."""
        if self.dtype is None:
            return "one str per row (non-tensor)"
        return f"{self.dtype} [{', '.join(self.shape)}]"


_LONG, _FLOAT, _STR = torch.int64, torch.float32, None

# fmt: off
_KEYS: tuple[tuple[str, str, torch.dtype | None, bool, str], ...] = (
    # name                 shape    dtype   req.   what it is
    # -- built from trajectories (agentrl.batch.collate.trajectories_to_batch) --
    ("prompts",             "B P",   _LONG,  True,  "prompt ids, left-padded with pad_token_id"),
    ("responses",           "B R",   _LONG,  True,  "response ids, right-padded with pad_token_id"),
    ("input_ids",           "B P+R", _LONG,  True,  "cat(prompts, responses)"),
    ("attention_mask",      "B P+R", _LONG,  True,  "1 on real tokens, 0 on padding"),
    ("position_ids",        "B P+R", _LONG,  True,  "cumsum(attention_mask) - 1, clipped at 0"),
    ("response_mask",       "B R",   _LONG,  True,  "the loss mask: 1 = policy-sampled"),
    ("rollout_log_probs",   "B R",   _FLOAT, True,  "log π_rollout, 0 where response_mask is 0"),
    ("policy_version",      "B R",   _LONG,  True,  "weight version per token, -1 where unmasked"),
    ("token_level_scores",  "B R",   _FLOAT, True,  "rewards placed on tokens"),
    ("uid",                 "B",     _STR,   True,  "group id (the samples of a task share it)"),
    ("agent",               "B",     _STR,   True,  "the agent that ran the episode"),
    ("data_source",         "B",     _STR,   True,  "the task's data source (picks its reward)"),
    # -- filled in by the training step (agentrl.training.step) --
    ("old_log_probs",       "B R",   _FLOAT, False, "π_old, or π_rollout in bypass mode"),
    ("ref_log_prob",        "B R",   _FLOAT, False, "log π_ref (KL loss or KL in the reward)"),
    ("values",              "B R",   _FLOAT, False, "V(s_t), from Critic.compute_values (GAE)"),
    ("token_level_rewards", "B R",   _FLOAT, False, "scores − β·KL when KL is in the reward"),
    ("advantages",          "B R",   _FLOAT, False, "from compute_advantages (the estimator)"),
    ("returns",             "B R",   _FLOAT, False, "critic targets, from compute_advantages"),
    ("rollout_is_weights",  "B R",   _FLOAT, False, "truncated IS weights (the correction)"),
    ("train_log_probs",     "B R",   _FLOAT, False, "π_train that the Σπ² baseline belongs to"),
    ("sum_pi_squared",      "B R",   _FLOAT, False, "Σ_v π(v)² per token (Σπ² baselines)"),
    ("teacher_log_probs",   "B R",   _FLOAT, False, "log π_teacher (distillation), 0 where unmasked"),
    ("prox_alpha",          "B R",   _FLOAT, False, "log-linear π_old weight α (proximal=loglinear)"),
)
# fmt: on

BATCH_SCHEMA: Mapping[str, BatchKey] = MappingProxyType(
    {
        name: BatchKey(name, tuple(shape.split()), dtype, required, doc)
        for name, shape, dtype, required, doc in _KEYS
    }
)
"""Every key of the trainer's batch (DESIGN section 3), by name."""

PROMPT_KEYS = frozenset(k.name for k in BATCH_SCHEMA.values() if k.shape == ("B", "P"))
"""Keys aligned with the (left-padded) prompt: ``[B, P]``."""
FULL_KEYS = frozenset(k.name for k in BATCH_SCHEMA.values() if k.shape == ("B", "P+R"))
"""Keys aligned with the whole sequence: ``[B, P+R]``."""
NON_TENSOR_KEYS = tuple(k.name for k in BATCH_SCHEMA.values() if not k.is_tensor)
"""Per-row strings carried alongside the tensors."""
_REQUIRED = tuple(k.name for k in BATCH_SCHEMA.values() if k.required)


def check_batch(batch: TensorDict, where: str, require: Iterable[str] = ()) -> TensorDict:
    """Check ``batch`` against :data:`BATCH_SCHEMA` and return it unchanged.

    Args:
        batch: the trainer's batch.
        where: who checks, for the message (``"trajectories_to_batch"``, ``"actor update"``).
        require: keys needed here beyond those every batch has (e.g. ``advantages``).

    Raises:
        BatchSchemaError: a required key is missing, or a declared key has the wrong kind,
            dtype or shape; the message names the key, the expected and the actual.
    """
    extra = [name for name in require if name not in BATCH_SCHEMA]
    if extra:
        raise ValueError(f"check_batch: {extra} are not batch keys; known: {list(BATCH_SCHEMA)}")
    present = {str(key) for key, _ in batch.items()}
    missing = [name for name in (*_REQUIRED, *require) if name not in present]
    if missing:
        wanted = "; ".join(
            f"'{n}' ({BATCH_SCHEMA[n].describe()}: {BATCH_SCHEMA[n].doc})" for n in missing
        )
        raise BatchSchemaError(
            f"{where}: the batch has no {wanted}; it has {', '.join(sorted(present)) or 'no keys'}"
        )
    sizes = _sizes(batch)
    for name, value in batch.items():
        spec = BATCH_SCHEMA.get(name)
        if spec is not None:
            _check_key(spec, value, sizes, where)
    return batch


def _sizes(batch: TensorDict) -> dict[str, int]:
    """``B``, ``P``, ``R`` and ``P+R`` of ``batch``, read off ``prompts`` and ``responses``."""
    rows = int(batch.batch_size[0]) if batch.batch_size else 0
    p, r = (_width(batch.get(name)) for name in ("prompts", "responses"))
    return {"B": rows, "P": p, "R": r, "P+R": p + r}


def _width(value: Any) -> int:
    """The column count of a 2-D tensor; -1 otherwise (its own check then names the problem)."""
    return value.shape[1] if isinstance(value, torch.Tensor) and value.dim() == 2 else -1


def _check_key(spec: BatchKey, value: Any, sizes: dict[str, int], where: str) -> None:
    """Raise BatchSchemaError unless ``value`` has the kind, dtype and shape of ``spec``."""
    head = f"{where}: batch key '{spec.name}'"
    if not spec.is_tensor:
        if not is_non_tensor(value):
            raise BatchSchemaError(
                f"{head} must be {spec.describe()}, got {_describe_value(value)}"
            )
        return
    if not isinstance(value, torch.Tensor):
        raise BatchSchemaError(
            f"{head} must be a tensor {spec.describe()}, got {_describe_value(value)}"
        )
    expected = [sizes[d] for d in spec.shape]
    if list(value.shape) != expected:
        dims = ", ".join(spec.shape)
        raise BatchSchemaError(
            f"{head} has shape {list(value.shape)}; expected [{dims}] = {expected} "
            f"(B rows, P = width of 'prompts', R = width of 'responses')"
        )
    if value.dtype != spec.dtype:
        raise BatchSchemaError(f"{head} has dtype {value.dtype}; expected {spec.describe()}")


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {value.dtype} {list(value.shape)}"
    return type(value).__name__
