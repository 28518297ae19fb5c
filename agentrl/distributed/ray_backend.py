"""``distributed.backend: ray``: the same components as the local run, placed as Ray actors.

Why it exists: one process (asyncio + server subprocesses) is the default and the fastest path on
one machine; a cluster needs the inference servers, the agent-loop workers, the reward workers
and the trainer on different nodes and GPUs. The classes that do the work are the ones the local
run uses (:func:`agentrl.serving.launch` of the same :func:`~agentrl.serving.spec_for` spec,
``AgentLoopWorker``, ``RewardManager``, ``Trainer``); this module only places them.

Placement (see docs/distributed.md)::

    driver: run_with_ray(cfg)
      InferenceServerActor x inference.num_servers   (num_gpus = distributed.num_gpus_per_server)
          -> one server subprocess on the actor's node; reports its URL
      RewardWorkerActor x 1                           -> RewardManager.score
      AgentLoopWorkerActor x rollout.num_workers      -> AgentLoopWorker over a ServerPool,
          scoring through RemoteScorer(reward actor)
      TrainerActor                                    (num_gpus = distributed.num_trainer_gpus)
          -> RayTrainer(cfg, server_urls=..., workers=[RemoteWorker(actor), ...],
                        server_actors=...).run()   (a Trainer; pushes via the ServerRegistry)
          TrainerRankActor x (trainer.world_size - 1)  (the same GPUs each; started by the
              trainer actor as trainer ranks 1..N-1, in one placement group with it on GPUs)

Guarantees:

- The trainer's ``AgentLoopManager`` runs unchanged: :class:`RemoteWorker` has the worker
  interface (``async run_episode``, ``counts``), and cancelling it cancels the remote episode.
- Every actor is shut down and killed when ``run_with_ray`` returns or raises; each server
  subprocess is stopped by its actor's ``shutdown()``, and a reaper process kills it if the actor
  process dies without shutting down (``ray.kill``, a crash).
- The actor classes are plain classes (``ray.remote`` is applied at placement time), so their
  constructor state pickles and they can be unit-tested without a cluster.
- Server, worker and reward actors that die are restarted by Ray
  (``distributed.max_actor_restarts``) and the run goes on (docs/distributed.md, "Faults"): a
  server that comes back on a new URL serves rollouts only after a verified push of the
  trainer's version (:mod:`agentrl.distributed.faults`); a failed worker's episode is
  re-dispatched once by the manager (:class:`RemoteWorker` raises, then waits for the restart);
  a scoring lost with the reward actor is tried once more (:class:`RemoteScorer`). Every
  retry is counted; Ray itself retries no call (``max_task_retries`` = 0).

Servers bind ``127.0.0.1`` unless ``AGENTRL_SERVER_BIND_HOST`` (or ``run_with_ray(...,
server_bind_host=)``) says otherwise; a multi-node cluster needs ``0.0.0.0`` there, and the URL
then carries the node's IP (``ray.util.get_node_ip_address()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.config import ExperimentConfig
from agentrl.inference.handle import ServerHandle
from agentrl.rollout.manager import AgentLoopWorker, WorkerConfig
from agentrl.serving import ServerSpec, launch, served_model, spec_for
from agentrl.types import Task, Trajectory

if TYPE_CHECKING:
    from agentrl.threads import ThreadPlan

__all__ = [
    "AgentLoopWorkerActor",
    "InferenceServerActor",
    "RayRankLauncher",
    "RemoteScorer",
    "RemoteWorker",
    "RewardWorkerActor",
    "TrainerActor",
    "TrainerRankActor",
    "run_with_ray",
    "trainer_bundles",
]

logger = logging.getLogger(__name__)

BIND_HOST_ENV = "AGENTRL_SERVER_BIND_HOST"

# Kills the server when the actor process that launched it is gone (argv: actor pid, server pid).
_REAPER = """
import os, signal, sys, time
parent, child = int(sys.argv[1]), int(sys.argv[2])
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while alive(parent) and alive(child):
    time.sleep(0.5)
