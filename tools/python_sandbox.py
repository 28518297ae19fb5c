"""A ``python`` tool: run model-written code under an OS isolation boundary (bubblewrap).

Why it exists: code-executing agents need a tool that runs arbitrary snippets without taking
the rollout worker down with them (an infinite loop, a memory bomb, a fork bomb) and without
reaching the network, the files or the secrets of the machine. A Python-level guard cannot
promise that (PEP 578: audit hooks are not a sandbox; model code switched ours off), so the
boundary is the kernel, set up by `bubblewrap <https://github.com/containers/bubblewrap>`_
(``bwrap``, Debian package ``bubblewrap``); docs/tools.md says why bwrap and not nsjail.

Guarantees of a sandboxed call (each checked by tests/integration/test_sandbox_escape.py):

- **no network**: a fresh network namespace (only its own loopback): nothing on the host,
  127.0.0.1 included, is reachable;
- **private file system**: a read-only ``/usr`` and Python installation, a few device nodes
  (``null``, ``zero``, ``full``, ``random``, ``urandom``) and one size-limited tmpfs
  (``disk_mb``) holding the working directory, ``/tmp`` and ``/dev/shm``. No host ``/etc``,
  ``/home``, ``/tmp``, ``/dev/shm`` or ``/proc``; the root is read-only;
- **processes**: a PID namespace whose init dies with the parent (``--die-with-parent``);
  when the call ends, every process the code started is killed; at most ``max_processes``
  processes at once (RLIMIT_NPROC, counted per sandbox: a per-call user id when run as root,
  a per-call user namespace otherwise);
- **memory and CPU**: RLIMIT_AS (``memory_mb``) and RLIMIT_CPU (``cpu_time_s``) per process,
  RLIMIT_FSIZE (``max_file_mb``), no core files; a wall-clock deadline (``wall_time_s``)
  enforced inside by the supervisor and outside by the parent (which SIGKILLs bwrap);
- **no inherited environment**: the environment is built from nothing (``PATH``, ``HOME``,
  ``TMPDIR``, a UTF-8 locale, one BLAS thread); no capabilities, ``no_new_privs``, a new
  session (no terminal), IPC/UTS/cgroup namespaces;
- **refusal**: without a working bwrap the tool refuses to start
  (:class:`SandboxUnavailableError`, naming the fix) unless ``allow_unsandboxed=True``;
  :func:`check_python_sandbox_available` runs the same check before any server starts.

The PEP 578 audit hook (files only under the working directory, no sockets, no spawning, no
ctypes...) stays as defence in depth, and is the only guard left in the explicitly unsafe
``allow_unsandboxed`` mode.

State: each episode has a private host directory. Files the code writes in its working
directory persist across the calls of the episode as an archive that only the next sandbox
reads (the host never unpacks model-written archives); Python variables do not persist (every
call is a fresh interpreter). Calls of one episode run one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from tools.base import Tool, ToolResult
from tools.limits import truncate

__all__ = [
    "SUPERVISOR_MARKER",
    "Isolation",
    "PythonTool",
    "SandboxRun",
    "SandboxUnavailableError",
    "check_python_sandbox_available",
    "interpreter_info",
    "isolation",
]

logger = logging.getLogger(__name__)

# Layout inside the sandbox: one tmpfs (``disk_mb``) holds everything writable.
_SCRATCH = "/sandbox"
_WORKDIR = "/sandbox/work"
_TMPDIR = "/sandbox/tmp"
_SHMDIR = "/sandbox/shm"
_STATE_IN = "/.agentrl/state.tar"
_STATE_FILE = "state.tar"
# Per-call user ids when bwrap runs as root: random, so that RLIMIT_NPROC (counted per user)
# is per call and sandboxes cannot signal each other. Far above any real account.
_UID_LOW, _UID_HIGH = 1 << 24, (1 << 31) - 2
_DEVICES = ("null", "zero", "full", "random", "urandom")
_INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install -y bubblewrap`; Fedora: `dnf install "
    "bubblewrap`) so that model code runs isolated, or set `tools.python.allow_unsandboxed: "
    "true` (PythonTool(allow_unsandboxed=True)) to run it with only the in-interpreter guard "
    "(unsafe: the code can reach the network, the files and the secrets of this machine)"
)

# The program the sandboxed interpreter runs (``python -I -S -c _SUPERVISOR CONFIG``). As the
# supervisor it restores the episode's files, reads the code from stdin, sets the limits and
# forks; the child installs the audit hook and runs the code; the supervisor waits for it up
# to the deadline, kills everything the code left, then writes a status line and (sandboxed)
# an archive of the working directory to the status pipe. Dependency-free (stdlib only).
SUPERVISOR_MARKER = "agentrl-sandbox-supervisor"
"""A comment on the supervisor's first line: in the command line of every sandboxed process."""
_SUPERVISOR = r"""# agentrl-sandbox-supervisor
import json, os, select, signal, sys
cfg = json.loads(sys.argv[1])
STATUS_FD = cfg["status_fd"]
sys.argv = ["<code>"]
sys.dont_write_bytecode = True
for name, value in cfg["rlimits"].items():
    import resource
    lim = getattr(resource, name)
    soft, hard = resource.getrlimit(lim)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    # CPU: SIGXCPU at the soft limit (reported as such), SIGKILL one second later.
    resource.setrlimit(lim, (value, value + 1 if name == "RLIMIT_CPU" else value))
os.chdir(cfg["cwd"])
restore_error = ""
if cfg["restore"] and os.path.exists(cfg["restore"]):
    try:
        import tarfile
        with tarfile.open(cfg["restore"]) as archive:
            try:
                archive.extractall(".", filter="tar")
            except TypeError:  # Python < 3.11.4 has no extraction filters
                archive.extractall(".")
    except Exception as e:
        restore_error = f"{type(e).__name__}: {e}"
code = sys.stdin.buffer.read().decode("utf-8", "replace")
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
sys.stdin = open(0, closefd=False)


def _supervise(pid):
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], cfg["wall_time_s"])
    timed_out = not ready
    if timed_out:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    try:  # whatever the code left running (in the sandbox: every process but this one)
        if cfg["sandboxed"]:
            os.kill(-1, signal.SIGKILL)
        else:
            os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    out = os.fdopen(STATUS_FD, "wb")
    head = {"exit_code": os.waitstatus_to_exitcode(status), "timed_out": timed_out,
            "restore_error": restore_error}
    out.write(json.dumps(head).encode() + b"\n")
    if cfg["archive"]:
        import tarfile
        with tarfile.open(fileobj=out, mode="w|") as archive:
            for entry in sorted(os.listdir(".")):
                archive.add(entry)
    out.close()
    os._exit(0)


def _install(root, read_roots, max_forks, pid_ns):
    # Everything the hook needs is bound here. No user code may run inside the hook: types are
    # compared with ``type(x) is``/``in`` (``isinstance`` would call a user ``__class__``),
    # names must be plain ``str`` and numbers are read with ``int.__int__`` (a subclass's
    # ``__eq__``, ``__hash__`` or ``__bool__`` would run user code with the hook's frame live).
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
    READ_OK = ("/dev/null", "/dev/urandom", "/dev/zero", "/dev/random")
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
    DENY = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
            "sys.settrace", "sys.setprofile", "sys.addaudithook", "resource.setrlimit",
            "resource.prlimit", "os.setuid", "os.setgid"}
    BLOCKED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess"}
    SIMPLE = {int, float, type(None), tuple, bool}
    as_int = int.__int__

    def name_of(value):
        if type(value) is not str:
            raise PermissionError("sandbox: names must be plain str")
        return value

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
            mode = "" if mode is None else name_of(mode)
            flags = 0 if flags is None else as_int(flags)
            write = any(c in mode for c in "wax+") or bool(flags & WRITE_FLAGS)
            check(path, write)
        elif event in FS_EVENTS:
            write = event not in READ_EVENTS
            for a in args:
                if type(a) not in SIMPLE:
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
            if args and as_int(args[0]) not in (0, os.getpid()):
                raise PermissionError("sandbox: signalling other processes is disabled")
        elif event == "socket.__new__":
            if len(args) > 1 and as_int(args[1]) != AF_UNIX:
                raise PermissionError("sandbox: network access is disabled")
        elif event in NET:
            raise PermissionError("sandbox: network access is disabled")
        elif event == "import" and args and name_of(args[0]) in BLOCKED_IMPORTS:
            raise ImportError(f"sandbox: module {args[0]!r} is disabled")
        elif event in DENY or event.startswith("ctypes."):
            raise PermissionError(f"sandbox: {event} is disabled")
        elif event == "object.__setattr__" and len(args) > 1 and name_of(args[1]) == "__code__":
            raise PermissionError("sandbox: replacing a function's code is disabled")
        elif event == "object.__getattr__" and len(args) > 1 and name_of(args[1]) == "tb_frame":
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
_child = os.fork()
if _child:
    _supervise(_child)
os.setsid()
os.close(STATUS_FD)
if cfg["audit"]:
    _install(os.path.realpath(cfg["write_root"]), tuple(cfg["read_roots"]), cfg["max_forks"],
             cfg["sandboxed"])
del _install, _supervise, _child, cfg, json
_source = code
del code
# An uncaught exception is printed by the interpreter's C code (exit status 1); the parent
# removes the supervisor's own "<string>" frames from it.
exec(compile(_source, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


class SandboxUnavailableError(RuntimeError):
    """No working OS isolation (bubblewrap) here, and ``allow_unsandboxed`` is not set."""


@dataclass(frozen=True)
class Isolation:
    """How this machine runs a sandboxed call (see :func:`isolation`)."""

    bwrap: str
    """Path of the ``bwrap`` executable."""
    mode: Literal["root", "userns"]
    """``root``: bwrap runs as root and drops to a per-call user id (``setpriv``);
    ``userns``: an unprivileged user namespace per call."""
    bind_paths: tuple[str, ...]
    """Read-only paths the sandbox holds besides ``/usr`` (the Python installation)."""
    setpriv: str = ""
    """Path of ``setpriv`` (root mode)."""


_PROBE_LOCK = threading.RLock()
_PROBED: dict[tuple[str, str], Isolation | str] = {}
_INFO: dict[str, dict[str, list[str]]] = {}
_INFO_PROBE = (
    "import sys, json, sysconfig\n"
    "paths = sysconfig.get_paths()\n"
    "print(json.dumps({'prefixes': [sys.prefix, sys.base_prefix, sys.exec_prefix,\n"
    "    sys.base_exec_prefix], 'site_dirs': [paths['purelib'], paths['platlib']],\n"
    "    'stdlib_dirs': [paths['stdlib'], paths['platstdlib']]}))"
)
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


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

    def covered(path: str, by: str) -> bool:
        """``path`` is ``by`` or lies inside it."""
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


def _sbin(name: str) -> str | None:
    """Absolute path of a system tool (looked up in the system directories only)."""
    return shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def isolation(python_executable: str | None = None, bwrap: str | None = None) -> Isolation | str:
    """The isolation this machine offers for ``python_executable``, or why there is none.

    Probed once per process, interpreter and bwrap path: a real sandboxed run of the
    interpreter must succeed. Returns an :class:`Isolation`, or a string saying what is
    missing and how to fix it.
    """
    exe = python_executable or sys.executable
    key = (exe, bwrap or "")
    with _PROBE_LOCK:
        if key not in _PROBED:
            _PROBED[key] = _probe_isolation(exe, bwrap)
        return _PROBED[key]


def _probe_isolation(exe: str, bwrap: str | None) -> Isolation | str:
    path = bwrap or shutil.which("bwrap") or _sbin("bwrap")
    if not path or not os.access(path, os.X_OK):
        return f"bubblewrap (`bwrap`) was not found{f' at {bwrap!r}' if bwrap else ''}"
    root = os.geteuid() == 0
    setpriv = _sbin("setpriv") or ""
    if root and not setpriv:
        return "`setpriv` (util-linux) was not found; running as root it drops the user id"
    try:
        binds = _python_paths(exe)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return f"cannot ask the interpreter {exe!r} where it lives: {exc}"
    iso = Isolation(
        bwrap=path, mode="root" if root else "userns", bind_paths=binds, setpriv=setpriv
    )
    workdir = tempfile.mkdtemp(prefix="agentrl-probe-")
    try:
        argv = [exe, "-I", "-S", "-c", "print('agentrl-sandbox-ok')"]
        cmd = _bwrap_command(iso, Path(workdir), argv, disk_mb=8)
        proc = subprocess.run(
            cmd, capture_output=True, timeout=60, check=False, cwd=workdir, env={}
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap at {path!r} could not be run: {exc}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if proc.returncode != 0 or proc.stdout.strip() != b"agentrl-sandbox-ok":
        err = proc.stderr.decode(errors="replace").strip()[-500:]
        return (
            f"bubblewrap at {path!r} cannot create a sandbox here (exit {proc.returncode}: "
            f"{err or 'no message'}); it needs root or unprivileged user namespaces "
            "(`sysctl kernel.unprivileged_userns_clone=1`; in Docker, a seccomp profile that "
            "allows them)"
        )
    return iso


def check_python_sandbox_available(section: Any = None) -> None:
    """Raise :class:`SandboxUnavailableError` (naming the fix) if the python tool cannot run.

    ``section`` is the ``tools.python`` config section (or a dict, or None for the defaults);
    its ``allow_unsandboxed``, ``python_executable`` and ``bwrap`` are read when present. Call
    it before starting any server when ``python`` is among ``tools.enabled``. Cached per
    process: costs one sandboxed ``pass`` (~0.1 s) the first time.
    """

    def get(key: str) -> Any:
        """``key`` of the section (dict or object), None when absent."""
        if section is None:
            return None
        if isinstance(section, dict):
            return section.get(key)
        return getattr(section, key, None)

    if get("allow_unsandboxed"):
        return
    iso = isolation(get("python_executable"), get("bwrap"))
    if isinstance(iso, str):
        raise SandboxUnavailableError(
            f"tools.python: the python tool runs model-written code and needs OS isolation, "
            f"but {iso}. Fix: {_INSTALL_HINT}."
        )


def _bwrap_command(
    iso: Isolation, state_dir: Path, argv: list[str], *, disk_mb: int, uid: int | None = None
) -> list[str]:
    """The bwrap command line that runs ``argv`` in a fresh sandbox (see the module docstring)."""
    cmd = [iso.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    # bwrap's own init is PID 1 (not --as-pid-1): it keeps --die-with-parent's SIGKILL, which
    # setpriv's change of user would clear on our supervisor, and its death ends the namespace.
    cmd += ["--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if iso.mode == "userns":
        cmd += ["--unshare-user", "--disable-userns"]
    cmd += ["--hostname", "sandbox", "--clearenv"]
    for key, value in _sandbox_env(_WORKDIR, _TMPDIR).items():
        cmd += ["--setenv", key, value]
    cmd += ["--ro-bind", "/usr", "/usr"]
    for d in _SYSTEM_DIRS[1:]:
        if os.path.islink(d):
            cmd += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            cmd += ["--ro-bind", d, d]
    # An interpreter under /tmp (a venv in a /tmp checkout) is bound inside the scratch's tmp
    # directory, which /tmp links to below: the same paths, and /tmp stays the private scratch.
    in_tmp = [p for p in iso.bind_paths if p.startswith("/tmp/")]
    made: set[str] = set()

    def bind(source: str, target: str) -> None:
        # bwrap would create missing parents 0700: unreadable to the sandbox's user.
        for parent in _ancestors(target):
            if parent not in made:
                made.add(parent)
                cmd.extend(["--perms", "0755", "--dir", parent])
        cmd.extend(["--ro-bind", source, target])

    for p in iso.bind_paths:
        if p not in in_tmp:
            bind(p, p)
    cmd += ["--tmpfs", "/dev"]
    for dev in _DEVICES:
        cmd += ["--dev-bind", f"/dev/{dev}", f"/dev/{dev}"]
    cmd += ["--symlink", _SHMDIR, "/dev/shm", "--remount-ro", "/dev"]
    cmd += ["--perms", "1777", "--size", str(disk_mb * 1024 * 1024), "--tmpfs", _SCRATCH]
    for d in (_WORKDIR, _TMPDIR, _SHMDIR):
        cmd += ["--dir", d, "--chmod", "1777", d]
    cmd += ["--symlink", _TMPDIR, "/tmp"]
    made.update(_ancestors(_TMPDIR + "/x"))
    for p in in_tmp:
        bind(p, _TMPDIR + p[len("/tmp") :])
    state = state_dir / _STATE_FILE
    if state.exists():
        cmd += ["--perms", "0755", "--dir", os.path.dirname(_STATE_IN)]
        cmd += ["--ro-bind", str(state), _STATE_IN]
    cmd += ["--chdir", _WORKDIR, "--remount-ro", "/", "--"]
    if iso.mode == "root":
        uid = uid if uid is not None else _UID_LOW + secrets.randbelow(_UID_HIGH - _UID_LOW)
        cmd += [iso.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        cmd += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    return [*cmd, *argv]


@dataclass
class SandboxRun:
    """The raw outcome of one run (``PythonTool.run_raw``)."""

    stdout: str
    stderr: str
    exit_code: int | None
    """Exit status of the code; negative = killed by that signal; None = unknown (the
    supervisor itself was killed)."""
    timed_out: bool
    wall_s: float
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    files_saved: bool = True
    """Sandboxed runs: whether this call's files were kept for the next call."""
    note: str = ""
    """A sandbox-side problem worth telling the model (files not restored or not saved)."""


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str = Field(
        description="Python source to run as a script. Print what you want to see; the output "
        "(stdout, then stderr) is returned."
    )


