"""A ``python`` tool: run model-written code in a sandboxed subprocess with hard limits.

Why it exists: code-executing agents need a tool that runs arbitrary snippets without taking
the rollout worker down with them (an infinite loop, a memory bomb, a stray ``fork``) and
without reaching the network or the files of the machine.

**This is a best-effort sandbox, not a security boundary against hostile code.** It contains
the mistakes a model makes while learning; a determined attacker with native code (a C
extension, a kernel bug) can get further. Run untrusted workloads in a container or VM too.

Layers, each on by default (``PythonTool`` arguments turn some off, for tests), and who
enforces them:

- **wall-time deadline** (parent process): the whole process group is SIGKILLed at
  ``wall_time_s`` (start-up included), on cancellation, and after every run (stragglers).
- **namespaces** (kernel; ``unshare``): a network namespace (only a down loopback, so every
  ``connect`` fails, even to 127.0.0.1); a PID namespace (the code runs as PID 1; when it
  exits or is killed, the kernel kills every process it forked, even one that called
  ``setsid``); a user namespace where available (limits cannot be raised again).
- **private root file system** (kernel; mount namespace + ``chroot``): the code sees a
  tmpfs root holding only ``/usr`` (and the ``/bin``, ``/lib``... links), the Python
  installation (both read-only), ``/dev/null``, ``/dev/urandom``, a ``/dev/shm`` and
  ``/tmp`` tmpfs, and its working directory (read-write) at its real path. ``/etc``, home
  directories, the project, other episodes' directories: none of it exists in there. All
  capabilities are dropped (``setpriv``) before the interpreter starts.
- **resource limits** (kernel; ``setrlimit`` before the code runs): RLIMIT_AS
  (``memory_mb``), RLIMIT_CPU (``cpu_time_s``), RLIMIT_FSIZE (``max_file_mb``),
  RLIMIT_NOFILE, RLIMIT_CORE = 0, and RLIMIT_NPROC when not root.
- **audit hook** (interpreter; PEP 578): opening, listing and changing files only inside the
  working directory (reading also inside the Python installation, for imports; symlinks are
  resolved first; paths must be ``str``/``bytes``/``pathlib`` objects); no sockets but
  AF_UNIX ones, no ``connect``/``bind``/DNS; no ``exec``/``system``/``Popen``/spawn; no
  ``ctypes``; no ``setrlimit``; no ``gc``/trace/frame introspection that would reach the
  hook itself; ``fork`` at most ``max_forks`` times from the top process, never from a
  child, and not at all without the PID namespace (nothing else could reap an escaped child).
- **environment** (parent): ``python -I -S`` (no user site, no ``PYTHON*`` variables, no
  ``.pth`` files; site-packages added explicitly), a scrubbed environment (``PATH``; ``HOME``
  and ``TMPDIR`` = the working directory; a UTF-8 locale), stdin closed once the code is
  read, a fresh temporary working directory per episode.

Which layers a machine supports is probed once per process and interpreter
(:func:`isolation`): ``unshare`` (util-linux) with root or unprivileged user namespaces gives
the namespaces; ``mount`` and ``chroot`` add the private root. Missing layers are skipped with
a warning (``namespaces=True`` / ``mount_namespace=True`` make them mandatory); without the
private root, the audit hook alone keeps the code out of the user's files.

State: each episode gets its own temporary directory (created on the first call, removed on
``release``); files persist across the calls of an episode, Python variables do not (every
call is a fresh interpreter).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from tools.base import Tool, ToolResult, truncate

__all__ = [
    "Isolation",
    "PythonTool",
    "SandboxRun",
    "interpreter_info",
    "isolation",
]

logger = logging.getLogger(__name__)

# The program the sandboxed interpreter runs first (``python -I -c _BOOTSTRAP CONFIG``): it
# sets the resource limits, installs the audit hook, then reads the user's code from stdin and
# executes it as ``__main__``. Kept dependency-free: only builtin modules before the hook.
_BOOTSTRAP = r"""
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
os.chdir(cfg["cwd"])
sys.argv = ["<code>"]
sys.dont_write_bytecode = True
for name, value in cfg["rlimits"].items():
    lim = getattr(resource, name)
    soft, hard = resource.getrlimit(lim)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(lim, (value, value))