if alive(child):
    os.kill(child, signal.SIGTERM)
    for _ in range(40):
        time.sleep(0.25)
        if not alive(child):
            break
    else:
        os.kill(child, signal.SIGKILL)
"""


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
        self._reaper = subprocess.Popen(
            [sys.executable, "-c", _REAPER, str(os.getpid()), str(handle.pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
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
            from agentrl.training.resolve import build_rewards
            from agentrl.user_code import import_user_modules

            import_user_modules(self.cfg.imports, self.cfg.base_dir)
            self._manager = build_rewards(self.cfg)
        return self._manager

    def connect_models(self, urls: dict[str, list[str]], api_key: str | None) -> None:
        """Reach the servers of the model rewards (started by the trainer actor's builder)."""
        self._rewards().connect_models(urls, api_key)

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
        from agentrl.training.resolve import build_rewards, build_toolset
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


class TrainerRankActor:
    """A follower trainer rank (rank 1..N-1 of ``trainer.world_size``) as a Ray actor: it joins
    rank 0 (the :class:`TrainerActor`) and runs :func:`agentrl.training.ranks.follow`, mirroring
    every model call of rank 0 until rank 0 sends stop."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = dict(env or {})
        """Its share of the trainer's threads (applied when it starts serving)."""

    def serve(self, spec: Any) -> int:
        """Join, build the models, run rank 0's commands until stop (the number run)."""
        from agentrl.threads import apply_env_threads
        from agentrl.training.ranks import follow

        os.environ.update(self.env)
        apply_env_threads()
        try:
            return follow(spec)
        except Exception:
            logger.exception("trainer rank %d failed", spec.rank)
            raise

    def info(self) -> dict[str, Any]:
        return {"actor_pid": os.getpid()}


def _in_bundle(placement_group: Any, index: int) -> dict[str, Any]:
    """Ray ``.options()`` placing an actor in bundle ``index`` of ``placement_group`` (if any)."""
    if placement_group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=index
        )
    }


