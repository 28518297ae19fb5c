"""One supervised run: the process started, fed its code, read to the end, and never left behind.

Why it exists: the parent side of a call has to hold whatever the code does: flood its output,
never exit, write a huge archive, or be cancelled mid-run by the episode. This module is that
side: it starts the command (:mod:`tools.sandbox.command`), writes the code to stdin, reads
stdout, stderr and the supervisor's status pipe concurrently, and enforces the hard deadline.

What it guarantees:

- the wall limit holds from outside the sandbox: once the supervisor says the code started,
  the parent gives it ``wall_time_s`` + :data:`OUTSIDE_GRACE_S` to report the code's end, then
  kills the call itself (its cgroup and bwrap), whatever the code did to its supervisor;
- when :func:`run_supervised` returns or raises (the hard deadline, a cancellation), the
  process group has been SIGKILLed (bwrap's ``--die-with-parent`` and PID namespace take every
  process of the code with it) and, with cgroups, every process of the call's cgroup too, and
  the cgroup is removed;
- with cgroups, the run says whether the call hit its memory limit (an OOM kill) and how much
  memory and how many processes it used at most, as the kernel counted them;
- stdout and stderr cost bounded memory: the first and the last ``stream_cap_bytes // 2``
  bytes are kept, the middle is replaced by a ``...[truncated N bytes]...`` marker;
- the archive of the working directory (sandboxed runs) is streamed into
  ``<episode>/state.tar.partial`` unread and unparsed (only the next sandbox unpacks it); it
  replaces ``state.tar`` only when complete (status read, process exited 0, under
  ``archive_cap_bytes``). A cancelled run leaves no partial file behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.sandbox.cgroup import CallCgroup, CgroupSetup, CgroupUsage
from tools.sandbox.command import cgroup_prefix
from tools.sandbox.config import STATE_FILE, SandboxLimits
from tools.sandbox.supervisor import STARTED_LINE

__all__ = ["OUTSIDE_GRACE_S", "SandboxRun", "run_supervised"]

OUTSIDE_GRACE_S = 1.0
"""Seconds past ``wall_time_s`` (counted from the code's start) before the parent kills a call
whose supervisor has not reported: the supervisor's own kill and report take milliseconds."""

logger = logging.getLogger(__name__)


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
    usage: CgroupUsage | None = None
    """What the call's cgroup counted (None without cgroups)."""


async def run_supervised(
    command: Callable[[int], list[str]],
    *,
    env: dict[str, str],
    episode_dir: Path,
    code: str,
    limits: SandboxLimits,
    sandboxed: bool,
    cgroups: CgroupSetup | None = None,
) -> SandboxRun:
    """Run ``command(status_fd)`` (the supervisor, in bwrap when ``sandboxed``) on ``code``,
    in a fresh cgroup of ``cgroups`` when given.

    ``status_fd`` is the write end of the status pipe, passed to the process and closed here.

    Raises:
        OSError: the call's cgroup could not be created.
    """
    cgroup = None
    if cgroups is not None:
        cgroup = await asyncio.to_thread(
            CallCgroup.create, cgroups, limits.cgroup_memory_bytes, limits.cgroup_pids(sandboxed)
        )
    try:
        return await _run(command, env, episode_dir, code, limits, sandboxed, cgroup)
    finally:
        if cgroup is not None:
            await asyncio.to_thread(cgroup.remove)


async def _run(
    command: Callable[[int], list[str]],
    env: dict[str, str],
    episode_dir: Path,
    code: str,
    limits: SandboxLimits,
    sandboxed: bool,
    cgroup: CallCgroup | None,
) -> SandboxRun:
    """Start the command (joining ``cgroup``) and collect it."""
    read_fd, write_fd = os.pipe()
    try:
        argv = cgroup_prefix(cgroup.procs_files() if cgroup else []) + command(write_fd)
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
    return await _collect(proc, code, read_fd, episode_dir, sandboxed, start, limits, cgroup)


async def _collect(
    proc: asyncio.subprocess.Process,
    code: str,
    status_fd: int,
    episode_dir: Path,
    sandboxed: bool,
    start: float,
    limits: SandboxLimits,
    cgroup: CallCgroup | None,
) -> SandboxRun:
    """Feed the code, read the outputs and the status pipe, enforce the wall limit from
    outside and the hard deadline."""
    cap = limits.stream_cap_bytes
    assert proc.stdout is not None and proc.stderr is not None
    out_task = asyncio.ensure_future(_read_capped(proc.stdout, cap))
    err_task = asyncio.ensure_future(_read_capped(proc.stderr, cap))
    partial = episode_dir / (STATE_FILE + ".partial")
    started, reported = asyncio.Event(), asyncio.Event()
    status_task = asyncio.ensure_future(
        _read_status(
            status_fd,
            partial if sandboxed else None,
            limits.archive_cap_bytes,
            (started, reported),
        )
    )

    def kill_call() -> None:
        """SIGKILL every process of the call (the cgroup, then bwrap's process group)."""
        if cgroup is not None:
            cgroup.kill()
        _killpg(proc.pid)

    fired = asyncio.Event()
    watchdog = asyncio.ensure_future(
        _watchdog((started, reported, fired), limits.wall_time_s, kill_call)
    )
    killed = False
    finished = False  # False while a cancellation propagates: no archive is kept then
    try:
        try:
            await asyncio.wait_for(_feed_and_wait(proc, code), timeout=limits.hard_deadline_s)
        except TimeoutError:
            killed = True
        finished = True
    finally:
        # Always: kill what is left, on the deadline, on cancellation and after a normal exit.
        watchdog.cancel()  # its kill may still run in a thread: ``fired`` says it started
        killed = killed or fired.is_set()
        if cgroup is not None:
            await asyncio.to_thread(cgroup.kill)
        done = await _reap(proc, (out_task, err_task, status_task))
        if status_task not in done or not finished:
            with contextlib.suppress(OSError):
                partial.unlink()
    stdout, out_dropped = out_task.result() if out_task in done else ("", 0)
    stderr, err_dropped = err_task.result() if err_task in done else ("", 0)
    head, archive_ok, note = status_task.result() if status_task in done else ({}, False, "")
    run = SandboxRun(
        stdout=stdout,
        stderr=stderr,
        exit_code=head.get("exit_code"),
        timed_out=killed or bool(head.get("timed_out")),
        wall_s=time.monotonic() - start,
        stdout_dropped=out_dropped,
        stderr_dropped=err_dropped,
        files_saved=not sandboxed,
        note=note,
        usage=cgroup.usage() if cgroup is not None else None,
    )
    if head.get("restore_error"):
        run.note = (
            f"note: the files of earlier calls could not be restored ({head['restore_error']})"
        )
    if run.usage is not None and run.usage.oom_kills:
        oom = (
            f"error: out of memory: the call's processes and files may use {limits.memory_mb} + "
            f"{limits.disk_mb} MiB in all; processes were killed"
        )
        run.note = f"{oom}\n{run.note}" if run.note else oom
    if sandboxed:
        run.files_saved = _keep_archive(partial, archive_ok and proc.returncode == 0)
    return run


async def _watchdog(
    events: tuple[asyncio.Event, asyncio.Event, asyncio.Event],
    wall_time_s: float,
    kill: Callable[[], None],
) -> None:
    """Kill the call (``kill``) when its code started more than ``wall_time_s`` +
    :data:`OUTSIDE_GRACE_S` ago and the supervisor has not reported. ``events``: (the code
    started, the supervisor reported, set here before killing).

    The supervisor is inside the sandbox, and the code must not be able to extend its own
    time by stopping it: this clock runs in the parent. A supervisor that never says the code
    started is covered by the hard deadline.
    """
    started, reported, fired = events
    await started.wait()
    try:
        await asyncio.wait_for(reported.wait(), wall_time_s + OUTSIDE_GRACE_S)
    except TimeoutError:
        fired.set()
        await asyncio.to_thread(kill)


async def _feed_and_wait(proc: asyncio.subprocess.Process, code: str) -> None:
    """Send the code on stdin, close it and wait for the process to end."""
    stdin = proc.stdin
    assert stdin is not None
    try:
        stdin.write(code.encode("utf-8", errors="replace"))
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the supervisor died before reading the code; its status says why
    await proc.wait()


async def _reap(
    proc: asyncio.subprocess.Process, readers: tuple[asyncio.Future[Any], ...]
) -> set[asyncio.Future[Any]]:
    """SIGKILL the process group (bwrap: the sandbox goes with it); the readers that finished."""
    _killpg(proc.pid)
    if proc.returncode is None:
        try:
            await asyncio.wait_for(proc.wait(), timeout=5.0)
        except TimeoutError:
            logger.error("python sandbox: process %d did not die after SIGKILL", proc.pid)
    done, pending = await asyncio.wait(set(readers), timeout=2.0)
    for task in pending:
        task.cancel()
    return done


def _keep_archive(partial: Path, ok: bool) -> bool:
    """Make this call's archive the episode's files (only a complete one)."""
    if not ok:
        with contextlib.suppress(OSError):
            partial.unlink()
        return False
    partial.chmod(0o644)  # read by the sandbox's user (another uid when run as root)
    partial.replace(partial.with_name(STATE_FILE))
    return True


def _killpg(pgid: int) -> None:
    """SIGKILL process group ``pgid``, if it still exists."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _read_status(
    fd: int, archive: Path | None, cap: int, events: tuple[asyncio.Event, asyncio.Event]
) -> tuple[dict[str, Any], bool, str]:
    """Read the supervisor's status pipe: (status line, archive complete, note).

    ``events`` are set when the supervisor says the code started, then when its status line
    (the code's end) arrives. The archive (sandboxed runs) is streamed into ``archive`` unread
    and unparsed: only the next sandbox unpacks it. Past ``cap`` bytes it is dropped (the
    note says so).
    """
    started, reported = events
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16)
    pipe = os.fdopen(fd, "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        try:
            line = await reader.readline()
            if line == STARTED_LINE:
                started.set()
                line = await reader.readline()
            head = json.loads(line) if line.endswith(b"\n") else {}
        except (ValueError, asyncio.LimitOverrunError):
            return {}, False, ""
        if isinstance(head, dict) and head:
            reported.set()
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
