"""The pause state machine: ``running`` -> ``draining`` -> ``paused`` -> ``running``.

Why it exists: a weight push pauses the engine, swaps weights, verifies them with a probe and
resumes. Three pause modes serve it: ``keep`` (running requests stay parked in the batch),
``abort`` (they end first, with finish reason ``abort``) and ``wait`` (admit nothing new, let the
running batch finish, then pause). This module holds the state and its transitions; the engine
decides when each one happens.

States and transitions::

    running  --pause(keep|abort)-->  paused
    running  --drain (wait)------->  draining  --the batch is empty-->  paused
    draining --pause(keep|abort)-->  paused
    any      --resume / deadline-->  running   (resume_epoch += 1)

Invariants:

- **a pause always ends**: entering ``draining`` or ``paused`` sets a deadline at most the
  engine's ``max_pause_s`` ahead; past it the engine resumes by itself (:meth:`PauseState.expired`)
  and counts ``pause_expired``;
- every resume (by a caller or by the deadline) increments ``epoch``, so a pending ``wait``
  pause whose requester left cancels only the pause it started (:meth:`PauseState.cancel`);
- while ``paused`` the engine runs control operations (weight loads, probes, aborts) but no
  prefill and no decode step; while ``draining`` it decodes the running batch and admits nothing;
- transitions happen under the engine's condition lock, and a resume notifies it, so the engine
  thread never sleeps through one; ``state`` is one attribute, read without the lock.

(Issue 26's colocated sleep is another state here: paused, with the weights and KV released.)
"""

from __future__ import annotations

import math
import threading
from typing import Literal

from agentrl.inference.engine.request import EngineRequestError

__all__ = ["PauseMode", "PauseState", "PauseStateName"]

PauseMode = Literal["keep", "abort", "wait"]
PauseStateName = Literal["running", "draining", "paused"]


class PauseState:
    """Whether the engine runs, drains toward a pause or is paused; its deadline and epoch.

    Args:
        cond: the engine's condition (its one lock); resumes notify it.
        max_pause_s: the longest any pause lasts (a caller's limit is capped by it).
    """

    def __init__(self, cond: threading.Condition, max_pause_s: float) -> None:
        if not max_pause_s > 0:
            raise ValueError(f"max_pause_s={max_pause_s}; it must be > 0")
        self._cond = cond
        self.max_pause_s = float(max_pause_s)
        self.state: PauseStateName = "running"
        self.deadline = 0.0
        """``time.monotonic()`` after which the pause or drain ends by itself."""
        self.epoch = 0
        """Incremented by every resume (manual or by deadline)."""

    @property
    def paused(self) -> bool:
        """True while paused (no prefill, no decode)."""
        return self.state == "paused"

    @property
    def draining(self) -> bool:
        """True while draining toward a pause (decoding, admitting nothing)."""
        return self.state == "draining"

    @property
    def active(self) -> bool:
        """True while paused or draining (vLLM reports both as paused)."""
        return self.state != "running"

    def limit(self, max_pause_s: float | None) -> float:
        """A caller's pause limit in seconds, capped by :attr:`max_pause_s` (its default);
        :class:`EngineRequestError` (``param="timeout_s"``) unless finite and > 0."""
        if max_pause_s is None:
            return self.max_pause_s
        if not (math.isfinite(max_pause_s) and max_pause_s > 0):
            raise EngineRequestError(f"timeout_s={max_pause_s!r}; use a value > 0", "timeout_s")
        return min(float(max_pause_s), self.max_pause_s)

    def enter(self, now: float, limit: float) -> None:
        """Enter ``paused`` (from any state), ending by itself ``limit`` seconds after ``now``."""
        with self._cond:
            self.state = "paused"
            self.deadline = now + limit

    def drain(self, now: float, limit: float) -> int:
        """Enter ``draining`` unless already paused; (re)set the deadline; returns the epoch."""
        with self._cond:
            if self.state != "paused":
                self.state = "draining"
            self.deadline = now + limit
            return self.epoch

    def drained(self) -> None:
        """The running batch emptied while draining: enter ``paused``."""
        with self._cond:
            if self.state == "draining":
                self.state = "paused"

    def resume(self) -> None:
        """Enter ``running`` now (cancelling a drain) and wake the engine."""
        with self._cond:
            self._resume_locked()

    def cancel(self, epoch: int) -> bool:
        """Resume only if no resume happened since ``epoch`` (a pause whose requester left)."""
        with self._cond:
            if self.epoch != epoch or not self.active:
                return False
            self._resume_locked()
            return True

    def expired(self, now: float) -> bool:
        """If a pause or drain is past its deadline at ``now``, resume; True when it did."""
        if not (self.active and now > self.deadline):
            return False
        self.resume()
        return True

    def _resume_locked(self) -> None:
        self.state = "running"
        self.epoch += 1
        self._cond.notify_all()