class RayRankLauncher:
    """Trainer ranks 1..N-1 as :class:`TrainerRankActor` s (the
    :class:`~agentrl.training.ranks.RankLauncher` of a run on Ray). Created by the trainer actor,
    which owns them: they die with it. Each gets ``num_gpus`` (``distributed.num_trainer_gpus``)
    and, with a placement group, its own bundle of it (bundle ``rank``)."""

    def __init__(self, num_gpus: float = 0.0, placement_group: Any = None) -> None:
        self.num_gpus = num_gpus
        self.placement_group = placement_group
        self.actors: dict[int, Any] = {}
        self.serving: dict[int, Any] = {}
        self._info: dict[int, Any] = {}

    def master_addr(self) -> str:
        """This node's IP, as Ray knows it."""
        import ray.util

        return ray.util.get_node_ip_address()

    def launch(self, spec: Any, env: dict[str, str]) -> None:
        """Create the rank's actor and start it serving (returns at once)."""
        import ray

        options = {"num_cpus": 0, "num_gpus": self.num_gpus}
        options.update(_in_bundle(self.placement_group, spec.rank))
        actor = ray.remote(TrainerRankActor).options(**options).remote(env)
        self.actors[spec.rank] = actor
        self._info[spec.rank] = actor.info.remote()  # before serve, which holds the actor
        self.serving[spec.rank] = actor.serve.remote(spec)

    def failures(self) -> dict[int, str]:
        """Ranks whose ``serve`` has ended (with its error, when it raised)."""
        import ray

        refs = list(self.serving.values())
        if not refs:
            return {}
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out: dict[int, str] = {}
        for rank, ref in self.serving.items():
            if ref in ready:
                try:
                    ray.get(ref)
                    out[rank] = "ended before the run stopped it"
                except Exception as exc:  # the rank's own error, reported to rank 0
                    out[rank] = f"failed: {exc}"
        return out

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every rank to return, then kill every rank actor."""
        import ray

        refs = list(self.serving.values())
        if refs and timeout_s > 0:
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor)

    def info(self) -> list[dict[str, Any]]:
        """Rank and actor pid of each rank actor started."""
        import ray

        out = []
        for rank, ref in self._info.items():
            pid = None
            with contextlib.suppress(Exception):
                details: dict[str, Any] = ray.get(ref, timeout=30)
                pid = details["actor_pid"]
            out.append({"rank": rank, "pid": pid})
        return out


def trainer_bundles(cfg: ExperimentConfig) -> list[dict[str, float]] | None:
    """The placement-group bundles of the trainer ranks: one ``{"GPU": num_trainer_gpus}``
    (plus ``distributed.resources.trainer``) per rank when ``trainer.world_size`` > 1 and the
    trainer asks for GPUs (so that Ray reserves them together; strategy ``PACK``), else None
    (no placement group)."""
    gpus = cfg.distributed.num_trainer_gpus
    if cfg.trainer.world_size == 1 or gpus <= 0:
        return None
    extra = dict(cfg.distributed.resources.get("trainer", {}))
    return [{"GPU": gpus, **extra} for _ in range(cfg.trainer.world_size)]


class TrainerActor:
    """Runs ``Trainer(cfg, server_urls=, workers=)`` in the actor and returns its ``TrainResult``.

    With ``trainer.world_size`` N > 1 it is trainer rank 0, and ranks 1..N-1 are
    :class:`TrainerRankActor` s it starts (:class:`RayRankLauncher`, in ``placement_group``).
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        resume: bool = False,
        stop_after_step: int | None = None,
        placement_group: Any = None,
    ) -> None:
        self.cfg = cfg
        self.resume = resume
        self.stop_after_step = stop_after_step
        self.placement_group = placement_group
        self._ranks: list[dict[str, Any]] = []
        self._trainer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_ranks"] = []
        state["_trainer"] = None
        return state

    async def run(
        self,
        server_urls: list[str],
        worker_handles: list[Any],
        server_handles: list[Any] | None = None,
        reward: Any = None,
    ) -> Any:
        """Train to the end with these servers and remote workers; returns the ``TrainResult``.

        ``server_handles`` (the :class:`InferenceServerActor` s behind ``server_urls``, in the
        same order) let the run follow servers that restart on new URLs
        (:class:`~agentrl.distributed.faults.ServerRegistry`). ``reward`` (the
        :class:`RewardWorkerActor` the workers score through) is told the servers of the model
        rewards (``reward.models``) this actor's builder started.
        """
        from agentrl.distributed.faults import RayTrainer, ServerDirectory
        from agentrl.training.ranks import launcher_scope

        async def connect_rewards(run: Any) -> None:
            if reward is not None and self.cfg.reward.models:
                await await_ref(reward.connect_models.remote(*run.rewards.model_servers()))

        directory = ServerDirectory(urls=list(server_urls))
        workers = [RemoteWorker(h, i, directory=directory) for i, h in enumerate(worker_handles)]
        trainer = RayTrainer(
            self.cfg,
            server_actors=list(server_handles or []),
            directory=directory,
            resume=self.resume,
            server_urls=server_urls,
            stop_after_step=self.stop_after_step,
            workers=workers or None,
            on_built=connect_rewards,
        )
        self._trainer = trainer
        launcher = None
        if self.cfg.trainer.world_size > 1:
            launcher = RayRankLauncher(self.cfg.distributed.num_trainer_gpus, self.placement_group)
        try:
            with launcher_scope(launcher):
                return await trainer.run()
        finally:
            if launcher is not None:
                self._ranks = launcher.info()

    def accounting(self) -> dict[str, Any]:
        """Where the last run's tasks and servers stand: the task ids dispatched, trained and
        dropped (the rest of the dispatched ones are pending), and the server registry's view
        (:meth:`~agentrl.distributed.faults.ServerRegistry.info`)."""
        t = self._trainer
        if t is None:
            return {}
        return {
            "dispatched": list(t.dispatched_task_ids),
            "trained": list(t.trained_task_ids),
            "dropped": list(t.dropped_task_ids),
            "servers": t.registry.info() if t.registry is not None else {},
        }

    def info(self) -> dict[str, Any]:
        """The actor's pid."""
        return {"actor_pid": os.getpid()}

    def rank_info(self) -> list[dict[str, Any]]:
        """Rank and pid of each follower rank actor of the last run (empty with one rank)."""
        return list(self._ranks)


