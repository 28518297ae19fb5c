"""Bounded-staleness admission and the trajectory buffer between rollout and training.

Two small objects carry the whole asynchronous contract (DESIGN section 3, "Staleness"):

:class:`StalenessBudget` decides whether a new episode may start. With trainer version ``v``,
staleness bound ``η`` and ``B`` trajectories per training step, AReaL's rule admits a new
episode only while ``(η + v + 1) · B > accepted + running``, where ``accepted`` counts every
trajectory that entered the buffer since the start (consumed or not) and ``running`` the
episodes in flight. Because ``v · B`` of the accepted ones have been consumed, at most
``(η + 1) · B`` trajectories can be buffered or in flight at any time, so none can start more
than ``η`` versions before the step that trains on it.

:class:`TrajectoryBuffer` collects scored trajectories into GRPO groups (all samples of one
task share a ``uid``) and hands out whole groups, oldest first.

Invariants (asserted by tests):

- every trajectory put into the buffer is, exactly once, either returned in a batch or counted
  in ``dropped`` with a reason (``stale``, ``uniform_reward``, ``incomplete_group``);
- no returned trajectory has staleness above ``max_staleness`` at the version it is consumed;
- the counters survive :meth:`state_dict` / :meth:`load_state_dict` (resume keeps the staleness
  accounting consistent: AReaL #1388 lost it).

Shutdown: :meth:`TrajectoryBuffer.close` wakes every waiter; a ``get`` on a closed, empty buffer
raises :class:`BufferClosed`.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from agentrl.types import Trajectory

__all__ = ["BufferClosed", "StalenessBudget", "TrajectoryBuffer"]


class BufferClosed(RuntimeError):
    """The buffer was closed and holds no complete group."""


@dataclass
class StalenessBudget:
    """AReaL's admission rule: start an episode only while ``(η + v + 1)·B > accepted + running``.

    ``batch_size`` is B in trajectories (tasks per step × samples per task). The trainer calls
    :meth:`set_version` after every optimizer step; the rollout side calls :meth:`try_admit`
    before starting ``n`` episodes, then :meth:`on_finished` for each (``accepted=False`` when the
    episode's trajectory was dropped before entering the buffer, so it frees its slot).
    """

    max_staleness: int
    batch_size: int
    version: int = 0
    accepted: int = 0
    running: int = 0
    _changed: asyncio.Event | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(
                f"trainer.max_staleness must be >= 0 (got {self.max_staleness}); "
                "0 is synchronous on-policy training"
            )
        if self.batch_size <= 0:
            raise ValueError(f"batch size must be positive (got {self.batch_size})")

    @property
    def capacity(self) -> int:
        """How many more episodes may start now."""
        limit = (self.max_staleness + self.version + 1) * self.batch_size
        return max(0, limit - self.accepted - self.running)

    def try_admit(self, n: int = 1) -> bool:
        """Admit ``n`` episodes at once (a whole GRPO group) if the budget allows it."""
        if n <= self.capacity:
            self.running += n
            return True
        return False

    async def admit(self, n: int = 1) -> None:
        """Wait until ``n`` episodes may start, then admit them."""
        while n > self.capacity:
            changed = self._event()
            changed.clear()
            await changed.wait()
        self.running += n

    def on_finished(self, accepted: bool = True) -> None:
        """An admitted episode ended: it entered the buffer (``accepted``) or was dropped."""
        if self.running <= 0:
            raise RuntimeError("on_finished called with no running episode")
        self.running -= 1
        if accepted:
            self.accepted += 1
        self._notify()

    def set_version(self, version: int) -> None:
        self.version = version
        self._notify()

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        # Every waiter wakes and re-checks its own condition (admission is cheap to evaluate).
        if self._changed is not None:
            self._changed.set()

    def state_dict(self) -> dict[str, int]:
        # Running episodes are not resumable state: after a restart they were lost and must not
        # hold budget, so only the accepted count and version persist.
        return {"version": self.version, "accepted": self.accepted}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.version = int(state["version"])
        self.accepted = int(state["accepted"])
        self.running = 0


class TrajectoryBuffer:
    """Groups scored trajectories by ``uid`` and releases whole groups, oldest first.

    ``group_size`` is the number of samples per task (GRPO's G). A group is complete when it holds
    ``group_size`` trajectories; groups that can never complete (an episode was dropped upstream)
    are released by :meth:`discard_group`.
    """

    def __init__(
        self,
        group_size: int,
        max_staleness: int,
        *,
        drop_uniform_reward_groups: bool = False,
    ) -> None:
        if group_size <= 0:
            raise ValueError(f"data.n_samples (group size) must be positive (got {group_size})")
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.drop_uniform_reward_groups = drop_uniform_reward_groups
        self._partial: dict[str, list[Trajectory]] = {}
        self._ready: OrderedDict[str, list[Trajectory]] = OrderedDict()
        self._cond = asyncio.Condition()
        self._closed = False
        self.put_count = 0
        self.consumed = 0
        self.dropped: Counter[str] = Counter()

    # ---- producer side ----------------------------------------------------------------------
    async def put(self, traj: Trajectory) -> None:
        async with self._cond:
            self.put_count += 1
            group = self._partial.setdefault(traj.uid, [])
            group.append(traj)
            if len(group) >= self.group_size:
                del self._partial[traj.uid]
                self._ready[traj.uid] = group
                self._cond.notify_all()

    async def discard_group(self, uid: str, reason: str = "incomplete_group") -> int:
        """Drop a partial group that can never complete; returns how many trajectories it held."""
        async with self._cond:
            group = self._partial.pop(uid, [])
            self.dropped[reason] += len(group)
            return len(group)

    async def close(self) -> None:
        async with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- consumer side ----------------------------------------------------------------------
    def ready_groups(self) -> int:
        return len(self._ready)

    async def get_groups(self, num_groups: int, current_version: int) -> list[list[Trajectory]]:
        """Wait for ``num_groups`` usable groups at trainer version ``current_version``.

        Groups with any trajectory staler than ``max_staleness`` are dropped (counted as
        ``stale``); with ``drop_uniform_reward_groups`` (dynamic sampling), groups whose rewards
        are all equal carry no GRPO signal and are dropped (counted as ``uniform_reward``).
        """
        out: list[list[Trajectory]] = []
        async with self._cond:
            while len(out) < num_groups:
                while not self._ready:
                    if self._closed:
                        raise BufferClosed(
                            f"buffer closed with {len(out)}/{num_groups} groups collected"
                        )
                    await self._cond.wait()
                _, group = self._ready.popitem(last=False)
                reason = self._rejection_reason(group, current_version)
                if reason is not None:
                    self.dropped[reason] += len(group)
                    continue
                out.append(group)
                self.consumed += len(group)
        return out

    def _rejection_reason(self, group: list[Trajectory], version: int) -> str | None:
        if any(t.staleness(version) > self.max_staleness for t in group):
            return "stale"
        if self.drop_uniform_reward_groups and len({t.reward for t in group}) == 1:
            return "uniform_reward"
        return None

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "async/buffer_ready_groups": float(len(self._ready)),
            "async/buffer_partial_groups": float(len(self._partial)),
            "async/consumed_total": float(self.consumed),
        }
        for reason in ("stale", "uniform_reward", "incomplete_group"):
            out[f"async/dropped_{reason}_total"] = float(self.dropped[reason])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "put_count": self.put_count,
            "consumed": self.consumed,
            "dropped": dict(self.dropped),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.put_count = int(state["put_count"])
        self.consumed = int(state["consumed"])
        self.dropped = Counter({k: int(v) for k, v in state["dropped"].items()})
