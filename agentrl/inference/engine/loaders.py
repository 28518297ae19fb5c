"""Weight loaders: every way new weights reach the engine, each ending in one checked update.

Why it exists: the trainer pushes weights over several transports (a shared directory, an HTTP
body, a URL served by the trainer's :class:`~agentrl.inference.weights.WeightServer`, a
collective broadcast) and as full weights or a LoRA adapter. Each loader here turns its source
into tensors, has the :class:`~agentrl.inference.engine.weight_store.WeightStore` check them,
and hands the checked :class:`~agentrl.inference.engine.weight_store.WeightUpdate` to ``apply``:
the engine's control operation that swaps weights and version between two decode steps.

Invariants:

- reading and checking run in the caller's thread, so decoding goes on meanwhile; only the swap
  waits for the engine thread;
- nothing changes unless the whole update was read and checked: a short read, a file that is
  not safetensors, a failed broadcast or a tensor that does not fit raises before ``apply``;
- bytes are received into the store's reused staging buffer and read as views of it; the buffer
  stays locked (``staging_lock``) until the load that reads it returns, and a second load while
  it is held is refused at once (:class:`VersionConflict`, a 409), never queued: queued loads
  held the server's worker threads that ``/pause`` and ``/weight_info`` need;
- a safetensors file whose metadata carries a LoRA spec, or a directory with peft's
  ``adapter_config.json``, is an adapter; anything else is full weights;
- the server is in at most one weight group; joining one leaves the previous, a broadcast that
  fails leaves it (the trainer rebuilds it at the next push), and ``group_lock`` serializes
  joining, leaving and receiving.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from agentrl.inference.collective import ALIGN, BucketLayout, WeightGroup, WeightGroupError
from agentrl.inference.engine.request import EngineRequestError
from agentrl.inference.engine.weight_store import (
    VersionConflict,
    WeightStore,
    WeightUpdate,
    check_version,
)
from agentrl.inference.lora import ADAPTER_CONFIG, METADATA_KEY, LoraSpec
from agentrl.inference.weights import (
    MAX_HEADER_BYTES,
    WeightLoadError,
    fetch_into,
    parse_safetensors,
    safetensors_metadata,
)

__all__ = ["WeightLoader"]

log = logging.getLogger(__name__)


class WeightLoader:
    """Loads weights from each source into ``store``, through ``apply``.

    Args:
        store: the served weights (checks, staging buffer).
        device: where the weights live (a broadcast lands there directly off the CPU).
        apply: swaps a checked update in between decode steps; returns the new version.
    """

    def __init__(
        self, store: WeightStore, device: torch.device, apply: Callable[[WeightUpdate], int]
    ) -> None:
        self.store = store
        self.device = device
        self._apply = apply
        self.group: WeightGroup | None = None
        """The :class:`~agentrl.inference.collective.WeightGroup` this server joined, if any."""
        self.group_lock = threading.Lock()
        """Serializes joining the weight group and receiving on it."""

    # ---- tensors in memory --------------------------------------------------------------------
    def load_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], version: int | None = None
    ) -> int:
        """Check full weights completely, then swap them in; returns the new version."""
        update = self.store.check_full(state_dict, version)
        if update.casts:
            log.warning("weight update widened dtypes losslessly: %s", update.casts)
        return self._apply(update)

    def load_lora(
        self, adapter: Mapping[str, torch.Tensor], spec: LoraSpec, version: int | None = None
    ) -> int:
        """Check a LoRA adapter completely, then merge it onto the base weights; the version."""
        return self._apply(self.store.check_lora(adapter, spec, version))

    def load_update(
        self,
        state: Mapping[str, torch.Tensor],
        version: int | None = None,
        lora: LoraSpec | None = None,
    ) -> int:
        """:meth:`load_lora` when ``lora`` is given, else :meth:`load_state_dict`."""
        if lora is not None:
            return self.load_lora(state, lora, version)
        return self.load_state_dict(state, version)

    # ---- safetensors bytes --------------------------------------------------------------------
    def load_safetensors(
        self, buf: bytearray | memoryview, version: int | None = None, *, what: str = "the body"
    ) -> int:
        """Load a safetensors file held in ``buf`` (hold ``staging_lock`` when it is the staging
        buffer): a LoRA adapter when its metadata carries one (:data:`METADATA_KEY`), else full
        weights."""
        try:
            state = parse_safetensors(buf)
            raw = safetensors_metadata(buf).get(METADATA_KEY)
        except WeightLoadError as e:
            raise WeightLoadError(f"{what} is not a valid safetensors file: {e}") from e
        lora = LoraSpec.from_json(raw, f"{what}: {METADATA_KEY}") if raw is not None else None
        return self.load_update(state, version, lora)

    @contextlib.contextmanager
    def _staging(self) -> Iterator[None]:
        """Hold the staging buffer for one load, or refuse at once while another load holds it."""
        if not self.store.staging_lock.acquire(blocking=False):
            raise VersionConflict(
                "another weight update is in progress; retry after it finishes", "staging"
            )
        try:
            yield
        finally:
            self.store.staging_lock.release()

    def load_weights_from_path(self, path: str | Path, version: int | None = None) -> int:
        """Load every ``*.safetensors`` file of a directory (or one file), read into the staging
        buffer. A directory with peft's ``adapter_config.json`` is a LoRA adapter."""
        if version is not None:
            check_version(version)
        p = Path(path)
        lora = _adapter_spec(p)
        try:
            files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
            sizes = [f.stat().st_size for f in files if f.is_file()]
        except OSError as e:
            raise WeightLoadError(f"cannot read weights at {str(p)!r}: {e.strerror}") from e
        if not files or len(sizes) != len(files):
            raise WeightLoadError(
                f"no safetensors weights at {str(p)!r}; pass a directory holding *.safetensors "
                "files (e.g. one written by save_pretrained) or a .safetensors file"
            )
        with self._staging():
            buf = self.store.staging_buffer(sum(sizes))
            state: dict[str, torch.Tensor] = {}
            offset = 0
            for f, size in zip(files, sizes, strict=True):
                part = buf[offset : offset + size]
                raw = _read_file_into(f, part, state)
                if lora is None and raw is not None:
                    lora = LoraSpec.from_json(raw, f"{f.name!r}: {METADATA_KEY}")
                offset += size
            return self.load_update(state, version, lora)

    def load_weights_from_url(
        self, url: str, version: int | None = None, *, timeout_s: float = 60.0
    ) -> int:
        """Pull a safetensors file over plain HTTP straight into the staging buffer (one
        ``readinto``, no per-chunk work; see :class:`~agentrl.inference.weights.WeightServer`),
        then load it."""
        if version is not None:
            check_version(version)
        with self._staging():
            buf = fetch_into(
                url,
                self.store.staging_buffer,
                max_bytes=self.store.state_bytes + MAX_HEADER_BYTES,
                timeout_s=timeout_s,
            )
            return self.load_safetensors(buf, version, what="the fetched weights")

    def load_weights_from_bytes(self, data: bytes | bytearray, version: int | None = None) -> int:
        """Load a serialized safetensors blob (an HTTP body), copied into the staging buffer."""
        with self._staging():
            buf = self.store.staging_buffer(len(data))
            buf[:] = data
            return self.load_safetensors(buf, version, what="the body")

    # ---- the collective transport (a weight group) --------------------------------------------
    def join_weight_group(self, group: WeightGroup, local_address: str | None = None) -> None:
        """Join ``group`` (blocks until every rank is in, at most its timeout), leaving any group
        joined before. Raises :class:`~agentrl.inference.collective.WeightGroupError`."""
        if group.backend == "nccl" and self.device.type != "cuda":
            raise WeightLoadError(
                f"backend 'nccl' needs the server's weights on a GPU; this server runs on "
                f"{self.device}: use backend 'gloo' (checkpoint.collective_backend: gloo)"
            )
        with self.group_lock:
            old, self.group = self.group, None
            if old is not None:
                old.close()
            group.connect(local_address)
            self.group = group

    def leave_weight_group(self) -> bool:
        """Leave the weight group (True when there was one)."""
        with self.group_lock:
            old, self.group = self.group, None
        if old is not None:
            old.close()
        return old is not None

    def receive_weights(
        self,
        group_id: str,
        layout: BucketLayout,
        version: int | None = None,
        lora: LoraSpec | None = None,
    ) -> int:
        """Receive every bucket of ``layout`` broadcast on the weight group ``group_id``, then load
        them (:meth:`load_update`: checked before anything is swapped); returns the new version.

        A wrong ``group_id`` is an :class:`EngineRequestError` (``param="group_id"``); a failed
        broadcast breaks and leaves the group (:class:`~agentrl.inference.collective.WeightGroupError`;
        the trainer rebuilds it at the next push) and changes nothing."""
        if version is not None:
            check_version(version)
        starts = _bucket_starts(layout)
        if starts[-1] > self.store.state_bytes + MAX_HEADER_BYTES:
            raise WeightLoadError(
                f"{starts[-1]} bytes cannot be this model's weights (<= {self.store.state_bytes})"
            )
        with self.group_lock, self.store.staging_lock:
            group = self._joined(group_id)
            if self.device.type == "cpu":
                flat = torch.frombuffer(self.store.staging_buffer(starts[-1]), dtype=torch.uint8)
            else:
                flat = torch.empty(starts[-1], dtype=torch.uint8, device=self.device)
            state: dict[str, torch.Tensor] = {}
            try:
                for i in range(len(layout.buckets)):
                    bucket = flat[starts[i] : starts[i] + layout.bucket_bytes(i)]
                    group.wait(group.broadcast(bucket))
                    state.update(layout.unpack(i, bucket))
            except WeightGroupError:
                self.group = None
                group.close()
                raise
            return self.load_update(state, version, lora)

    def _joined(self, group_id: str) -> WeightGroup:
        """The group joined, if it is ``group_id``; else :class:`EngineRequestError`."""
        group = self.group
        if group is None or group.group_id != group_id:
            have = None if group is None else group.group_id
            raise EngineRequestError(
                f"this server is in weight group {have!r}, not {group_id!r}; join it first",
                "group_id",
            )
        return group


