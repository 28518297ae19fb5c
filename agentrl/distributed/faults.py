"""Ray fault tolerance: servers that come back on new URLs rejoin the run, verified, first.

Why it exists: on Ray a server actor that dies is restarted by Ray
(``distributed.max_actor_restarts``) and starts a new server process; so does a live server actor
whose server process died. A new process listens on a new port (a new URL) and holds the model's
initial weights. The run's CheckpointEngine and ServerPools know servers by URL, so something
must notice the new URL, bring that server to the trainer's weights and version, and only then
let rollouts reach it. That is the :class:`ServerRegistry`, owned by the trainer (rank 0, in the
trainer actor), next to the engine and the pool it updates.

States of one server slot (one server actor)::

    serving  --(health check fails at a push, or the actor reports a new server)-->  detached
    detached --(the actor reports a running server: a new one, or the same one again)-->  pending
    pending  --(a push of the trainer's version reached it and was verified)-->  serving
    any      --(the actor is gone for good: its restarts are used up)-->  retired

Guarantees:

- Rollouts reach a server (the trainer's pool, and every worker actor's pool through the
  :class:`ServerDirectory`) only while it is ``serving``: after a push of the trainer's current
  version to it succeeded and was verified (the CheckpointEngine's push protocol: loaded,
  version set, probe compared with the trainer's log-probs while paused). A replacement joins
  at the next push: between pushes the trainer's weights may be mid-update, so nothing else
  could be pushed as "the current version".
- A dead server does not stop the run: before each push every registered server is
  health-checked and the unreachable ones are detached; one that fails the push and then its
  health check is detached too. A live server that fails a push (a verification mismatch, say)
  still fails it: retried ``checkpoint.push_retries`` times, then the run stops with the report,
  as in the local run. With no server left, a push waits for one to come back (up to
  ``wait_for_server_s``), then stops the run naming every slot's state.
- The engine's and the pools' server sets change only under one lock that every push attempt
  holds, so a push never sees its servers change under it.

Shutdown: :meth:`ServerRegistry.aclose` stops the polling; the clients the registry made belong to
the engine, which the run's exit stack closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from agentrl.distributed.actors import await_ref
from agentrl.inference.client import PolicyClient
from agentrl.serving.watch import Watchers
from agentrl.training import Trainer
from agentrl.weightsync.engine import PushReport, ServerPushStatus, WeightPushError

__all__ = ["RayTrainer", "RegistryPushReport", "ServerDirectory", "ServerRegistry"]

logger = logging.getLogger(__name__)


@dataclass
class ServerDirectory:
    """The URLs of the servers that serve rollouts now, and a generation number that changes
    with them. :class:`~agentrl.distributed.actors.RemoteWorker` sends a snapshot with
    each episode, so every worker actor's pool follows (a restarted actor included)."""

    urls: list[str] = field(default_factory=list)
    generation: int = 0

    def snapshot(self) -> tuple[int, list[str]]:
        """``(generation, urls)``, a copy."""
        return self.generation, list(self.urls)

    def set(self, urls: Sequence[str]) -> None:
        """Serve from ``urls`` from now on (a new generation when they differ)."""
        if list(urls) != self.urls:
            self.urls = list(urls)
            self.generation += 1


@dataclass
class _Slot:
    """One server actor and what the registry knows of its server."""

    index: int
    actor: Any
    url: str
    launch_id: str | None = None
    state: str = "serving"
    launches: list[dict[str, Any]] = field(default_factory=list)
    last_push: dict[str, Any] | None = None

    @property
    def registered(self) -> bool:
        """In the CheckpointEngine (``serving`` or ``pending``)."""
        return self.state in ("serving", "pending")


