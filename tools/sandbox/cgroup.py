"""Per-call cgroups: memory and pids limits over every process of a call, shared memory included.

Why it exists: rlimits are per process. ``RLIMIT_AS`` does not see memfds, ``/dev/shm`` or
tmpfs pages once they are unmapped (96 x 16 MB memfds raised host memory by 1.5 GB under
``memory_mb=256``), and ``n`` processes get ``n x memory_mb``. A cgroup charges every page a
call's processes touch, files and memfds included, to one counter, and counts its processes.

How: the probe (:func:`detect`, once per process) finds where this process may create cgroups:

- **cgroup v2** (one unified hierarchy; what current distributions mount): a child of
  ``cgroup_parent`` (a delegated cgroup, e.g. a systemd scope with ``Delegate=yes``), else of
  this process's own cgroup, else of the hierarchy's root (root on a host), that offers the
  ``memory`` and ``pids`` controllers. Limits: ``memory.max``,
  ``memory.swap.max=0``, ``memory.oom.group=1`` (an OOM kills the whole call), ``pids.max``;
  the call is killed with ``cgroup.kill``.
- **cgroup v1** (separate ``memory`` and ``pids`` hierarchies, writable as root): one child in
  each. Limits: ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (when swap is
  accounted), ``pids.max``; the call is killed by SIGKILLing ``cgroup.procs`` until it is empty
  (a fork bomb is bounded by ``pids.max``).

Each call gets ``<base>/agentrl-sandbox/call-<pid>-<n>-<random>`` (v1: in both hierarchies);
the command starts through :func:`tools.sandbox.command.cgroup_prefix`, which moves itself into
the call's cgroups and then execs bwrap, so every process of the call is inside from its
first instruction. Where neither version is writable, :func:`detect` returns why, and the tool
falls back to rlimits with a warning, or refuses (``cgroups="required"``).

What it guarantees: the functions take the sysfs root and the ``/proc/self`` texts as
arguments, so the path logic of both versions is tested on any machine (a fake root in a
temporary directory); nothing here runs at import.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "BASE",
    "CallCgroup",
    "CgroupSetup",
    "CgroupUsage",
    "CgroupVersion",
    "detect",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "sweep",
]

BASE = "agentrl-sandbox"
"""The directory that holds the calls' cgroups, under the parent cgroup."""
CONTROLLERS = ("memory", "pids")
CgroupVersion = Literal["v1", "v2"]
_KILL_ROUNDS = 50
_COUNTER = itertools.count()


@dataclass(frozen=True)
class CgroupSetup:
    """Where this process creates the calls' cgroups (the answer of :func:`detect`)."""

    version: CgroupVersion
    bases: tuple[Path, ...]
    """v2: the one base directory; v1: the ``memory`` base, then the ``pids`` base."""
    swap: bool
    """Swap is accounted (v2 ``memory.swap.max``, v1 ``memory.memsw.*``) and set to none."""


@dataclass(frozen=True)
class CgroupUsage:
    """What a call's cgroup recorded (None: the kernel does not report it)."""

    memory_peak_bytes: int | None
    oom_kills: int
    pids_peak: int | None
    pids_refused: int
    """Forks refused at ``pids.max``."""


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as {controller: path}; the v2 entry (``0::/path``) under ``""``."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out[""] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def parse_mountinfo(text: str) -> dict[str, tuple[str, str]]:
    """Cgroup mounts of ``/proc/self/mountinfo`` as {controller: (mount point, mounted root)};
    the cgroup2 mount under ``""`` (the first mount of each wins)."""
    out: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4 or sep < 5:
            continue
        root, mount, fstype, options = fields[3], fields[4], fields[sep + 1], fields[sep + 3]
        if fstype == "cgroup2":
            out.setdefault("", (mount, root))
        elif fstype == "cgroup":
            for opt in options.split(","):
                if opt in CONTROLLERS:
                    out.setdefault(opt, (mount, root))
    return out