class _EpisodeDir:
    """Per-episode state: a private host directory and a lock (calls run one at a time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = asyncio.Lock()

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"_EpisodeDir({str(self.path)!r})"


class PythonTool(Tool):
    """Run Python code in a bubblewrap sandbox (see the module docstring for the boundary).

    Args:
        wall_time_s: Wall-clock seconds the code may run; then every process is killed.
        memory_mb: Address-space limit (RLIMIT_AS) of each process, in MiB.
        max_output_chars: Most characters of output returned (head and tail kept, the middle
            cut with a marker); the marker is counted, so the result never exceeds it.
        cpu_time_s: CPU seconds per process (RLIMIT_CPU); default ``ceil(wall_time_s) + 1``.
        max_file_mb: Largest file the code may write (RLIMIT_FSIZE), in MiB.
        max_processes: Most processes the code may have at once, itself included.
        disk_mb: Size of the sandbox's tmpfs (working directory, ``/tmp``, ``/dev/shm``).
        allow_unsandboxed: Run without OS isolation when bwrap is unavailable (only the audit
            hook and resource limits then; fork disabled). Unsafe; off by default, when the
            tool refuses to start instead.
        python_executable: Interpreter to run (default: this one, ``sys.executable``).
        bwrap: Path of the ``bwrap`` executable (default: found on ``PATH``).
        base_dir: Where per-episode host directories are created (default: the system
            temporary directory).
        audit_hook: Install the in-interpreter audit hook (defence in depth).
        site_packages: Let the code import the packages installed next to the interpreter
            (numpy, sympy, ...). ``.pth`` files are not processed (editable installs are not
            importable).
        name: Tool name the model sees.

    Raises:
        SandboxUnavailableError: bwrap cannot isolate code here and ``allow_unsandboxed`` is
            False (checked once per process, when the tool is built).
    """

    name = "python"
    description = (
        "Run a Python 3 script in a fresh interpreter and return what it prints (stdout, then "
        "stderr). Variables do not persist between calls; files written to the current "
        "directory do. No network access; time, memory and disk are limited."
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
        max_processes: int = 16,
        disk_mb: int = 64,
        allow_unsandboxed: bool = False,
        python_executable: str | None = None,
        bwrap: str | None = None,
        base_dir: str | Path | None = None,
        audit_hook: bool = True,
        site_packages: bool = True,
        name: str = "python",
    ) -> None:
        _check_limits(wall_time_s, memory_mb, max_output_chars, max_processes, disk_mb)
        self.name = name
        self.wall_time_s = float(wall_time_s)
        self.memory_mb = int(memory_mb)
        self.output_chars = int(max_output_chars)
        self.cpu_time_s = cpu_time_s if cpu_time_s is not None else math.ceil(wall_time_s) + 1
        self.max_file_mb = int(max_file_mb)
        self.max_processes = int(max_processes)
        self.disk_mb = int(disk_mb)
        self.allow_unsandboxed = bool(allow_unsandboxed)
        self.python_executable = python_executable or sys.executable
        self.bwrap = bwrap
        self.base_dir = str(base_dir) if base_dir is not None else None
        self.audit_hook = audit_hook
        self.site_packages = site_packages
        # Past the code's deadline the supervisor needs a moment to archive the files (tmpfs
        # reads); the parent kills bwrap at ``_hard_deadline_s``. The ToolSet timeout is only
        # a backstop behind both.
        self._hard_deadline_s = self.wall_time_s + 5.0 + self.disk_mb / 50.0
        self.timeout_s = self._hard_deadline_s + 5.0
        # Output is already cut to ``output_chars`` (marker included); leave the ToolSet's
        # ``max_output_chars`` in charge of anything stricter.
        self.max_output_chars = None
        iso = isolation(self.python_executable, self.bwrap)
        if isinstance(iso, str):
            if not self.allow_unsandboxed:
                raise SandboxUnavailableError(
                    f"python tool: model code needs OS isolation, but {iso}. Fix: {_INSTALL_HINT}."
                )
            logger.warning(
                "python tool: running model code WITHOUT OS isolation (allow_unsandboxed=True): %s",
                iso,
            )

    # ---- lifecycle ----
    async def create(self) -> _EpisodeDir:
        """A fresh, private host directory for this episode."""
        path = Path(tempfile.mkdtemp(prefix="agentrl-py-", dir=self.base_dir))
        return _EpisodeDir(path.resolve())

    async def release(self, state: Any) -> None:
        """Delete the episode's directory."""
        if state is not None:
            # One archive file (sandboxed) or the files of an unsandboxed episode: quick.
            shutil.rmtree(os.fspath(state), ignore_errors=True)

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        """Run ``arguments["code"]``; in an episode, in its persistent directory, one at a time."""
        if state is None:
            return await self.run(arguments["code"])
        async with state.lock:
            run = await self.run_raw(arguments["code"], state.path)
        return self._to_result(run)

    # ---- standalone use ----
    async def run(self, code: str) -> ToolResult:
        """Run ``code`` once in a throw-away episode directory (no episode needed)."""
        state = await self.create()
        try:
            return self._to_result(await self.run_raw(code, state.path))
        finally:
            await self.release(state)

    async def _isolation(self) -> Isolation | None:
        """The isolation to use; None = unsandboxed (only when allowed)."""
        key = (self.python_executable, self.bwrap or "")
        if key in _PROBED and self.python_executable in _INFO:
            iso = _PROBED[key]
        else:  # first run in this process (e.g. after unpickling): probe off the event loop
            iso = await asyncio.to_thread(isolation, self.python_executable, self.bwrap)
            await asyncio.to_thread(interpreter_info, self.python_executable)
        if isinstance(iso, Isolation):
            return iso
        if self.allow_unsandboxed:
            return None
        raise SandboxUnavailableError(
            f"python tool: model code needs OS isolation, but {iso}. Fix: {_INSTALL_HINT}."
        )

    def _config(self, iso: Isolation | None, episode_dir: Path, status_fd: int) -> dict[str, Any]:
        """The supervisor's configuration (limits, layout, hook) for one run."""
        info = interpreter_info(self.python_executable)
        sandboxed = iso is not None
        rlimits: dict[str, int] = {
            "RLIMIT_AS": self.memory_mb * 1024 * 1024,
            "RLIMIT_CPU": math.ceil(self.cpu_time_s),
            "RLIMIT_FSIZE": self.max_file_mb * 1024 * 1024,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": 256,
        }
        if iso is not None:
            # The supervisor counts as one process of the sandbox's user; with a user namespace
            # bwrap's init (PID 1) does too.
            overhead = 1 if iso.mode == "root" else 2
            rlimits["RLIMIT_NPROC"] = self.max_processes + overhead
        elif os.geteuid() != 0:
            rlimits["RLIMIT_NPROC"] = 4096  # counts every process of this user: a coarse brake
        cwd = _WORKDIR if sandboxed else str(episode_dir)
        return {
            "rlimits": rlimits,
            "cwd": cwd,
            "write_root": _SCRATCH if sandboxed else cwd,
            "restore": _STATE_IN if sandboxed else "",
            "archive": sandboxed,
            "sandboxed": sandboxed,
            "status_fd": status_fd,
            "wall_time_s": self.wall_time_s,
            "audit": self.audit_hook,
            "max_forks": self.max_processes - 1 if sandboxed else 0,
            "site_dirs": list(dict.fromkeys(info["site_dirs"])) if self.site_packages else [],
            "read_roots": sorted(
                {os.path.realpath(p) for p in [*info["stdlib_dirs"], *info["site_dirs"]]}
            ),
        }

    async def run_raw(self, code: str, episode_dir: Path) -> SandboxRun:
        """Run ``code`` for the episode in ``episode_dir``; never leaves a process behind."""
        iso = await self._isolation()
        read_fd, write_fd = os.pipe()
        try:
            config = self._config(iso, episode_dir, write_fd)
            argv = [self.python_executable, "-I", "-S", "-c", _SUPERVISOR, json.dumps(config)]
            if iso is not None:
                argv = _bwrap_command(iso, episode_dir, argv, disk_mb=self.disk_mb)
            env = {} if iso is not None else _sandbox_env(str(episode_dir), str(episode_dir))
            start = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=str(episode_dir),
                env=env,
                start_new_session=True,
                pass_fds=(write_fd,),
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return await self._collect(proc, code, read_fd, episode_dir, iso is not None, start)

    async def _collect(
        self,
        proc: asyncio.subprocess.Process,
        code: str,
        status_fd: int,
        episode_dir: Path,
        sandboxed: bool,
        start: float,
    ) -> SandboxRun:
        """Feed the code, read the outputs and the status pipe, enforce the hard deadline."""
        cap = 4 * self.output_chars + 4096
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        out_task = asyncio.ensure_future(_read_capped(proc.stdout, cap))
        err_task = asyncio.ensure_future(_read_capped(proc.stderr, cap))
        partial = episode_dir / (_STATE_FILE + ".partial")
        archive_cap = 2 * self.disk_mb * 1024 * 1024 + (1 << 20)
        status_task = asyncio.ensure_future(
            _read_status(status_fd, partial if sandboxed else None, archive_cap)
        )
        stdin = proc.stdin

        async def feed_and_wait() -> None:
            """Send the code on stdin, close it and wait for the process to end."""
            try:
                stdin.write(code.encode("utf-8", errors="replace"))
                await stdin.drain()
                stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the supervisor died before reading the code; its status says why
            await proc.wait()

        killed = False
        finished = False  # False while a cancellation propagates: no archive is kept then
        try:
            try:
                await asyncio.wait_for(feed_and_wait(), timeout=self._hard_deadline_s)
            except TimeoutError:
                killed = True
            finished = True
        finally:
            # Always: kill what is left (bwrap; --die-with-parent and the PID namespace take the
            # rest with it), on the deadline, on cancellation and after a normal exit.
            _killpg(proc.pid)
            if proc.returncode is None:
                try:
                    await asyncio.wait_for(proc.wait(), timeout=5.0)
                except TimeoutError:
                    logger.error("python sandbox: process %d did not die after SIGKILL", proc.pid)
            done, pending = await asyncio.wait({out_task, err_task, status_task}, timeout=2.0)
            for task in pending:
                task.cancel()
            if status_task not in done or not finished:
                with contextlib.suppress(OSError):
                    partial.unlink()
        wall = time.monotonic() - start
        stdout, out_dropped = out_task.result() if out_task in done else ("", 0)
        stderr, err_dropped = err_task.result() if err_task in done else ("", 0)
        head, archive_ok, note = status_task.result() if status_task in done else ({}, False, "")
        run = SandboxRun(
            stdout=stdout,
            stderr=stderr,
            exit_code=head.get("exit_code"),
            timed_out=killed or bool(head.get("timed_out")),
            wall_s=wall,
            stdout_dropped=out_dropped,
            stderr_dropped=err_dropped,
            files_saved=not sandboxed,
            note=note,
        )
        if head.get("restore_error"):
            run.note = (
                f"note: the files of earlier calls could not be restored ({head['restore_error']})"
            )
        if sandboxed:
            run.files_saved = self._keep_archive(partial, archive_ok and proc.returncode == 0)
        return run

    def _keep_archive(self, partial: Path, ok: bool) -> bool:
        """Make this call's archive the episode's files (only a complete one)."""
        if not ok:
            with contextlib.suppress(OSError):
                partial.unlink()
            return False
        partial.chmod(0o644)  # read by the sandbox's user (another uid when run as root)
        partial.replace(partial.with_name(_STATE_FILE))
        return True

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
        elif run.exit_code is None:
            error = True
            note = "error: the sandbox was killed before the code finished"
        elif run.exit_code < 0:
            error = True
            note = f"error: killed by {_signal_name(-run.exit_code)}"
            hint = _SIGNAL_HINTS.get(-run.exit_code)
            if hint:
                note += f" ({hint})"
        elif run.exit_code:
            error = True
            if not stderr.strip():
                note = f"error: exit code {run.exit_code}"
        if run.note:
            note = f"{note}\n{run.note}" if note else run.note
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


