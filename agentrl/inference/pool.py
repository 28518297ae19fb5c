"""ServerPool: many inference servers behind the one ``generate`` call agents already use.

Routing: a request with a ``session_id`` that the pool has seen goes back to the server that
served that session (its prefix cache holds the earlier turns) as long as that server is
alive; otherwise the pool picks the live server with the fewest outstanding requests (ties go
to the server that has completed fewer) and remembers the choice. The session map is an LRU
bounded by ``max_sessions``.

Invariants:

- every ``generate`` call returns exactly one :class:`~agentrl.types.Generation` or raises
  exactly one error; a request is re-sent to another server only when its server could not
  have delivered an answer (connection refused/dropped, a timeout, or a 5xx); a 4xx is raised at
  once and never retried. A server that timed out or disconnected aborts that request itself
  (the client's deadline travels with it, and the embedded server aborts on disconnect), so a
  retry elsewhere does not make a duplicate;
- a connection failure marks a server dead only if a health check right after it fails too: a
  healthy server that closed one kept-alive connection stays in the pool;
- a server's ``outstanding`` count goes up when a request is sent to it and down when that
  request ends, whatever the outcome (``completed`` or ``failures`` goes up by one);
- an answer a server cut (``finish_reason="abort"``: its request deadline, a shutdown) is never
  passed off as complete: it is retried once on another server, and if that fails too the
  aborted answer is returned (``finish_reason="abort"``, reported as ``aborted`` to the agent's
  stop policy); ``ServerStats.aborted`` counts them. The client's own deadline is the server's
  plus a grace, so a slow server answers (aborted) before the client gives up;
- a dead server gets no new requests until a health check finds it healthy again; the
  background health loop (``health_check_interval_s``) probes every server, dead or alive;
- when no server is alive, a request waits up to ``wait_for_server_s`` for one to come back
  (a restarting server, a replacement added on a new URL, a lost node's servers placed
  elsewhere) before it fails; every server down at once is an outage to ride out, not a
  reason to fail every episode in flight;
- membership may change at run time (:meth:`ServerPool.add_server`,
  :meth:`ServerPool.remove_server`, :meth:`ServerPool.set_servers`: a restarted server comes
  back on a new URL): a removed server gets no new request and its sessions move on their next
  turn; requests already in flight on it end as usual (counted), and its client is closed once
  none is left.

Broadcast helpers (pause, resume, weight updates, versions, prefix cache) run on every server
concurrently and return a per-server report ``{url: Ok | exception}``; they never raise for a
single server's failure, so the CheckpointEngine can tell exactly which server is in which
state.

Shutdown: :meth:`ServerPool.aclose` stops the health loop, then closes the clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.inference.client import (
    InferenceRequestError,
    InferenceServerError,
    PauseMode,
    PolicyClient,
)
from agentrl.types import Generation, SamplingParams

if TYPE_CHECKING:
    from agentrl.config import InferenceConfig

__all__ = ["BroadcastReport", "Ok", "ServerPool", "ServerStats"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Ok:
    """A broadcast step that succeeded on one server; ``value`` is what the call returned."""

    value: Any = None


BroadcastReport = dict[str, "Ok | BaseException"]
"""Per-server outcome of a broadcast: ``{url: Ok(value) | the exception it raised}``."""


@dataclass(frozen=True)
class ServerStats:
    """A snapshot of one server's counters."""

    url: str
    alive: bool
    outstanding: int
    completed: int
    failures: int
    sessions: int
    aborted: int = 0
    """Answers this server cut (``finish_reason="abort"``: its deadline, a shutdown)."""


@dataclass
class _Server:
    url: str
    client: PolicyClient
    alive: bool = True
    outstanding: int = 0
    completed: int = 0
    failures: int = 0
    aborted: int = 0
    removed: bool = False


