"""The trajectory buffer between rollout and training (the consumer half of bounded staleness).

Admission (whether a new episode may start: AReaL's rule ``(η + v + 1) · B > accepted +
running``) lives in :class:`agentrl.rollout.manager.StalenessAdmission`, the one
implementation; this buffer enforces the other half: no group staler than ``η`` is trained on.

:class:`TrajectoryBuffer` collects scored trajectories into GRPO groups (all samples of one
task share a ``uid``) and hands out whole groups, oldest policy first: the ready group whose
oldest sampled token is the oldest goes first (ties in completion order). Completion order
alone starved the slow groups (multi-turn, tool-calling episodes finish last, and a partial
rollout counts from its first token), so they went stale and were dropped while faster,
tool-free ones filled the batches: a drop that selected on the very behaviour being learned.

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
from typing import Any

from agentrl.types import Trajectory

__all__ = ["BufferClosed", "TrajectoryBuffer"]


class BufferClosed(RuntimeError):
    """The buffer was closed and holds no complete group."""


class TrajectoryBuffer:
    """Groups scored trajectories by ``uid`` and releases whole groups, oldest policy first.

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
        self._dropped_task_ids: list[str] = []
        self._discarded: dict[str, int] = {}
        """uid of a discarded group -> members still to arrive (dropped on arrival)."""

    # ---- producer side ----------------------------------------------------------------------
    async def put(self, traj: Trajectory) -> bool:
        """Add a scored trajectory; False when its group was discarded (it is counted dropped)."""
        async with self._cond:
            self.put_count += 1
            if traj.uid in self._discarded:
                self._late_member(traj.uid)
                self.dropped["incomplete_group"] += 1
                return False
            group = self._partial.setdefault(traj.uid, [])
            group.append(traj)
            if len(group) >= self.group_size:
                del self._partial[traj.uid]
                self._ready[traj.uid] = group
                self._cond.notify_all()
            return True

    def discard_group_nowait(self, uid: str, task_id: str) -> int:
        """One episode of group ``uid`` ended without a trajectory (a counted drop upstream):
        the group can never complete. Drops what it holds and every member that arrives later
        (counted ``incomplete_group``); returns how many trajectories were dropped now.

        Synchronous (callable from the manager's ``on_finished`` hook on the event loop): it
        adds no ready group, so no waiter needs waking.
        """
        if uid in self._discarded:
            self._late_member(uid)  # another member of an already discarded group: no trajectory
            return 0
        group = self._partial.pop(uid, [])
        self._discarded[uid] = self.group_size - len(group) - 1
        self.dropped["incomplete_group"] += len(group)
        self._dropped_task_ids.append(task_id)
        if self._discarded[uid] <= 0:
            del self._discarded[uid]
        return len(group)

    def _late_member(self, uid: str) -> None:
        self._discarded[uid] -= 1
        if self._discarded[uid] <= 0:
            del self._discarded[uid]

    async def discard_group(self, uid: str, reason: str = "incomplete_group") -> int:
        """Drop a partial group that can never complete; returns how many trajectories it held."""
        async with self._cond:
            group = self._partial.pop(uid, [])
            self.dropped[reason] += len(group)
            if group:
                self._dropped_task_ids.append(group[0].task_id)
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
                group = self._ready.pop(self._oldest_ready())
                reason = self._rejection_reason(group, current_version)
                if reason is not None:
                    self.dropped[reason] += len(group)
                    self._dropped_task_ids.append(group[0].task_id)
                    continue
                out.append(group)
                self.consumed += len(group)
        return out

    def _oldest_ready(self) -> str:
        """The uid of the ready group sampled by the oldest policy (first completed on ties)."""
        return min(self._ready, key=lambda uid: _oldest_version(self._ready[uid]))

    def _rejection_reason(self, group: list[Trajectory], version: int) -> str | None:
        if any(t.staleness(version) > self.max_staleness for t in group):
            return "stale"
        if self.drop_uniform_reward_groups and len({t.reward for t in group}) == 1:
            return "uniform_reward"
        return None

    def pop_dropped_task_ids(self) -> list[str]:
        """Task ids of the groups dropped since the last call (one entry per dropped group)."""
        out, self._dropped_task_ids = self._dropped_task_ids, []
        return out

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


def _oldest_version(group: list[Trajectory]) -> int:
    versions = [v for v in (t.min_version for t in group) if v is not None]
    return min(versions) if versions else 0