# ---- placement ----------------------------------------------------------------------------------
def _connect(address: str | None) -> bool:
    """Join ``address`` (or a running cluster), else start a local one. True if we connected
    (:mod:`agentrl.distributed.cluster`: a cluster we start has its own token, whatever
    ``~/.ray`` holds)."""
    from agentrl.distributed.cluster import connect
    from agentrl.training.run_log import LOG_LEVEL_ENV

    root = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": pythonpath, LOG_LEVEL_ENV: os.environ.get(LOG_LEVEL_ENV, "info")}
    # Every actor logs like the driver; Ray forwards its lines with a "(Actor pid=N)" prefix
    # (uncoloured in a log file).
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    hook = "agentrl.training.run_log.configure_from_env"
    return connect(address, {"env_vars": env, "worker_process_setup_hook": hook})


def _absolute(cfg: ExperimentConfig) -> ExperimentConfig:
    """Paths every actor must resolve the same way (their working directories differ)."""
    cfg = cfg.model_copy(deep=True)
    cfg.base_dir = str(Path(cfg.base_dir or ".").resolve())
    cfg.trainer.output_dir = str(Path(cfg.trainer.output_dir).resolve())
    if cfg.model.path:
        cfg.model.path = str(Path(cfg.model.path).resolve())
    if cfg.checkpoint.shared_dir is not None:
        cfg.checkpoint.shared_dir = str(Path(cfg.checkpoint.shared_dir).resolve())
    return cfg


def run_with_ray(
    cfg: ExperimentConfig,
    *,
    resume: bool = False,
    stop_after_step: int | None = None,
    server_bind_host: str | None = None,
    placement_info: dict[str, Any] | None = None,
) -> Any:
    """Train ``cfg`` with servers, workers, the reward worker and the trainer as Ray actors.

    Connects to ``distributed.ray_address`` (or a running cluster, else a local one), places
    the actors, runs the trainer actor to the end and returns its ``TrainResult``. Every actor
    is shut down and killed on the way out, also on failure. ``placement_info``, when given, is
    filled with what ran where (actor and server pids, per-actor episode counts; ``handles``:
    the actor handles, as soon as they exist; ``accounting``: the trainer's task ids and server
    registry) for tests and logs.

    Server, worker and reward actors are restarted by Ray when they die (up to
    ``distributed.max_actor_restarts`` times each; see docs/distributed.md, "Faults").
    """
    import ray

    from agentrl.threads import make_plan
    from agentrl.training.build import server_api_key, worker_config
    from agentrl.training.resolve import model_dir, resolve_experiment

    cfg = _absolute(cfg)
    # One bearer token for the servers this run places; every actor gets it inside the config
    # (an excluded field: never in the logged params or the written config).
    cfg.inference.api_key = server_api_key(cfg, launching=cfg.inference.backend != "external")
    # Every name and file resolves in the driver first: a mistake fails before any actor starts.
    plan = resolve_experiment(cfg).plan
    inf, dist = cfg.inference, cfg.distributed
    bind_host = server_bind_host or os.environ.get(BIND_HOST_ENV, "127.0.0.1")
    started = _connect(dist.ray_address)
    info = placement_info if placement_info is not None else {}
    actors: list[Any] = []  # every actor placed so far: all are shut down in the finally
    try:
        model_path = str(model_dir(cfg))  # builds the tiny model (if any); starts nothing
        workers_cfg = worker_config(cfg, greedy_baseline=plan.advantage.needs_greedy_baseline)
        # The servers share this machine's cpus with the trainer (one plan; vLLM sizes itself).
        threads = make_plan(
            inf.num_servers,
            cpus=dist.cpus,
            server_threads=dist.server_threads,
            server_nice=dist.server_nice,
        )
        servers, urls = _place_servers(cfg, model_path, bind_host, threads, actors)
        reward, workers = _place_workers(cfg, urls, model_path, workers_cfg, actors)
        info["handles"] = {"servers": servers, "workers": workers, "reward": reward}
        info["servers"] = ray.get([a.info.remote() for a in servers], timeout=60)
        result = _run_trainer(
            cfg,
            urls,
            workers,
            actors,
            info,
            servers=servers,
            resume=resume,
            stop_after_step=stop_after_step,
            reward=reward,
        )
        _collect_info(info, servers, workers, reward)
        return result
    finally:
        _shutdown(actors)
        if started:
            from agentrl.distributed.cluster import disconnect

            disconnect()