def _under(sys_root: Path, mount: str, mount_root: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` in a hierarchy mounted at ``mount`` (showing
    ``mount_root``), below ``sys_root``; None when the mount does not show it."""
    mount_root = mount_root.rstrip("/")
    if path != mount_root and not path.startswith(mount_root + "/"):
        return None
    rel = path[len(mount_root) :].strip("/")
    return sys_root / mount.lstrip("/") / rel


def _write(path: Path, value: str) -> None:
    """Write ``value`` to a cgroup file (one ``write``; the kernel reads it whole)."""
    with open(path, "w") as f:
        f.write(value)


def _read_kv(path: Path) -> dict[str, int]:
    """A ``key value`` cgroup file (``memory.events``, ``pids.events``) as ints; {} if absent."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def _read_int(path: Path) -> int | None:
    """A one-number cgroup file; None if absent or not a number (``max``)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _enable_controllers(directory: Path) -> None:
    """v2: make ``memory`` and ``pids`` available to the children of ``directory``."""
    enabled = set((directory / "cgroup.subtree_control").read_text().split())
    missing = [c for c in CONTROLLERS if c not in enabled]
    if missing:
        _write(directory / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))


def _try_v2(
    sys_root: Path, mounts: dict[str, tuple[str, str]], own: dict[str, str], parent: str | None
) -> CgroupSetup | str:
    """A v2 setup under ``parent``, else under this process's cgroup, else under the mounted
    root (as root on a host: the root cgroup may hold processes and still delegate); or why
    not (each candidate's reason)."""
    if "" not in mounts:
        return "no cgroup v2 hierarchy is mounted"
    mount, mount_root = mounts[""]
    if parent:
        given = Path(parent)
        candidates = [given if given.is_absolute() else sys_root / mount.lstrip("/") / parent]
    else:
        mine = _under(sys_root, mount, mount_root, own.get("", "/"))
        if mine is None:
            return "this process's cgroup v2 is outside the mounted hierarchy"
        candidates = list(dict.fromkeys([mine, sys_root / mount.lstrip("/")]))
    reasons: list[str] = []
    for directory in candidates:
        found = _v2_under(directory)
        if isinstance(found, CgroupSetup):
            return found
        reasons.append(found)
    return "; ".join(reasons)


def _v2_under(directory: Path) -> CgroupSetup | str:
    """A v2 setup with its base in cgroup ``directory``, or why not."""
    try:
        offered = set((directory / "cgroup.controllers").read_text().split())
    except OSError as e:
        return f"{directory} is not a cgroup v2 directory ({e.strerror})"
    missing = [c for c in CONTROLLERS if c not in offered]
    if missing:
        return f"cgroup v2 {directory} does not offer the {'/'.join(missing)} controller(s)"
    base = directory / BASE
    try:
        _enable_controllers(directory)
        base.mkdir(exist_ok=True)
        _enable_controllers(base)
    except OSError as e:
        return (
            f"cannot enable memory and pids for children of cgroup v2 {directory} ({e.strerror};"
            " a cgroup with processes cannot: give the tool a delegated cgroup of its own)"
        )
    return _trial(CgroupSetup("v2", (base,), (directory / "memory.swap.max").exists()))


def _try_v1(
    sys_root: Path, mounts: dict[str, tuple[str, str]], own: dict[str, str]
) -> CgroupSetup | str:
    """A v1 setup (a child in the ``memory`` and in the ``pids`` hierarchy), or why not."""
    bases: list[Path] = []
    for c in CONTROLLERS:
        if c not in mounts or c not in own:
            return f"no cgroup v1 {c} hierarchy is mounted"
        directory = _under(sys_root, *mounts[c], own[c])
        if directory is None or not (directory / "cgroup.procs").exists():
            return f"this process's cgroup v1 {c} directory is not visible"
        base = directory / BASE
        try:
            base.mkdir(exist_ok=True)
        except OSError as e:
            return f"cannot create cgroup v1 {base} ({e.strerror})"
        bases.append(base)
    swap = (bases[0].parent / "memory.memsw.limit_in_bytes").exists()
    return _trial(CgroupSetup("v1", tuple(bases), swap))


def _trial(setup: CgroupSetup) -> CgroupSetup | str:
    """``setup`` if a call's cgroup can really be made and limited there; else why not.
    Sweeps the cgroups of calls whose process is gone (a trainer killed mid-call) first."""
    sweep(setup)
    try:
        call = CallCgroup.create(setup, 64 << 20, 8)
    except OSError as e:
        return f"cannot create a limited cgroup {setup.version} under {setup.bases[0]} ({e})"
    call.remove()
    return setup


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this host's PID namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(setup: CgroupSetup) -> list[Path]:
    """Remove the calls' cgroups left by processes that are gone; the ones removed.

    Their processes died with them (bwrap's ``--die-with-parent``); a cgroup still holding
    one is left alone (``rmdir`` refuses it).
    """
    removed: list[Path] = []
    for base in setup.bases:
        try:
            entries = list(base.iterdir())
        except OSError:
            continue
        for d in entries:
            parts = d.name.split("-")
            if len(parts) < 3 or parts[0] != "call" or not parts[1].isdigit() or not d.is_dir():
                continue
            if _alive(int(parts[1])):
                continue
            with contextlib.suppress(OSError):
                d.rmdir()
                removed.append(d)
    return removed


_LOCK = threading.Lock()
_DETECTED: dict[str | None, CgroupSetup | str] = {}


def detect(
    parent: str | None = None,
    *,
    sys_root: Path = Path("/"),
    proc_cgroup: str | None = None,
    mountinfo: str | None = None,
) -> CgroupSetup | str:
    """Where calls' cgroups go (v2 first, then v1), or why nowhere (both versions' reasons).

    ``parent``: a v2 cgroup to use instead of this process's own (absolute path, or relative
    to the v2 mount); when it is given, only it is tried (it is what the operator asked for). ``sys_root``, ``proc_cgroup`` and ``mountinfo`` stand for ``/``,
    ``/proc/self/cgroup`` and ``/proc/self/mountinfo`` (tests pass a fake tree). Cached per
    ``parent`` for the real machine.
    """
    real = proc_cgroup is None and mountinfo is None and sys_root == Path("/")
    with _LOCK:
        if real and parent in _DETECTED:
            return _DETECTED[parent]
        if proc_cgroup is None:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        if mountinfo is None:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        mounts, own = parse_mountinfo(mountinfo), parse_proc_cgroup(proc_cgroup)
        v2 = _try_v2(sys_root, mounts, own, parent)
        if isinstance(v2, CgroupSetup) or parent:
            result = v2 if isinstance(v2, CgroupSetup) else f"cgroup v2: {v2}"
        else:
            v1 = _try_v1(sys_root, mounts, own)
            result = v1 if isinstance(v1, CgroupSetup) else f"cgroup v2: {v2}; cgroup v1: {v1}"
        if real:
            _DETECTED[parent] = result
        return result


@dataclass(frozen=True)
class CallCgroup:
    """The cgroup(s) of one call: created limited, killed, read, removed."""

    setup: CgroupSetup
    dirs: tuple[Path, ...]

    @classmethod
    def create(cls, setup: CgroupSetup, memory_bytes: int, pids: int) -> CallCgroup:
        """A fresh cgroup per base directory, its limits written before any process joins.

        Raises:
            OSError: a directory or a limit could not be written (nothing is left behind).
        """
        name = f"call-{os.getpid()}-{next(_COUNTER)}-{secrets.token_hex(3)}"
        call = cls(setup, tuple(base / name for base in setup.bases))
        try:
            for d in call.dirs:
                d.mkdir()
            for path, value in call.limit_files(memory_bytes, pids):
                _write(path, value)
        except OSError:
            call.remove()
            raise
        return call

    def limit_files(self, memory_bytes: int, pids: int) -> list[tuple[Path, str]]:
        """The (file, value) pairs that set the limits, in the order they must be written."""
        mem, swap = str(memory_bytes), self.setup.swap
        if self.setup.version == "v2":
            d = self.dirs[0]
            files = [(d / "memory.max", mem)]
            if swap:
                files.append((d / "memory.swap.max", "0"))
            return [*files, (d / "memory.oom.group", "1"), (d / "pids.max", str(pids))]
        memory, pid_dir = self.dirs
        files = [(memory / "memory.limit_in_bytes", mem)]
        if swap:  # memsw (memory + swap) may not be below memory: written after it
            files.append((memory / "memory.memsw.limit_in_bytes", mem))
        return [*files, (pid_dir / "pids.max", str(pids))]

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes its pid to, to join the call."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        """Processes in the call now."""
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return found

    def kill(self) -> bool:
        """SIGKILL every process of the call (v2 ``cgroup.kill`` first); True once it is empty."""
        if self.setup.version == "v2" and (self.dirs[0] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                _write(self.dirs[0] / "cgroup.kill", "1")
        for _ in range(_KILL_ROUNDS):
            alive = self.pids()
            if not alive:
                return True
            for pid in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.002)
        return not self.pids()

    def usage(self) -> CgroupUsage:
        """Peak memory and processes, OOM kills and refused forks, as the kernel counted them."""
        if self.setup.version == "v2":
            mem_dir = pid_dir = self.dirs[0]
            peak = _read_int(mem_dir / "memory.peak")
            ooms = _read_kv(mem_dir / "memory.events").get("oom_kill", 0)
        else:
            mem_dir, pid_dir = self.dirs
            peak = _read_int(mem_dir / "memory.max_usage_in_bytes")
            ooms = _read_kv(mem_dir / "memory.oom_control").get("oom_kill", 0)
        return CgroupUsage(
            memory_peak_bytes=peak,
            oom_kills=ooms,
            pids_peak=_read_int(pid_dir / "pids.peak"),
            pids_refused=_read_kv(pid_dir / "pids.events").get("max", 0),
        )

    def remove(self) -> bool:
        """Kill what is left and remove the directories; True when all are gone."""
        gone = True
        for d in self.dirs:
            for _ in range(_KILL_ROUNDS):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        gone = False
                        break
                    self.kill()
                    time.sleep(0.005)
            else:
                gone = False
        return gone
