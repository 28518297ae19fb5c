"""Data-parallel training with torch FSDP2: sharding, the full-batch-exact step, weight gathering.

Why it exists: one trainer process per GPU (``torchrun`` or Ray actors) must train on one rollout
batch as if a single process had trained on all of it, and hand the CheckpointEngine the same
Hugging Face-named full state dict a single-process :class:`~agentrl.training.actor.Actor` would.
This module holds every piece of that which is not the update loop itself; the loops stay in
``Actor.update_with_log_probs`` and ``Critic.update`` and only ask :class:`DistContext` for a
:class:`MiniBatchPlan`. ``Actor``, ``FrozenPolicy`` (the reference) and ``Critic`` all take
``dist=``; :mod:`agentrl.training.ranks` runs the ranks from ``agentrl train``
(``trainer.world_size``).

Guarantees:

- :func:`shard_model` applies ``fully_shard`` to every decoder layer (the classes a Hugging Face
  model lists in ``_no_split_modules``), then to the root; a model without such layers is an
  error naming its class. On CUDA the default mixed precision is bf16 parameters for compute and
  float32 gradient reduction over float32 master weights; on CPU everything stays float32.
- :meth:`DistContext.plan_mini_batch`: every rank holds the same mini-batch; the rows are split
  over ranks by :func:`~agentrl.batch.balance_across_ranks` (token-balanced, every row exactly
  once); the loss normalizers are the *global* token/sequence counts (local counts all-reduced);
  every rank runs the same number of micro-batches (ranks with fewer run padding micro-batches
  whose loss is multiplied by 0, because FSDP's per-layer all-gathers and reduce-scatters must
  match across ranks); and each rank's loss is multiplied by the world size, so FSDP's gradient
  *average* over ranks equals the single-process full-batch gradient (up to float summation
  order).
- :func:`full_state_dict_for_push` is a collective: every rank calls it, rank 0 gets contiguous
  CPU tensors under the Hugging Face names (tied weights once, like
  ``Actor.state_dict_for_push``), the other ranks get ``{}``. Only rank 0 talks to servers.

Example (one process per device, launched by ``torchrun --nproc-per-node N``)::

    dist_ctx = init_distributed()
    actor = Actor(model_dir, ActorConfig(...), dist=dist_ctx)
    metrics, logp = actor.update_with_log_probs(batch)  # the same batch on every rank
    weights = actor.state_dict_for_push()  # full on rank 0, {} elsewhere
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from agentrl.batch import (
    balance_across_ranks,
    prompt_group_rows,
    select_rows,
    split_by_prompt_groups,
    split_by_token_budget,
)

__all__ = [
    "DistContext",
    "MiniBatchPlan",
    "decoder_layers",
    "default_mixed_precision",
    "full_state_dict_for_push",
    "init_distributed",
    "offload_policy",
    "shard_model",
]


# ---------------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------------


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM, in module order.

    A block is a module whose class name is in the model's ``_no_split_modules`` (the list
    transformers keeps for exactly this purpose: ``Qwen2DecoderLayer``, ``LlamaDecoderLayer``,
    ``GPT2Block``, ...). Nested matches (a block inside a block) are not repeated.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers: list[torch.nn.Module] = []
    inside: set[str] = set()
    for qual, module in model.named_modules():
        if type(module).__name__ in names and not any(qual.startswith(p + ".") for p in inside):
            layers.append(module)
            inside.add(qual)
    if not layers:
        raise ValueError(
            f"shard_model: found no decoder layers in {type(model).__name__} "
            f"(_no_split_modules={sorted(names)}); FSDP2 shards one decoder layer per unit, so "
            "the model class must list its layer class in _no_split_modules (any Hugging Face "
            "causal LM does) or be sharded by hand with torch.distributed.fsdp.fully_shard"
        )
    return layers


def offload_policy(device_type: str) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` (pinned host memory on CUDA, for asynchronous copies)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def default_mixed_precision(device_type: str) -> MixedPrecisionPolicy:
    """bf16 compute / float32 gradient reduction on CUDA; no casting (float32) elsewhere."""
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(
    model: Any,
    mesh: DeviceMesh | None = None,
    *,
    reshard_after_forward: bool = True,
    mixed_precision: MixedPrecisionPolicy | None = None,
    layers_of: torch.nn.Module | None = None,
    float32_units: Sequence[torch.nn.Module] = (),
    cpu_offload: bool = False,
) -> Any:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, LM head).

    Args:
        model: a Hugging Face causal LM (or a module around one, see ``layers_of``), on CPU or
            on the mesh's device; FSDP2 moves each rank's parameter shards to the mesh's device.
        mesh: a 1-D device mesh over the data-parallel ranks (None = all ranks of the default
            process group, on CUDA when available).
        reshard_after_forward: free each layer's gathered parameters after its forward (ZeRO-3
            memory; one more all-gather in backward). False keeps them until backward (ZeRO-2-
            like: faster, more memory).
        mixed_precision: None = :func:`default_mixed_precision` for the mesh's device type.
        layers_of: the Hugging Face model whose decoder layers get their own FSDP unit (None =
            ``model``); the critic passes its backbone and shards backbone + value head as one
            root.
        float32_units: submodules sharded as their own unit that always computes in float32
            (the critic's value head, whatever ``mixed_precision`` says).
        cpu_offload: keep parameter shards, gradients and optimizer state in host memory
            (:func:`offload_policy`; ``trainer.cpu_offload``).

    Returns:
        ``model`` itself, now an ``FSDPModule`` whose parameters are ``DTensor`` shards.
    """
    if mesh is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = mixed_precision or default_mixed_precision(mesh.device_type)
    offload = offload_policy(mesh.device_type) if cpu_offload else OffloadPolicy()
    common: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": offload,
    }
    for layer in decoder_layers(model if layers_of is None else layers_of):
        fully_shard(layer, mp_policy=policy, **common)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for unit in float32_units:
        fully_shard(unit, mp_policy=fp32, **common)
    fully_shard(model, mp_policy=policy, **common)
    return model


