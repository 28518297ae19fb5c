"""Trainer ranks driven by the run: rank 0 runs the loop, ranks 1..N-1 mirror its model calls.

Why it exists: with ``trainer.world_size`` N > 1, FSDP2 (:mod:`agentrl.training.fsdp`) shards the
actor, the reference and the critic over N processes, and every model call (a log-prob pass, an
update, a weight gather for a push, a save) becomes a collective that every rank must make, in
the same order, with the same arguments. The loop, the rollouts, the buffer and the weight pushes
stay in one process, though: only rank 0 talks to servers. So rank 0 is the trainer process, and
ranks 1..N-1 are followers that build the same models and execute each call rank 0 announces.

How:

- a control channel (:class:`ControlChannel`): ``broadcast_object_list`` from rank 0 on a
  dedicated gloo group (so it works beside an NCCL default group on GPUs). The first message is
  the :class:`Setup` (the config and the model directory); then :class:`Command` s: a method
  call of a role (``actor``, ``reference``, ``critic``), a function to run on every rank
  (checkpoint shards, :meth:`RankedModel.on_every_rank`), or stop;
- :class:`RankedModel` (rank 0): announces each collective call (:data:`COLLECTIVE_METHODS`),
  then runs it locally; any other attribute is the local model's. The loop and the step call the
  same methods as on a plain model;
- :func:`follow` (ranks 1..N-1): join, build, then receive and run until stop;
- launching (:class:`RankLauncher`): :class:`LocalRankLauncher` runs the followers as
  subprocesses (``python -m agentrl.training.ranks`` with ``RANK``/``WORLD_SIZE``/
  ``MASTER_ADDR``/``MASTER_PORT`` and its share of the trainer's threads); the Ray trainer actor
  installs a launcher of follower Ray actors with :func:`launcher_scope`.

Guarantees:

- every collective method is run by every rank in rank 0's order with rank 0's arguments (one
  lock orders the announcements, so two threads of rank 0 never interleave calls); the
  followers' results are dropped (gathered outputs are the same on every rank; rank 0's are
  the ones the run uses);
- no follower outlives the run: :meth:`Ranks.stop` (on the run's exit stack from the moment the
  first follower starts) sends stop, waits, kills what is left and destroys rank 0's process
  group. A follower whose rank 0 is gone exits: its gloo connections close, so the channel and
  every collective fail at once, and a local follower also watches its parent's pid;
- a follower that fails logs its traceback and exits; rank 0's call then fails with an error
  that names the rank, its exit and its log, and the ranks accept no further call.

Example (what :func:`agentrl.training.build.start_policies` does)::

    ranks = start_ranks(cfg, model_dir, threads=plan.trainer, register=stack.callback)
    policies = ranks.wrap(load_policies(cfg, model_dir, algo, dist=ranks.dist))
    policies.actor.update_with_log_probs(batch)   # runs on every rank
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

from agentrl.threads import ProcessThreads

__all__ = [
    "COLLECTIVE_METHODS",
    "Command",
    "ControlChannel",
    "LocalRankLauncher",
    "RankLauncher",
    "RankSpec",
    "RankedModel",
    "Ranks",
    "Setup",
    "follow",
    "launcher_scope",
    "rank_threads",
    "start_ranks",
]

logger = logging.getLogger(__name__)

COLLECTIVE_METHODS = frozenset(
    {
        "compute_log_probs",
        "compute_log_probs_and_sum_pi_squared",
        "update",
        "update_with_log_probs",
        "compute_values",
        "state_dict_for_push",
        "score_tokens",
        "save_pretrained",
        "full_state_dict",
    }
)
"""Model methods that are collectives under FSDP2: rank 0 announces each call to every rank."""

JOIN_TIMEOUT = timedelta(minutes=10)
"""How long the ranks wait for each other at start-up (slow imports, Ray actor placement)."""
CHANNEL_TIMEOUT = timedelta(days=7)
"""Followers wait this long for the next command (rank 0 may wait for rollouts for hours); a dead
rank 0 is noticed at once anyway (closed connections, the parent watchdog)."""
STOP_TIMEOUT_S = 60.0
"""How long a clean stop waits for the followers to exit before killing them."""

_ENV_DEVICE = "AGENTRL_TRAINER_DEVICE"
_ENV_PARENT = "AGENTRL_RANK0_PID"


# ---- messages and the channel ---------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """The first message to the followers: what to build (the same models as rank 0)."""

    cfg: Any
    """The run's ``ExperimentConfig``."""
    model_dir: str


