"""``distributed.backend: ray``: the same components as the local run, placed as Ray actors.

Why it exists: one process (asyncio + server subprocesses) is the default and the fastest path on
one machine; a cluster needs the inference servers, the agent-loop workers, the reward workers
and the trainer on different nodes and GPUs. The actors it places live in
:mod:`agentrl.distributed.actors`; the classes that do the work are the ones the local run uses
(:func:`agentrl.serving.launch` of the same :func:`~agentrl.serving.spec_for` spec,
``AgentLoopWorker``, ``RewardManager``, ``Trainer``); this module only places them.

Placement (see docs/distributed.md)::

    driver: run_with_ray(cfg)
      InferenceServerActor x inference.num_servers   (num_gpus = distributed.num_gpus_per_server)
          -> one server subprocess on the actor's node; reports its URL
      RewardWorkerActor x 1                           -> RewardManager.score
      AgentLoopWorkerActor x rollout.num_workers      -> AgentLoopWorker over a ServerPool,
          scoring through RemoteScorer(reward actor)
      TrainerActor(cfg, resolved)                     (num_gpus = distributed.num_trainer_gpus)
          -> RayTrainer(cfg, resolved=, server_urls=..., workers=[RemoteWorker(actor), ...],
                        server_actors=...).run()   (a Trainer; pushes via the ServerRegistry)
          TrainerRankActor x (trainer.world_size - 1)  (the same GPUs each; started by the
              trainer actor as trainer ranks 1..N-1, in one placement group with it on GPUs)

Guarantees:

- The config is resolved once, in the driver (or by the caller: ``agentrl train``), and the
  trainer actor gets that ``Resolved`` (pickled with its constructor arguments): a mistake fails
  before any actor starts, and the actor neither reads the task files nor resolves again.
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

import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.config import ExperimentConfig
from agentrl.distributed.actors import (
    BIND_HOST_ENV,
    AgentLoopWorkerActor,
    InferenceServerActor,
    RemoteWorker,
    RewardWorkerActor,
    await_ref,
)
from agentrl.rollout.manager import WorkerConfig
from agentrl.serving import spec_for

if TYPE_CHECKING:
    from agentrl.threads import ThreadPlan
    from agentrl.training import Resolved

__all__ = [
    "RayRankLauncher",
    "TrainerActor",
    "TrainerRankActor",
    "run_with_ray",
    "trainer_bundles",
]

logger = logging.getLogger(__name__)


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
        from agentrl.training import follow

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
    """Runs ``Trainer(cfg, resolved=, server_urls=, workers=)`` in the actor and returns its
    ``TrainResult``; ``resolved`` is the driver's resolution of ``cfg`` (the actor does not
    resolve again).

    With ``trainer.world_size`` N > 1 it is trainer rank 0, and ranks 1..N-1 are
    :class:`TrainerRankActor` s it starts (:class:`RayRankLauncher`, in ``placement_group``).
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        resolved: Resolved | None = None,
        resume: bool = False,
        stop_after_step: int | None = None,
        placement_group: Any = None,
    ) -> None:
        self.cfg = cfg
        self.resolved = resolved
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
        rewards (``reward.models``) and of the teacher this actor's builder started.
        """
        from agentrl.distributed.faults import RayTrainer, ServerDirectory
        from agentrl.training import launcher_scope

        async def connect_rewards(run: Any) -> None:
            if reward is not None and (self.cfg.reward.models or self.cfg.teacher.enabled):
                teacher = run.rewards.teacher
                teacher_urls = teacher.servers.urls if teacher is not None else None
                ref = reward.connect_models.remote(*run.rewards.model_servers(), teacher_urls)
                await await_ref(ref)

        directory = ServerDirectory(urls=list(server_urls))
        workers = [RemoteWorker(h, i, directory=directory) for i, h in enumerate(worker_handles)]
        trainer = RayTrainer(
            self.cfg,
            resolved=self.resolved,
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
    from agentrl.training import LOG_LEVEL_ENV

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
    resolved: Resolved | None = None,
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
    registry) for tests and logs. ``resolved`` is the caller's resolution of ``cfg``
    (``agentrl train``'s); without one, ``cfg`` is resolved here. Either way the trainer actor
    gets it and does not resolve again.

    Server, worker and reward actors are restarted by Ray when they die (up to
    ``distributed.max_actor_restarts`` times each; see docs/distributed.md, "Faults").
    """
    import ray

    from agentrl.threads import make_plan
    from agentrl.training import model_dir, resolve_experiment, server_api_key, worker_config

    cfg = _absolute(cfg)
    # One bearer token for the servers this run places; every actor gets it inside the config
    # (an excluded field: never in the logged params or the written config).
    cfg.inference.api_key = server_api_key(cfg, launching=cfg.inference.backend != "external")
    # Every name and file resolves in the driver, once: a mistake fails before any actor starts.
    resolved = resolved if resolved is not None else resolve_experiment(cfg)
    plan = resolved.plan
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
            resolved,
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