code = sys.stdin.read()
sys.stdin.close()
os.close(0)
os.open(os.devnull, os.O_RDONLY)
sys.stdin = open(0, closefd=False)

def _install(root, read_roots, max_forks, pid_ns):
    # Everything the hook needs is bound here; no user code ever runs inside the hook (paths
    # must be str/bytes/pathlib objects, so no user __fspath__ runs between check and use).
    import _posixsubprocess, pathlib, socket
    def _no_spawn(*a, **k):
        raise PermissionError("sandbox: starting programs is disabled")
    _posixsubprocess.fork_exec = _no_spawn
    realpath, sep, fsdecode = os.path.realpath, os.sep, os.fsdecode
    PATH_TYPES = (pathlib.PosixPath, pathlib.PurePosixPath)
    AF_UNIX = socket.AF_UNIX
    state = {"forks": max_forks, "busy": False}
    os.register_at_fork(after_in_child=lambda: state.__setitem__("forks", 0))
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    READ_OK = ("/dev/null", "/dev/urandom")
    READ_EVENTS = {"os.listdir", "os.scandir", "glob.glob", "glob.glob/2", "os.getxattr",
                   "os.listxattr"}
    FS_EVENTS = READ_EVENTS | {
        "os.chdir", "os.mkdir", "os.remove", "os.rmdir", "os.rename", "os.link", "os.symlink",
        "os.chmod", "os.chown", "os.truncate", "os.utime", "os.chflags", "os.lchflags",
        "os.setxattr", "os.removexattr", "os.mkfifo", "os.mknod", "shutil.copyfile",
        "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.rmtree",
        "shutil.move", "shutil.chown", "shutil.make_archive", "shutil.unpack_archive",
        "tempfile.mkstemp", "tempfile.mkdtemp"}
    SPAWN = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
             "os.startfile", "pty.spawn", "os.forkpty"}
    NET = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
           "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
           "socket.gethostbyname_ex", "socket.getnameinfo", "http.client.connect",
           "urllib.Request", "ftplib.connect", "smtplib.connect", "telnetlib.Telnet.open",
           "webbrowser.open"}
    # Introspection that could reach the hook's own frames and state.
    DENY = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
            "sys.settrace", "sys.setprofile", "sys.addaudithook", "resource.setrlimit",
            "resource.prlimit", "os.setuid", "os.setgid"}
    BLOCKED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess"}
    SIMPLE = (int, float, type(None), tuple, bool)

    def as_text(path):
        t = type(path)
        if t is str:
            return path
        if t is bytes:
            return fsdecode(path)
        if t in PATH_TYPES:
            return str(path)
        raise PermissionError(
            f"sandbox: pass file paths as str, bytes or pathlib paths, not {t.__name__}")

    def check(path, write):
        text = as_text(path)
        p = realpath(text)
        if p == root or p.startswith(root + sep):
            return
        if not write:
            if p in READ_OK:
                return
            for r in read_roots:
                if p == r or p.startswith(r + sep):
                    return
        raise PermissionError(f"sandbox: access to {text!r} is outside the working directory")

    def hook(event, args):
        if state["busy"]:
            return
        if event == "open":
            path, mode, flags = args
            if type(path) is int:
                return
            write = bool(mode and any(c in mode for c in "wax+")) or bool(
                (flags or 0) & WRITE_FLAGS)
            check(path, write)
        elif event in FS_EVENTS:
            write = event not in READ_EVENTS
            for a in args:
                if not isinstance(a, SIMPLE):
                    check(a, write)
        elif event in SPAWN:
            raise PermissionError("sandbox: starting programs is disabled")
        elif event == "os.fork":
            if state["forks"] <= 0:
                raise PermissionError(
                    "sandbox: fork is disabled" if max_forks == 0 or not pid_ns
                    else "sandbox: fork limit reached (children may not fork)")
            state["forks"] -= 1
        elif event in ("os.kill", "os.killpg") and not pid_ns:
            if args and args[0] not in (0, os.getpid()):
                raise PermissionError("sandbox: signalling other processes is disabled")
        elif event == "socket.__new__":
            if len(args) > 1 and args[1] != AF_UNIX:
                raise PermissionError("sandbox: network access is disabled")
        elif event in NET:
            raise PermissionError("sandbox: network access is disabled")
        elif event == "import" and args and args[0] in BLOCKED_IMPORTS:
            raise ImportError(f"sandbox: module {args[0]!r} is disabled")
        elif event in DENY or event.startswith("ctypes."):
            raise PermissionError(f"sandbox: {event} is disabled")
        elif event == "object.__setattr__" and len(args) > 1 and args[1] == "__code__":
            raise PermissionError("sandbox: replacing a function's code is disabled")
        elif event == "object.__getattr__" and len(args) > 1 and args[1] == "tb_frame":
            # A traceback through the hook must not hand out the hook's frames.
            state["busy"] = True
            try:
                name = args[0].tb_frame.f_code.co_filename
            finally:
                state["busy"] = False
            if name == "<string>":
                raise PermissionError("sandbox: the sandbox's own frames are hidden")

    sys.addaudithook(hook)