@dataclass(frozen=True)
class Command:
    """One message of rank 0 to the followers."""

    kind: Literal["call", "every_rank", "stop"]
    role: str = ""
    """``actor``, ``reference`` or ``critic``."""
    method: str = ""
    """The model method of a ``call``."""
    fn: Callable[..., Any] | None = None
    """``fn(model, rank, world_size, *args)`` of an ``every_rank`` (a module-level function)."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


class ControlChannel:
    """Objects broadcast from rank 0 on a dedicated gloo group (pickled by torch)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def send(self, message: Any) -> None:
        """Rank 0: ``message`` to every follower."""
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self) -> Any:
        """A follower: the next message of rank 0 (blocks)."""
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Every rank waits for every other (after an ``every_rank`` command)."""
        import torch.distributed as dist

        dist.barrier(group=self.group)


@dataclass(frozen=True)
class RankSpec:
    """Where a rank joins: its rank, the world size, rank 0's store and the trainer device."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    device: str = "auto"

    def env(self) -> dict[str, str]:
        """The environment a follower subprocess reads (:func:`main`)."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            _ENV_DEVICE: self.device,
        }

    @classmethod
    def from_env(cls) -> RankSpec:
        """The spec of this follower subprocess (the inverse of :meth:`env`)."""
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
        ]
        if missing:
            raise RuntimeError(
                f"python -m agentrl.training.ranks: environment variables {missing} are not set; "
                "this module is started by the trainer (trainer.world_size > 1), not by hand"
            )
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
            device=os.environ.get(_ENV_DEVICE, "auto"),
        )


def _init_group(store: Any, rank: int, world_size: int, device: str) -> tuple[Any, ControlChannel]:
    """The default process group (NCCL on CUDA, else gloo), the gloo control group and this
    rank's :class:`~agentrl.training.fsdp.DistContext`; the same order on every rank."""
    import torch.distributed as dist

    from agentrl.training.actor import resolve_device
    from agentrl.training.fsdp import DistContext

    backend = "nccl" if resolve_device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    group = dist.new_group(backend="gloo", timeout=CHANNEL_TIMEOUT)
    return DistContext.current(device), ControlChannel(group)


