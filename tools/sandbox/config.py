"""The configuration of one sandboxed call: its limits, the layout inside the sandbox, and the
configuration the supervisor reads.

Why it exists: the same numbers are enforced in three places (the supervisor's rlimits and
deadline inside, the parent's hard deadline and output caps outside, the bwrap tmpfs size), and
the paths inside the sandbox are shared by the command builder and the supervisor. Keeping them
in one module keeps the three in agreement.

What it guarantees: a :class:`SandboxLimits` is validated when built (a bad value raises a
``ValueError`` naming it and the accepted range) and frozen; :func:`supervisor_config` is the
whole contract with :mod:`tools.sandbox.supervisor` (plain JSON values).

Example::

    limits = SandboxLimits(wall_time_s=5, memory_mb=256, cpu_time_s=6)
    limits.hard_deadline_s      # 11.28: the parent's SIGKILL, past the supervisor's deadline
    limits.rlimits("root")      # {"RLIMIT_AS": 268435456, ..., "RLIMIT_NPROC": 17}
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tools.sandbox import seccomp, supervisor

__all__ = [
    "PROTECTED_PIDS",
    "SCRATCH",
    "SHMDIR",
    "STATE_FILE",
    "STATE_IN",
    "SUPERVISOR_FILE",
    "SUPERVISOR_IN_SANDBOX",
    "TMPDIR",
    "WORKDIR",
    "Isolation",
    "SandboxLimits",
    "supervisor_config",
]

# Layout inside the sandbox: one tmpfs (``disk_mb``) holds everything writable.
SCRATCH = "/sandbox"
WORKDIR = "/sandbox/work"
TMPDIR = "/sandbox/tmp"
SHMDIR = "/sandbox/shm"
STATE_IN = "/.agentrl/state.tar"
"""Where the previous call's archive is bound (read-only) for the supervisor to unpack."""
STATE_FILE = "state.tar"
"""The archive's name in the episode's host directory."""
SUPERVISOR_FILE = Path(supervisor.__file__).resolve()
"""The supervisor program on the host (run by this path when unsandboxed)."""
SUPERVISOR_IN_SANDBOX = "/.agentrl/supervisor.py"
"""Where :data:`SUPERVISOR_FILE` is bound (read-only) in the sandbox."""

PROTECTED_PIDS = (1, 2)
"""The pids (and process groups) the code may not signal, inside the sandbox's PID namespace:
bwrap's init (1) and the supervisor (2, its only child, a session leader). The supervisor
checks that it is one of them before it applies the seccomp filter that protects them."""
SANDBOX_OVERHEAD_PIDS = 3
"""Processes of a sandboxed call besides the code's: bwrap outside and its init inside the
PID namespace, and the supervisor (unsandboxed: the supervisor only)."""

IsolationMode = Literal["root", "userns"]


