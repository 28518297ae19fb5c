"""The command line of one sandboxed call: bubblewrap's options, then the supervisor's.

Why it exists: the isolation boundary of the python tool *is* this command line. Every
guarantee of the sandbox (docs/tools.md) is one group of bwrap options here, built in stages so
each can be read, tested and extended alone:

1. :func:`_namespaces`: new IPC, PID, network, UTS and cgroup namespaces, ``--die-with-parent``,
   a new session; in a user namespace (not root), no nested user namespaces;
2. :func:`_environment`: the environment built from nothing (:func:`sandbox_env`);
3. :func:`_filesystem`: a fresh root, read-only at the end: ``/usr`` and the interpreter
   read-only, five device nodes, one tmpfs of ``disk_mb`` (work dir, ``/tmp``, ``/dev/shm``),
   and the supervisor and the episode's archive bound read-only under ``/.agentrl``;
4. :func:`_drop_privileges`: as root, a random per-call user id with no capabilities and
   ``no_new_privs`` (``setpriv``), so RLIMIT_NPROC is per call and calls cannot signal each
   other.

Around these stages: per-call cgroup limits (:mod:`tools.sandbox.cgroup`) are a prefix,
:func:`cgroup_prefix`, that moves itself into the call's cgroups and then execs bwrap; the
seccomp filter (:mod:`tools.sandbox.seccomp`) travels in the supervisor's configuration and is
installed by the code's own process just before the code runs (the supervisor needs ``kill``
of every process, which the filter denies the code).

What it guarantees: the command is a pure function of its arguments and of the host's system
directories (which of ``/bin``, ``/lib``... exist and are links); nothing is started here.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from tools.sandbox.config import (
    SCRATCH,
    SHMDIR,
    STATE_FILE,
    STATE_IN,
    SUPERVISOR_FILE,
    SUPERVISOR_IN_SANDBOX,
    TMPDIR,
    WORKDIR,
    Isolation,
)
from tools.sandbox.supervisor import CHECK, MARKER

__all__ = [
    "SYSTEM_DIRS",
    "ancestors",
    "bwrap_command",
    "cgroup_prefix",
    "check_argv",
    "sandbox_env",
    "supervisor_argv",
]

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Host directories the sandbox holds read-only (or as the same symlinks)."""
_DEVICES = ("null", "zero", "full", "random", "urandom")
# Per-call user ids when bwrap runs as root: random, so that RLIMIT_NPROC (counted per user)
# is per call and sandboxes cannot signal each other. Far above any real account.
_UID_LOW, _UID_HIGH = 1 << 24, (1 << 31) - 2


def supervisor_argv(
    python_executable: str, config: dict[str, Any], *, sandboxed: bool
) -> list[str]:
    """The interpreter running the supervisor with ``config`` (inside bwrap when ``sandboxed``)."""
    supervisor = SUPERVISOR_IN_SANDBOX if sandboxed else str(SUPERVISOR_FILE)
    return [python_executable, "-I", "-S", supervisor, MARKER, json.dumps(config)]


def check_argv(python_executable: str, seccomp_hex: str = "") -> list[str]:
    """The interpreter running the supervisor's self-check (installs the seccomp program
    ``seccomp_hex`` when given, then prints ``CHECK_OK``), sandboxed."""
    extra = [seccomp_hex] if seccomp_hex else []
    return [python_executable, "-I", "-S", SUPERVISOR_IN_SANDBOX, CHECK, *extra]


_JOIN_CGROUPS = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def cgroup_prefix(procs_files: list[str]) -> list[str]:
    """The command prefix that joins the cgroups whose ``cgroup.procs`` are ``procs_files``, then
    execs the rest of the command line (exit 125 if it cannot join); [] when there are none."""
    if not procs_files:
        return []
    return ["/bin/sh", "-c", _JOIN_CGROUPS, "agentrl-cgroup", *procs_files, "--"]