@dataclass
class RegistryPushReport(PushReport):
    """A :class:`PushReport` whose metrics also say where the registry's servers stand:
    ``weight_sync/servers_{serving,pending,detached,retired}`` (now) and
    ``weight_sync/servers_{replaced,joined,detached_total}`` (since the start)."""

    registry: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The push's metrics plus the registry's."""
        return {**super().metrics(), **self.registry}


class ServerRegistry:
    """Follows the server actors of a Ray run (module docstring: states and guarantees).

    ``actors`` and ``urls`` are the server actors and the URLs they reported at start, in the
    same order; ``engine`` the run's CheckpointEngine and ``pools`` the ServerPools to keep in
    step (the trainer's); ``directory`` the workers'. ``make_client(url)`` builds the engine's
    control client of a new server. Each actor is asked ``ensure_serving()`` every
    ``poll_interval_s`` (which also starts a new server when its process died).
    """

    def __init__(
        self,
        actors: Sequence[Any],
        urls: Sequence[str],
        engine: Any,
        pools: Sequence[Any],
        *,
        make_client: Callable[[str], PolicyClient],
        directory: ServerDirectory | None = None,
        poll_interval_s: float = 10.0,
        push_retries: int = 1,
        start_timeout_s: float = 900.0,
        wait_for_server_s: float = 900.0,
        health_timeout_s: float = 5.0,
    ) -> None:
        if len(actors) != len(urls):
            raise ValueError(
                f"ServerRegistry: {len(actors)} server actors but {len(urls)} URLs; "
                "give one URL per actor, in the same order"
            )
        self.slots = [
            _Slot(i, a, u.rstrip("/")) for i, (a, u) in enumerate(zip(actors, urls, strict=True))
        ]
        self.engine = engine
        self.pools = list(pools)
        self.make_client = make_client
        self.directory = directory or ServerDirectory(urls=[s.url for s in self.slots])
        self.poll_interval_s = poll_interval_s
        self.push_retries = push_retries
        self.start_timeout_s = start_timeout_s
        self.wait_for_server_s = wait_for_server_s
        self.health_timeout_s = health_timeout_s
        self.counts = {"replaced": 0, "joined": 0, "detached": 0}
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._watchers: Watchers[_Slot] = Watchers()

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start polling every server actor (needs a running event loop)."""
        self._watchers.start(self._watch, self.slots)

    async def aclose(self) -> None:
        """Stop polling."""
        await self._watchers.aclose()

    async def _watch(self, slot: _Slot) -> None:
        while slot.state != "retired":
            try:
                await self.poll(slot)
            except Exception:  # the watcher must outlive anything one poll does
                logger.exception("polling server actor %d failed", slot.index)
            await asyncio.sleep(self.poll_interval_s)

    # ---- observing the actors -----------------------------------------------------------------
    async def poll(self, slot: _Slot) -> None:
        """Ask the slot's actor for a running server (``ensure_serving``) and take in what it
        says: a new server becomes ``pending``; an actor gone for good is retired. An actor
        that is restarting, or whose server failed to start, is asked again next round."""
        from ray.exceptions import ActorDiedError, RayError

        ref = slot.actor.ensure_serving.remote()
        try:
            # Not asyncio.wait_for: on Python 3.11 it drops a cancellation that lands as the
            # answer arrives, and the watcher would outlive aclose() (which then never returns).
            async with asyncio.timeout(self.start_timeout_s):
                info = await await_ref(ref)
        except ActorDiedError as exc:
            async with self._lock:
                await self._retire(slot, exc)
            return
        except (RayError, TimeoutError) as exc:
            logger.warning("server actor %d has no server now (%s); asking again", slot.index, exc)
            return
        async with self._lock:
            await self._observe(slot, info)

    async def _observe(self, slot: _Slot, info: dict[str, Any]) -> None:
        url, launch = str(info["url"]).rstrip("/"), str(info["launch_id"])
        if slot.state == "retired":
            return
        if launch == slot.launch_id or (slot.launch_id is None and url == slot.url):
            if slot.launch_id is None:
                slot.launch_id = launch
                slot.launches.append(dict(info))
            if slot.state == "detached":
                self._add_pending(slot, "it answers again")
            return
        if slot.registered:
            await self._detach(slot, f"its actor reports a new server at {url}")
        slot.url, slot.launch_id = url, launch
        slot.launches.append(dict(info))
        self.counts["replaced"] += 1
        self._add_pending(slot, "a new server process")

    def _add_pending(self, slot: _Slot, why: str) -> None:
        """Register the slot's server with the engine (it gets the next push) but not with
        any pool (nothing is routed to it before that push is verified)."""
        self.engine.replace_client(None, self.make_client(slot.url))
        slot.state = "pending"
        logger.info(
            "server %d at %s (%s) is pending: it joins at the next verified push",
            slot.index,
            slot.url,
            why,
        )
        self._changed.set()

    async def _detach(self, slot: _Slot, why: str) -> None:
        """Take the slot's server out of the engine and every pool (and the directory)."""
        removed = self.engine.replace_client(slot.url, None)
        if removed is not None:
            await removed.aclose()
        for pool in self.pools:
            await pool.remove_server(slot.url)
        slot.state = "detached"
        self.counts["detached"] += 1
        logger.warning("server %d at %s detached: %s", slot.index, slot.url, why)
        self._publish()

    async def _retire(self, slot: _Slot, exc: BaseException) -> None:
        if slot.registered:
            await self._detach(slot, "its actor is gone for good")
        slot.state = "retired"
        logger.error(
            "server actor %d is gone for good (restarts used up: distributed.max_actor_restarts)"
            ": %s",
            slot.index,
            exc,
        )
        self._changed.set()

    def _join(self, slot: _Slot) -> None:
        for pool in self.pools:
            pool.add_server(slot.url)
        slot.state = "serving"
        self.counts["joined"] += 1
        logger.info("server %d at %s serves rollouts again", slot.index, slot.url)
        self._publish()

    def _publish(self) -> None:
        self.directory.set([s.url for s in self.slots if s.state == "serving"])
        self._changed.set()

    def _slot_of(self, url: str) -> _Slot | None:
        for s in self.slots:
            if s.url == url and s.registered:
                return s
        return None

    # ---- pushing ------------------------------------------------------------------------------
    async def push(self, actor: Any, version: int) -> RegistryPushReport:
        """Push ``actor``'s weights as ``version`` to every registered server, verified with
        ``actor.score_tokens`` (module docstring: what is detached, what fails the run).
        Pending servers that pass join the pools. Raises :class:`WeightPushError` when a live
        server keeps failing, after ``1 + push_retries`` attempts."""
        state = actor.state_dict_for_push()
        report: PushReport | None = None
        attempts = 1 + self.push_retries
        for attempt in range(attempts):
            await self._wait_for_a_server(version)
            async with self._lock:
                await self._detach_unreachable()
                if not self.engine.clients:
                    continue
                pushed = await self.engine.push(state, version, score=actor.score_tokens)
                done = await self._settle(pushed)
            report = pushed
            if done:
                return self._with_counts(pushed)
            logger.warning(
                "weight push attempt %d/%d failed:\n%s", attempt + 1, attempts, pushed.describe()
            )
        if report is None:
            raise RuntimeError(self._nothing_to_push(version))
        raise WeightPushError(report)

    async def _wait_for_a_server(self, version: int) -> None:
        deadline = time.monotonic() + self.wait_for_server_s
        while not any(s.registered for s in self.slots):
            if all(s.state == "retired" for s in self.slots):
                raise RuntimeError(self._nothing_to_push(version))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(self._nothing_to_push(version))
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 5.0))

    def _nothing_to_push(self, version: int) -> str:
        states = ", ".join(f"server {s.index} ({s.url}): {s.state}" for s in self.slots)
        return (
            f"cannot push weight version {version}: no inference server is reachable "
            f"(waited up to {self.wait_for_server_s:g} s for one to come back; "
            f"distributed.max_actor_restarts bounds the restarts): {states}"
        )

    async def _healthy(self, client: PolicyClient) -> bool:
        """Two short ``/health`` tries (a busy server may miss one)."""
        for _ in range(2):
            if await client.health(timeout_s=self.health_timeout_s):
                return True
        return False

    async def _detach_unreachable(self) -> None:
        clients = list(self.engine.clients)
        healthy = await asyncio.gather(*(self._healthy(c) for c in clients))
        for client, ok in zip(clients, healthy, strict=True):
            slot = self._slot_of(client.base_url)
            if not ok and slot is not None:
                await self._detach(slot, "it failed its health check before a push")

    async def _settle(self, report: PushReport) -> bool:
        """Record each server's outcome; pending servers that passed join; failed servers that
        are unreachable now are detached. True when every server still registered passed."""
        for url, status in report.servers.items():
            slot = self._slot_of(url)
            if slot is None:
                continue
            slot.last_push = _status_summary(report.version, status)
            if status.ok:
                if slot.state == "pending":
                    self._join(slot)
                continue
            client = next((c for c in self.engine.clients if c.base_url == url), None)
            if client is None or not await self._healthy(client):
                await self._detach(slot, f"it failed the push and its health check: {status.error}")
        registered = [s.url for s in self.slots if s.registered]
        return bool(registered) and all(
            u in report.servers and report.servers[u].ok for u in registered
        )

    def _with_counts(self, report: PushReport) -> RegistryPushReport:
        base = {f.name: getattr(report, f.name) for f in fields(PushReport)}
        registry = {f"weight_sync/servers_{k}": float(v) for k, v in self.counts.items()}
        registry["weight_sync/servers_detached_total"] = registry.pop(
            "weight_sync/servers_detached"
        )
        for state in ("serving", "pending", "detached", "retired"):
            registry[f"weight_sync/servers_{state}"] = float(
                sum(s.state == state for s in self.slots)
            )
        return RegistryPushReport(**base, registry=registry)

    # ---- reporting ----------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Per slot: state, URL, every server launch seen and the last push it took part in
        (version, ok, verify difference); and the counters."""
        return {
            "slots": [
                {
                    "index": s.index,
                    "state": s.state,
                    "url": s.url,
                    "launches": list(s.launches),
                    "last_push": s.last_push,
                }
                for s in self.slots
            ],
            "counts": dict(self.counts),
        }


def _status_summary(version: int, status: ServerPushStatus) -> dict[str, Any]:
    return {
        "version": version,
        "server_version": status.version,
        "ok": status.ok,
        "verify_max_abs_diff": status.verify_max_abs_diff,
        "verified_while_paused": status.verified_while_paused,
        "error": status.error,
    }


class RayTrainer(Trainer):
    """The trainer of a Ray run: a :class:`Trainer` whose weight pushes go through a
    :class:`ServerRegistry` over the run's server actors (``server_actors``, in the order of
    ``server_urls``), which keeps ``directory`` (the worker actors' view) in step. Without
    server actors (``inference.backend: external``) it is a plain :class:`Trainer`."""

    def __init__(
        self,
        cfg: Any,
        *,
        server_actors: Sequence[Any] = (),
        directory: ServerDirectory | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(cfg, **kwargs)
        self.server_actors = list(server_actors)
        self.directory = directory
        self.registry: ServerRegistry | None = None

    async def _train(self, run: Any, tracker: Any, dataset: Any) -> Any:
        if not self.server_actors:
            return await super()._train(run, tracker, dataset)
        cfg = self.cfg
        ck, key = cfg.checkpoint, cfg.inference.api_key
        self.registry = ServerRegistry(
            self.server_actors,
            run.server_urls,
            run.engine,
            [run.pool],
            make_client=lambda url: PolicyClient(url, timeout_s=ck.push_timeout_s, api_key=key),
            directory=self.directory,
            poll_interval_s=cfg.inference.health_check_interval_s,
            push_retries=ck.push_retries,
        )
        self.registry.start()
        try:
            return await super()._train(run, tracker, dataset)
        finally:
            await self.registry.aclose()

    async def _push(self, version: int) -> Any:
        """Push through the registry (servers that came back join here, verified)."""
        if self.registry is None or self.run_obj is None:
            return await super()._push(version)
        return await self.registry.push(self.run_obj.policies.actor, version)
