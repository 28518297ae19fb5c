"""Admission: when an episode may start (the staleness budget), and the key of each episode.

Why it exists: in asynchronous RL the rollouts may run ahead of the weights only so far. The
trainer's rule for that lives here, apart from the manager that applies it: the manager asks an
:class:`AdmissionController` before every episode and tells it when each one ends.

Invariants (what is always true, given the manager's calls described in
:class:`AdmissionController`):

- admission is atomic: ``may_start()`` is checked and ``on_admitted(key)`` called in the same
  event-loop step, so a rule like AReaL's ``(η + v + 1) · batch_size > accepted + running``
  (:class:`StalenessAdmission`) is never overshot;
- ``on_admitted`` is called exactly once per admitted episode and ``on_finished`` exactly once
  after it (with the trajectory, or ``None`` for a drop), whatever the episode's end;
- hooks never block; the manager logs and counts their exceptions (``rollout/hook_errors``).

Example::

    admission = StalenessAdmission(batch_size=32, max_staleness=1)
    manager = AgentLoopManager(policy, tokenizer, admission=admission, ...)
    ...
    admission.set_version(v + 1)   # after each weight push: one more batch may start
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agentrl.types import Trajectory

__all__ = ["AdmissionController", "AlwaysAdmit", "EpisodeKey", "StalenessAdmission"]


@dataclass(frozen=True)
class EpisodeKey:
    """Identifies one admitted episode."""

    uid: str
    index: int
    task_id: str


@runtime_checkable
class AdmissionController(Protocol):
    """The trainer's hook on when episodes may start (the staleness budget).

    The manager calls, per episode: ``await wait_for_admission()`` (returns when ``may_start()``
    is likely true), then ``may_start()`` (re-checked; if false it waits again), then, in the
    same event-loop step, ``on_admitted(key)``; when the episode ends, ``on_finished(key, traj)``
    (``traj`` is ``None`` for a drop). Hooks must not block; exceptions in ``on_*`` are logged
    and counted (``rollout/hook_errors``).
    """

    def may_start(self) -> bool:
        """True when one more episode may start now."""
        ...

    async def wait_for_admission(self) -> None:
        """Return when ``may_start()`` is likely true (the manager re-checks)."""
        ...

    def on_admitted(self, key: EpisodeKey) -> None:
        """Episode ``key`` was admitted (same event-loop step as ``may_start()``)."""
        ...

    def on_finished(self, key: EpisodeKey, traj: Trajectory | None) -> None:
        """Episode ``key`` ended: with ``traj``, or ``None`` for a drop."""
        ...


class AlwaysAdmit:
    """No staleness budget: admit whenever a concurrency slot is free."""

    def may_start(self) -> bool:
        """Always true."""
        return True

    async def wait_for_admission(self) -> None:
        """Returns at once."""
        return None

    def on_admitted(self, key: EpisodeKey) -> None:
        """Nothing to record."""
        return None

    def on_finished(self, key: EpisodeKey, traj: Trajectory | None) -> None:
        """Nothing to record."""
        return None


class StalenessAdmission:
    """AReaL's admission rule: start an episode only while ``(η + v + 1) · B > accepted + running``.

    ``η`` = ``max_staleness``, ``v`` = the trainer's weight version (``set_version``), ``B`` =
    ``batch_size`` (episodes per trainer step). ``running`` counts admitted, unfinished episodes;
    ``accepted`` counts finished ones. The trainer calls ``set_version(v)`` after each weight
    push, and ``reject(n)`` for finished episodes it threw away (e.g. too stale) so that they are
    replaced. With η = 0 this is synchronous training: at most one batch per version.

    ``warmup`` > 0 ramps η up over the first ``warmup`` versions: the bound at version ``v`` is
    ``min(η, ⌊v · η / warmup⌋)``, so the first updates, which move the policy most, train on
    fresher samples.
    """

    def __init__(
        self, batch_size: int, max_staleness: int = 0, version: int = 0, warmup: int = 0
    ) -> None:
        if batch_size < 1 or max_staleness < 0 or warmup < 0:
            raise ValueError(
                f"StalenessAdmission(batch_size={batch_size}, max_staleness={max_staleness}, "
                f"warmup={warmup}): batch_size must be >= 1, max_staleness and warmup >= 0"
            )
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.warmup = warmup
        self.version = version
        self.accepted = 0
        self.running = 0
        self.held = False
        """True while :meth:`hold` stops every start (colocated mode: the servers sleep)."""
        self._changed = asyncio.Event()

    @property
    def staleness_bound(self) -> int:
        """η at the current version (``max_staleness`` once the warmup is over)."""
        if self.warmup and self.version < self.warmup:
            return self.version * self.max_staleness // self.warmup
        return self.max_staleness

    @property
    def capacity(self) -> int:
        """Episodes that may still start now."""
        limit = (self.staleness_bound + self.version + 1) * self.batch_size
        return limit - (self.accepted + self.running)

    def may_start(self) -> bool:
        """True while the budget has room (``capacity > 0``) and nothing holds admission."""
        return self.capacity > 0 and not self.held

    def hold(self) -> None:
        """Start no episode until :meth:`release` (running ones go on)."""
        self.held = True

    def release(self) -> None:
        """End a :meth:`hold`."""
        self.held = False
        self._changed.set()

    async def wait_for_admission(self) -> None:
        """Wait until the budget has room (a version bump, a finish or a reject)."""
        while not self.may_start():
            self._changed.clear()
            await self._changed.wait()

    def on_admitted(self, key: EpisodeKey) -> None:
        """Count the episode as running."""
        self.running += 1

    def on_finished(self, key: EpisodeKey, traj: Trajectory | None) -> None:
        """Move the episode from running to accepted (a drop just stops running)."""
        self.running -= 1
        if traj is not None:
            self.accepted += 1
        self._changed.set()

    def set_version(self, version: int) -> None:
        """The trainer pushed weight version ``version`` (the budget grows a batch per version)."""
        self.version = version
        self._changed.set()

    def reject(self, n: int = 1) -> None:
        """``n`` finished episodes were thrown away by the trainer: admit as many replacements."""
        self.accepted -= n
        self._changed.set()