# Started with -S (no .pth processing, half the start-up): site-packages are added by hand.
for _p in cfg["site_dirs"]:
    if _p not in sys.path:
        sys.path.append(_p)
if cfg["audit"]:
    _install(os.path.realpath(os.getcwd()), tuple(cfg["read_roots"]), cfg["max_forks"],
             cfg["pid_ns"])
del _install, cfg, json, resource
_source = code
del code
# An uncaught exception is printed by the interpreter's C code (exit status 1); the parent
# removes the sandbox's own "<string>" frames from it.
exec(compile(_source, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

# Runs inside the new user+mount namespace, before the code: builds a private root file
# system holding only /usr (and the /bin, /lib... links), the Python installation (read-only),
# a few device nodes, and the working directory (read-write) at its real path, then chroots
# into it. Mounts made here are private to the namespace and vanish with it.
_MOUNT_SCRIPT = r"""
set -e
CHROOT=$1; MOUNT=$2; R=$3; W=$4; shift 4
mount() { "$MOUNT" "$@"; }
mount -t tmpfs -o size=64m,mode=755 agentrl-sandbox "$R"
ro() {  # read-only bind (mount(8) binds, then remounts read-only, in one process)
  if [ -d "$1" ]; then mkdir -p "$R$1"; else mkdir -p "$R$(dirname "$1")"; : > "$R$1"; fi
  mount --rbind -o ro "$1" "$R$1"
}
ro /usr
for d in /bin /sbin /lib /lib32 /lib64 /libx32; do
  if [ -L "$d" ]; then ln -s "$(readlink "$d")" "$R$d"; elif [ -d "$d" ]; then ro "$d"; fi
done
while [ "$1" != "--" ]; do ro "$1"; shift; done
shift
mkdir -p "$R/dev/shm" "$R/tmp"
for f in null urandom; do : > "$R/dev/$f"; mount --bind "/dev/$f" "$R/dev/$f"; done
mount -t tmpfs -o size=64m agentrl-shm "$R/dev/shm"
mkdir -p "$R$W"
mount --bind "$W" "$R$W"
exec "$CHROOT" "$R" "$@"
"""

_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


@dataclass(frozen=True)
class Isolation:
    """How this machine can isolate a sandboxed run (see :func:`isolation`)."""

    prefix: tuple[str, ...]
    """The ``unshare`` command (user where available, network, PID and maybe mount)."""
    mount: bool
    """Whether the run sees a private root file system (working directory + Python only)."""
    bind_paths: tuple[str, ...] = ()
    """Read-only paths the private root holds besides /usr (the Python installation)."""
    setpriv: tuple[str, ...] = ()
    """Command that drops every capability before the interpreter starts (may be empty)."""


_PROBE_LOCK = threading.RLock()
_PROBED: dict[tuple[str, bool], Isolation | None] = {}


_INFO: dict[str, dict[str, list[str]]] = {}
_INFO_PROBE = (
    "import sys, json, sysconfig\n"
    "paths = sysconfig.get_paths()\n"
    "print(json.dumps({'prefixes': [sys.prefix, sys.base_prefix, sys.exec_prefix,\n"
    "    sys.base_exec_prefix], 'site_dirs': [paths['purelib'], paths['platlib']],\n"
    "    'stdlib_dirs': [paths['stdlib'], paths['platstdlib']]}))"
)


def interpreter_info(python_executable: str) -> dict[str, list[str]]:
    """Prefixes, site-packages and stdlib directories of an interpreter (cached).

    Asked of the interpreter itself, with ``site`` on, so a virtual environment reports its own
    site-packages (under ``-S`` it would report the base installation's).
    """
    with _PROBE_LOCK:
        if python_executable not in _INFO:
            out = subprocess.run(
                [python_executable, "-I", "-c", _INFO_PROBE],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            _INFO[python_executable] = json.loads(out.stdout)
        return _INFO[python_executable]


def _python_paths(python_executable: str) -> tuple[str, ...]:
    """Directories the interpreter needs (its prefixes), minus what /usr already covers."""
    info = interpreter_info(python_executable)
    candidates: set[str] = set()
    for prefix in [*info["prefixes"], *info["site_dirs"], *info["stdlib_dirs"]]:
        candidates.add(os.path.abspath(prefix))
        candidates.add(os.path.realpath(prefix))
    exe_dir = os.path.dirname(os.path.abspath(python_executable))
    candidates.update({exe_dir, os.path.dirname(os.path.realpath(python_executable))})
    for extra in ("/etc/ld.so.cache",):
        if os.path.exists(extra):
            candidates.add(extra)

    def covered(path: str, by: str) -> bool:
        return path == by or path.startswith(by.rstrip("/") + "/")

    kept: list[str] = []
    for path in sorted(candidates, key=len):
        if any(covered(path, d) or covered(os.path.realpath(path), d) for d in _SYSTEM_DIRS):
            continue
        if any(covered(path, k) for k in kept):
            continue
        if os.path.realpath(path) != path and any(os.path.islink(p) for p in _ancestors(path)):
            continue  # reached through a symlinked directory; its real path is bound instead
        kept.append(path)
    return tuple(kept)


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts) - 1)]


