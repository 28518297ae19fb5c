"""Which isolation this machine offers, asked once per process: a real sandboxed run must work.

Why it exists: the python tool must refuse to start where it cannot isolate model code (no
bubblewrap, no ``setpriv`` as root, user namespaces blocked, an interpreter it cannot bind),
and say why and how to fix it, before any server starts, not at the first model call.

What it guarantees: :func:`isolation` returns an :class:`~tools.sandbox.config.Isolation` only
after the supervisor itself ran inside a sandbox built exactly as a call's is (same command
builder, same binds); otherwise a sentence naming what is missing. Results are cached per
process, interpreter and bwrap path, under a lock (threads may probe at once).
:func:`check_python_sandbox_available` raises :class:`SandboxUnavailableError` naming the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tools.sandbox import seccomp
from tools.sandbox.cgroup import detect
from tools.sandbox.command import SYSTEM_DIRS, ancestors, bwrap_command, check_argv
from tools.sandbox.config import PROTECTED_PIDS, Isolation
from tools.sandbox.supervisor import CHECK_OK

__all__ = [
    "CGROUP_HINT",
    "INSTALL_HINT",
    "SandboxUnavailableError",
    "check_python_sandbox_available",
    "interpreter_info",
    "isolation",
    "python_paths",
]

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install -y bubblewrap`; Fedora: `dnf install "
    "bubblewrap`) so that model code runs isolated, or set `tools.python.allow_unsandboxed: "
    "true` (PythonTool(allow_unsandboxed=True)) to run it with only the in-interpreter guard "
    "(unsafe: the code can reach the network, the files and the secrets of this machine)"
)
"""The fix, quoted by every refusal."""
CGROUP_HINT = (
    "on cgroup v2, give the trainer a delegated cgroup with the memory and pids controllers "
    "(`systemd-run --user --scope -p Delegate=yes ...`, or as root a cgroup it does not live "
    "in) and name it in `tools.python.cgroup_parent`; on cgroup v1, run as root with the memory "
    "and pids hierarchies mounted; or set `tools.python.cgroups: auto` (rlimits only where no "
    "cgroup can be made)"
)
"""The fix, quoted when per-call cgroups are required but unavailable."""


class SandboxUnavailableError(RuntimeError):
    """No working OS isolation (bubblewrap) here, and ``allow_unsandboxed`` is not set."""


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


def is_probed(python_executable: str, bwrap: str | None) -> bool:
    """Whether :func:`isolation` and :func:`interpreter_info` are cached (no subprocess)."""
    return (python_executable, bwrap or "") in _PROBED and python_executable in _INFO


def python_paths(python_executable: str) -> tuple[str, ...]:
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
        if any(covered(path, d) or covered(os.path.realpath(path), d) for d in SYSTEM_DIRS):
            continue
        if any(covered(path, k) for k in kept):
            continue
        if os.path.realpath(path) != path and any(os.path.islink(p) for p in ancestors(path)):
            continue  # reached through a symlinked directory; its real path is bound instead
        kept.append(path)
    return tuple(kept)


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
    """Find bwrap (and setpriv as root), then run the supervisor's self-check sandboxed."""
    path = bwrap or shutil.which("bwrap") or _sbin("bwrap")
    if not path or not os.access(path, os.X_OK):
        return f"bubblewrap (`bwrap`) was not found{f' at {bwrap!r}' if bwrap else ''}"
    root = os.geteuid() == 0
    setpriv = _sbin("setpriv") or ""
    if root and not setpriv:
        return "`setpriv` (util-linux) was not found; running as root it drops the user id"
    try:
        program = seccomp.filter_hex(PROTECTED_PIDS)
    except ValueError as exc:
        return f"no seccomp filter for this machine ({exc})"
    try:
        binds = python_paths(exe)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return f"cannot ask the interpreter {exe!r} where it lives: {exc}"
    iso = Isolation(
        bwrap=path, mode="root" if root else "userns", bind_paths=binds, setpriv=setpriv
    )
    workdir = tempfile.mkdtemp(prefix="agentrl-probe-")
    try:
        cmd = bwrap_command(iso, Path(workdir), check_argv(exe, program), disk_mb=8)
        proc = subprocess.run(
            cmd, capture_output=True, timeout=60, check=False, cwd=workdir, env={}
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap at {path!r} could not be run: {exc}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if proc.returncode != 0 or proc.stdout.strip() != CHECK_OK.encode():
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
    its ``allow_unsandboxed``, ``python_executable``, ``bwrap``, ``cgroups`` and ``cgroup_parent``
    are read when present. Call
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

    if get("cgroups") == "required":
        found = detect(get("cgroup_parent"))
        if isinstance(found, str):
            raise SandboxUnavailableError(
                f"tools.python.cgroups: 'required', but no per-call cgroup can be made here: "
                f"{found}. Fix: {CGROUP_HINT}."
            )
    if get("allow_unsandboxed"):
        return
    iso = isolation(get("python_executable"), get("bwrap"))
    if isinstance(iso, str):
        raise SandboxUnavailableError(
            f"tools.python: the python tool runs model-written code and needs OS isolation, "
            f"but {iso}. Fix: {INSTALL_HINT}."
        )