def _tied_duplicates(model: torch.nn.Module) -> set[str]:
    """Parameter names that alias an earlier parameter (e.g. a tied ``lm_head.weight``)."""
    seen: set[int] = set()
    dupes: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            dupes.add(name)
        seen.add(id(param))
    return dupes


def full_state_dict_for_push(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Gather the full weights of an FSDP2 model on rank 0 (a collective: call on every rank).

    Args:
        model: a model sharded by :func:`shard_model`.
        dtype: cast floating-point tensors to this dtype (None = keep the master dtype).

    Returns:
        On rank 0, contiguous CPU tensors under the Hugging Face parameter names (tied weights
        appear once, under their first name); ``{}`` on every other rank.
    """
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not full:
        return {}
    dupes = _tied_duplicates(model)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        if name in dupes:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"full_state_dict_for_push: {name} is a {type(tensor).__name__}")
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.to("cpu").contiguous()
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a ``DTensor`` (a collective for sharded ones); ``t`` otherwise."""
    return t.full_tensor() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------------------------
# The data-parallel step
# ---------------------------------------------------------------------------------------------


@dataclass
class MiniBatchPlan:
    """What one rank runs for one mini-batch.

    ``micro[i]`` holds rows ``rows[i]`` of the mini-batch (indices into the mini-batch); an
    empty ``rows[i]`` marks a padding micro-batch: run forward and backward, but multiply its
    loss by 0 and record nothing. ``global_tokens`` / ``global_seqs`` are the counts over the
    whole mini-batch on all ranks; multiply every real micro-batch's loss by ``loss_scale``.
    """

    micro: list[TensorDict]
    rows: list[list[int]]
    global_tokens: int
    global_seqs: int
    loss_scale: float


@dataclass
class DistContext:
    """This process's place in the data-parallel group, and the collectives the actor needs.

    Build it with :func:`init_distributed` (torchrun environment) or
    :meth:`DistContext.current` (a process group that is already initialized).
    """

    rank: int
    world_size: int
    mesh: DeviceMesh
    device: torch.device
    reshard_after_forward: bool = True
    mixed_precision: MixedPrecisionPolicy | None = None
    cpu_offload: bool = False
    """Shard with host offload (``trainer.cpu_offload``; :func:`shard_model`)."""

    @classmethod
    def current(
        cls,
        device: str = "auto",
        *,
        reshard_after_forward: bool = True,
        mixed_precision: MixedPrecisionPolicy | None = None,
    ) -> DistContext:
        """The context of the initialized default process group, on ``device``.

        ``device="auto"`` is ``cuda:LOCAL_RANK`` when CUDA is available, else CPU.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "DistContext.current: torch.distributed is not initialized; call "
                "init_distributed() (under torchrun) or torch.distributed.init_process_group first"
            )
        rank, world = dist.get_rank(), dist.get_world_size()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
            dev = torch.device("cuda", local if dev.index is None else dev.index)
            torch.cuda.set_device(dev)
        mesh = init_device_mesh(dev.type, (world,))
        return cls(rank, world, mesh, dev, reshard_after_forward, mixed_precision)

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that talks to the inference servers."""
        return self.rank == 0

    def shard(
        self,
        model: Any,
        *,
        layers_of: torch.nn.Module | None = None,
        float32_units: Sequence[torch.nn.Module] = (),
    ) -> Any:
        """:func:`shard_model` with this context's mesh and settings."""
        return shard_model(
            model,
            self.mesh,
            reshard_after_forward=self.reshard_after_forward,
            mixed_precision=self.mixed_precision,
            layers_of=layers_of,
            float32_units=float32_units,
            cpu_offload=self.cpu_offload,
        )

    # ---- collectives --------------------------------------------------------------------
    def _gather_ints(self, values: Sequence[int]) -> torch.Tensor:
        """``[world, len(values)]`` int64: every rank's ``values``."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine, group=self.mesh.get_group())
        return torch.stack(parts).cpu()

    def merge_rows(
        self,
        outputs: Sequence[torch.Tensor],
        rows: Sequence[Sequence[int]],
        n_rows: int,
        width: int,
    ) -> torch.Tensor:
        """Every rank's per-row results ``[b_i, T_i]`` as one ``[n_rows, width]`` float32 tensor.

        Each batch row must be produced by exactly one rank (the plans guarantee it); rows are
        summed over ranks with zeros elsewhere, which is exact.
        """
        merged = torch.zeros(n_rows, width, dtype=torch.float32, device=self.device)
        for out, ix in zip(outputs, rows, strict=True):
            index = torch.as_tensor(list(ix), dtype=torch.long, device=self.device)
            merged[index, : out.shape[1]] = out.to(self.device, torch.float32)
        dist.all_reduce(merged, op=dist.ReduceOp.SUM, group=self.mesh.get_group())
        return merged.cpu()

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Each of ``values`` summed over ranks (float64; every rank passes as many)."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.mesh.get_group())
        return [float(x) for x in t.cpu()]

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank (a collective)."""
        return bool(self._gather_ints([int(flag)]).max())

    def reduce_metric_sums(
        self, sums: dict[str, float], counts: dict[str, float]
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Sum per-key metric sums and counts (weights) over ranks (keys may differ between
        ranks)."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (sums, counts), group=self.mesh.get_group())
        total_s: dict[str, float] = {}
        total_c: dict[str, float] = {}
        for s, c in gathered:
            for k, v in s.items():
                total_s[k] = total_s.get(k, 0.0) + v
                total_c[k] = total_c.get(k, 0.0) + c[k]
        return total_s, total_c

    # ---- planning -----------------------------------------------------------------------
    def plan_mini_batch(
        self, mini_batch: TensorDict, max_tokens: int, share_prompts: bool = False
    ) -> MiniBatchPlan:
        """This rank's share of ``mini_batch`` (identical on every rank), micro-batched.

        Rows are assigned by :func:`balance_across_ranks` on valid lengths (prompt + response,
        the forward cost; with ``share_prompts`` the rows of one prompt go to one rank together,
        costed as the prompt once plus their responses); this rank's rows are packed by
        :func:`split_by_token_budget` (:func:`split_by_prompt_groups`); the micro-batch count
        is padded to the maximum over ranks with copies of the mini-batch's first row
        (``rows == []``).
        """
        mine = self._my_rows(mini_batch, share_prompts)
        micro: list[TensorDict] = []
        rows: list[list[int]] = []
        tokens = seqs = 0
        if mine:
            local = select_rows(mini_batch, mine)
            split = split_by_prompt_groups if share_prompts else split_by_token_budget
            micro, local_rows = split(local, max_tokens)
            rows = [[mine[i] for i in ix] for ix in local_rows]
            mask = local["response_mask"].float()
            tokens = int(mask.sum().item())
            seqs = int((mask.sum(dim=1) > 0).sum().item())
        everyone = self._gather_ints([tokens, seqs, len(micro)])
        n_micro = int(everyone[:, 2].max())
        if len(micro) < n_micro:
            filler = select_rows(mini_batch, [0])
            micro += [filler] * (n_micro - len(micro))
            rows += [[] for _ in range(n_micro - len(rows))]
        return MiniBatchPlan(
            micro=micro,
            rows=rows,
            global_tokens=int(everyone[:, 0].sum()),
            global_seqs=int(everyone[:, 1].sum()),
            loss_scale=float(self.world_size),
        )

    def _my_rows(self, mini_batch: TensorDict, share_prompts: bool) -> list[int]:
        """The mini-batch rows this rank runs (see :meth:`plan_mini_batch`)."""
        attn = mini_batch["attention_mask"]
        lengths = [int(x) for x in attn.sum(dim=1).tolist()]
        units = prompt_group_rows(mini_batch) if share_prompts else None
        if units is None:
            return balance_across_ranks(lengths, self.world_size)[0][self.rank]
        p_lens = attn[:, : mini_batch["prompts"].shape[1]].sum(dim=1).tolist()
        cost = [int(p_lens[u[0]]) + sum(lengths[i] - int(p_lens[i]) for i in u) for u in units]
        assignment, _ = balance_across_ranks(cost, self.world_size)
        return sorted(row for unit in assignment[self.rank] for row in units[unit])


def init_distributed(
    backend: str | None = None,
    *,
    device: str = "auto",
    reshard_after_forward: bool = True,
    mixed_precision: MixedPrecisionPolicy | None = None,
) -> DistContext:
    """Initialize the default process group from the torchrun environment and return its context.

    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` come from ``torchrun`` (or a
    Ray actor that sets them); ``backend`` None = ``nccl`` with CUDA, else ``gloo``.
    """
    if not dist.is_initialized():
        for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise RuntimeError(
                    f"init_distributed: environment variable {key} is not set; launch with "
                    "`torchrun --nproc-per-node N ...` or set RANK/WORLD_SIZE/MASTER_ADDR/"
                    "MASTER_PORT yourself"
                )
        cuda = torch.cuda.is_available() and device != "cpu"
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
    return DistContext.current(
        device, reshard_after_forward=reshard_after_forward, mixed_precision=mixed_precision
    )
