"""The weight group: a standalone ``torch.distributed`` group that broadcasts weights in buckets.

Why it exists: on GPUs (and between machines) the fastest way to move a new weight version from
the trainer into every inference server is a collective broadcast (NCCL on GPUs, gloo on CPUs),
not a file or an HTTP body. Both ends of the ``collective`` transport live here:

- :class:`WeightGroup` is a process group of its own (a ``TCPStore`` hosted by the trainer, then a
  ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` built on it directly), so it never touches the
  default process group a trainer may already use for FSDP. The trainer is rank 0, server ``i``
  is rank ``i + 1``. **Every collective has a timeout** (``timeout_s``): a peer that dies makes
  the others fail with an error after at most that long, never hang. A group whose collective
  failed is *broken* and is rebuilt at the next push.
- :class:`BucketLayout` is the wire format: the tensors (name, dtype, shape) cut into buckets of
  at most ``bucket_bytes`` (a tensor larger than that is a bucket of its own), each packed as one
  ``uint8`` buffer with every tensor at a 16-byte-aligned offset. Both ends derive the offsets
  from the same list, so only names, dtypes and shapes travel (as JSON, with the receive request).
  The trainer packs a bucket into one of two reused buffers while the previous one is broadcast;
  a bucket of one tensor is broadcast from the tensor's own memory (no copy).

A receiver checks nothing here: it receives every bucket (a collective must run on every rank to
the end), then the engine checks the tensors before swapping anything.
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from agentrl.inference.weights import WeightLoadError

__all__ = [
    "ALIGN",
    "BucketLayout",
    "CollectiveBackend",
    "TensorMeta",
    "WeightGroup",
    "WeightGroupError",
    "dtype_from_name",
    "dtype_name",
]

logger = logging.getLogger(__name__)

CollectiveBackend = Literal["gloo", "nccl"]
ALIGN = 16
"""Every tensor starts at a multiple of this many bytes inside its bucket."""
_DTYPES = {
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
}


class WeightGroupError(RuntimeError):
    """Joining the group or a collective on it failed (a peer is gone, or it timed out)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (vLLM's ``dtype_names`` spelling)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any) -> torch.dtype:
    """The inverse of :func:`dtype_name`; :class:`WeightLoadError` for anything else."""
    if not isinstance(name, str) or name not in _DTYPES:
        raise WeightLoadError(f"dtype {name!r:.40} is not supported; use one of {sorted(_DTYPES)}")
    return getattr(torch, name)


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a bucket: its name, dtype, shape and byte range inside the bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class BucketLayout:
    """Tensors cut into buckets of at most ``bucket_bytes`` (see the module docstring)."""

    def __init__(self, buckets: Sequence[Sequence[tuple[str, torch.dtype, Sequence[int]]]]) -> None:
        self.buckets: list[list[TensorMeta]] = []
        for bucket in buckets:
            metas, offset = [], 0
            for name, dtype, shape in bucket:
                nbytes = math.prod(shape) * dtype.itemsize
                metas.append(TensorMeta(name, dtype, tuple(int(d) for d in shape), offset, nbytes))
                offset = _aligned(offset + nbytes)
            self.buckets.append(metas)

    @classmethod
    def plan(cls, state: Mapping[str, torch.Tensor], bucket_bytes: int) -> BucketLayout:
        """Cut ``state`` (in its order) into buckets of at most ``bucket_bytes``."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}; it must be >= 1")
        buckets: list[list[tuple[str, torch.dtype, Sequence[int]]]] = [[]]
        size = 0
        for name, t in state.items():
            nbytes = _aligned(t.numel() * t.element_size())
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, t.dtype, tuple(t.shape)))
            size += nbytes
        return cls([b for b in buckets if b])

    def bucket_bytes(self, i: int) -> int:
        """Size of bucket ``i`` on the wire."""
        last = self.buckets[i][-1]
        return last.offset + last.nbytes

    @property
    def num_bytes(self) -> int:
        """Bytes of every bucket together."""
        return sum(self.bucket_bytes(i) for i in range(len(self.buckets)))

    def to_json(self) -> list[dict[str, list[Any]]]:
        """``[{"names", "dtype_names", "shapes"}, ...]``: what the receive request carries."""
        return [
            {
                "names": [m.name for m in b],
                "dtype_names": [dtype_name(m.dtype) for m in b],
                "shapes": [list(m.shape) for m in b],
            }
            for b in self.buckets
        ]

    @classmethod
    def from_json(cls, raw: Any) -> BucketLayout:
        """Parse :meth:`to_json` output; :class:`WeightLoadError` naming the bad field."""
        if not isinstance(raw, list) or not raw:
            raise WeightLoadError(
                "buckets must be a non-empty list of {names, dtype_names, shapes}"
            )
        buckets = []
        for i, b in enumerate(raw):
            names, dtypes, shapes = (b.get(k) if isinstance(b, dict) else None for k in _FIELDS)
            if not all(isinstance(x, list) for x in (names, dtypes, shapes)) or not (
                len(names) == len(dtypes) == len(shapes) > 0  # type: ignore[arg-type]
            ):
                raise WeightLoadError(
                    f"buckets[{i}] needs lists names, dtype_names and shapes of one length >= 1"
                )
            entries = []
            for name, dt, shape in zip(names, dtypes, shapes, strict=True):  # type: ignore[arg-type]
                if not isinstance(name, str) or not (
                    isinstance(shape, list)
                    and all(
                        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
                    )
                ):
                    raise WeightLoadError(
                        f"buckets[{i}]: bad name {name!r:.80} or shape {shape!r:.80}"
                    )
                entries.append((name, dtype_from_name(dt), shape))
            buckets.append(entries)
        return cls(buckets)

    def unpack(self, i: int, packed: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of bucket ``i`` as views of its received ``uint8`` buffer."""
        for m in self.buckets[i]:
            flat = packed[m.offset : m.offset + m.nbytes]
            yield m.name, flat.view(m.dtype).view(m.shape)

    def pack_into(
        self, i: int, state: Mapping[str, torch.Tensor], out: torch.Tensor
    ) -> torch.Tensor:
        """Copy bucket ``i``'s tensors from ``state`` into ``out[:bucket_bytes(i)]``; or, for a
        bucket of one tensor already on ``out``'s device, that tensor's own bytes (no copy)."""
        metas = self.buckets[i]
        first = state[metas[0].name]
        if len(metas) == 1 and first.is_contiguous() and first.device == out.device:
            return first.reshape(-1).view(torch.uint8)
        buf = out[: self.bucket_bytes(i)]
        for m in metas:
            t = state[m.name]
            buf[m.offset : m.offset + m.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        return buf

    def max_bucket_bytes(self) -> int:
        """The largest bucket (the size of a packing buffer)."""
        return max(self.bucket_bytes(i) for i in range(len(self.buckets)))


_FIELDS = ("names", "dtype_names", "shapes")


class WeightGroup:
    """A standalone process group for weight broadcasts (rank 0 = the trainer, the source).

    Build it with :meth:`host` (the trainer: starts the ``TCPStore``; its ``port`` goes to the
    servers) then :meth:`connect` on every rank (blocks until all ``world_size`` ranks are in,
    at most ``timeout_s``). Every broadcast is bounded by ``timeout_s`` too.
    """

    def __init__(
        self,
        *,
        group_id: str,
        rank: int,
        world_size: int,
        backend: CollectiveBackend,
        address: str,
        port: int,
        timeout_s: float,
        store: Any = None,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}; use 'gloo' (CPU) or 'nccl' (GPU)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}")
        self.group_id = group_id
        self.rank = rank
        self.world_size = world_size
        self.backend: CollectiveBackend = backend
        self.address = address
        self.port = port
        self.timeout_s = float(timeout_s)
        self.broken = False
        """True once a collective failed: the group must not be used again."""
        self._store = store
        self._pg: Any = None

    @classmethod
    def host(
        cls,
        *,
        group_id: str,
        world_size: int,
        backend: CollectiveBackend,
        address: str,
        timeout_s: float,
    ) -> WeightGroup:
        """Rank 0: start the rendezvous store on ``address`` (a free port); :meth:`connect` next."""
        import torch.distributed as dist

        store = dist.TCPStore(
            address,
            0,
            world_size=None,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        return cls(
            group_id=group_id,
            rank=0,
            world_size=world_size,
            backend=backend,
            address=address,
            port=int(store.port),
            timeout_s=timeout_s,
            store=store,
        )

    @property
    def device(self) -> torch.device:
        """Where broadcast buffers live: CPU for gloo, the current CUDA device for NCCL."""
        return torch.device("cpu") if self.backend == "gloo" else torch.device("cuda")

    def connect(self, local_address: str | None = None) -> None:
        """Join the group (every rank; blocks until all are in, or raises :class:`WeightGroupError`).

        ``local_address`` is the interface gloo listens on (default: the store's address)."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
            self.broken = True
            raise WeightGroupError(
                "the weight group's backend is 'nccl' but this process has no CUDA device (or a "
                "torch without NCCL); use backend 'gloo' on CPUs "
                "(checkpoint.collective_backend: gloo)"
            )
        try:
            if self._store is None:
                self._store = dist.TCPStore(
                    self.address,
                    self.port,
                    world_size=None,
                    is_master=False,
                    timeout=timeout,
                    wait_for_workers=False,
                )
            store = dist.PrefixStore(f"agentrl-weights/{self.group_id}/", self._store)
            if self.backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private in the stubs, the documented way to set devices + timeout
                opts._timeout = timeout
                host = local_address or self.address
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
                self._pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
            else:
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(store, self.rank, self.world_size, nccl_opts)
        except (RuntimeError, ValueError, OSError) as e:
            self.broken = True
            raise WeightGroupError(
                f"could not join weight group {self.group_id} as rank {self.rank} of "
                f"{self.world_size} at {self.address}:{self.port} within {self.timeout_s:g}s: {e}"
            ) from e

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting ``tensor`` from rank 0 (in place on the others); returns the work
        to :meth:`wait` on."""
        if self._pg is None or self.broken:
            raise WeightGroupError(f"weight group {self.group_id} is not connected (or broken)")
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            return self._pg.broadcast(tensor, 0, timeout)
        except RuntimeError as e:
            self.broken = True
            raise WeightGroupError(f"broadcast on weight group {self.group_id}: {e}") from e

    def wait(self, work: Any) -> None:
        """Wait for a broadcast started by :meth:`broadcast` (at most ``timeout_s``)."""
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            self.broken = True
            raise WeightGroupError(
                f"broadcast on weight group {self.group_id} failed (a peer died or stalled "
                f"longer than {self.timeout_s:g}s): {e}"
            ) from e

    def close(self) -> None:
        """Forget the group (its sockets close with it); idempotent."""
        self.broken = True
        self._pg = None
        self._store = None

    def describe(self) -> dict[str, Any]:
        """For ``/weight_info`` and logs."""
        return {
            "group_id": self.group_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "backend": self.backend,
            "broken": self.broken,
        }