def isolation(python_executable: str | None = None, mount: bool = True) -> Isolation | None:
    """The strongest isolation ``unshare`` offers here for this interpreter, or None.

    Probed once per process and interpreter, in order: user + mount + network + PID
    namespaces (a private root file system), mount without a user namespace (needs root), then
    the same without the mount namespace. A candidate counts only if a real run of the
    interpreter succeeds under it.
    """
    exe = python_executable or sys.executable
    key = (exe, mount)
    with _PROBE_LOCK:
        if key in _PROBED:
            return _PROBED[key]
        result: Isolation | None = None
        unshare = shutil.which("unshare")
        if unshare:
            base = ["-n", "-p", "-f", "--kill-child"]
            user = ["-U", "-r"]
            candidates: list[tuple[list[str], bool]] = []
            if mount and _sbin("chroot") and _sbin("mount"):
                candidates += [
                    ([unshare, *user, "-m", *base], True),
                    ([unshare, "-m", *base], True),
                ]
            candidates += [([unshare, *user, *base], False), ([unshare, *base], False)]
            try:
                paths = _python_paths(exe)
            except (OSError, subprocess.SubprocessError, ValueError):
                paths = None
            setpriv_bin = "/usr/bin/setpriv" if os.path.exists("/usr/bin/setpriv") else None
            setpriv = (
                (setpriv_bin, "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs")
                if setpriv_bin
                else ()
            )
            for prefix, with_mount in candidates:
                if with_mount and paths is None:
                    continue
                iso = Isolation(
                    prefix=tuple(prefix),
                    mount=with_mount,
                    bind_paths=paths or (),
                    setpriv=setpriv if with_mount else (),
                )
                if _probe(iso, exe):
                    result = iso
                    break
        if result is None:
            logger.warning(
                "python sandbox: 'unshare' cannot create namespaces here; running without the "
                "namespace layers (audit hook and resource limits still apply, fork is disabled)"
            )
        elif not result.mount and mount:
            logger.warning(
                "python sandbox: no private root file system here (mount namespace "
                "unavailable); file isolation rests on the audit hook alone"
            )
        _PROBED[key] = result
        return result


