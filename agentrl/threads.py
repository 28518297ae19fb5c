"""One CPU-thread plan for every process of a run.

Why it exists: torch sizes its intra-op pool to every core it can see, in *every* process. A
run is several processes (the trainer, each embedded inference server, tool/reward workers), so
on a 2-core laptop the quickstart ran 3 processes x 2 threads, and was measured 1.5-3x slower
than with one thread each; weight pushes queued 0.5-22 s behind oversubscribed generation.
Here the run decides, once, how many threads each process gets from the cores it may use, and
each process applies its share before torch starts any parallel work.

Guarantees:

- :func:`make_plan` never gives a process fewer than one thread, and by default the threads of
  all processes add up to at most the usable cores (or one each when there are more processes
  than cores: one thread per process is the measured best then).
- When the trainer and the servers take turns (a synchronous run, ``max_staleness: 0``, or a
  colocated one), the trainer gets every usable core and the servers split them among
  themselves: the servers are idle while the trainer updates, and the other way round.
  Measured on 2 cores, the synchronous quickstart's step went from 0.74-0.75 to 0.64 s (12
  steps, trainer 1 vs 2 threads); an asynchronous run is as fast or faster with one (0.52-0.53
  vs 0.53-0.58 s).
- :meth:`ProcessThreads.env` is what a child process needs (``OMP_NUM_THREADS``,
  ``MKL_NUM_THREADS``, ...; ``AGENTRL_THREADS`` for our own servers), so a child that imports
  torch starts with the right pool; :meth:`ProcessThreads.apply` sets torch's intra-op and
  inter-op pools (and the CPU affinity when the plan pins) in the current process.
- When the processes outnumber the cores even at one thread each (the quickstart: a trainer
  and two servers on 2 cores), the local servers run at a lower priority (``nice``
  :data:`SERVER_NICE`): the trainer's step is the critical path of an asynchronous run, and
  the servers have the staleness bound's slack. They still get every cycle the trainer leaves
  (while it waits for rollouts or a push). Measured on 2 cores (``benchmarks/peers``), with
  the π_old pass folded into the update: agentrl's single-turn step went from 1.00-1.13x
  TRL's to 0.73-0.75x, the tool-calling step from 0.99-1.06x to 0.72-0.83x.
- The plan is plain data (it pickles, crosses Ray) and :meth:`ThreadPlan.describe` is the one
  line logged at start-up.

Example::

    plan = make_plan(num_servers=2)                 # 2 cores -> trainer 1, servers 1 + 1
    plan.trainer.apply()                            # in the trainer process, early
    env = {**os.environ, **plan.servers[0].env()}   # for the first server's subprocess
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "ProcessThreads",
    "ThreadPlan",
    "apply_env_threads",
    "available_cpus",
    "make_plan",
]

logger = logging.getLogger(__name__)

THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)
"""Environment variables that size the BLAS/OpenMP pools of a child process."""

ENV_THREADS = "AGENTRL_THREADS"
"""Set for a child process by the plan: its intra-op thread count (read by :func:`apply_env_threads`)."""
ENV_CPUS = "AGENTRL_CPUS"
"""Set for a child process by a pinning plan: its CPU list, comma separated."""
ENV_NICE = "AGENTRL_NICE"
"""Set for a child process that runs at a lower priority: the niceness to add."""
SERVER_NICE = 10
"""Niceness of local servers when the plan oversubscribes the cores (CFS weight 110 vs the
trainer's 1024: the trainer keeps its core while both want one)."""


def available_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (``os.sched_getaffinity``; all CPUs where unsupported)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class ProcessThreads:
    """The share of one process: intra-op threads, inter-op threads, and CPUs when pinned."""

    role: str
    threads: int
    interop_threads: int = 1
    cpus: tuple[int, ...] | None = None
    """CPUs to pin the process to; None = not pinned."""
    nice: int = 0
    """Niceness to add to the process (0 = the parent's priority)."""

    def env(self) -> dict[str, str]:
        """Environment for a child process that runs this share."""
        env = {name: str(self.threads) for name in THREAD_ENV_VARS}
        env[ENV_THREADS] = str(self.threads)
        if self.cpus is not None:
            env[ENV_CPUS] = ",".join(str(c) for c in self.cpus)
        if self.nice:
            env[ENV_NICE] = str(self.nice)
        return env

    def apply(self) -> None:
        """Size torch's pools (pin, lower the priority) in *this* process; call before torch
        does parallel work."""
        _apply(self.threads, self.interop_threads, self.cpus, self.nice)

    def describe(self) -> str:
        """``role=N`` (``@cpus`` when pinned, ``~nice`` when deprioritized)."""
        where = "" if self.cpus is None else "@" + ",".join(str(c) for c in self.cpus)
        nice = f"~{self.nice}" if self.nice else ""
        return f"{self.role}={self.threads}{where}{nice}"


@dataclass(frozen=True)
class ThreadPlan:
    """Threads of every process of one run, decided once from the usable CPUs."""

    cpus: tuple[int, ...]
    trainer: ProcessThreads
    servers: tuple[ProcessThreads, ...] = ()
    workers: ProcessThreads = field(default_factory=lambda: ProcessThreads("workers", 1))
    """Tool and reward worker processes (each gets this share)."""
    reward_servers: tuple[ProcessThreads, ...] = ()
    """Embedded servers of the model rewards (``reward.models``: reward models, judges)."""

    def describe(self) -> str:
        """One line for the start-up log, e.g. ``2 cpus: trainer=1 server0=1 server1=1``."""
        parts = [self.trainer.describe(), *(s.describe() for s in self.servers)]
        parts += [s.describe() for s in self.reward_servers]
        parts.append(self.workers.describe())
        return f"{len(self.cpus)} cpus: " + " ".join(parts)


def _share(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal positive integers (the first get the extra)."""
    base, extra = divmod(total, parts)
    return [max(1, base + (1 if i < extra else 0)) for i in range(parts)]


def make_plan(
    num_servers: int,
    *,
    cpus: Sequence[int] | int | None = None,
    trainer_threads: int | None = None,
    server_threads: int | None = None,
    pin: bool = False,
    external_servers: bool = False,
    reward_servers: int = 0,
    server_nice: int | None = None,
    turns: bool = False,
) -> ThreadPlan:
    """Split the usable CPUs between the trainer, ``num_servers`` local servers and
    ``reward_servers`` local model-reward servers.

    Args:
        num_servers: inference servers that run on this machine and share its CPUs.
        cpus: the CPUs the run may use: a list of CPU ids, a count (the first N of the
            affinity set), or None for every CPU of the affinity set.
        trainer_threads / server_threads: explicit shares (override the split).
        pin: pin each process to its own disjoint CPUs (needs at least one CPU per process;
            otherwise the plan is made without pinning and says so in the log).
        external_servers: the servers are not ours to size (vLLM sizes itself, or they run
            elsewhere): the trainer gets the CPUs the local servers leave.
        reward_servers: embedded servers of model rewards (reward models, judges) on this
            machine; each gets a server's share (``server_threads`` applies to them too).
        server_nice: niceness of every local server; None = :data:`SERVER_NICE` when the
            threads outnumber the CPUs and nothing is pinned, else 0.
        turns: the trainer and the servers take turns (a synchronous run, ``max_staleness``
            0, or a colocated one: no rollout runs while the trainer updates), so the trainer's
            share is every CPU and the servers split the CPUs among themselves.
    """
    usable = available_cpus()
    if isinstance(cpus, int):
        if cpus < 1:
            raise ValueError(f"distributed.cpus={cpus}: give a positive count or a list of CPUs")
        chosen = usable[:cpus] if cpus <= len(usable) else tuple(range(cpus))
    elif cpus is not None:
        chosen = tuple(sorted(set(int(c) for c in cpus)))
        if not chosen:
            raise ValueError("distributed.cpus=[]: list at least one CPU, or null for all")
    else:
        chosen = usable
    n = len(chosen)
    if reward_servers < 0:
        raise ValueError(f"reward_servers={reward_servers}; it must be >= 0")
    local_servers = 0 if external_servers else num_servers
    processes = 1 + local_servers + reward_servers
    shares = [n, *_share(n, processes - 1)] if turns and processes > 1 else _share(n, processes)
    t_trainer = trainer_threads or shares[0]
    t_servers = [server_threads or s for s in shares[1:]]
    cpu_sets: list[tuple[int, ...] | None] = [None] * processes
    if pin and turns and processes > 1:  # in its turn the trainer uses the servers' CPUs
        cpu_sets = [chosen[:t_trainer], *_pin_sets(t_servers, chosen)]
    elif pin:
        cpu_sets = _pin_sets([t_trainer, *t_servers], chosen)
    trainer = ProcessThreads("trainer", t_trainer, 1, cpu_sets[0])
    roles = [f"server{i}" for i in range(local_servers)]
    roles += [f"reward{i}" for i in range(reward_servers)]
    # More threads than cores and nobody pinned: the trainer wins contention (module docstring).
    if server_nice is None:
        oversubscribed = cpu_sets[0] is None and t_trainer + sum(t_servers) > n
        server_nice = SERVER_NICE if oversubscribed else 0
    elif not 0 <= server_nice <= 19:
        raise ValueError(f"distributed.server_nice={server_nice}: use 0-19, or null for auto")
    nice = server_nice
    others = [
        ProcessThreads(role, t, 1, cpu_sets[1 + i], nice)
        for i, (role, t) in enumerate(zip(roles, t_servers, strict=True))
    ]
    return ThreadPlan(
        cpus=chosen,
        trainer=trainer,
        servers=tuple(others[:local_servers]),
        reward_servers=tuple(others[local_servers:]),
    )


def _pin_sets(want: list[int], chosen: tuple[int, ...]) -> list[tuple[int, ...] | None]:
    """Disjoint CPU sets of ``want[i]`` CPUs each from ``chosen``, or no pinning at all (logged)
    when they do not fit."""
    if sum(want) > len(chosen):
        logger.warning(
            "distributed.pin_cpus: %d processes want %d threads but only %d cpus are usable; "
            "not pinning",
            len(want),
            sum(want),
            len(chosen),
        )
        return [None] * len(want)
    sets: list[tuple[int, ...] | None] = []
    start = 0
    for k in want:
        sets.append(chosen[start : start + k])
        start += k
    return sets


_applied: tuple[int, int, tuple[int, ...] | None] | None = None
_niced = False


def _apply(threads: int, interop: int, cpus: tuple[int, ...] | None, nice: int = 0) -> None:
    global _applied, _niced
    for name in THREAD_ENV_VARS:
        os.environ[name] = str(threads)
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError) as exc:
            logger.warning("cannot pin to cpus %s: %s", cpus, exc)
    if nice > 0 and not _niced:  # once per process: os.nice adds up
        try:
            os.nice(nice)
            _niced = True
        except (AttributeError, OSError) as exc:
            logger.warning("cannot lower the priority by %d: %s", nice, exc)
    import torch

    torch.set_num_threads(threads)
    if _applied is None or _applied[1] != interop:
        try:
            torch.set_num_interop_threads(interop)
        except RuntimeError:
            # Only settable before the first inter-op parallel work; keep what is there.
            logger.debug(
                "torch inter-op threads already fixed at %d", torch.get_num_interop_threads()
            )
    _applied = (threads, interop, cpus)


def apply_env_threads(default: int | None = None) -> int | None:
    """In a child process: apply the share its parent's plan put in the environment.

    Reads ``AGENTRL_THREADS`` (and ``AGENTRL_CPUS``, ``AGENTRL_NICE``); falls back to ``default``; returns the
    thread count applied, or None when neither is set (torch keeps its own default).
    """
    raw = os.environ.get(ENV_THREADS)
    threads = int(raw) if raw else default
    if threads is None:
        return None
    cpus_raw = os.environ.get(ENV_CPUS)
    cpus = tuple(int(c) for c in cpus_raw.split(",")) if cpus_raw else None
    _apply(max(1, threads), 1, cpus, int(os.environ.get(ENV_NICE) or 0))
    return threads
