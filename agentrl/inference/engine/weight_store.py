"""The weights the engine serves, their version, and the memory new weights arrive in.

Why it exists: every way weights reach the engine (a state dict, safetensors on disk, an HTTP
body, a URL, a LoRA adapter, a collective broadcast) ends in the same two steps: check the update
completely against the served weights, then swap weights and version together between two decode
steps. This module owns what those steps touch: the model's parameters (shared with the model,
copied into in place), the version, the merged LoRA adapter and its base weights, the cached
checksum, and the reused staging buffer.

Invariants:

- an update is checked completely (:meth:`WeightStore.check_full`, :meth:`WeightStore.check_lora`:
  names, shapes, dtypes equal or losslessly widened, finite values, every parameter present but
  tied copies, a valid version) before anything is copied; a checked update is a
  :class:`WeightUpdate`;
- :meth:`WeightStore.apply` runs only on the engine thread between decode steps (a control
  operation), so a forward never sees half-swapped weights; it changes the weights, the version,
  the checksum cache and the reported casts together, or (an invalid resulting version) nothing;
- a LoRA adapter is merged onto the kept base weights, never onto a previous merge; a full load
  makes the loaded weights the new base;
- versions are ints in ``[0, MAX_VERSION]``;
- the staging buffer is filled and read only by whoever holds :attr:`WeightStore.staging_lock`.

(Issue 21 adds a content digest to :class:`WeightUpdate`, monotonic versions and the last
verified weights to roll back to, all applied by :meth:`WeightStore.apply`; issue 26 releases
and re-allocates this memory around a colocated trainer step.)
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.inference.engine.request import INT64_MAX, EngineRequestError
from agentrl.inference.lora import LoraMerger, LoraSpec, check_adapter
from agentrl.inference.weights import check_state_dict

__all__ = ["MAX_VERSION", "WeightStore", "WeightUpdate", "check_version"]

MAX_VERSION = INT64_MAX
"""Weight versions are integers in ``[0, 2**63 - 1]``."""


def check_version(version: Any, param: str = "version") -> int:
    """``version`` as an int in ``[0, MAX_VERSION]``, else :class:`EngineRequestError`."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise EngineRequestError(
            f"{param}={version!r:.60} is not an integer; versions are 0, 1, 2, ...", param
        )
    if not 0 <= version <= MAX_VERSION:
        raise EngineRequestError(
            f"{param}={str(version)[:40]} is outside [0, 2**63 - 1]; versions are 0, 1, 2, ...",
            param,
        )
    return version


@dataclass(frozen=True)
class WeightUpdate:
    """A checked weight update waiting to be applied: full weights or a LoRA adapter."""

    version: int | None
    """The version it becomes (None: the current one + 1)."""
    state: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Full weights by parameter name (empty for an adapter)."""
    casts: dict[str, int] = field(default_factory=dict)
    """Dtype widenings the load applies (``{"float16->float32": n}``), reported."""
    adapter: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    """A LoRA adapter's ``{weight name: (A, B)}`` (from ``check_adapter``)."""
    spec: LoraSpec | None = None
    """The adapter's spec; set exactly when ``adapter`` is."""


class WeightStore:
    """The served weights (shared with ``model``), their version, LoRA base and staging buffer.

    Args:
        model: the served ``torch.nn.Module``; its ``state_dict()`` tensors are copied into.
        version: the version of the weights it holds now.
    """

    def __init__(self, model: Any, version: int) -> None:
        self.params: dict[str, torch.Tensor] = dict(model.state_dict())
        """The model's state dict: the tensors a load copies into."""
        self.version = check_version(version, "weight_version")
        """The version of the weights held now (written by the engine thread only)."""
        self.lora = LoraMerger(self.params)
        """The merged LoRA adapter (if any) and the base weights it was merged onto."""
        self.last_load_casts: dict[str, int] = {}
        """Dtype widenings of the last weight load (``{"float16->float32": n}``), reported."""
        self.staging_lock = threading.Lock()
        """Held by whoever fills :meth:`staging_buffer` until the load that reads it is done."""
        self._staging = bytearray()
        self._checksum: str | None = None

    @property
    def state_bytes(self) -> int:
        """Bytes of the model's state dict (tied copies counted once per name)."""
        return sum(t.numel() * t.element_size() for t in self.params.values())

    def staging_buffer(self, num_bytes: int) -> memoryview:
        """A reusable buffer of ``num_bytes`` for receiving weights (hold :attr:`staging_lock`).

        Reused across pushes, so its pages are already mapped: writing into fresh memory costs
        more than the copy itself (page faults).
        """
        if len(self._staging) < num_bytes:
            self._staging = bytearray(num_bytes)
        return memoryview(self._staging)[:num_bytes]

    def check_full(
        self, state_dict: Mapping[str, torch.Tensor], version: int | None
    ) -> WeightUpdate:
        """Full weights checked against the served ones (``check_state_dict``), as an update;
        raises :class:`~agentrl.inference.weights.WeightLoadError` or
        :class:`EngineRequestError` (the version) and changes nothing."""
        if version is not None:
            check_version(version)
        casts = check_state_dict(state_dict, self.params)
        return WeightUpdate(version=version, state=state_dict, casts=casts)

    def check_lora(
        self, adapter: Mapping[str, torch.Tensor], spec: LoraSpec, version: int | None
    ) -> WeightUpdate:
        """A LoRA adapter checked against the served weights (``check_adapter``), as an update;
        raises and changes nothing when it does not fit."""
        if version is not None:
            check_version(version)
        plan = check_adapter(adapter, spec, self.params)
        return WeightUpdate(version=version, adapter=plan, spec=spec)

    def apply(self, update: WeightUpdate) -> int:
        """Swap in a checked update (engine thread, between decode steps); the new version."""
        new = self.version + 1 if update.version is None else int(update.version)
        check_version(new)
        if update.adapter is not None and update.spec is not None:
            self.lora.apply(update.adapter, update.spec)
        else:
            with torch.no_grad():
                for k, v in update.state.items():
                    self.params[k].copy_(v)
            self.lora.forget()  # the full weights are the new base
        self.version = new
        self._checksum = None
        self.last_load_casts = update.casts
        return new

    def checksum(self) -> str:
        """sha256 over every name and its bytes, in name order (cached until the weights change;
        engine thread)."""
        if self._checksum is None:
            h = hashlib.sha256()
            for name, t in sorted(self.params.items()):
                h.update(name.encode())
                h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().data)
            self._checksum = h.hexdigest()
        return self._checksum
