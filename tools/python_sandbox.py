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
- **memory and processes per call** (cgroups, :mod:`tools.sandbox.cgroup`, v2 or v1): every
  process of the call, with its files, memfds and shared memory, shares ``memory_mb +
  disk_mb`` MiB (no swap) and ``max_processes`` (plus the sandbox's two); without a writable
  cgroup, a loud warning and rlimits only (``cgroups="required"`` refuses instead);
- **memory and CPU per process**: RLIMIT_AS (``memory_mb``) and RLIMIT_CPU (``cpu_time_s``),
  RLIMIT_FSIZE (``max_file_mb``), no core files; a wall-clock deadline (``wall_time_s``)
  enforced inside by the supervisor and, from the code's start, outside by the parent (which
  kills the call's cgroup and bwrap ``wall_time_s`` + 1 s after the code started);
- **system calls** (:mod:`tools.sandbox.seccomp`): a seccomp filter, installed before the
  code runs, denies namespaces, ``io_uring``, ``userfaultfd``, ``ptrace``, ``bpf``, the key
  ring, mounts, ``perf_event_open``, ``kexec`` and signals to the supervisor, which the code
  therefore cannot trace, stop or kill;
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

This module is the tool (arguments, lifecycle, what the model reads back); the sandbox itself
lives in :mod:`tools.sandbox`: the limits and layout (``config``), the isolation probe
(``probe``), the bwrap command line (``command``), the supervisor program run inside
(``supervisor``) and the parent's side of a run (``process``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from tools.base import Tool, ToolResult
from tools.limits import truncate
from tools.sandbox.cgroup import CgroupSetup, detect
from tools.sandbox.command import bwrap_command, sandbox_env, supervisor_argv
from tools.sandbox.config import (
    SUPERVISOR_FILE,
    SUPERVISOR_IN_SANDBOX,
    Isolation,
    SandboxLimits,
    supervisor_config,
)
from tools.sandbox.probe import (
    CGROUP_HINT,
    INSTALL_HINT,
    SandboxUnavailableError,
    check_python_sandbox_available,
    interpreter_info,
    is_probed,
    isolation,
)
from tools.sandbox.process import SandboxRun, run_supervised
from tools.sandbox.supervisor import MARKER as SUPERVISOR_MARKER

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

CGROUP_MODES = ("auto", "required", "off")
_WARNED: set[str] = set()


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
        memory_mb: Address-space limit (RLIMIT_AS) of each process, in MiB; with a cgroup,
            also the memory of all the call's processes together (plus ``disk_mb`` for its
            files; memfds and shared memory count).
        max_output_chars: Most characters of output returned (head and tail kept, the middle
            cut with a marker); the marker is counted, so the result never exceeds it.
        cpu_time_s: CPU seconds per process (RLIMIT_CPU); default ``ceil(wall_time_s) + 1``.
        max_file_mb: Largest file the code may write (RLIMIT_FSIZE), in MiB.
        max_processes: Most processes (and threads) the code may have at once, itself
            included (RLIMIT_NPROC, and the call's cgroup ``pids.max``).
        disk_mb: Size of the sandbox's tmpfs (working directory, ``/tmp``, ``/dev/shm``).
        allow_unsandboxed: Run without OS isolation when bwrap is unavailable (only the audit
            hook and resource limits then; fork disabled). Unsafe; off by default, when the
            tool refuses to start instead.
        python_executable: Interpreter to run (default: this one, ``sys.executable``).
        bwrap: Path of the ``bwrap`` executable (default: found on ``PATH``).
        base_dir: Where per-episode host directories are created (default: the system
            temporary directory).
        cgroups: Per-call cgroup limits: ``"auto"`` (used where this process can create
            cgroups, v2 or v1; otherwise a loud warning and rlimits only), ``"required"``
            (refuse to start without them), ``"off"`` (rlimits only).
        cgroup_parent: A cgroup v2 directory to create the calls' cgroups under (a delegated
            cgroup with the memory and pids controllers), instead of this process's own.
        audit_hook: Install the in-interpreter audit hook (defence in depth).
        site_packages: Let the code import the packages installed next to the interpreter
            (numpy, sympy, ...). ``.pth`` files are not processed (editable installs are not
            importable).
        name: Tool name the model sees.

    Raises:
        SandboxUnavailableError: bwrap cannot isolate code here and ``allow_unsandboxed`` is
            False, or ``cgroups="required"`` and no per-call cgroup can be made (checked once
            per process, when the tool is built).
        ValueError: ``cgroups`` is not one of ``auto``, ``required``, ``off``.
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
        cgroups: str = "auto",
        cgroup_parent: str | None = None,
        audit_hook: bool = True,
        site_packages: bool = True,
        name: str = "python",
    ) -> None:
        self.limits = SandboxLimits(
            wall_time_s=float(wall_time_s),
            memory_mb=int(memory_mb),
            output_chars=int(max_output_chars),
            cpu_time_s=cpu_time_s if cpu_time_s is not None else math.ceil(wall_time_s) + 1,
            max_file_mb=int(max_file_mb),
            max_processes=int(max_processes),
            disk_mb=int(disk_mb),
        )
        self.name = name
        self.allow_unsandboxed = bool(allow_unsandboxed)
        self.python_executable = python_executable or sys.executable
        self.bwrap = bwrap
        self.base_dir = str(base_dir) if base_dir is not None else None
        self.audit_hook = audit_hook
        self.site_packages = site_packages
        if cgroups not in CGROUP_MODES:
            raise ValueError(
                f"PythonTool: cgroups={cgroups!r} is not one of {', '.join(CGROUP_MODES)}; use "
                "'auto' (cgroups where possible), 'required' or 'off'"
            )
        self.cgroups = cgroups
        self.cgroup_parent = cgroup_parent
        # The parent kills bwrap at ``limits.hard_deadline_s``, past the supervisor's own
        # deadline; the ToolSet timeout is only a backstop behind both.
        self.timeout_s = self.limits.hard_deadline_s + 5.0
        # Output is already cut to ``output_chars`` (marker included); leave the ToolSet's
        # ``max_output_chars`` in charge of anything stricter.
        self.max_output_chars = None
        iso = isolation(self.python_executable, self.bwrap)
        if isinstance(iso, str):
            if not self.allow_unsandboxed:
                raise SandboxUnavailableError(
                    f"python tool: model code needs OS isolation, but {iso}. Fix: {INSTALL_HINT}."
                )
            logger.warning(
                "python tool: running model code WITHOUT OS isolation (allow_unsandboxed=True): %s",
                iso,
            )
        self._cgroup_setup()

    # ---- the limits, one by one (read-only) ----
    @property
    def wall_time_s(self) -> float:
        """Wall-clock seconds the code may run."""
        return self.limits.wall_time_s

    @property
    def memory_mb(self) -> int:
        """Address-space limit of each process, in MiB."""
        return self.limits.memory_mb

    @property
    def output_chars(self) -> int:
        """Most characters of output returned, marker included."""
        return self.limits.output_chars

    @property
    def cpu_time_s(self) -> float:
        """CPU seconds per process."""
        return self.limits.cpu_time_s

    @property
    def max_file_mb(self) -> int:
        """Largest file the code may write, in MiB."""
        return self.limits.max_file_mb

    @property
    def max_processes(self) -> int:
        """Most processes the code may have at once."""
        return self.limits.max_processes

    @property
    def disk_mb(self) -> int:
        """Size of the sandbox's tmpfs, in MiB."""
        return self.limits.disk_mb

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

    def _cgroup_setup(self) -> CgroupSetup | None:
        """Where this call's cgroup goes (None: rlimits only); refuses or warns as configured.

        Raises:
            SandboxUnavailableError: ``cgroups="required"`` and no cgroup can be made here.
        """
        if self.cgroups == "off":
            return None
        found = detect(self.cgroup_parent)
        if isinstance(found, CgroupSetup):
            return found
        if self.cgroups == "required":
            raise SandboxUnavailableError(
                f"python tool: cgroups='required', but no per-call cgroup can be made here: "
                f"{found}. Fix: {CGROUP_HINT}."
            )
        if found not in _WARNED:
            _WARNED.add(found)
            logger.warning(
                "python tool: NO PER-CALL CGROUP (%s): memory_mb and max_processes are "
                "per-process rlimits only, so memfds, shared memory and several processes "
                "can use more. Fix: %s.",
                found,
                CGROUP_HINT,
            )
        return None

    async def _isolation(self) -> Isolation | None:
        """The isolation to use; None = unsandboxed (only when allowed)."""
        if is_probed(self.python_executable, self.bwrap):
            iso = isolation(self.python_executable, self.bwrap)
        else:  # first run in this process (e.g. after unpickling): probe off the event loop
            iso = await asyncio.to_thread(isolation, self.python_executable, self.bwrap)
            await asyncio.to_thread(interpreter_info, self.python_executable)
        if isinstance(iso, Isolation):
            return iso
        if self.allow_unsandboxed:
            return None
        raise SandboxUnavailableError(
            f"python tool: model code needs OS isolation, but {iso}. Fix: {INSTALL_HINT}."
        )

    def _command(self, iso: Isolation | None, episode_dir: Path, status_fd: int) -> list[str]:
        """The command line of one run: the supervisor (with its configuration) in bwrap."""
        info = interpreter_info(self.python_executable)
        config = supervisor_config(
            self.limits,
            iso.mode if iso is not None else None,
            episode_dir,
            status_fd,
            audit=self.audit_hook,
            site_dirs=list(dict.fromkeys(info["site_dirs"])) if self.site_packages else [],
            read_roots=sorted(
                {os.path.realpath(p) for p in [*info["stdlib_dirs"], *info["site_dirs"]]}
            ),
        )
        argv = supervisor_argv(self.python_executable, config, sandboxed=iso is not None)
        if iso is None:
            return argv
        return bwrap_command(iso, episode_dir, argv, disk_mb=self.disk_mb)

    async def run_raw(self, code: str, episode_dir: Path) -> SandboxRun:
        """Run ``code`` for the episode in ``episode_dir``; never leaves a process behind."""
        iso = await self._isolation()
        cgroups = self._cgroup_setup()
        return await run_supervised(
            lambda status_fd: self._command(iso, episode_dir, status_fd),
            env={} if iso is not None else sandbox_env(str(episode_dir), str(episode_dir)),
            episode_dir=episode_dir,
            code=code,
            limits=self.limits,
            sandboxed=iso is not None,
            cgroups=cgroups,
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
            metrics=_metrics(run),
        )


