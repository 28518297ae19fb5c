"""The Ray actors that do a run's work beside the trainer: inference servers, agent-loop
workers and the reward worker, with the driver-side wrappers the trainer calls them through.

Why it exists: :mod:`agentrl.distributed.ray_backend` places actors and drives the run; the
classes placed live here. They are plain classes (``ray.remote`` is applied at placement time),
so their constructor state pickles and they can be unit-tested without a cluster.

- :class:`InferenceServerActor` owns one server subprocess (the same
  :func:`~agentrl.serving.spec_for` spec a local run launches) and a reaper that kills it if the
  actor process dies first;
- :class:`AgentLoopWorkerActor` runs ``AgentLoopWorker`` episodes over a ServerPool, scoring
  through :class:`RemoteScorer` (the :class:`RewardWorkerActor`);
- :class:`RemoteWorker` gives the trainer's AgentLoopManager the worker interface over an
  actor handle (cancelling it cancels the remote episode; a dead actor raises, the manager
  re-dispatches once, the next call waits for Ray's restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import subprocess
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from agentrl.config import ExperimentConfig
from agentrl.inference.handle import ServerHandle
from agentrl.lifetime import start_reaper
from agentrl.rollout.manager import AgentLoopWorker, WorkerConfig
from agentrl.serving import ServerSpec, launch, served_model
from agentrl.types import Task, Trajectory

__all__ = [
    "BIND_HOST_ENV",
    "AgentLoopWorkerActor",
    "InferenceServerActor",
    "RemoteScorer",
    "RemoteWorker",
    "RewardWorkerActor",
    "await_ref",
    "wait_reachable",
]

logger = logging.getLogger(__name__)

BIND_HOST_ENV = "AGENTRL_SERVER_BIND_HOST"


def _reconstructed() -> bool:
    """True inside a Ray actor that Ray restarted (its constructor ran again)."""
    import ray

    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return False
    with warnings.catch_warnings():  # Ray's own property reads a deprecated field of itself
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(context.was_current_actor_reconstructed)


def _url_host(bind_host: str) -> str:
    if bind_host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    if bind_host in ("0.0.0.0", "::"):
        import ray.util

        return ray.util.get_node_ip_address()
    return bind_host


# ---- actors (plain classes; ray.remote is applied in run_with_ray) ----------------------------
class InferenceServerActor:
    """Owns one inference server subprocess on the actor's node.

    ``start()`` launches it (embedded or vLLM, as ``inference.backend`` says) and returns its URL;
    ``shutdown()`` stops it. If the actor process dies first, a reaper process stops the server.
    """

    def __init__(self, spec: ServerSpec, *, index: int = 0, log_dir: str | None = None) -> None:
        self.spec = spec
        """What to launch (:func:`agentrl.serving.spec_for`: the same spec a local run's server
        gets; ``spec.host`` is the bind address, ``spec.api_key`` the run's token)."""
        self.index = index
        self.log_dir = log_dir
        self._handle: ServerHandle | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._url = ""
        self._launch_id = ""
        self._launches = 0
        """Servers this actor process started (a restarted actor counts from 0 again)."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handle"] = None  # a running process belongs to the node that started it
        state["_reaper"] = None
        state["_url"] = ""
        state["_launch_id"] = ""
        return state

    def start(self) -> str:
        """Launch the server and its reaper if none runs (:meth:`ensure_serving`); its URL."""
        return str(self.ensure_serving()["url"])

    def ensure_serving(self) -> dict[str, Any]:
        """A running server, and where it is (:meth:`info`, with a ``launch_id`` unique to each
        server process). Starts one when none runs: on the first call, after Ray restarted this
        actor (its constructor ran again), or after the server process died. A new process gets
        a new port, so a new URL, and the model's initial weights: the run's
        :class:`~agentrl.distributed.faults.ServerRegistry` pushes the current ones before
        anything is routed to it."""
        if self._handle is not None and self._handle.is_running():
            return self.info()
        if self._handle is not None:
            logger.warning(
                "server %d (pid %d, %s) exited with code %s; starting a new one",
                self.index,
                self._handle.pid,
                self._url,
                self._handle.process.poll(),
            )
            self.shutdown()
        self._launch()
        return self.info()

    def _log_path(self) -> Path | None:
        """``{backend}-{index}.log`` for the actor's first server; later ones (after a restart
        of the actor or of its server) get their own file, named after their launch."""
        if not self.log_dir:
            return None
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        first = self._launches == 0 and not _reconstructed()
        suffix = "" if first else f".{self._launch_id}"
        return Path(self.log_dir) / f"{self.spec.backend}-{self.index}{suffix}.log"

    def _launch(self) -> None:
        """Start the server subprocess and its reaper; set the URL and the launch id."""
        self._launch_id = uuid.uuid4().hex[:12]
        handle = launch(dataclasses.replace(self.spec, log_path=self._log_path()))
        self._handle = handle
        self._launches += 1
        self._reaper = start_reaper(handle.pid)
        port = handle.base_url.rsplit(":", 1)[1]
        self._url = f"http://{_url_host(self.spec.host)}:{port}"

    def url(self) -> str:
        """The server's URL as other nodes reach it ("" before :meth:`start`)."""
        return self._url

    def info(self) -> dict[str, Any]:
        """Where things run: the actor's pid, the server's pid, URL and launch id, the log file."""
        h = self._handle
        return {
            "index": self.index,
            "actor_pid": os.getpid(),
            "node_id": _node_id(),
            "server_pid": h.pid if h is not None else None,
            "url": self._url,
            "launch_id": self._launch_id,
            "log_path": str(h.log_path) if h is not None else None,
        }

    def ping(self) -> bool:
        """True (the actor answers: it is not dead or restarting)."""
        return True

    def healthy(self) -> bool:
        """The server process runs and answers ``/health`` with 200."""
        if self._handle is None or not self._handle.is_running():
            return False
        import httpx

        try:
            return httpx.get(self._handle.base_url + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def shutdown(self) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL); returns its exit code (None if none ran)."""
        code = None
        if self._handle is not None:
            code = self._handle.stop()
            self._handle = None
        if self._reaper is not None:
            with contextlib.suppress(ProcessLookupError):
                self._reaper.kill()
            with contextlib.suppress(Exception):
                self._reaper.wait(timeout=5)
            self._reaper = None
        return code

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()


class RewardWorkerActor:
    """Scores trajectories with a ``RewardManager`` built from the config's ``reward`` section
    (after importing the config's ``imports:``, so user reward functions resolve here too)."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self._manager: Any = None
        self.scored = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_manager"] = None  # rebuilt from the config on arrival
        return state

    def _rewards(self) -> Any:
        if self._manager is None:
            from agentrl.training import build_rewards
            from agentrl.user_code import import_user_modules

            import_user_modules(self.cfg.imports, self.cfg.base_dir)
            self._manager = build_rewards(self.cfg)
        return self._manager

    def connect_models(
        self,
        urls: dict[str, list[str]],
        api_key: str | None,
        teacher_urls: list[str] | None = None,
    ) -> None:
        """Reach the servers of the model rewards and of the distillation teacher (started by
        the trainer actor's builder)."""
        manager = self._rewards()
        manager.connect_models(urls, api_key)
        if teacher_urls:
            from agentrl.rollout.teacher import Teacher

            manager.teacher = Teacher.from_config(self.cfg)
            manager.teacher.connect(teacher_urls, api_key)

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        """``traj`` scored by the config's reward functions (see ``RewardManager.score``)."""
        out = await self._rewards().score(traj, task)
        self.scored += 1
        return out

    def info(self) -> dict[str, Any]:
        """The actor's pid and how many trajectories it scored."""
        return {"actor_pid": os.getpid(), "scored": self.scored}

    def ping(self) -> bool:
        """True (the actor answers: it is not dead or restarting)."""
        return True


class RemoteScorer:
    """The ``Scorer`` protocol over a :class:`RewardWorkerActor` handle (pickles: a handle does).

    A scoring whose reward actor died (``RayActorError``: killed, crashed, its node lost) is
    tried once more, once the actor answers again (Ray restarts it), counted
    ``reward_retries``. Scoring is a function of the trajectory and the task, so a second try
    gives the same answer (a reward with side effects, e.g. a paid judge, may run twice); a
    second failure reaches the worker as an error: a counted drop (``reward_errors``).
    Dropping at once instead would drop every episode that finishes while the actor restarts,
    enough in a row to stop the run. An error raised by the reward itself is not retried.
    """

    def __init__(self, handle: Any, *, restart_timeout_s: float = 120.0) -> None:
        self.handle = handle
        self.restart_timeout_s = restart_timeout_s
        self.counts: dict[str, int] = {}

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        """``traj`` scored by the reward actor (cancelling cancels the remote call)."""
        from ray.exceptions import RayActorError

        try:
            return await await_ref(self.handle.score.remote(traj, task))
        except RayActorError as exc:
            self.counts["reward_retries"] = self.counts.get("reward_retries", 0) + 1
            logger.warning(
                "the reward actor failed scoring episode %s/%d (%s); scoring it again once the "
                "actor answers",
                traj.uid,
                traj.index,
                type(exc).__name__,
            )
        await wait_reachable(self.handle, self.restart_timeout_s, what="the reward actor")
        return await await_ref(self.handle.score.remote(traj, task))


class AgentLoopWorkerActor:
    """An ``AgentLoopWorker`` built inside the actor: a ServerPool over the server URLs, the
    tokenizer from the model dir, the config's ToolSet (built on first use), and scoring through
    a reward actor (``reward``) or a local ``RewardManager`` (``reward=None``).

    The servers it routes to follow the run's :class:`~agentrl.distributed.faults.
    ServerDirectory`: each episode call carries its ``(generation, urls)``, and the pool is made
    to match when the generation changed, so a replaced server is used as soon as it was pushed
    to, and a restarted worker actor (built again from its constructor's URLs) catches up on its
    first call."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        server_urls: list[str],
        model_dir: str,
        worker_config: WorkerConfig,
        *,
        reward: Any = None,
        worker_id: int = 0,
    ) -> None:
        self.cfg = cfg
        self.server_urls = list(server_urls)
        self.model_dir = model_dir
        self.worker_config = worker_config
        self.reward = reward
        self.worker_id = worker_id
        self.episodes = 0
        self.running = 0
        """Episodes in flight in this actor now."""
        self.incarnation = uuid.uuid4().hex
        """New each time the constructor runs (so after Ray restarted the actor)."""
        self._generation = 0
        self._follow_lock: asyncio.Lock | None = None
        self._worker: AgentLoopWorker | None = None
        self._pool: Any = None
        self._scorer: RemoteScorer | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_worker"] = None  # rebuilt on the actor's node (pool, tokenizer, tools)
        state["_pool"] = None
        state["_scorer"] = None
        state["_follow_lock"] = None
        return state

    def _build(self) -> AgentLoopWorker:
        if self._worker is not None:
            return self._worker
        from transformers import AutoTokenizer

        from agentrl.inference.pool import ServerPool
        from agentrl.training import build_rewards, build_toolset
        from agentrl.user_code import import_user_modules

        # The user's agents, tools and rewards register themselves when imported: here too.
        import_user_modules(self.cfg.imports, self.cfg.base_dir)
        self._pool = ServerPool.from_config(
            self.server_urls,
            self.cfg.inference,
            api_key=self.cfg.inference.api_key,
            model=served_model(self.cfg),  # a LoRA run on vLLM samples from its adapter
        )
        self._pool.start()
        if self.reward is not None:
            self._scorer = RemoteScorer(self.reward)
        scorer: Any = self._scorer or build_rewards(self.cfg)
        self._worker = AgentLoopWorker(
            self._pool,
            AutoTokenizer.from_pretrained(
                self.model_dir, trust_remote_code=self.cfg.model.trust_remote_code
            ),
            tools=functools.partial(build_toolset, self.cfg),
            reward=scorer,
            config=self.worker_config,
            worker_id=self.worker_id,
        )
        return self._worker

    async def _follow(self, servers: tuple[int, list[str]] | None) -> None:
        """Route to the directory's servers when its generation is newer than the one followed
        (an empty list is ignored: the pool keeps failing over among the servers it has). One
        change at a time, so concurrent episodes never interleave two of them."""
        if servers is None or servers[0] <= self._generation or not servers[1]:
            return
        if self._follow_lock is None:
            self._follow_lock = asyncio.Lock()
        async with self._follow_lock:
            if servers[0] <= self._generation:
                return
            self._generation, urls = servers[0], list(servers[1])
            if self._pool is None:
                self.server_urls = urls
            else:
                await self._pool.set_servers(urls)

    async def run_episode(
        self, task: Task, uid: str, index: int, servers: tuple[int, list[str]] | None = None
    ) -> Trajectory | None:
        """``AgentLoopWorker.run_episode`` on this actor's worker (built on first use), routed
        to ``servers`` (a directory snapshot) when given."""
        await self._follow(servers)
        self.running += 1
        try:
            traj = await self._build().run_episode(task, uid, index)
        finally:
            self.running -= 1
        self.episodes += 1
        return traj

    async def run_episode_counted(
        self, task: Task, uid: str, index: int, servers: tuple[int, list[str]] | None = None
    ) -> tuple[Trajectory | None, dict[str, int], str]:
        """``run_episode`` plus the worker's counters and this actor's :attr:`incarnation`
        (one round trip for all)."""
        traj = await self.run_episode(task, uid, index, servers)
        return traj, self.counts(), self.incarnation

    def counts(self) -> dict[str, int]:
        """The worker's counters, the reward retries included (empty before the first episode)."""
        out = dict(self._worker.counts) if self._worker is not None else {}
        if self._scorer is not None:
            out.update(self._scorer.counts)
        return out

    def info(self) -> dict[str, Any]:
        """The actor's pid, its worker id, how many episodes it ran and runs now, and the
        servers it uses."""
        return {
            "actor_pid": os.getpid(),
            "node_id": _node_id(),
            "episodes": self.episodes,
            "running": self.running,
            "worker_id": self.worker_id,
            "servers": self._pool.urls if self._pool is not None else list(self.server_urls),
        }

    def ping(self) -> bool:
        """True (the actor answers: it is not dead or restarting)."""
        return True

    async def shutdown(self) -> None:
        """Close the worker's server pool."""
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None
        # Tools need no closing here: each episode releases its tool states when it ends.


class RemoteWorker:
    """The trainer-side stand-in for an :class:`AgentLoopWorkerActor`: what ``AgentLoopManager``
    needs of a worker (``run_episode``, ``counts``, ``available``); cancelling an episode cancels
    it remotely.

    Faults: a call that finds the actor dead raises (the manager re-dispatches the episode once);
    the next call first waits until the actor answers again (Ray restarts it, up to
    ``restart_timeout_s``), so episodes are not sent into a restart. An actor that is gone for
    good (its restarts used up) makes :attr:`available` false: the manager sends it nothing more.
    Counters survive a restart of the actor (the old incarnation's are kept), and
    ``worker_restarts`` counts the restarts seen.
    """

    def __init__(
        self,
        handle: Any,
        worker_id: int = 0,
        *,
        directory: Any = None,
        restart_timeout_s: float = 120.0,
    ) -> None:
        self.handle = handle
        self.worker_id = worker_id
        self.directory = directory
        """The run's :class:`~agentrl.distributed.faults.ServerDirectory` (None = the URLs the
        actor was built with, always)."""
        self.restart_timeout_s = restart_timeout_s
        self.available = True
        self._base: dict[str, int] = {}
        self._current: dict[str, int] = {}
        self._incarnation: str | None = None
        self._suspect = False

    @property
    def counts(self) -> dict[str, int]:
        """The actor's counters, summed over its incarnations, and ``worker_restarts``."""
        out = dict(self._base)
        for k, v in self._current.items():
            out[k] = out.get(k, 0) + v
        return out

    async def run_episode(self, task: Task, uid: str, index: int) -> Trajectory | None:
        """The remote episode's trajectory; the worker's counters are refreshed with it."""
        from ray.exceptions import RayActorError

        if self._suspect:
            await self._wait_until_back()
        servers = self.directory.snapshot() if self.directory is not None else None
        try:
            traj, counts, incarnation = await await_ref(
                self.handle.run_episode_counted.remote(task, uid, index, servers)
            )
        except RayActorError:  # died, restarting or unreachable: the manager re-dispatches
            self._suspect = True
            raise
        self._refresh(counts, incarnation)
        return traj

    async def _wait_until_back(self) -> None:
        from ray.exceptions import ActorDiedError

        try:
            await wait_reachable(
                self.handle, self.restart_timeout_s, what=f"worker actor {self.worker_id}"
            )
        except ActorDiedError:
            if self.available:
                logger.error("worker actor %d is gone for good (restarts used up)", self.worker_id)
            self.available = False
            raise
        self._suspect = False

    def _refresh(self, counts: dict[str, int], incarnation: str) -> None:
        if self._incarnation is not None and incarnation != self._incarnation:
            for k, v in self._current.items():  # the previous incarnation's final counters
                self._base[k] = self._base.get(k, 0) + v
            self._base["worker_restarts"] = self._base.get("worker_restarts", 0) + 1
        self._incarnation = incarnation
        self._current = dict(counts)


async def await_ref(ref: Any) -> Any:
    """The result of a Ray ``ObjectRef``; cancelling the await cancels the remote call."""
    import ray

    try:
        return await ref
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            ray.cancel(ref)
        raise


async def wait_reachable(handle: Any, timeout_s: float, *, what: str = "the actor") -> None:
    """Return once the actor behind ``handle`` answers ``ping()`` (it may be restarting).

    Raises ``ActorDiedError`` when it is gone for good (its restarts used up) and
    ``TimeoutError`` (naming ``what``) when it does not answer within ``timeout_s``.
    """
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await asyncio.wait_for(await_ref(handle.ping.remote()), max(1.0, timeout_s))
            return
        except ActorDiedError:
            raise
        except (ActorUnavailableError, RayActorError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what} did not answer within {timeout_s:g} s after it failed "
                    f"(Ray restarts it up to distributed.max_actor_restarts times): {exc}"
                ) from exc
        await asyncio.sleep(0.5)


def _node_id() -> str:
    """The Ray node this process runs on (hex); "" outside a connected Ray process (an actor
    class used in-process, as tests do)."""
    import ray

    if not getattr(ray, "is_initialized", lambda: False)():
        return ""
    return ray.get_runtime_context().get_node_id()
