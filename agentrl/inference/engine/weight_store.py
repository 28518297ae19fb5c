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

- a version names one set of weights: :meth:`WeightStore.digest` (sha256 over every name and
  its bytes) is reported with the version, and both change in the same :meth:`WeightStore.apply`;
- versions only grow: a load to a version not greater than the served one is refused
  (:class:`VersionConflict`); only :meth:`WeightStore.rollback` (to the last verified weights)
  and an explicit ``rollback`` relabel go down. Two exceptions start a new sequence: the first
  load of a server (at the version it was launched with: those weights were never pushed), and
  the first load by a new *writer* (a lease taken with a writer id other than the current one:
  a new or resumed trainer run starts its own versions, usually at 0). The writer it replaces
  is fenced: its later leases are refused (409), so two runs never interleave versions;
- the last verified weights are kept (a CPU copy, :meth:`WeightStore.mark_verified`), so a
  failed verify restores them instead of serving the bad ones;
- one writer at a time: while a :class:`PushLease` is held, weight-changing routes need its
  token.

- released weights (a level-2 sleep, :mod:`~agentrl.inference.engine.sleep`) are the last
  verified ones: only served, verified weights may be released, and :meth:`WeightStore.restore`
  re-allocates them from the verified copy before any check, load, probe or wake-up reads them.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.inference.engine.request import INT64_MAX, EngineRequestError
from agentrl.inference.engine.sleep import ParamShapes, release_params, restore_params
from agentrl.inference.lora import LoraMerger, LoraSpec, check_adapter
from agentrl.inference.weights import check_state_dict

__all__ = [
    "MAX_VERSION",
    "PushLease",
    "VersionConflict",
    "WeightStore",
    "WeightUpdate",
    "check_version",
    "state_digest",
]

MAX_VERSION = INT64_MAX
"""Weight versions are integers in ``[0, 2**63 - 1]``."""

FENCED_WRITERS = 64
"""How many replaced writers a server remembers (and refuses)."""


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


class VersionConflict(EngineRequestError):
    """A version that would not move forward, or a push by someone not holding the lease (409)."""