def _probe(iso: Isolation, exe: str) -> bool:
    workdir = tempfile.mkdtemp(prefix="agentrl-probe-")
    try:
        cmd, root = _command(iso, Path(workdir), [exe, "-I", "-S", "-c", "pass"])
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                timeout=30,
                check=False,
                cwd=workdir,
                env=_sandbox_env(Path(workdir)),
            )
        finally:
            if root:
                os.rmdir(root)
        return proc.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _command(iso: Isolation | None, workdir: Path, argv: list[str]) -> tuple[list[str], str]:
    """The full command for ``argv`` under ``iso``, and the mount point it needs ('' if none).

    The caller removes the (empty, on the host) mount point directory after the run.
    """
    if iso is None:
        return list(argv), ""
    if not iso.mount:
        return [*iso.prefix, *argv], ""
    root = tempfile.mkdtemp(prefix="agentrl-root-", dir=str(workdir.parent))
    cmd = [
        *iso.prefix,
        "sh",
        "-c",
        _MOUNT_SCRIPT,
        "agentrl-sandbox",
        _sbin("chroot") or "chroot",
        _sbin("mount") or "mount",
        root,
        str(workdir),
        *iso.bind_paths,
        "--",
        *iso.setpriv,
        *argv,
    ]
    return cmd, root


def _sbin(name: str) -> str | None:
    """Absolute path of a system tool (sandboxed runs get a minimal PATH without sbin)."""
    return shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


@dataclass
class SandboxRun:
    """The raw outcome of one run (``PythonTool.run_raw``)."""

    stdout: str
    stderr: str
    exit_code: int | None
    """Exit status; negative = killed by that signal; None = never started."""
    timed_out: bool
    wall_s: float
    stdout_dropped: int = 0
    stderr_dropped: int = 0


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str = Field(
        description="Python source to run as a script. Print what you want to see; the output "
        "(stdout, then stderr) is returned."
    )