def _role_options(cfg: ExperimentConfig, role: str) -> dict[str, Any]:
    """Ray ``.options()`` placing a role's actors: ``distributed.resources[role]`` (custom
    resources) and, for servers and workers, ``distributed.placement: spread``."""
    dist = cfg.distributed
    options: dict[str, Any] = {}
    if dist.resources.get(role):  # type: ignore[call-overload]  # a role name of the Literal
        options["resources"] = dict(dist.resources[role])  # type: ignore[index]
    if dist.placement == "spread" and role in ("server", "worker"):
        options["scheduling_strategy"] = "SPREAD"
    return options


def _node_id() -> str:
    """The Ray node this process runs on (hex)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def _restarts(cfg: ExperimentConfig) -> dict[str, Any]:
    """Ray ``.options()`` of the actors that are restarted when they die (servers, workers, the
    reward actor). ``max_task_retries`` stays 0: Ray never runs a call again by itself; the run
    decides what is tried again, and counts it (the registry polls the servers, the manager
    re-dispatches an episode once, :class:`RemoteScorer` scores once more)."""
    return {"max_restarts": cfg.distributed.max_actor_restarts, "max_task_retries": 0}


def _place_workers(
    cfg: ExperimentConfig,
    urls: list[str],
    model_path: str,
    workers_cfg: WorkerConfig,
    actors: list[Any],
) -> tuple[Any, list[Any]]:
    """The reward actor and ``rollout.num_workers`` worker actors (added to ``actors``)."""
    import ray

    reward_cls = ray.remote(RewardWorkerActor).options(
        num_cpus=0, **_restarts(cfg), **_role_options(cfg, "reward")
    )
    reward = reward_cls.remote(cfg)
    actors.append(reward)
    worker_cls = ray.remote(AgentLoopWorkerActor).options(
        num_cpus=0, **_restarts(cfg), **_role_options(cfg, "worker")
    )
    workers = [
        worker_cls.remote(cfg, urls, model_path, workers_cfg, reward=reward, worker_id=i)
        for i in range(cfg.rollout.num_workers)
    ]
    actors.extend(workers)
    return reward, workers


def _collect_info(
    info: dict[str, Any], servers: list[Any], workers: list[Any], reward: Any
) -> None:
    """What ran where, after the run: per-worker episodes and counters, the reward actor's
    count, and each server actor's server now (``servers_final``; a restarted one differs)."""
    import ray

    info["workers"] = ray.get([w.info.remote() for w in workers], timeout=60)
    info["worker_counts"] = ray.get([w.counts.remote() for w in workers], timeout=60)
    info["reward"] = ray.get(reward.info.remote(), timeout=60)
    info["servers_final"] = ray.get([a.info.remote() for a in servers], timeout=60)