@dataclass(frozen=True)
class Isolation:
    """How this machine runs a sandboxed call (see :func:`tools.sandbox.probe.isolation`)."""

    bwrap: str
    """Path of the ``bwrap`` executable."""
    mode: IsolationMode
    """``root``: bwrap runs as root and drops to a per-call user id (``setpriv``);
    ``userns``: an unprivileged user namespace per call."""
    bind_paths: tuple[str, ...]
    """Read-only paths the sandbox holds besides ``/usr`` (the Python installation)."""
    setpriv: str = ""
    """Path of ``setpriv`` (root mode)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use. Enforced inside the sandbox except the output cap (the parent)."""

    wall_time_s: float = 5.0
    """Wall-clock seconds the code may run; then every process is killed."""
    memory_mb: int = 256
    """Address-space limit (RLIMIT_AS) of each process, in MiB; with a cgroup, the memory of
    the call's processes together (:attr:`cgroup_memory_bytes`)."""
    output_chars: int = 4000
    """Most characters of output returned, marker included."""
    cpu_time_s: float = 6.0
    """CPU seconds per process (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later)."""
    max_file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE), in MiB."""
    max_processes: int = 16
    """Most processes the code may have at once, itself included (RLIMIT_NPROC)."""
    disk_mb: int = 64
    """Size of the sandbox's tmpfs (working directory, ``/tmp``, ``/dev/shm``)."""

    def __post_init__(self) -> None:
        if self.wall_time_s <= 0:
            raise ValueError(f"PythonTool: wall_time_s must be > 0, got {self.wall_time_s}")
        if self.memory_mb < 32:
            raise ValueError(
                f"PythonTool: memory_mb={self.memory_mb} is too small for an interpreter; use >= 32"
            )
        if self.output_chars < 64:
            raise ValueError(f"PythonTool: max_output_chars must be >= 64, got {self.output_chars}")
        if self.max_processes < 1:
            raise ValueError(f"PythonTool: max_processes must be >= 1, got {self.max_processes}")
        if self.disk_mb < 1:
            raise ValueError(f"PythonTool: disk_mb must be >= 1, got {self.disk_mb}")

    @property
    def hard_deadline_s(self) -> float:
        """When the parent SIGKILLs bwrap: past the code's deadline, the supervisor needs a
        moment to archive the files (tmpfs reads)."""
        return self.wall_time_s + 5.0 + self.disk_mb / 50.0

    @property
    def cgroup_memory_bytes(self) -> int:
        """The call's cgroup memory limit: ``memory_mb`` for its processes plus ``disk_mb`` for
        its files (tmpfs pages are memory, charged to the cgroup like memfds and shm)."""
        return (self.memory_mb + self.disk_mb) * 1024 * 1024

    def cgroup_pids(self, sandboxed: bool) -> int:
        """The call's cgroup pids limit (tasks, threads included): ``max_processes`` plus
        bwrap's two processes and the supervisor (unsandboxed: the supervisor)."""
        return self.max_processes + (SANDBOX_OVERHEAD_PIDS if sandboxed else 1)

    @property
    def stream_cap_bytes(self) -> int:
        """Bytes of stdout (and of stderr) the parent keeps (head and tail)."""
        return 4 * self.output_chars + 4096

    @property
    def archive_cap_bytes(self) -> int:
        """Largest archive of the working directory kept for the next call."""
        return 2 * self.disk_mb * 1024 * 1024 + (1 << 20)

    def rlimits(self, mode: IsolationMode | None) -> dict[str, int]:
        """The supervisor's ``{RLIMIT_* name: value}`` under isolation ``mode`` (None =
        unsandboxed)."""
        rlimits: dict[str, int] = {
            "RLIMIT_AS": self.memory_mb * 1024 * 1024,
            "RLIMIT_CPU": math.ceil(self.cpu_time_s),
            "RLIMIT_FSIZE": self.max_file_mb * 1024 * 1024,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": 256,
        }
        if mode is not None:
            # The supervisor counts as one process of the sandbox's user; with a user namespace
            # bwrap's init (PID 1) does too.
            overhead = 1 if mode == "root" else 2
            rlimits["RLIMIT_NPROC"] = self.max_processes + overhead
        elif os.geteuid() != 0:
            rlimits["RLIMIT_NPROC"] = 4096  # counts every process of this user: a coarse brake
        return rlimits


def supervisor_config(
    limits: SandboxLimits,
    mode: IsolationMode | None,
    episode_dir: Path,
    status_fd: int,
    *,
    audit: bool,
    site_dirs: list[str],
    read_roots: list[str],
) -> dict[str, Any]:
    """The supervisor's configuration for one run (``mode`` None = unsandboxed).

    ``site_dirs`` are appended to the code's ``sys.path``; ``read_roots`` are readable under
    the audit hook (the interpreter's stdlib and site-packages).
    """
    sandboxed = mode is not None
    cwd = WORKDIR if sandboxed else str(episode_dir)
    return {
        "rlimits": limits.rlimits(mode),
        "cwd": cwd,
        "write_root": SCRATCH if sandboxed else cwd,
        "restore": STATE_IN if sandboxed else "",
        "archive": sandboxed,
        "sandboxed": sandboxed,
        "status_fd": status_fd,
        "wall_time_s": limits.wall_time_s,
        "audit": audit,
        "max_forks": limits.max_processes - 1 if sandboxed else 0,
        "site_dirs": site_dirs,
        "read_roots": read_roots,
        "seccomp": seccomp.filter_hex(PROTECTED_PIDS) if sandboxed else "",
        "protect_pids": list(PROTECTED_PIDS),
    }