def _role_options(
    cfg: ExperimentConfig, role: str, index: int = 0, nodes: list[str] | None = None
) -> dict[str, Any]:
    """Ray ``.options()`` placing actor ``index`` of a role: ``distributed.resources[role]``
    (custom resources) and, for servers and workers, ``distributed.placement: spread``: the
    ``nodes`` (:func:`spread_nodes`) dealt out in turn, each a soft node affinity (a restart
    after its node died goes to any node), or Ray's best-effort ``SPREAD`` without ``nodes``."""
    dist = cfg.distributed
    options: dict[str, Any] = {}
    if dist.resources.get(role):  # type: ignore[call-overload]  # a role name of the Literal
        options["resources"] = dict(dist.resources[role])  # type: ignore[index]
    if dist.placement == "spread" and role in ("server", "worker"):
        if nodes:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            node = nodes[index % len(nodes)]
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
            options["num_cpus"] = SPREAD_CPUS
        else:
            options["scheduling_strategy"] = "SPREAD"
    return options


SPREAD_CPUS = 0.01
"""The CPUs a spread actor requests (the others request none): Ray honours a soft node affinity
only for a request that is not empty. Measured on a two-node ``Cluster``: with 0 CPUs 10 of 24
actors went to the other node; with 0.01, 0 of 24."""


def spread_nodes(
    cfg: ExperimentConfig, role: str, alive: list[dict[str, Any]], here: str
) -> list[str]:
    """The ids of the nodes ``placement: spread`` deals ``role``'s actors to: of ``alive``
    (``ray.nodes()`` entries), those whose resources cover what the role requests (its
    ``distributed.resources``; a server's GPUs), the driver's node ``here`` first, then by id.
    Dealt out by the driver, not left to Ray's ``SPREAD``: that one is best effort, and once put
    every actor of a two-node test on one node (the second node not yet in the scheduler's
    view)."""
    dist = cfg.distributed
    need = {"CPU": SPREAD_CPUS, **(dist.resources.get(role) or {})}  # type: ignore[call-overload]
    if role == "server" and dist.num_gpus_per_server:
        need["GPU"] = dist.num_gpus_per_server
    fits = [
        n["NodeID"]
        for n in alive
        if n.get("Alive") and all(n["Resources"].get(k, 0) >= v for k, v in need.items())
    ]
    return sorted(fits, key=lambda node: (node != here, node))


def _spread(cfg: ExperimentConfig, role: str) -> list[str] | None:
    """:func:`spread_nodes` of the connected cluster, or None without ``placement: spread``."""
    if cfg.distributed.placement != "spread":
        return None
    import ray

    here = ray.get_runtime_context().get_node_id()
    return spread_nodes(cfg, role, ray.nodes(), here)


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
    worker_cls, nodes = ray.remote(AgentLoopWorkerActor), _spread(cfg, "worker")
    workers = [
        worker_cls.options(
            **{"num_cpus": 0, **_restarts(cfg), **_role_options(cfg, "worker", i, nodes)}
        ).remote(cfg, urls, model_path, workers_cfg, reward=reward, worker_id=i)
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
    server_cls, nodes = ray.remote(InferenceServerActor), _spread(cfg, "server")
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
        options = {"num_cpus": 0, "num_gpus": dist.num_gpus_per_server, **_restarts(cfg)}
        options.update(_role_options(cfg, "server", i, nodes))
        a = server_cls.options(**options).remote(spec, index=i, log_dir=log_dir)
        servers.append(a)
        actors.append(a)
    urls = ray.get([a.start.remote() for a in servers], timeout=inf.startup_timeout_s + 300)
    return servers, urls


def _run_trainer(
    cfg: ExperimentConfig,
    resolved: Resolved,
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
    :func:`trainer_bundles` asks for one) with the driver's ``resolved``, run it to the end and
    return its ``TrainResult``.
    The trainer actor itself is not restarted: its state is the run (``--resume`` continues
    it from the last checkpoint)."""
    import ray
    from ray.exceptions import ActorDiedError

    group = _trainer_group(cfg)
    try:
        trainer = (
            ray.remote(TrainerActor)
            .options(
                num_cpus=0,
                num_gpus=cfg.distributed.num_trainer_gpus,
                **(_in_bundle(group, 0) or _role_options(cfg, "trainer")),
            )
            .remote(
                cfg,
                resolved=resolved,
                resume=resume,
                stop_after_step=stop_after_step,
                placement_group=group,
            )
        )
        actors.append(trainer)
        info["trainer"] = ray.get(trainer.info.remote(), timeout=120)
        t0 = time.perf_counter()
        try:
            return ray.get(trainer.run.remote(urls, workers, servers, reward))
        except ActorDiedError as exc:
            raise _trainer_lost(exc) from exc
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


def _trainer_lost(exc: BaseException) -> Exception:
    """The run's end when the trainer actor died (its node lost, the process killed): a
    :class:`~agentrl.training.loop.RunFailed` that says how to go on."""
    from agentrl.training import RunFailed

    reason = next((line.strip() for line in str(exc).splitlines() if "died because" in line), "")
    return RunFailed(
        f"the trainer actor died ({reason or type(exc).__name__}); the trainer is not restarted: "
        "`agentrl train ... --resume` continues from the last checkpoint "
        "(distributed.resources.trainer pins the trainer to the nodes you trust most)"
    )


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
