"""A local run's own inference servers under faults: the dead one is ejected, restarted, and
rejoins only at the trainer's current weight version, verified.

Why it exists: ``agentrl train`` launches its servers itself (``inference.backend`` embedded or
vLLM). One that died mid-run (SIGKILL, OOM) failed the next weight push and stopped the run.
The run's servers are now watched by the same
:class:`~agentrl.serving.supervisor.ServerSupervisor` as the rollout service's; this module is
the trainer's side of it: which servers a push reaches, and when a restarted one joins.

Guarantees:

- a dead server leaves the pool at once; its requests in flight fail and the pool retries them
  on another server (an episode is a trajectory or a counted drop, never lost or run twice);
  the next pushes reach the live servers only, and the push report lists the dead one under
  ``ejected`` with its reason, never as failed;
- a restarted server (at most ``inference.max_server_restarts`` times per server, counted)
  starts on ``model.path``'s weights: it is added to the next push and joins the pool only
  when that push loaded, set and verified the trainer's version on it. Between pushes the
  actor's weights may be mid-update, so a push is the one moment there is a "current version"
  to give it (the Ray run's registry does the same). A server that fails that push stays out
  and is tried again at the following one;
- a push with no live server waits for a restarted one (``inference.wait_for_server_s``); once
  every server failed for good the run stops with :class:`~agentrl.training.loop.RunFailed`
  naming each server and why, whether it was pushing or waiting for a batch;
- ``servers/{ejected,restarts,rejoined}`` (since the start) and ``servers/{serving,failed}``
  (now) are logged every step; the log says each ejection, restart and rejoin.

Shutdown: :func:`watch_servers` stops the watchers and the servers restarted here; the servers
``build_serving`` launched are stopped by its exit stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from agentrl.inference.client import PolicyClient
from agentrl.serving.supervisor import ServerSupervisor, Slot
from agentrl.training.errors import RunFailed
from agentrl.weightsync.engine import PushReport, ScoreFn

__all__ = ["RunServers", "watch_servers"]

logger = logging.getLogger(__name__)

Pending = dict[str, tuple[PolicyClient, Callable[[], None]]]
"""``{url: (client, join)}``: restarted servers that join at the next verified push."""


class RunServers:
    """The run's servers for its pushes (module docstring); ``push`` is the engine's call."""

    def __init__(self, run: Any, supervisor: ServerSupervisor | None = None) -> None:
        inf = run.cfg.inference
        self.engine = run.engine
        self.wait_for_server_s = float(inf.wait_for_server_s)
        self.logs = f"{run.cfg.trainer.output_dir}/logs"
        self.supervisor = supervisor or ServerSupervisor(
            run, max_restarts=inf.max_server_restarts, interval_s=inf.health_check_interval_s
        )
        self.supervisor.on_failed = self._slot_failed
        self._pending: Pending = {}
        self._on_lost: list[Callable[[str], None]] = []
        self._lock = asyncio.Lock()

    def start(self) -> None:
        """Watch every server (needs a running event loop)."""
        self.supervisor.start(self.catch_up)

    async def aclose(self) -> None:
        """Stop watching; stop the servers restarted here."""
        await self.supervisor.aclose()

    async def catch_up(self, client: PolicyClient, join: Callable[[], None]) -> str | None:
        """The supervisor's :data:`~agentrl.serving.supervisor.CatchUp`: the server joins at
        the next push that verifies it (arranged: None)."""
        if client.base_url not in self._pending:
            logger.info(
                "server at %s is up again: it joins at the next weight push", client.base_url
            )
        self._pending[client.base_url] = (client, join)
        return None

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` once every server failed for good."""
        self._on_lost.append(callback)

    def _slot_failed(self, slot: Slot) -> None:
        if self.supervisor.all_failed():
            message = self.lost_message()
            for callback in self._on_lost:
                callback(message)

    def lost_message(self) -> str:
        """Why the run cannot go on: every server and why it is out."""
        states = "; ".join(
            f"server {s.index} ({s.url}): {s.state}, {s.reason}" for s in self.supervisor.slots
        )
        return (
            f"every inference server is gone and its restarts are used up "
            f"(inference.max_server_restarts={self.supervisor.max_restarts}): {states}; see "
            f"the servers' logs under {self.logs}, or raise inference.max_server_restarts"
        )

    # ---- pushes -------------------------------------------------------------------------------
    async def push(self, weights: Any, version: int, score: ScoreFn | None = None) -> PushReport:
        """:meth:`CheckpointEngine.push` to the live servers and the restarted ones waiting to
        join; the report lists the others under ``ejected``. Raises :class:`RunFailed` when no
        server is left (module docstring)."""
        async with self._lock:
            pending = await self._targets(version)
            report = await self.engine.push(weights, version, score=score)
            await self._settle(report, pending)
        return report

    async def _targets(self, version: int) -> Pending:
        """Point the engine at the live and the pending servers; wait for one if none is."""
        deadline = time.monotonic() + self.wait_for_server_s
        while True:
            await self.supervisor.before_push()
            pending = self._current_pending()
            live = self.supervisor.live_clients()
            if live or pending:
                self.engine.clients = live + [client for client, _ in pending.values()]
                return pending
            if self.supervisor.all_failed():
                raise RunFailed(self.lost_message())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RunFailed(
                    f"cannot push weight version {version}: no inference server came back "
                    f"within inference.wait_for_server_s={self.wait_for_server_s:g} s: "
                    f"{self.supervisor.ejected()}"
                )
            await asyncio.sleep(min(0.5, remaining))

    def _current_pending(self) -> Pending:
        """The pending servers that are still their slot's server (a slot restarted again has
        a new one)."""
        current = {s.url: s.client for s in self.supervisor.slots if s.state == "ejected"}
        self._pending = {u: p for u, p in self._pending.items() if current.get(u) is p[0]}
        return dict(self._pending)

    async def _settle(self, report: PushReport, pending: Pending) -> None:
        """Pending servers the push verified join; live servers that failed and are dead now
        are ejected; the report keeps the servers still in the pool and lists the rest."""
        failed = {
            u: s.error or s.stage
            for u, s in report.servers.items()
            if not s.ok and u not in pending
        }
        await self.supervisor.after_push(failed)
        for url, (_, join) in pending.items():
            self._pending.pop(url, None)
            status = report.servers.get(url)
            if status is not None and status.ok:
                join()
            else:
                why = status.error if status is not None else "not reached"
                logger.warning(
                    "server at %s stays out of the pool: the push of version %d to it failed "
                    "(%s); it is tried again at the next push",
                    url,
                    report.version,
                    why,
                )
        serving = {s.url for s in self.supervisor.slots if s.state == "serving"}
        # a server that died during the push may even be relaunched on a new URL by now
        report.ejected = {
            u: f"it left the pool during the push ({s.error or s.stage})"
            for u, s in report.servers.items()
            if u not in serving
        }
        report.ejected.update(self.supervisor.ejected())
        report.servers = {u: s for u, s in report.servers.items() if u in serving}

    # ---- reporting ----------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``servers/{ejected,restarts,rejoined}`` (since the start), ``servers/{serving,
        failed}`` (now)."""
        counts = self.supervisor.counts
        slots = self.supervisor.slots
        return {
            "servers/ejected": float(counts["ejected"]),
            "servers/restarts": float(counts["restarts"]),
            "servers/rejoined": float(counts["rejoined"]),
            "servers/serving": float(sum(s.state == "serving" for s in slots)),
            "servers/failed": float(sum(s.state == "failed" for s in slots)),
        }


@contextlib.asynccontextmanager
async def watch_servers(run: Any) -> AsyncIterator[RunServers | None]:
    """Watch the servers ``run`` launched (``run.servers`` meanwhile); None when it launched
    none (external servers, given URLs, Ray's server actors: those are watched elsewhere)."""
    if not run.handles:
        yield None
        return
    servers = RunServers(run)
    servers.start()
    run.servers = servers
    try:
        yield servers
    finally:
        run.servers = None
        await servers.aclose()