def _bucket_starts(layout: BucketLayout) -> list[int]:
    """Byte offset of each bucket in one flat buffer (aligned to ``ALIGN``), then the total."""
    starts = [0]
    for i in range(len(layout.buckets)):
        starts.append(-(-(starts[-1] + layout.bucket_bytes(i)) // ALIGN) * ALIGN)
    return starts


def _read_file_into(f: Path, part: memoryview, state: dict[str, torch.Tensor]) -> str | None:
    """Read safetensors file ``f`` into ``part`` (exactly its size) and add its tensors (views of
    ``part``) to ``state``; returns its LoRA metadata, if any."""
    try:
        with f.open("rb") as fh:
            got = fh.readinto(part)
    except OSError as e:
        raise WeightLoadError(f"cannot read {f.name!r}: {e.strerror}") from e
    if got != len(part):
        raise WeightLoadError(f"{f.name!r} changed while being read; push again")
    try:
        state.update(parse_safetensors(part))
        return safetensors_metadata(part).get(METADATA_KEY)
    except WeightLoadError as e:
        raise WeightLoadError(f"{f.name!r} is not a valid safetensors file: {e}") from e


def _adapter_spec(path: Path) -> LoraSpec | None:
    """The :class:`LoraSpec` of a peft adapter directory (``adapter_config.json``), else None."""
    cfg = path / ADAPTER_CONFIG if path.is_dir() else None
    if cfg is None or not cfg.is_file():
        return None
    try:
        raw = cfg.read_text()
    except OSError as e:
        raise WeightLoadError(f"cannot read {str(cfg)!r}: {e.strerror}") from e
    return LoraSpec.from_json(raw, f"{str(cfg)!r}")