def state_digest(params: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every name and its bytes, in name order: the content digest of a version."""
    h = hashlib.sha256()
    for name, t in sorted(params.items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


class PushLease:
    """At most one weight writer at a time: a holder takes the lease for ``ttl_s`` seconds and
    sends its token with every weight-changing request; anyone else is refused until it is
    released or expires (a trainer that died mid-push cannot block the next one for longer).

    Args:
        clock: monotonic seconds (injected by tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._holder = ""
        self._expires = 0.0
        self.writer = ""
        """The current writer: the id of the last lease taken with one ("" until then)."""
        self.new_writer = False
        """True from a lease taken by a new writer until its first load."""
        self._fenced: deque[str] = deque(maxlen=FENCED_WRITERS)

    def acquire(self, holder: str, ttl_s: float, writer: str = "") -> str:
        """A new token for ``holder``; :class:`VersionConflict` while another holds the lease.

        A non-empty ``writer`` other than the current one takes the server over: its first
        load may take any version (:meth:`WeightStore.check_forward`) and the writer it replaces
        is fenced (its later leases are refused). An empty ``writer`` changes nothing."""
        if not 0 < ttl_s <= 3600:
            raise EngineRequestError(f"ttl_s={ttl_s!r:.40}; send seconds in (0, 3600]", "ttl_s")
        with self._lock:
            now = self.clock()
            if self._token is not None and now < self._expires:
                raise VersionConflict(
                    f"push lease held by {self._holder!r:.80} for {self._expires - now:.1f} s "
                    "more; another weight push is in progress, retry after it finishes",
                    "lease",
                )
            if writer and writer in self._fenced:
                raise VersionConflict(
                    f"writer {writer!r:.80} was replaced by writer {self.writer!r:.80}: another "
                    "run now pushes to this server; give each run its own servers",
                    "writer",
                )
            self._token = secrets.token_hex(16)
            self._holder = holder
            self._expires = now + ttl_s
            if writer and writer != self.writer:
                if self.writer:
                    self._fenced.append(self.writer)
                self.writer = writer
                self.new_writer = True
            return self._token

    def release(self, token: str | None) -> bool:
        """Release the lease if ``token`` holds it (True when it did)."""
        with self._lock:
            if token is None or token != self._token:
                return False
            self._token = None
            return True

    def check(self, token: str | None) -> None:
        """Raise :class:`VersionConflict` unless no live lease is held or ``token`` holds it."""
        with self._lock:
            if self._token is None or self.clock() >= self._expires or token == self._token:
                return
            raise VersionConflict(
                f"push lease held by {self._holder!r:.80}; send its x-push-lease token or "
                "wait for that push to finish",
                "x-push-lease",
            )

    def describe(self) -> dict[str, object] | None:
        """``{"holder", "expires_in_s"}`` while held, else None."""
        with self._lock:
            left = self._expires - self.clock()
            if self._token is None or left <= 0:
                return None
            return {"holder": self._holder, "writer": self.writer, "expires_in_s": round(left, 3)}


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
        self._model = model
        self.params: dict[str, torch.Tensor] = dict(model.state_dict())
        """The model's state dict: the tensors a load copies into."""
        self.version = check_version(version, "weight_version")
        """The version of the weights held now (written by the engine thread only)."""
        self.generation = 0
        """Counts every change of the weights' values (load, rollback, restore): KV computed
        under another generation is stale (the prefix cache checks it)."""
        self.loaded = False
        """True once a push has loaded weights (until then the launch weights may be replaced
        at the launch version)."""
        self.lora = LoraMerger(self.params)
        """The merged LoRA adapter (if any) and the base weights it was merged onto."""
        self.last_load_casts: dict[str, int] = {}
        """Dtype widenings of the last weight load (``{"float16->float32": n}``), reported."""
        self.staging_lock = threading.Lock()
        """Held by whoever fills :meth:`staging_buffer` until the load that reads it is done."""
        self._staging = bytearray()
        self._checksum: str | None = None
        self.lease = PushLease()
        """The push lease: one weight writer at a time."""
        self._verified = {k: v.detach().to("cpu", copy=True) for k, v in self.params.items()}
        self.verified_version = self.version
        """The version of the last verified weights (kept on the CPU for :meth:`rollback`)."""
        self.verified_digest: str | None = None
        self._released: ParamShapes | None = None
        self.before_check: Callable[[], object] = self.restore
        """Run before an update is checked: re-allocates released weights (the engine makes it
        a control operation)."""

    @property
    def released(self) -> bool:
        """True while the served weights are released (a level-2 sleep)."""
        return self._released is not None

    def released_shapes(self) -> ParamShapes:
        """The shapes of the released parameters (empty while the weights are held)."""
        return dict(self._released or {})

    def release(self) -> int:
        """Free the served weights (engine thread; a level-2 sleep); the bytes freed. Refused
        (:class:`VersionConflict`) while a LoRA adapter is merged (the next push is the adapter
        alone: the base must stay; sleep at level 1) or while the served version is not the
        verified one (a wake-up restores the verified weights, which would go back)."""
        if self._released is not None:
            return 0
        if self.lora.spec is not None:
            raise VersionConflict(
                "level=2 releases the weights, but a LoRA adapter is merged and the next push "
                "carries the adapter alone; sleep at level 1",
                "level",
            )
        if self.version != self.verified_version:
            raise VersionConflict(
                f"level=2: the served version {self.version} is not verified (the last verified "
                f"is {self.verified_version}) and a wake-up restores the verified weights; "
                "verify the push first or sleep at level 1",
                "level",
            )
        self._checksum = self.verified_digest or state_digest(self._verified)
        self._released, freed = release_params(self._model)
        self.params.clear()  # in place: the LoRA merger holds this dict
        return freed

    def restore(self) -> bool:
        """Re-allocate released weights and fill them with the last verified ones (engine
        thread); True when there was something to restore."""
        if self._released is None:
            return False
        restore_params(self._model, self._released)
        self.params.update(self._model.state_dict())
        self._released = None
        self.rollback()
        return True

    def release_staging(self) -> int:
        """Drop the staging buffer unless a load holds it (a level-1 sleep); the bytes freed."""
        if not self.staging_lock.acquire(blocking=False):
            return 0
        try:
            freed = len(self._staging)
            self._staging = bytearray()
            return freed
        finally:
            self.staging_lock.release()

    @property
    def state_bytes(self) -> int:
        """Bytes of the model's state dict (tied copies counted once per name; the verified
        copy's while the weights are released)."""
        held = self.params if self._released is None else self._verified
        return sum(t.numel() * t.element_size() for t in held.values())

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
        self.before_check()
        casts = check_state_dict(state_dict, self.params)
        return WeightUpdate(version=version, state=state_dict, casts=casts)

    def check_lora(
        self, adapter: Mapping[str, torch.Tensor], spec: LoraSpec, version: int | None
    ) -> WeightUpdate:
        """A LoRA adapter checked against the served weights (``check_adapter``), as an update;
        raises and changes nothing when it does not fit."""
        if version is not None:
            check_version(version)
        self.before_check()
        plan = check_adapter(adapter, spec, self.params)
        return WeightUpdate(version=version, adapter=plan, spec=spec)

    def apply(self, update: WeightUpdate) -> int:
        """Swap in a checked update (engine thread, between decode steps); the new version."""
        new = self.version + 1 if update.version is None else int(update.version)
        check_version(new)
        self.check_forward(new)
        if update.adapter is not None and update.spec is not None:
            self.lora.apply(update.adapter, update.spec)
        else:
            with torch.no_grad():
                for k, v in update.state.items():
                    self.params[k].copy_(v)
            self.lora.forget()  # the full weights are the new base
        self.version = new
        self.generation += 1
        self.loaded = True
        self.lease.new_writer = False
        self._checksum = None
        self.last_load_casts = update.casts
        return new

    def check_forward(self, version: int) -> None:
        """:class:`VersionConflict` unless ``version`` is greater than the served one (or equal
        to it on the first load of a server, which replaces the weights it was launched with;
        or any version on the first load of a new writer, which starts its own sequence)."""
        if self.lease.new_writer:
            return
        if version < self.version or (version == self.version and self.loaded):
            raise VersionConflict(
                f"version {version} is not greater than the served version {self.version}; "
                "push a higher version (only a rollback goes back)",
                "version",
            )

    def relabel(self, version: int, rollback: bool = False) -> int:
        """Label the served weights ``version`` (engine thread): equal is a no-op, lower needs
        ``rollback``."""
        version = check_version(version)
        if version < self.version and not rollback:
            raise VersionConflict(
                f"version {version} is lower than the served version {self.version}; send "
                '"rollback": true to go back on purpose',
                "version",
            )
        self.version = version
        return version

    def mark_verified(self, version: int) -> str:
        """Keep the served weights as the last verified ones (engine thread); their digest.
        ``version`` must be the served one (a verify of something else proves nothing)."""
        if version != self.version:
            raise VersionConflict(
                f"cannot mark version {version} verified: the server holds version {self.version}",
                "version",
            )
        with torch.no_grad():
            for k, v in self.params.items():
                self._verified[k].copy_(v)
        self.verified_version = version
        self.verified_digest = self.digest()
        return self.verified_digest

    def rollback(self) -> int:
        """Restore the last verified weights and their version (engine thread); the version.
        The restored weights become the LoRA base."""
        with torch.no_grad():
            for k, v in self._verified.items():
                self.params[k].copy_(v)
        self.lora.forget()
        self.generation += 1
        self.version = self.verified_version
        self._checksum = self.verified_digest
        self.last_load_casts = {}
        return self.version

    def digest(self) -> str:
        """The content digest of the served weights (:func:`state_digest`; cached until the
        weights change; engine thread)."""
        if self._checksum is None:
            self._checksum = state_digest(self.params)
        return self._checksum

    def checksum(self) -> str:
        """Same as :meth:`digest` (the older name)."""
        return self.digest()