class ServerPool:
    """Least-outstanding-requests routing with sticky sessions over several servers.

    Example::

        async with ServerPool(["http://127.0.0.1:8001", "http://127.0.0.1:8002"]) as pool:
            gen = await pool.generate(prompt_ids, SamplingParams(), session_id="episode-7")
            report = await pool.pause("keep")   # {url: Ok(None) | error}
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        health_check_interval_s: float | None = 5.0,
        max_sessions: int = 10_000,
        max_attempts: int | None = None,
        retry_backoff_s: float = 0.1,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        model: str | None = None,
        client_factory: Callable[[str], PolicyClient] | None = None,
        api_key: str | None = None,
        wait_for_server_s: float = 0.0,
    ) -> None:
        """``health_check_interval_s=None`` disables the background loop (call
        :meth:`check_health` yourself). ``max_attempts`` bounds how many servers one request
        may try (default: twice the number of servers). ``client_factory(url)`` builds the
        per-server client (tests pass in-process transports). ``api_key`` (default
        ``$AGENTRL_API_KEY``) is sent to every server. ``wait_for_server_s``: how long a
        request waits for a live server when none is alive."""
        if not urls:
            raise ValueError("ServerPool needs at least one server URL in 'urls'")
        if len(set(urls)) != len(urls):
            raise ValueError(f"ServerPool 'urls' has duplicates: {list(urls)}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")

        def default_factory(url: str) -> PolicyClient:
            # The pool retries on other servers itself; each client tries once.
            return PolicyClient(
                url,
                model=model,
                timeout_s=timeout_s,
                connect_timeout_s=connect_timeout_s,
                max_retries=0,
                api_key=api_key,
            )

        self._factory = client_factory or default_factory
        self._servers: dict[str, _Server] = {}
        self._retired: list[_Server] = []
        """Removed servers whose client is still open (requests were in flight on them)."""
        for url in urls:
            client = self._factory(url)
            self._servers[client.base_url] = _Server(client.base_url, client)
        self.health_check_interval_s = health_check_interval_s
        self.max_sessions = max_sessions
        self.max_attempts = max_attempts or 2 * len(urls)
        self.retry_backoff_s = retry_backoff_s
        self.wait_for_server_s = wait_for_server_s
        self.failure_probe_timeout_s = min(2.0, connect_timeout_s)
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._health_task: asyncio.Task[None] | None = None
        self._tiebreak = 0
        self.first_answer = asyncio.Event()
        """Set when a server first answers a ``generate`` (the start-up log's "first rollout")."""

    @classmethod
    def from_config(
        cls,
        urls: Sequence[str],
        config: InferenceConfig,
        *,
        api_key: str | None = None,
        model: str | None = None,
    ) -> ServerPool:
        """A pool over ``urls`` with the ``inference`` section's health interval, request
        timeout and retries (``max_retries`` retries = ``max_retries + 1`` attempts)."""
        return cls(
            urls,
            health_check_interval_s=config.health_check_interval_s,
            timeout_s=config.request_timeout_s,
            max_attempts=config.max_retries + 1,
            api_key=api_key,
            model=model,
            wait_for_server_s=config.wait_for_server_s,
        )

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return list(self._servers)

    def start(self) -> None:
        """Start the background health loop (idempotent; needs a running event loop)."""
        if self.health_check_interval_s is None or self._health_task is not None:
            return
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def aclose(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        servers = [*self._servers.values(), *self._retired]
        self._retired = []
        await asyncio.gather(*(s.client.aclose() for s in servers))

    async def __aenter__(self) -> ServerPool:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _health_loop(self) -> None:
        assert self.health_check_interval_s is not None
        while True:
            await asyncio.sleep(self.health_check_interval_s)
            try:
                await self.check_health()
            except Exception:  # the loop must survive anything one probe does
                logger.exception("health check failed")

    async def check_health(self) -> dict[str, bool]:
        """Probe every server's ``/health`` now; mark each alive or dead accordingly."""
        servers = list(self._servers.values())
        results = await asyncio.gather(*(s.client.health() for s in servers))
        for server, ok in zip(servers, results, strict=True):
            if ok and not server.alive:
                logger.info("server %s is healthy again", server.url)
            elif not ok and server.alive:
                logger.warning("server %s failed its health check; marking it dead", server.url)
            server.alive = ok
        return {s.url: ok for s, ok in zip(servers, results, strict=True)}

    # ---- reporting ----------------------------------------------------------------------
    def dead_servers(self) -> list[str]:
        return [s.url for s in self._servers.values() if not s.alive]

    def stats(self) -> dict[str, ServerStats]:
        per_server: dict[str, int] = dict.fromkeys(self._servers, 0)
        for url in self._sessions.values():
            per_server[url] += 1
        return {
            s.url: ServerStats(
                url=s.url,
                alive=s.alive,
                outstanding=s.outstanding,
                completed=s.completed,
                failures=s.failures,
                sessions=per_server[s.url],
                aborted=s.aborted,
            )
            for s in self._servers.values()
        }

    def session_server(self, session_id: str) -> str | None:
        """The server a session is pinned to (None if unknown); does not touch the LRU order."""
        return self._sessions.get(session_id)

    # ---- routing ------------------------------------------------------------------------
    def _pick(self, session_id: str | None, exclude: set[str]) -> _Server | None:
        if session_id is not None:
            url = self._sessions.get(session_id)
            server = self._servers.get(url) if url is not None else None
            if server is not None and server.alive and server.url not in exclude:
                self._sessions.move_to_end(session_id)
                return server
        candidates = [s for s in self._servers.values() if s.alive and s.url not in exclude]
        if not candidates:
            return None
        # Rotate the start so equal servers share load instead of the first taking all ties.
        self._tiebreak = (self._tiebreak + 1) % len(candidates)
        rotated = candidates[self._tiebreak :] + candidates[: self._tiebreak]
        best = min(rotated, key=lambda s: (s.outstanding, s.completed))
        if session_id is not None:
            self._sessions[session_id] = best.url
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return best

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        session_id: str | None = None,
        *,
        extra_body: dict[str, Any] | None = None,
    ) -> Generation:
        """Same contract as :meth:`PolicyClient.generate`; routes and fails over (module doc)."""
        request_id = uuid.uuid4().hex
        tried: set[str] = set()
        last_error: BaseException | None = None
        cut_retried, aborted = False, None
        for attempt in range(self.max_attempts):
            server = self._pick(session_id, tried)
            if server is None and tried:
                # Every live server failed this request once; allow a second round.
                tried.clear()
                server = self._pick(session_id, tried)
            if server is None:
                server = await self._wait_for_live(session_id)
            if server is None:
                break
            server.outstanding += 1
            try:
                gen = await server.client.generate(
                    prompt_ids,
                    sampling,
                    session_id,
                    request_id=f"{request_id}-{attempt}",
                    extra_body=extra_body,
                )
            except InferenceRequestError:
                server.failures += 1
                raise
            except InferenceServerError as exc:
                server.failures += 1
                last_error = exc
                tried.add(server.url)
                if exc.connection_failed and server.alive:
                    await self._mark_dead_unless_healthy(server, exc)
                await asyncio.sleep(self.retry_backoff_s * attempt)
                continue
            finally:
                server.outstanding -= 1
                if server.removed and server.outstanding == 0:
                    await self._close_idle_retired()
            server.completed += 1
            self.first_answer.set()
            if gen.finish_reason == "abort" and not cut_retried and attempt + 1 < self.max_attempts:
                # Truncation is never success: the server cut this answer (and ended it, so a
                # retry is no duplicate); try once more on another server.
                server.aborted += 1
                cut_retried, aborted = True, gen
                tried.add(server.url)
                continue
            if gen.finish_reason == "abort":
                server.aborted += 1
            return gen
        if aborted is not None:
            return aborted  # the retry failed too: the agent's stop policy sees "abort"
        raise InferenceServerError(
            ",".join(self._servers),
            f"no server could serve the request after {len(tried) or 0} failed server(s); "
            f"dead servers: {self.dead_servers()}; last error: {last_error}",
            connection_failed=True,
        )

    async def _wait_for_live(self, session_id: str | None) -> _Server | None:
        """A live server once one is back (health loop, a replacement added), polling for up to
        ``wait_for_server_s``; None after that."""
        if self.wait_for_server_s <= 0:
            return None
        logger.warning(
            "no live server (dead: %s); waiting up to %g s for one to come back",
            self.dead_servers(),
            self.wait_for_server_s,
        )
        deadline = asyncio.get_running_loop().time() + self.wait_for_server_s
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.25)
            server = self._pick(session_id, set())
            if server is not None:
                return server
        return None

    # ---- membership -----------------------------------------------------------------------
    def add_server(self, url: str) -> str:
        """Route requests to the server at ``url`` from now on (alive until a check says
        otherwise); returns its normalized URL. Adding a URL that is in the pool does nothing."""
        client = self._factory(url)
        if client.base_url in self._servers:
            self._close_later(client)
            return client.base_url
        self._servers[client.base_url] = _Server(client.base_url, client)
        logger.info("server %s joined the pool", client.base_url)
        return client.base_url

    async def remove_server(self, url: str) -> bool:
        """Stop routing to ``url`` (False if it is not in the pool). Its sessions are
        forgotten (their next turn picks another server); requests in flight on it finish as
        usual, and its client is closed once none is left."""
        server = self._servers.pop(url.rstrip("/"), None)
        if server is None:
            return False
        server.removed = True
        for session, pinned in list(self._sessions.items()):
            if pinned == server.url:
                del self._sessions[session]
        self._retired.append(server)
        await self._close_idle_retired()
        logger.info("server %s left the pool", server.url)
        return True

    async def set_servers(self, urls: Sequence[str]) -> None:
        """Make the pool's servers exactly ``urls`` (added and removed as needed)."""
        if not urls:
            raise ValueError("ServerPool.set_servers needs at least one server URL in 'urls'")
        wanted = [self.add_server(u) for u in urls]
        for url in [u for u in self._servers if u not in wanted]:
            await self.remove_server(url)

    async def _close_idle_retired(self) -> None:
        idle = [s for s in self._retired if s.outstanding == 0]
        self._retired = [s for s in self._retired if s.outstanding > 0]
        await asyncio.gather(*(s.client.aclose() for s in idle), return_exceptions=True)

    def _close_later(self, client: PolicyClient) -> None:
        """Close a client that was built but not needed (no request was ever sent on it)."""
        self._retired.append(_Server(client.base_url, client, alive=False, removed=True))

    async def _mark_dead_unless_healthy(self, server: _Server, exc: BaseException) -> None:
        """A connection failed: dead only if ``/health`` fails too (one short probe)."""
        if await server.client.health(timeout_s=self.failure_probe_timeout_s):
            logger.info("server %s dropped a connection but is healthy (%s)", server.url, exc)
            return
        if server.alive:
            logger.warning("server %s is unreachable (%s); marking it dead", server.url, exc)
            server.alive = False

    # ---- broadcasts ---------------------------------------------------------------------
    async def _broadcast(
        self, call: Callable[[PolicyClient], Awaitable[Any]], *, alive_only: bool = False
    ) -> BroadcastReport:
        servers = [s for s in self._servers.values() if s.alive or not alive_only]

        async def one(server: _Server) -> Ok | BaseException:
            try:
                return Ok(await call(server.client))
            except Exception as exc:  # reported per server, never raised: see the module doc
                if isinstance(exc, InferenceServerError) and exc.connection_failed:
                    server.alive = False
                return exc

        results = await asyncio.gather(*(one(s) for s in servers))
        return {s.url: r for s, r in zip(servers, results, strict=True)}

    async def pause(self, mode: PauseMode = "keep") -> BroadcastReport:
        return await self._broadcast(lambda c: c.pause(mode))

    async def resume(self) -> BroadcastReport:
        return await self._broadcast(lambda c: c.resume())

    async def abort_requests(self) -> BroadcastReport:
        return await self._broadcast(lambda c: c.abort_requests())

    async def reset_prefix_cache(self) -> BroadcastReport:
        return await self._broadcast(lambda c: c.reset_prefix_cache())

    async def set_weight_version(self, version: int) -> BroadcastReport:
        return await self._broadcast(lambda c: c.set_weight_version(version))

    async def weight_info(self) -> BroadcastReport:
        return await self._broadcast(lambda c: c.weight_info())

    async def update_weights_from_path(self, path: str | Path, version: int) -> BroadcastReport:
        return await self._broadcast(lambda c: c.update_weights_from_path(path, version))

    async def update_weights_from_bytes(self, data: bytes, version: int) -> BroadcastReport:
        return await self._broadcast(lambda c: c.update_weights_from_bytes(data, version))

    async def broadcast(self, call: Callable[[PolicyClient], Awaitable[T]]) -> BroadcastReport:
        """Run any client call on every server (e.g. a custom control endpoint)."""
        return await self._broadcast(call)
