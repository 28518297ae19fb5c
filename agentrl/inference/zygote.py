"""Embedded servers forked from a preloaded process (the zygote): start-up without the imports.

Why it exists: an embedded server spent most of its start importing torch, transformers and
the server (7-8 s of CPU on this 2-core machine, before its model was even read), once per
server, in every run. The zygote pays that once per launching process: it imports what every
server imports (:data:`PRELOAD`) and then forks a ready interpreter per server, which runs
``agentrl serve-model`` as if it had been started on the command line (same argv, environment,
working directory and log file; its process title is that command line).

How: :func:`spawn` (used by ``launch_embedded_server``) starts the process's zygote on first
use (``python -m agentrl.inference.zygote``; :func:`prestart` starts it early, so its imports
overlap the caller's) and sends it one JSON request per server over a socket pair. It returns a
:class:`ForkedProcess`: the ``Popen`` surface a :class:`~agentrl.inference.handle.ServerHandle`
uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``),
each call answered by the zygote. The zygote is the parent: it records a server's exit code
when it reaps it (no zombies are left) and never signals a reaped pid, so a pid it signals is
never one the system reused.

Guarantees and caveats:

- lifetime (:mod:`agentrl.lifetime`): the zygote dies with its owner (its parent; checked every
  :data:`CHECK_S`, and ``PDEATHSIG`` when started from the main thread); its servers get
  ``PDEATHSIG`` from the zygote's only thread and watch it (``AGENTRL_OWNER_PID``), so a server
  never outlives the run that started it. When the owner closes the socket (it exited), the
  zygote stops its servers (SIGTERM, SIGKILL after :data:`GRACE_S`) and exits;
- the zygote never runs torch work (no thread pool exists when it forks); a server sets its own
  thread count, CPUs and niceness from its environment, as before;
- environment variables a library reads only at import (e.g. ``HF_HUB_OFFLINE``) are the
  zygote's, that is the launching process's when the zygote started;
- ``AGENTRL_ZYGOTE=0`` starts every server as a plain subprocess instead; a zygote that cannot
  start (its import failed) does the same, with a warning that has the zygote's log tail.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agentrl.lifetime import ENV_OWNER_PID, child_preexec, die_with_parent, owner_env

__all__ = [
    "ENV_ZYGOTE",
    "ForkedProcess",
    "ZygoteError",
    "enabled",
    "prestart",
    "running",
    "shutdown",
    "spawn",
]

logger = logging.getLogger(__name__)

ENV_ZYGOTE = "AGENTRL_ZYGOTE"
"""``0`` turns the zygote off: every embedded server starts as a plain subprocess."""
PRELOAD = (
    "torch",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen2.modeling_qwen2",
    "uvicorn",
    "agentrl.cli",
    "agentrl.inference.server",
    "agentrl.inference.engine",
    "agentrl.inference.scoring",
)
"""What every embedded server imports (a missing one is skipped: the server imports it later)."""
LOG_TAIL_BYTES = 4000
"""How much of the end of the zygote's own output a warning quotes."""
CHECK_S = 0.5
"""How often the zygote checks that its owner is alive and reaps its servers that ended."""
GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL when the zygote stops its servers."""
READY_TIMEOUT_S = 120.0
"""How long a first :func:`spawn` waits for the zygote's imports."""
TITLE_ROOM = 512
"""Bytes of command line the zygote reserves, so a server's title (its command line) fits."""


class ZygoteError(RuntimeError):
    """The zygote could not start, or stopped answering."""


