"""Inference servers of one process: eject the dead, restart our own, rejoin verified.

Why it exists: the rollout service and a local ``agentrl train`` push weights to every server
and route rollouts over a pool of them. A server that dies (SIGKILL, OOM) or stops answering
must not fail every later push (the live servers would load each payload while the version
stayed behind), and must not silently serve old weights when it comes back. So each server has
a slot here (the Ray run has its own, :mod:`agentrl.distributed.faults`: Ray restarts its
server actors)::

    serving  --(its process exited; two health checks failed; or it failed a push and then
                its health check)-->  ejected
    ejected  --(launched by us and dead or unhealthy: stopped and launched again, at most
                ``max_restarts`` times (``inference.max_server_restarts``); a new URL)-->  ejected
    ejected  --(healthy, and at the current version: the current weights pushed to it and
                verified if it was not)-->  serving
    ejected  --(launched by us, restarts used up)-->  failed

Servers given as URLs (``inference.backend: external``) are never restarted (they are not ours):
they are probed until they answer, then brought to the current version like any other.

Who brings a server to the current version is the owner's ``catch_up`` (:data:`CatchUp`): the
service pushes its saved weights at once (``WeightService.catch_up``); a trainer, whose weights
are only "the current version" at a push, adds the server to its next push and lets it join
when that push verified it (:mod:`agentrl.training.run_servers`).

Guarantees:

- the pool routes to a server only while its slot is ``serving``: an ejected server leaves the
  pool at once (requests in flight on it end as usual and the pool retries them elsewhere);
- a server rejoins only while holding the owner's current version: the catch-up push and the
  rejoin happen under the owner's push lock (the service's; the trainer's push itself), so no
  push can run between them;
- pushes reach the ``serving`` slots only (:meth:`ServerSupervisor.live_clients`); the push
  report lists ejected servers as ``ejected`` with their reason, never as failed;
- the owner is ``degraded`` while any slot is not ``serving``, with each slot's reason and the
  time it left the pool (:meth:`ServerSupervisor.degraded`);
- restarts are bounded per slot and counted (``counts["restarts"]``); a failed launch counts;
  a slot that fails for good is reported to ``on_failed`` (a trainer stops once every slot has).

Shutdown: :meth:`ServerSupervisor.aclose` stops the watchers, stops the servers it launched and
closes every slot's client (the servers ``build_serving`` launched are stopped by its stack).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.inference.client import PolicyClient
from agentrl.serving.watch import Watchers

__all__ = ["CatchUp", "ServerSupervisor", "Slot", "launcher_for"]

logger = logging.getLogger(__name__)

CatchUp = Callable[[PolicyClient, Callable[[], None]], Awaitable[str | None]]
"""``catch_up(client, join)``: under the weight lock, bring ``client``'s server to the current
version and call ``join()`` (now, or at the owner's next push: the slot stays ``ejected`` until
then and ``catch_up`` is called again each round); returns None on success (or when the join is
arranged), else why it could not."""

Relaunch = Callable[[int, int], Any]
"""``relaunch(index, attempt)`` -> a started, healthy ``ServerHandle`` (blocking; in a thread)."""


@dataclass
class Slot:
    """One inference server (of the service, or of a local run) and what the supervisor knows
    of it."""

    index: int
    url: str
    client: PolicyClient
    handle: Any = None
    """The ``ServerHandle`` when we launched this server (None: given as a URL)."""
    state: str = "serving"
    reason: str | None = None
    """Why the slot is not serving (None while serving)."""
    since: float | None = None
    """Unix time the slot left ``serving`` (None while serving)."""
    restarts: int = 0

    @property
    def launched(self) -> bool:
        """True when we launched this server (it may be restarted)."""
        return self.handle is not None

    def describe(self) -> dict[str, Any]:
        """The slot as plain data (``/v1/status``)."""
        return {
            "index": self.index,
            "url": self.url,
            "state": self.state,
            "launched": self.launched,
            "pid": self.handle.pid if self.launched else None,
            "restarts": self.restarts,
            "reason": self.reason,
            "since": self.since,
        }


def launcher_for(serving: Any) -> Relaunch | None:
    """How to launch server ``index`` of ``serving`` again (None when it launched none)."""
    if not getattr(serving, "handles", None):
        return None
    from agentrl.serving import launch, spec_for

    logs = Path(serving.cfg.trainer.output_dir) / "logs"

    def relaunch(index: int, attempt: int) -> Any:
        """Start server ``index`` again (its own log, on a new port) and wait until healthy."""
        spec = spec_for(
            serving.cfg,
            "policy",
            index=index,
            model=serving.model_dir,
            plan=serving.threads,
            log_dir=logs,
            api_key=serving.api_key,
        )
        if spec.log_path is not None:
            log = spec.log_path
            spec = dataclasses.replace(
                spec, log_path=log.with_name(f"{log.stem}-restart{attempt}{log.suffix}")
            )
        return launch(spec)

    return relaunch


class ServerSupervisor:
    """Watches the servers of the service or of a local run (module docstring: states and
    guarantees).

    ``serving`` is the ``build_serving`` result (its engine's clients, in URL order, and its
    ``handles``); ``relaunch`` defaults to :func:`launcher_for`; ``make_client(url)`` builds the
    control client of a relaunched server."""

    def __init__(
        self,
        serving: Any,
        *,
        max_restarts: int = 3,
        interval_s: float = 5.0,
        health_timeout_s: float = 3.0,
        relaunch: Relaunch | None = None,
        make_client: Callable[[str], PolicyClient] | None = None,
        clock: Callable[[], float] = time.time,
        on_failed: Callable[[Slot], None] | None = None,
    ) -> None:
        handles = list(getattr(serving, "handles", None) or [])
        self.serving = serving
        self.slots = [
            Slot(i, c.base_url, c, handle=handles[i] if i < len(handles) else None)
            for i, c in enumerate(serving.engine.clients)
        ]
        self.max_restarts = max_restarts
        self.interval_s = interval_s
        self.health_timeout_s = health_timeout_s
        self.relaunch = relaunch or launcher_for(serving)
        self.make_client = make_client or self._default_client
        self.clock = clock
        self.on_failed = on_failed
        """Called with a slot that failed for good (its restarts used up)."""
        self.counts = {"ejected": 0, "restarts": 0, "rejoined": 0}
        self._catch_up: CatchUp | None = None
        self._watchers: Watchers[Slot] = Watchers()
        self._started: list[Any] = []
        """Handles this supervisor launched (it stops them)."""
        self._old_clients: list[PolicyClient] = []

    def _default_client(self, url: str) -> PolicyClient:
        timeout = float(self.serving.cfg.checkpoint.push_timeout_s)
        return PolicyClient(url, timeout_s=timeout, api_key=getattr(self.serving, "api_key", None))

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, catch_up: CatchUp) -> None:
        """Watch every slot (needs a running event loop); ``catch_up`` brings a server to the
        current version (:meth:`WeightService.catch_up`)."""
        self._catch_up = catch_up
        self._watchers.start(self._watch, self.slots)

    async def aclose(self) -> None:
        """Stop watching, stop the servers launched here, close the clients made here."""
        await self._watchers.aclose()
        await asyncio.gather(*(asyncio.to_thread(h.stop) for h in self._started))
        self._started = []
        # The engine closes the clients it holds at its own exit; closing twice is harmless, and
        # an ejected slot's client may no longer be among them.
        mine = [s.client for s in self.slots] + self._old_clients
        await asyncio.gather(*(c.aclose() for c in mine), return_exceptions=True)

    async def _watch(self, slot: Slot) -> None:
        while slot.state != "failed":
            try:
                await self.check(slot)
            except Exception:  # the watcher must outlive anything one round does
                logger.exception("supervising server %d (%s) failed", slot.index, slot.url)
            await asyncio.sleep(self.interval_s)

    # ---- one round ----------------------------------------------------------------------------
    async def check(self, slot: Slot) -> None:
        """One round for ``slot``: eject it if it is dead; recover it if it is ejected."""
        if slot.state == "serving":
            why = await self._why_dead(slot)
            if why is not None:
                await self.eject(slot, why)
            return
        if slot.state == "ejected":
            await self._recover(slot)

    async def _healthy(self, slot: Slot) -> bool:
        """Two short ``/health`` tries (a busy server may miss one)."""
        for _ in range(2):
            if await slot.client.health(timeout_s=self.health_timeout_s):
                return True
        return False

    async def _why_dead(self, slot: Slot) -> str | None:
        exited = "its process {pid} exited (code {code})"
        if slot.launched and not slot.handle.is_running():
            return exited.format(pid=slot.handle.pid, code=slot.handle.process.returncode)
        if not await self._healthy(slot):
            if slot.launched and not slot.handle.is_running():  # it died during the checks
                return exited.format(pid=slot.handle.pid, code=slot.handle.process.returncode)
            return "it failed two health checks"
        return None

    async def eject(self, slot: Slot, reason: str) -> None:
        """Take a serving slot out of the pool (the next pushes skip it) and say why."""
        if slot.state != "serving":
            return
        slot.state, slot.reason, slot.since = "ejected", reason, self.clock()
        self.counts["ejected"] += 1
        await self.serving.pool.remove_server(slot.url)
        logger.warning("server %d at %s ejected: %s", slot.index, slot.url, reason)

    async def _recover(self, slot: Slot) -> None:
        if slot.launched and await self._why_dead(slot) is not None:
            if not await self._restart(slot):
                return
        elif not await self._healthy(slot):
            return  # a server given as a URL: probed again next round
        assert self._catch_up is not None, "ServerSupervisor.start(catch_up) was not called"
        error = await self._catch_up(slot.client, lambda: self._join(slot))
        if error is not None:
            reason = f"it could not be brought to the current version: {error}"
            if reason != slot.reason:  # said once, not every round
                logger.warning("server %d at %s stays ejected: %s", slot.index, slot.url, reason)
            slot.reason = reason

    async def _restart(self, slot: Slot) -> bool:
        """Stop the slot's server and launch it again (bounded); True when it runs."""
        if self.relaunch is None or slot.restarts >= self.max_restarts:
            slot.state = "failed"
            slot.reason = (
                f"{slot.reason}; restarts used up ({slot.restarts} of {self.max_restarts})"
            )
            logger.error("server %d (%s) failed for good: %s", slot.index, slot.url, slot.reason)
            if self.on_failed is not None:
                self.on_failed(slot)
            return False
        slot.restarts += 1
        self.counts["restarts"] += 1
        await asyncio.to_thread(slot.handle.stop)
        try:
            handle = await asyncio.to_thread(self.relaunch, slot.index, slot.restarts)
        except Exception as exc:
            slot.reason = f"restart {slot.restarts} failed: {type(exc).__name__}: {exc}"[:2000]
            logger.error("server %d: %s", slot.index, slot.reason)
            return False
        self._started.append(handle)
        self._old_clients.append(slot.client)
        slot.handle, slot.url = handle, handle.base_url
        slot.client = self.make_client(handle.base_url)
        logger.info("server %d restarted at %s (restart %d)", slot.index, slot.url, slot.restarts)
        return True

    def _join(self, slot: Slot) -> None:
        """Called under the weight lock once the slot's server holds the current version."""
        self.serving.pool.add_server(slot.url)
        slot.state, slot.reason, slot.since = "serving", None, None
        self.counts["rejoined"] += 1
        logger.info(
            "server %d at %s rejoined the pool at the current version", slot.index, slot.url
        )

    # ---- pushes -------------------------------------------------------------------------------
    def live_clients(self) -> list[PolicyClient]:
        """The control clients of the serving slots (what a push reaches)."""
        return [s.client for s in self.slots if s.state == "serving"]

    async def before_push(self) -> None:
        """Eject the serving slots that are dead now (a push would only wait on them)."""
        serving = [s for s in self.slots if s.state == "serving"]
        reasons = await asyncio.gather(*(self._why_dead(s) for s in serving))
        for slot, why in zip(serving, reasons, strict=True):
            if why is not None:
                await self.eject(slot, why)

    async def after_push(self, failed: dict[str, str]) -> None:
        """Eject the servers that failed a push (``{url: error}``) and are unreachable now."""
        for slot in [s for s in self.slots if s.url in failed and s.state == "serving"]:
            why = await self._why_dead(slot)
            if why is not None:
                await self.eject(slot, f"it failed a push ({failed[slot.url]}) and {why}")

    def eject_now(self, url: str, reason: str) -> Awaitable[None]:
        """Eject the serving slot of ``url`` (a server left on the wrong weights)."""
        slot = next((s for s in self.slots if s.url == url), None)
        return self.eject(slot, reason) if slot is not None else asyncio.sleep(0)

    # ---- reporting ----------------------------------------------------------------------------
    def ejected(self) -> dict[str, str]:
        """``{url: reason}`` of every slot that is not serving."""
        return {s.url: s.reason or s.state for s in self.slots if s.state != "serving"}

    def degraded(self) -> list[dict[str, Any]]:
        """Every slot that is not serving: which server, why, since when (empty: healthy)."""
        return [s.describe() for s in self.slots if s.state != "serving"]

    def all_failed(self) -> bool:
        """True when every slot failed for good (no server can serve again)."""
        return all(s.state == "failed" for s in self.slots)

    def describe(self) -> dict[str, Any]:
        """Every slot and the counters (``/v1/status``)."""
        return {"slots": [s.describe() for s in self.slots], "counts": dict(self.counts)}