# ---- rank 0 ---------------------------------------------------------------------------------
class RankLauncher(Protocol):
    """Starts and stops the follower ranks (ranks 1..N-1) of one run."""

    def master_addr(self) -> str:
        """The address followers reach rank 0's store at."""
        ...

    def launch(self, spec: RankSpec, env: dict[str, str]) -> None:
        """Start follower ``spec.rank`` with ``env`` (its thread share) added to its environment."""
        ...

    def failures(self) -> dict[int, str]:
        """Followers that have ended, and how (empty while every follower runs)."""
        ...

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the followers to end, then kill what is left."""
        ...

    def info(self) -> list[dict[str, Any]]:
        """Rank, pid and log of each follower started."""
        ...


_LAUNCHER: ContextVar[RankLauncher | None] = ContextVar("agentrl_rank_launcher", default=None)


@contextlib.contextmanager
def launcher_scope(launcher: RankLauncher | None) -> Iterator[None]:
    """Use ``launcher`` for the follower ranks of runs built inside this block (the Ray trainer
    actor's follower actors); None or outside any block: :class:`LocalRankLauncher`."""
    token = _LAUNCHER.set(launcher)
    try:
        yield
    finally:
        _LAUNCHER.reset(token)


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class LocalRankLauncher:
    """Followers as subprocesses of the trainer process (one machine), each logging to
    ``<log_dir>/rank<r>.log`` and watching the trainer's pid."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def master_addr(self) -> str:
        """Loopback: every rank runs on this machine."""
        return "127.0.0.1"

    def _log(self, rank: int) -> Path:
        return self.log_dir / f"rank{rank}.log"

    def launch(self, spec: RankSpec, env: dict[str, str]) -> None:
        """``python -m agentrl.training.ranks`` with the spec and ``env`` in its environment."""
        import agentrl

        self.log_dir.mkdir(parents=True, exist_ok=True)
        root = str(Path(agentrl.__file__).resolve().parents[1])
        pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        child_env = {**os.environ, **env, **spec.env(), "PYTHONPATH": pythonpath}
        child_env[_ENV_PARENT] = str(os.getpid())
        with open(self._log(spec.rank), "ab") as log:
            self.procs[spec.rank] = subprocess.Popen(
                [sys.executable, "-m", "agentrl.training.ranks"],
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def failures(self) -> dict[int, str]:
        """Followers that exited, with their status and the end of their log."""
        return {
            rank: f"exited with status {proc.returncode}; log {self._log(rank)}:\n"
            + _log_tail(self._log(rank))
            for rank, proc in self.procs.items()
            if proc.poll() is not None
        }

    def stop(self, timeout_s: float) -> None:
        """Wait for the followers, then SIGTERM and SIGKILL the ones still running."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)

    def info(self) -> list[dict[str, Any]]:
        """Rank, pid and log file of each follower subprocess."""
        return [{"rank": r, "pid": p.pid, "log": str(self._log(r))} for r, p in self.procs.items()]


def rank_threads(trainer: ProcessThreads, world_size: int) -> list[ProcessThreads]:
    """The trainer's thread share split over ``world_size`` ranks (at least one thread each;
    pinned CPUs are split too when there is one per rank)."""
    base, extra = divmod(trainer.threads, world_size)
    counts = [max(1, base + (1 if r < extra else 0)) for r in range(world_size)]
    cpus: list[tuple[int, ...] | None] = [trainer.cpus] * world_size
    if trainer.cpus is not None and len(trainer.cpus) >= world_size:
        start, parts = 0, []
        for n in counts:
            parts.append(trainer.cpus[start : start + n])
            start += n
        cpus = list(parts)
    return [
        ProcessThreads(f"rank{r}", counts[r], trainer.interop_threads, cpus[r])
        for r in range(world_size)
    ]


class _OutOfStep(RuntimeError):
    """A call after an earlier one failed: the ranks can no longer agree on what runs next."""


class Ranks:
    """Rank 0's side of the trainer ranks: the channel, the launcher, the order of calls."""

    def __init__(self, launcher: RankLauncher, world_size: int) -> None:
        self.launcher = launcher
        self.world_size = world_size
        self.dist: Any = None
        """This rank's :class:`~agentrl.training.fsdp.DistContext` (once joined)."""
        self.channel: ControlChannel | None = None
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._stopped = False

    # ---- calls --------------------------------------------------------------------------
    def call(self, model: Any, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Announce ``role.method(*args, **kwargs)`` to every rank, then run it on rank 0."""
        with self._lock:
            try:
                self._send(Command("call", role, method, args=args, kwargs=kwargs))
                return getattr(model, method)(*args, **kwargs)
            except Exception as exc:
                error = self._failed(exc, f"{role}.{method}")
                if error is exc:
                    raise
                raise error from exc
            except BaseException:
                self._broken = f"{role}.{method}"
                raise

    def every_rank(
        self, model: Any, role: str, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> Any:
        """``fn(model, rank, world_size, *args)`` on every rank (rank 0's result), then a barrier."""
        with self._lock:
            try:
                self._send(Command("every_rank", role, fn=fn, args=args))
                result = fn(model, 0, self.world_size, *args)
                assert self.channel is not None  # _send checked
                self.channel.barrier()
                return result
            except Exception as exc:
                error = self._failed(exc, f"{role}: {getattr(fn, '__name__', fn)}")
                if error is exc:
                    raise
                raise error from exc
            except BaseException:
                self._broken = f"{role}: {getattr(fn, '__name__', fn)}"
                raise

    def _send(self, command: Command) -> None:
        if self._stopped or self.channel is None:
            raise RuntimeError("the trainer ranks are not running (stopped, or never joined)")
        if self._broken is not None:
            raise _OutOfStep(
                f"the trainer ranks are out of step since {self._broken} failed; the run must stop"
            )
        failures = self.launcher.failures()
        if failures:
            raise RuntimeError(self._describe(failures, f"{command.role}.{command.method}"))
        self.channel.send(command)

    def _failed(self, exc: Exception, what: str) -> Exception:
        """The error to raise for a failed call: the follower's failure when one ended, else
        the call's own error."""
        if isinstance(exc, _OutOfStep):
            return exc
        self._broken = what
        deadline = time.monotonic() + 10.0  # a crashed follower's exit may lag its closed socket
        failures = self.launcher.failures()
        lost_peer = any(w in str(exc).lower() for w in ("closed", "reset", "peer"))
        while not failures and lost_peer and time.monotonic() < deadline:
            time.sleep(0.2)
            failures = self.launcher.failures()
        return RuntimeError(self._describe(failures, what)) if failures else exc

    @staticmethod
    def _describe(failures: dict[int, str], what: str) -> str:
        ranks = ", ".join(f"rank {r} {why}" for r, why in sorted(failures.items()))
        return f"a trainer rank failed during {what}: {ranks}"

    def wrap(self, policies: Any) -> Any:
        """``Policies`` whose models are :class:`RankedModel` proxies over these ranks."""
        from agentrl.training.step import Policies

        def ranked(role: str, model: Any) -> Any:
            return None if model is None else RankedModel(role, model, self)

        return Policies(
            actor=ranked("actor", policies.actor),
            reference=ranked("reference", policies.reference),
            critic=ranked("critic", policies.critic),
        )

    # ---- stop ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every follower (cleanly when the channel is in step, else by signal) and leave
        the process group; idempotent."""
        import torch.distributed as dist

        if self._stopped:
            return
        self._stopped = True
        clean = self.channel is not None and self._broken is None
        if clean and self._lock.acquire(timeout=5.0):
            try:
                clean = not self.launcher.failures()
                if clean:
                    self.channel.send(Command("stop"))  # type: ignore[union-attr]  # joined
            except Exception as exc:  # the stop goes on by signal
                logger.warning("could not send stop to the trainer ranks: %s", exc)
                clean = False
            finally:
                self._lock.release()
        else:
            clean = False
        self.launcher.stop(STOP_TIMEOUT_S if clean else 0.0)
        if self.channel is None or not dist.is_initialized():
            return
        # A call still running in another thread fails now that the followers are gone; leave
        # the group once it has (it releases the lock), not under its feet.
        if self._lock.acquire(timeout=30.0):
            self._lock.release()
            dist.destroy_process_group()
        else:
            logger.warning("a model call is still running on rank 0; its process group stays")


class RankedModel:
    """Rank 0's stand-in for one sharded model: each collective method call
    (:data:`COLLECTIVE_METHODS`) is announced to every rank, then run on rank 0's shard; every
    other attribute is the local model's (``config``, ``global_step``, ``temperature``...)."""

    def __init__(self, role: str, model: Any, ranks: Ranks) -> None:
        self.role = role
        self.local = model
        """Rank 0's model (calling its collectives directly would desynchronize the ranks)."""
        self.ranks = ranks

    @property
    def world_size(self) -> int:
        """Ranks the model is sharded over."""
        return self.ranks.world_size

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("role", "local", "ranks"):
            raise AttributeError(name)
        attr = getattr(self.local, name)
        if name in COLLECTIVE_METHODS:
            return functools.partial(self.ranks.call, self.local, self.role, name)
        return attr

    def on_every_rank(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(model, rank, world_size, *args)`` on every rank's shard (a module-level function,
        so that followers can import it); rank 0's result."""
        return self.ranks.every_rank(self.local, self.role, fn, args)


def _join_as_rank0(store: Any, ranks: Ranks, device: str) -> None:
    """Join the group as rank 0 while watching the followers: one that dies before joining is
    an error naming it, not a wait for the join timeout."""
    box: dict[str, Any] = {}

    def join() -> None:
        try:
            box["joined"] = _init_group(store, 0, ranks.world_size, device)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=join, name="rank0-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
    while thread.is_alive():
        thread.join(timeout=0.5)
        failures = ranks.launcher.failures()
        if failures and thread.is_alive():
            raise RuntimeError(Ranks._describe(failures, "start-up (joining the process group)"))
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer ranks did not join within {JOIN_TIMEOUT}")
    if "error" in box:
        raise box["error"]
    ranks.dist, ranks.channel = box["joined"]


def _check_local_gpus(device: str, world_size: int) -> None:
    """On CUDA every local rank needs a GPU of its own (NCCL refuses two ranks on one)."""
    import torch

    from agentrl.training.actor import resolve_device

    if resolve_device(device).type != "cuda":
        return
    gpus = torch.cuda.device_count()
    if gpus < world_size:
        raise ValueError(
            f"trainer.world_size={world_size} with trainer.device={device!r}: each rank needs a "
            f"GPU of its own, and this machine has {gpus}; set trainer.world_size<={gpus}, or "
            "trainer.device=cpu, or place the ranks on a Ray cluster (distributed.backend=ray)"
        )


def start_ranks(
    cfg: Any,
    model_dir: Path,
    *,
    threads: ProcessThreads,
    register: Callable[[Callable[[], None]], Any],
) -> Ranks:
    """Start ranks 1..N-1 (``N = cfg.trainer.world_size``), join them as rank 0 and send them the
    :class:`Setup`; the caller builds rank 0's models with ``ranks.dist`` and wraps them.

    ``register(ranks.stop)`` is called before the first follower starts (an exit stack's
    ``callback``). ``threads`` (the trainer's share) is split over the ranks; rank 0 applies its
    part here. The followers come from the launcher of :func:`launcher_scope`, else
    :class:`LocalRankLauncher` (logs in ``<output_dir>/logs``).
    """
    import torch.distributed as dist

    world = cfg.trainer.world_size
    if dist.is_initialized():
        raise RuntimeError(
            "trainer.world_size > 1 starts its own process group, but torch.distributed is "
            "already initialized in this process (torchrun?); run `agentrl train` as one process"
        )
    launcher = _LAUNCHER.get() or LocalRankLauncher(Path(cfg.trainer.output_dir) / "logs")
    if isinstance(launcher, LocalRankLauncher):
        _check_local_gpus(cfg.trainer.device, world)
    ranks = Ranks(launcher, world)
    register(ranks.stop)
    addr = launcher.master_addr()
    store = dist.TCPStore(
        addr, 0, world, is_master=True, wait_for_workers=False, timeout=JOIN_TIMEOUT
    )
    shares = rank_threads(threads, world)
    device = cfg.trainer.device
    for rank in range(1, world):
        launcher.launch(RankSpec(rank, world, addr, store.port, device), shares[rank].env())
    shares[0].apply()
    _join_as_rank0(store, ranks, device)
    assert ranks.channel is not None  # joined
    ranks.channel.send(Setup(cfg=cfg, model_dir=str(model_dir)))
    logger.info(
        "trainer ranks: %d (%s); rank 0 is this process, followers %s",
        world,
        " ".join(s.describe() for s in shares),
        launcher.info(),
    )
    return ranks


# ---- ranks 1..N-1 ---------------------------------------------------------------------------
def _build_followers_models(setup: Setup, dist_ctx: Any) -> dict[str, Any]:
    """The models rank 0 built, from the same config, sharded with ``dist_ctx``."""
    from agentrl.training.algorithm import build_algorithm
    from agentrl.training.policies import load_policies
    from agentrl.training.state import seed_everything
    from agentrl.user_code import import_user_modules

    cfg = setup.cfg
    import_user_modules(cfg.imports, cfg.base_dir)
    seed_everything(cfg.trainer.seed)
    plan = build_algorithm(cfg.algorithm, base_dir=cfg.base_dir)
    policies = load_policies(cfg, Path(setup.model_dir), plan, dist=dist_ctx)
    return {"actor": policies.actor, "reference": policies.reference, "critic": policies.critic}


def _serve(channel: ControlChannel, models: dict[str, Any], rank: int, world_size: int) -> int:
    """Run rank 0's commands until stop; the number of commands run."""
    done = 0
    while True:
        command: Command = channel.receive()
        if command.kind == "stop":
            return done
        model = models.get(command.role)
        if model is None:
            raise RuntimeError(f"rank {rank}: rank 0 called {command.role!r}, which was not built")
        if command.kind == "call":
            getattr(model, command.method)(*command.args, **command.kwargs)
        else:
            assert command.fn is not None  # every_rank
            command.fn(model, rank, world_size, *command.args)
            channel.barrier()
        done += 1


def follow(spec: RankSpec) -> int:
    """Run follower rank ``spec.rank`` to the end: join rank 0, build the models of its
    :class:`Setup`, run its commands until stop; the number of commands run. Raises when
    anything fails (rank 0 gone included); the process group is left on the way out."""
    import torch.distributed as dist

    store = dist.TCPStore(
        spec.master_addr, spec.master_port, spec.world_size, is_master=False, timeout=JOIN_TIMEOUT
    )
    dist_ctx, channel = _init_group(store, spec.rank, spec.world_size, spec.device)
    try:
        setup: Setup = channel.receive()
        models = _build_followers_models(setup, dist_ctx)
        return _serve(channel, models, spec.rank, spec.world_size)
    finally:
        dist.destroy_process_group()


def _watch_parent(pid: int) -> None:
    """Exit this process once ``pid`` (rank 0, our parent) is gone (reparented)."""

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="rank0-watchdog", daemon=True).start()


def main() -> int:
    """``python -m agentrl.training.ranks``: one follower subprocess (started by rank 0)."""
    from agentrl.threads import apply_env_threads

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    spec = RankSpec.from_env()
    if _ENV_PARENT in os.environ:
        _watch_parent(int(os.environ[_ENV_PARENT]))
    apply_env_threads()
    logger.info("trainer rank %d of %d: pid %d", spec.rank, spec.world_size, os.getpid())
    try:
        done = follow(spec)
    except Exception:
        logger.exception("trainer rank %d failed", spec.rank)
        return 1
    logger.info("trainer rank %d stopped after %d commands", spec.rank, done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