class PythonTool(Tool):
    """Run Python code in a sandboxed subprocess (see the module docstring for the layers).

    Args:
        wall_time_s: Wall-clock seconds per call; the process group is killed at the deadline.
        memory_mb: Address-space limit (RLIMIT_AS) of the interpreter, in MiB.
        max_output_chars: Most characters of output returned (head and tail kept, the middle
            cut with a marker); the marker is counted, so the result never exceeds it.
        cpu_time_s: CPU seconds per process (RLIMIT_CPU); default ``ceil(wall_time_s) + 1``.
        max_file_mb: Largest file the code may write (RLIMIT_FSIZE), in MiB.
        max_forks: How many times the top process may ``fork`` (children may not); only with
            the PID namespace, else fork is disabled.
        python_executable: Interpreter to run (default: this one, ``sys.executable``).
        base_dir: Where per-episode working directories are created (default: the system
            temporary directory).
        namespaces: Use the ``unshare`` network/PID namespaces: None = when available,
            True = required (error if unavailable), False = never.
        audit_hook: Install the in-interpreter audit hook (files, sockets, spawning).
        site_packages: Let the code import the packages installed next to the interpreter
            (numpy, sympy, ...). ``.pth`` files are not processed (editable installs are not
            importable).
        mount_namespace: Give the code a private root file system (only /usr, the Python
            installation, read-only, and the working directory): None = when available,
            True = required, False = never. Needs ``namespaces``.
        name: Tool name the model sees.
    """

    name = "python"
    description = (
        "Run a Python 3 script in a fresh interpreter and return what it prints (stdout, then "
        "stderr). Variables do not persist between calls; files written to the current "
        "directory do. No network access; time and memory are limited."
    )
    arguments_model: ClassVar[type[BaseModel] | None] = _Args

    def __init__(
        self,
        wall_time_s: float = 5.0,
        memory_mb: int = 256,
        max_output_chars: int = 4000,
        *,
        cpu_time_s: float | None = None,
        max_file_mb: int = 16,
        max_forks: int = 8,
        python_executable: str | None = None,
        base_dir: str | Path | None = None,
        namespaces: bool | None = None,
        audit_hook: bool = True,
        site_packages: bool = True,
        mount_namespace: bool | None = None,
        name: str = "python",
    ) -> None:
        if wall_time_s <= 0:
            raise ValueError(f"PythonTool: wall_time_s must be > 0, got {wall_time_s}")
        if memory_mb < 32:
            raise ValueError(
                f"PythonTool: memory_mb={memory_mb} is too small for an interpreter; use >= 32"
            )
        if max_output_chars < 64:
            raise ValueError(f"PythonTool: max_output_chars must be >= 64, got {max_output_chars}")
        self.name = name
        self.wall_time_s = float(wall_time_s)
        self.memory_mb = int(memory_mb)
        self.output_chars = int(max_output_chars)
        self.cpu_time_s = cpu_time_s if cpu_time_s is not None else math.ceil(wall_time_s) + 1
        self.max_file_mb = int(max_file_mb)
        self.max_forks = int(max_forks)
        self.python_executable = python_executable or sys.executable
        self.base_dir = str(base_dir) if base_dir is not None else None
        self.namespaces = namespaces
        self.audit_hook = audit_hook
        self.site_packages = site_packages
        self.mount_namespace = mount_namespace
        # The sandbox enforces its own deadline; the ToolSet timeout is only a backstop.
        self.timeout_s = self.wall_time_s + 10.0
        # Output is already cut to ``output_chars`` (marker included); leave the ToolSet's
        # ``max_output_chars`` in charge of anything stricter.
        self.max_output_chars = None

    # ---- lifecycle ----
    async def create(self) -> Path:
        """A fresh, private working directory for this episode."""
        path = Path(tempfile.mkdtemp(prefix="agentrl-py-", dir=self.base_dir))
        return path.resolve()

    async def release(self, state: Any) -> None:
        if state is not None:
            await asyncio.to_thread(shutil.rmtree, state, True)

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        workdir = Path(state) if state is not None else None
        if workdir is None:
            return await self.run(arguments["code"])
        run = await self.run_raw(arguments["code"], workdir)
        return self._to_result(run)

    # ---- standalone use ----
    async def run(self, code: str) -> ToolResult:
        """Run ``code`` once in a throw-away working directory (no episode needed)."""
        workdir = await self.create()
        try:
            return self._to_result(await self.run_raw(code, workdir))
        finally:
            await self.release(workdir)

    async def _isolation(self) -> Isolation | None:
        if self.namespaces is False:
            return None
        iso = await asyncio.to_thread(
            isolation, self.python_executable, self.mount_namespace is not False
        )
        if iso is None and self.namespaces:
            raise RuntimeError(
                "PythonTool(namespaces=True) but 'unshare' cannot create network/PID "
                "namespaces here; run as root, enable unprivileged user namespaces, or pass "
                "namespaces=None to fall back to the audit hook"
            )
        if self.mount_namespace and (iso is None or not iso.mount):
            raise RuntimeError(
                "PythonTool(mount_namespace=True) but no private root file system can be "
                "built here (needs unshare -m, mount and chroot); pass mount_namespace=None"
            )
        return iso

    async def run_raw(self, code: str, workdir: Path) -> SandboxRun:
        """Run ``code`` in ``workdir`` under every enabled layer; never leaves a process behind."""
        info = await asyncio.to_thread(interpreter_info, self.python_executable)
        iso = await self._isolation()
        pid_ns = iso is not None
        rlimits: dict[str, int] = {
            "RLIMIT_AS": self.memory_mb * 1024 * 1024,
            "RLIMIT_CPU": math.ceil(self.cpu_time_s),
            "RLIMIT_FSIZE": self.max_file_mb * 1024 * 1024,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": 256,
        }
        if os.geteuid() != 0:
            # Counts every process of this user, so it is only a coarse fork-bomb brake.
            rlimits["RLIMIT_NPROC"] = 4096
        config = {
            "rlimits": rlimits,
            "audit": self.audit_hook,
            "max_forks": self.max_forks if pid_ns else 0,
            "pid_ns": pid_ns,
            "site_dirs": list(dict.fromkeys(info["site_dirs"])) if self.site_packages else [],
            "read_roots": sorted(
                {os.path.realpath(p) for p in [*info["stdlib_dirs"], *info["site_dirs"]]}
            ),
            "cwd": str(workdir),
        }
        env = _sandbox_env(workdir)
        argv = [self.python_executable, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(config)]
        cmd, mount_point = _command(iso, workdir, argv)
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=str(workdir),
                env=env,
                start_new_session=True,
            )
        except BaseException:
            _rmdir(mount_point)
            raise
        cap = 4 * self.output_chars + 4096
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        out_task = asyncio.ensure_future(_read_capped(proc.stdout, cap))
        err_task = asyncio.ensure_future(_read_capped(proc.stderr, cap))
        stdin = proc.stdin

        async def feed_and_wait() -> None:
            try:
                stdin.write(code.encode("utf-8", errors="replace"))
                await stdin.drain()
                stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the interpreter died before reading its code; the exit status says why
            await proc.wait()

        timed_out = False
        try:
            try:
                await asyncio.wait_for(feed_and_wait(), timeout=self.wall_time_s)
            except TimeoutError:
                timed_out = True
        finally:
            # Always: kill whatever is left of the process group (a forked child, or all of it
            # at the deadline or on cancellation); the PID namespace kills the rest.
            _killpg(proc.pid)
            if proc.returncode is None:
                try:
                    await asyncio.wait_for(proc.wait(), timeout=5.0)
                except TimeoutError:
                    logger.error("python sandbox: process %d did not die after SIGKILL", proc.pid)
            # A grandchild that escaped the group may hold the pipes open: do not wait on it.
            done, pending = await asyncio.wait({out_task, err_task}, timeout=1.0)
            for task in pending:
                task.cancel()
            _rmdir(mount_point)
        wall = time.monotonic() - start
        stdout, out_dropped = out_task.result() if out_task in done else ("", 0)
        stderr, err_dropped = err_task.result() if err_task in done else ("", 0)
        return SandboxRun(
            stdout=stdout,
            stderr=stderr,
            exit_code=proc.returncode,
            timed_out=timed_out,
            wall_s=wall,
            stdout_dropped=out_dropped,
            stderr_dropped=err_dropped,
        )

    def _to_result(self, run: SandboxRun) -> ToolResult:
        stdout, stderr = run.stdout, _hide_sandbox_frames(run.stderr)
        text = stdout
        if stderr:
            if text and not text.endswith("\n"):
                text += "\n"
            text += stderr
        error = False
        note = ""
        if run.timed_out:
            error = True
            note = f"error: timed out after {self.wall_time_s:g} s; the process was killed"
        elif run.exit_code is not None and run.exit_code < 0:
            error = True
            note = f"error: killed by {_signal_name(-run.exit_code)}"
            hint = _SIGNAL_HINTS.get(-run.exit_code)
            if hint:
                note += f" ({hint})"
        elif run.exit_code:
            error = True
            if not stderr.strip():
                note = f"error: exit code {run.exit_code}"
        if note:
            if text and not text.endswith("\n"):
                text += "\n"
            text += note
        if not text.strip():
            text = "(no output)"
        # Keep the note visible: cut the middle of the output, never the status line.
        body_limit = self.output_chars - (len(note) + 1 if note else 0)
        if note and len(text) > self.output_chars:
            body = text[: len(text) - len(note)].rstrip("\n")
            body, _ = truncate(body, max(0, body_limit - 32), "middle")
            text = body + "\n" + note
        else:
            text, _ = truncate(text, max(0, self.output_chars - 32), "middle")
        return ToolResult(
            content=text,
            error=error,
            metrics={
                "exit_code": float(run.exit_code if run.exit_code is not None else -1),
                "wall_s": run.wall_s,
                "timed_out": float(run.timed_out),
            },
        )