def _check_limits(
    wall_time_s: float, memory_mb: int, max_output_chars: int, max_processes: int, disk_mb: int
) -> None:
    if wall_time_s <= 0:
        raise ValueError(f"PythonTool: wall_time_s must be > 0, got {wall_time_s}")
    if memory_mb < 32:
        raise ValueError(
            f"PythonTool: memory_mb={memory_mb} is too small for an interpreter; use >= 32"
        )
    if max_output_chars < 64:
        raise ValueError(f"PythonTool: max_output_chars must be >= 64, got {max_output_chars}")
    if max_processes < 1:
        raise ValueError(f"PythonTool: max_processes must be >= 1, got {max_processes}")
    if disk_mb < 1:
        raise ValueError(f"PythonTool: disk_mb must be >= 1, got {disk_mb}")


_SIGNAL_HINTS: dict[int, str] = {
    signal.SIGKILL: "memory, CPU or time limit",
    signal.SIGXCPU: "CPU time limit",
    signal.SIGXFSZ: "file size limit",
    signal.SIGSEGV: "crashed; often the memory limit",
}


_SANDBOX_FRAME = re.compile(r'^  File "<string>", line \d+, in .*\n', re.MULTILINE)


def _hide_sandbox_frames(stderr: str) -> str:
    """Drop the supervisor's and the audit hook's traceback lines (they run as ``<string>``)."""
    return _SANDBOX_FRAME.sub("", stderr)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _sandbox_env(home: str, tmpdir: str) -> dict[str, str]:
    """The whole environment of a run: nothing inherited from the parent."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": tmpdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _read_status(fd: int, archive: Path | None, cap: int) -> tuple[dict[str, Any], bool, str]:
    """Read the supervisor's status pipe: (status line, archive complete, note).

    The archive (sandboxed runs) is streamed into ``archive`` unread and unparsed: only the
    next sandbox unpacks it. Past ``cap`` bytes it is dropped (the note says so).
    """
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16)
    pipe = os.fdopen(fd, "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        try:
            line = await reader.readline()
            head = json.loads(line) if line.endswith(b"\n") else {}
        except (ValueError, asyncio.LimitOverrunError):
            return {}, False, ""
        if not isinstance(head, dict) or archive is None:
            return (head if isinstance(head, dict) else {}), False, ""
        size = 0
        with open(archive, "wb") as f:
            while chunk := await reader.read(1 << 16):
                size += len(chunk)
                if size > cap:
                    note = f"note: files not saved for the next call (more than {cap >> 20} MiB)"
                    return head, False, note
                f.write(chunk)
        return head, size > 0, ""
    finally:
        transport.close()


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