def _metrics(run: SandboxRun) -> dict[str, float]:
    """The call's numbers: exit code, wall time, timeout and, with a cgroup, peak memory (MiB),
    peak processes and out-of-memory kills."""
    metrics = {
        "exit_code": float(run.exit_code if run.exit_code is not None else -1),
        "wall_s": run.wall_s,
        "timed_out": float(run.timed_out),
    }
    if run.usage is not None:
        metrics["oom_kills"] = float(run.usage.oom_kills)
        if run.usage.memory_peak_bytes is not None:
            metrics["memory_peak_mb"] = run.usage.memory_peak_bytes / (1 << 20)
        if run.usage.pids_peak is not None:
            metrics["pids_peak"] = float(run.usage.pids_peak)
    return metrics


_SIGNAL_HINTS: dict[int, str] = {
    signal.SIGKILL: "memory, CPU or time limit",
    signal.SIGXCPU: "CPU time limit",
    signal.SIGXFSZ: "file size limit",
    signal.SIGSEGV: "crashed; often the memory limit",
}


_SUPERVISOR_PATHS = "|".join(re.escape(p) for p in (SUPERVISOR_IN_SANDBOX, str(SUPERVISOR_FILE)))
_SANDBOX_FRAME = re.compile(
    rf'^  File "(?:{_SUPERVISOR_PATHS})", line \d+, in .*\n(?:    .*\n)*', re.MULTILINE
)


def _hide_sandbox_frames(stderr: str) -> str:
    """Drop the supervisor's and the audit hook's traceback frames (the supervisor's file, in
    the sandbox or on the host), with their source and marker lines when shown."""
    return _SANDBOX_FRAME.sub("", stderr)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