_SIGNAL_HINTS: dict[int, str] = {
    signal.SIGKILL: "memory, CPU or time limit",
    signal.SIGXCPU: "CPU time limit",
    signal.SIGXFSZ: "file size limit",
    signal.SIGSEGV: "crashed; often the memory limit",
}


_SANDBOX_FRAME = re.compile(r'^  File "<string>", line \d+, in .*\n', re.MULTILINE)


def _hide_sandbox_frames(stderr: str) -> str:
    """Drop the bootstrap's and the audit hook's traceback lines (they run as ``<string>``)."""
    return _SANDBOX_FRAME.sub("", stderr)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _sandbox_env(workdir: Path) -> dict[str, str]:
    """The whole environment of a sandboxed run: nothing inherited from the parent."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(workdir),
        "TMPDIR": str(workdir),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _rmdir(path: str) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[str, int]:
    """Read to EOF keeping the first and the last ``cap // 2`` bytes; return (text, dropped).

    The dropped middle is replaced by a ``...[truncated N bytes]...`` marker, so a flood of
    output costs bounded memory and the end of the output (often the traceback) survives.
    """
    half = max(1, cap // 2)
    head = bytearray()
    tail = bytearray()
    total = 0
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            break
        total += len(chunk)
        room = half - len(head)
        if room > 0:
            head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            tail += chunk
            if len(tail) > half:
                del tail[: len(tail) - half]
    dropped = total - len(head) - len(tail)
    text = head.decode("utf-8", errors="replace")
    if dropped:
        text += f"...[truncated {dropped} bytes]..."
    return text + tail.decode("utf-8", errors="replace"), dropped