class ForkedProcess:
    """A server forked by the zygote, with the ``subprocess.Popen`` methods servers use."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (negative: the signal) once the process ended, else None."""
        if self.returncode is None:
            code = self._zygote.call({"op": "poll", "pid": self.pid}, dead=-signal.SIGKILL)
            self.returncode = code if isinstance(code, int) else None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the process ends; ``subprocess.TimeoutExpired`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return code

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless the process already ended (and was reaped)."""
        if self.poll() is None:
            self._zygote.call({"op": "signal", "pid": self.pid, "sig": int(sig)}, dead=None)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"ForkedProcess(pid={self.pid}, returncode={self.returncode})"


def enabled() -> bool:
    """Whether embedded servers are forked from a zygote (``AGENTRL_ZYGOTE`` is not ``0``)."""
    return os.environ.get(ENV_ZYGOTE, "1") != "0" and hasattr(os, "fork")


def running() -> bool:
    """Whether this process has a live zygote already."""
    z = _current
    return z is not None and _owner_pid == os.getpid() and z.process.poll() is None


def prestart() -> None:
    """Start this process's zygote now, without waiting for its imports (no-op when off)."""
    if enabled():
        with contextlib.suppress(ZygoteError, OSError):
            _zygote()


def shutdown() -> None:
    """Stop this process's zygote now (its servers with it), e.g. after a run failed to start."""
    global _current
    with _lock:
        z, _current = _current, None
    if z is None or _owner_pid != os.getpid():
        return
    if not z.spawned:  # nothing to stop gracefully, and its imports may still be running
        z.process.kill()
    z.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        z.process.wait(timeout=GRACE_S + 5)


def spawn(
    argv: Sequence[str], *, env: Mapping[str, str], log_path: str, cwd: str | None = None
) -> ForkedProcess:
    """Fork a server running ``agentrl`` with ``argv`` (e.g. ``["serve-model", DIR, ...]``),
    environment ``env`` and output appended to ``log_path``. Raises :class:`ZygoteError` when
    no zygote can serve (the caller starts a subprocess instead)."""
    zygote = _zygote()
    request = {
        "op": "spawn",
        "argv": ["agentrl", *argv],
        "env": dict(env),
        "cwd": cwd or os.getcwd(),
        "log": str(log_path),
    }
    zygote.spawned = True
    pid = zygote.call(request, dead=None)
    if not isinstance(pid, int):
        raise ZygoteError(f"the zygote did not fork the server; its output: {zygote.log_tail()}")
    return ForkedProcess(zygote, pid)


class _Zygote:
    """The launching side: the zygote's process and one request at a time over the socket."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        # The zygote's own output goes to a file with no name (unlinked at once): nothing is
        # left behind however the two processes end (SIGKILL included); warnings quote its end.
        self.log = tempfile.TemporaryFile(prefix="agentrl-zygote-")  # noqa: SIM115 (its life)
        env = dict(os.environ, **owner_env(), SPT_NOENV="1", PYTHONUNBUFFERED="1")
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), "." * TITLE_ROOM],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=self.log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=child_preexec(),
            )
        finally:
            theirs.close()
        self.sock = ours
        self.reader = ours.makefile("rb")
        self.lock = threading.Lock()
        self.ready = False
        self.broken = False
        self.spawned = False

    def call(self, request: dict[str, Any], *, dead: Any) -> Any:
        """Send ``request``, return its ``result``; ``dead`` when the zygote is gone."""
        with self.lock:
            if self.broken:
                return dead
            try:
                if not self.ready:
                    self._await_ready()
                self.sock.sendall(json.dumps(request).encode() + b"\n")
                reply = self._read(None)
            except (OSError, ValueError, ZygoteError) as exc:
                self.broken = True
                logger.warning(
                    "the server zygote stopped answering (%s); its output: %s", exc, self.log_tail()
                )
                return dead
        return reply.get("result")

    def _await_ready(self) -> None:
        reply = self._read(READY_TIMEOUT_S)
        if not reply.get("ready"):
            raise ZygoteError(f"unexpected first message {reply!r}")
        self.ready = True

    def _read(self, timeout_s: float | None) -> dict[str, Any]:
        if timeout_s is not None and not select.select([self.sock], [], [], timeout_s)[0]:
            raise ZygoteError(f"no answer in {timeout_s:.0f} s")
        line = self.reader.readline()
        if not line:
            raise ZygoteError("it exited")
        return json.loads(line)

    def log_tail(self) -> str:
        """The end of the zygote's own output (``(none)`` when it wrote nothing)."""
        try:
            size = os.fstat(self.log.fileno()).st_size
            start = max(0, size - LOG_TAIL_BYTES)
            text = os.pread(self.log.fileno(), size - start, start).decode(errors="replace")
        except (OSError, ValueError):  # closed already
            return "(unreadable)"
        return text.strip() or "(none)"

    def close(self) -> None:
        """Close the socket: the zygote stops its servers and exits."""
        with contextlib.suppress(OSError):
            self.sock.close()


_lock = threading.Lock()
_current: _Zygote | None = None


def _zygote() -> _Zygote:
    """This process's zygote, started on first use (and again after one broke or we forked)."""
    global _current
    with _lock:
        z = _current
        if z is None or z.broken or z.process.poll() is not None or _owner_pid != os.getpid():
            z = _current = _start()
        return z


_owner_pid = os.getpid()


def _start() -> _Zygote:
    global _owner_pid
    _owner_pid = os.getpid()
    return _Zygote()


# --- the zygote process ---------------------------------------------------------------------


def _main(fd: int) -> int:
    """The zygote: import :data:`PRELOAD`, say ready, then answer requests until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the servers
    owner = os.getppid()
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception as exc:  # the server imports (and reports) it itself
            print(f"zygote: cannot preload {name}: {exc}", flush=True)
    import gc

    gc.collect()
    gc.freeze()  # the forked servers do not copy the preloaded heap on their first collection
    children: dict[int, int | None] = {}
    reader = sock.makefile("rb")
    try:
        sock.sendall(b'{"ready": true}\n')
    except OSError:  # the owner is gone already (it shut us down mid-import, or died)
        return 0
    while os.getppid() == owner:
        ready = select.select([sock], [], [], CHECK_S)[0]
        _reap(children)
        if not ready:
            continue
        try:
            line = reader.readline()
        except OSError:  # the owner closed with a request unread (a reset): the same as EOF
            break
        if not line:
            break
        result = _answer(json.loads(line), children, sock)
        sock.sendall(json.dumps({"result": result}).encode() + b"\n")
    _stop_all(children)
    return 0


def _answer(request: dict[str, Any], children: dict[int, int | None], sock: socket.socket) -> Any:
    op, pid = request.get("op"), request.get("pid")
    if op == "spawn":
        child = os.fork()
        if child == 0:
            _child(request, sock)
        children[child] = None
        return child
    if not isinstance(pid, int) or pid not in children:
        return None
    if op == "signal" and children[pid] is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, int(request["sig"]))
        return True
    return children[pid]


def _reap(children: dict[int, int | None]) -> None:
    """Record the exit code of every server that ended (it is no longer signalled)."""
    for pid, code in children.items():
        if code is None:
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children[pid] = os.waitstatus_to_exitcode(status)


def _child(request: dict[str, Any], sock: socket.socket) -> None:
    """In the forked server: become ``agentrl ARGV`` (its output, environment, title), run it."""
    code = 1
    try:
        sock.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        die_with_parent()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        argv = list(request["argv"])
        sys.argv = argv
        _set_title(" ".join(argv))  # before the environment changes (setproctitle reads it)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[ENV_OWNER_PID] = str(os.getppid())  # watch_owner: die with the zygote
        from agentrl.cli import main

        code = main(argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the log gets it; the process must end here
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _set_title(title: str) -> None:
    """``ps`` and ``/proc/PID/cmdline`` show ``title`` (best effort)."""
    with contextlib.suppress(ImportError):  # SPT_NOENV (set by the launcher): keep the environ
        import setproctitle

        setproctitle.setproctitle(title)


def _stop_all(children: dict[int, int | None]) -> None:
    """SIGTERM every live server, SIGKILL what is left after :data:`GRACE_S`, reap them all."""
    live = [pid for pid, code in children.items() if code is None]
    for pid in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while live and time.monotonic() < deadline:
        live = [pid for pid in live if not _reaped(pid)]
        time.sleep(0.1)
    for pid in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.exit(_main(int(sys.argv[1])))