def sandbox_env(home: str, tmpdir: str) -> dict[str, str]:
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


def ancestors(path: str) -> list[str]:
    """The directories above ``path``, outermost first (``/a/b/c`` -> ``/a``, ``/a/b``)."""
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts) - 1)]


def bwrap_command(
    iso: Isolation, state_dir: Path, argv: list[str], *, disk_mb: int, uid: int | None = None
) -> list[str]:
    """The bwrap command line that runs ``argv`` in a fresh sandbox (see the module docstring).

    ``state_dir`` is the episode's host directory (its archive, when there is one, is bound
    for the supervisor to restore); ``uid`` fixes the per-call user id of the root mode.
    """
    return [
        iso.bwrap,
        *_namespaces(iso),
        *_environment(),
        *_filesystem(iso, state_dir, disk_mb),
        "--chdir",
        WORKDIR,
        "--remount-ro",
        "/",
        "--",
        *_drop_privileges(iso, uid),
        *argv,
    ]


def _namespaces(iso: Isolation) -> list[str]:
    """Namespaces and process-lifetime options."""
    cmd = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    # bwrap's own init is PID 1 (not --as-pid-1): it keeps --die-with-parent's SIGKILL, which
    # setpriv's change of user would clear on our supervisor, and its death ends the namespace.
    cmd += ["--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if iso.mode == "userns":
        cmd += ["--unshare-user", "--disable-userns"]
    return [*cmd, "--hostname", "sandbox"]


def _environment() -> list[str]:
    """``--clearenv`` and the variables of :func:`sandbox_env`."""
    cmd = ["--clearenv"]
    for key, value in sandbox_env(WORKDIR, TMPDIR).items():
        cmd += ["--setenv", key, value]
    return cmd


def _filesystem(iso: Isolation, state_dir: Path, disk_mb: int) -> list[str]:
    """The private root: system and interpreter read-only, devices, the scratch tmpfs, and the
    supervisor and the episode's archive under ``/.agentrl``."""
    cmd = ["--ro-bind", "/usr", "/usr"]
    for d in SYSTEM_DIRS[1:]:
        if os.path.islink(d):
            cmd += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            cmd += ["--ro-bind", d, d]
    # An interpreter under /tmp (a venv in a /tmp checkout) is bound inside the scratch's tmp
    # directory, which /tmp links to below: the same paths, and /tmp stays the private scratch.
    in_tmp = [p for p in iso.bind_paths if p.startswith("/tmp/")]
    made: set[str] = set()

    def bind(source: str, target: str) -> None:
        """Bind ``source`` read-only at ``target``, its missing parents made readable."""
        # bwrap would create missing parents 0700: unreadable to the sandbox's user.
        for parent in ancestors(target):
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
    cmd += ["--symlink", SHMDIR, "/dev/shm", "--remount-ro", "/dev"]
    cmd += ["--perms", "1777", "--size", str(disk_mb * 1024 * 1024), "--tmpfs", SCRATCH]
    for d in (WORKDIR, TMPDIR, SHMDIR):
        cmd += ["--dir", d, "--chmod", "1777", d]
    cmd += ["--symlink", TMPDIR, "/tmp"]
    made.update(ancestors(TMPDIR + "/x"))
    for p in in_tmp:
        bind(p, TMPDIR + p[len("/tmp") :])
    bind(str(SUPERVISOR_FILE), SUPERVISOR_IN_SANDBOX)
    state = state_dir / STATE_FILE
    if state.exists():
        bind(str(state), STATE_IN)
    return cmd


def _drop_privileges(iso: Isolation, uid: int | None) -> list[str]:
    """Root mode: ``setpriv`` to a per-call user id, no capabilities, ``no_new_privs``."""
    if iso.mode != "root":
        return []
    uid = uid if uid is not None else _UID_LOW + secrets.randbelow(_UID_HIGH - _UID_LOW)
    return [
        iso.setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
    ]