def _place_servers(
    cfg: ExperimentConfig,
    model_path: str,
    bind_host: str,
    threads: ThreadPlan,
    actors: list[Any],
) -> tuple[list[Any], list[str]]:
    """The server actors and the URLs the workers use. With ``inference.backend: external``
    none is placed (the configured URLs); else ``inference.num_servers`` actors are placed, each
    added to ``actors`` as soon as it exists (so a failure later still shuts it down), and
    started (up to 600 s)."""
    import ray

    inf, dist = cfg.inference, cfg.distributed
    if inf.backend == "external":
        return [], list(inf.urls)
    server_cls = ray.remote(InferenceServerActor).options(
        num_cpus=0,
        num_gpus=dist.num_gpus_per_server,
        **_restarts(cfg),
        **_role_options(cfg, "server"),
    )
    log_dir = str(Path(cfg.trainer.output_dir) / "logs")
    servers: list[Any] = []
    for i in range(inf.num_servers):
        spec = spec_for(
            cfg,
            "policy",
            index=i,
            model=model_path,
            plan=threads,
            api_key=inf.api_key,
            host=bind_host,
        )
        a = server_cls.remote(spec, index=i, log_dir=log_dir)
        servers.append(a)
        actors.append(a)
    urls = ray.get([a.start.remote() for a in servers], timeout=inf.startup_timeout_s + 300)
    return servers, urls


def _run_trainer(
    cfg: ExperimentConfig,
    urls: list[str],
    workers: list[Any],
    actors: list[Any],
    info: dict[str, Any],
    *,
    servers: list[Any],
    resume: bool,
    stop_after_step: int | None,
    reward: Any = None,
) -> Any:
    """Place the trainer actor (trainer rank 0; in a placement group with its ranks' GPUs when
    :func:`trainer_bundles` asks for one), run it to the end and return its ``TrainResult``.
    The trainer actor itself is not restarted: its state is the run (``--resume`` continues
    it from the last checkpoint)."""
    import ray

    group = _trainer_group(cfg)
    try:
        trainer = (
            ray.remote(TrainerActor)
            .options(
                num_cpus=0,
                num_gpus=cfg.distributed.num_trainer_gpus,
                **(_in_bundle(group, 0) or _role_options(cfg, "trainer")),
            )
            .remote(cfg, resume=resume, stop_after_step=stop_after_step, placement_group=group)
        )
        actors.append(trainer)
        info["trainer"] = ray.get(trainer.info.remote(), timeout=120)
        t0 = time.perf_counter()
        try:
            return ray.get(trainer.run.remote(urls, workers, servers, reward))
        finally:
            info["train_wall_s"] = time.perf_counter() - t0
            with contextlib.suppress(Exception):
                info["trainer_ranks"] = ray.get(trainer.rank_info.remote(), timeout=60)
            with contextlib.suppress(Exception):
                info["accounting"] = ray.get(trainer.accounting.remote(), timeout=60)
    finally:
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(group)


def _trainer_group(cfg: ExperimentConfig) -> Any:
    """A ready placement group for the trainer ranks' GPUs (:func:`trainer_bundles`), or None."""
    bundles = trainer_bundles(cfg)
    if bundles is None:
        return None
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=600)
    except Exception as exc:
        with contextlib.suppress(Exception):
            remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not reserve {len(bundles)} x {bundles[0]['GPU']} GPU(s) for the trainer "
            f"ranks (trainer.world_size={cfg.trainer.world_size}, distributed.num_trainer_gpus="
            f"{cfg.distributed.num_trainer_gpus}) within 600 s: {exc}"
        ) from exc
    return group


def _shutdown(actors: list[Any]) -> None:
    """Ask every actor to shut down (servers stop their processes), then kill them all."""
    import ray

    refs = [a.shutdown.remote() for a in actors if hasattr(a, "shutdown")]
    with contextlib.suppress(Exception):
        ray.wait(refs, num_returns=len(refs), timeout=60)
    for a in actors:
        with contextlib.suppress(Exception):
            ray.kill(a)
