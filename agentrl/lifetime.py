"""Children never outlive their owner (issue 21).

Why it exists: ``agentrl train`` and ``agentrl serve`` start inference servers and workers as
subprocesses. A plain ``Popen`` child survives its parent's SIGKILL (and a SIGTERM whose
default action skips every ``finally``): it is re-parented to PID 1 and keeps its port, its GPU
memory and its CPU. :func:`die_with_parent` is a ``preexec_fn`` that asks Linux to send the child
SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), whatever killed the parent.

Invariants and caveats:

- Linux only (elsewhere it is a no-op; the owners' ``finally`` blocks still stop their children);
- the signal is tied to the *thread* that started the child: start long-lived children from the
  main thread or from a thread that lives as long as its owner (an executor's worker thread
  does; a thread that ends kills its children);
- a parent that died between ``fork`` and the ``prctl`` is caught: the child exits at once.

So :func:`child_preexec` arms the signal only from the main thread, and every child that is
ours (``agentrl serve-model``) also gets :data:`ENV_OWNER_PID` and runs :func:`watch_owner`: a
daemon thread that exits the process once it is re-parented (its owner died), checked every
:data:`WATCH_INTERVAL_S`. Together: a child dies with its owner whichever thread started it.

A child that is not ours (vLLM's API server and the engine processes it forks, none of which
watches us) gets a reaper instead (:func:`start_reaper`): a small process that outlives the
owner by design, and once the owner is gone stops the child, or with ``group=True`` the child's
whole process group (SIGTERM, then SIGKILL). A reaper exits by itself once its child is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

__all__ = [
    "ENV_OWNER_PID",
    "PR_SET_PDEATHSIG",
    "WATCH_INTERVAL_S",
    "child_preexec",
    "die_with_parent",
    "owner_env",
    "start_reaper",
    "watch_owner",
]

ENV_OWNER_PID = "AGENTRL_OWNER_PID"
"""The pid a child must die with (set by :func:`owner_env`, read by :func:`watch_owner`)."""
WATCH_INTERVAL_S = 0.5
"""How often :func:`watch_owner` checks the parent pid."""

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal the calling process gets when its parent (thread) dies."""


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: the child gets SIGKILL when its parent dies.

    Runs in the child between ``fork`` and ``exec`` (async-signal-safe calls only).
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # cannot arm it; the owner's own cleanup still stops the child
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)


def child_preexec() -> Callable[[], None] | None:
    """:func:`die_with_parent` when called from the main thread (whose life is the process's),
    else None (a worker thread may end before the child should)."""
    return die_with_parent if threading.current_thread() is threading.main_thread() else None


def owner_env() -> dict[str, str]:
    """Environment entries that make a child running :func:`watch_owner` die with this process."""
    return {ENV_OWNER_PID: str(os.getpid())}


def watch_owner(interval_s: float = WATCH_INTERVAL_S) -> bool:
    """In a child: exit (status 70) as soon as the process named by :data:`ENV_OWNER_PID` is no
    longer the parent. Returns False (and watches nothing) when the variable is unset."""
    raw = os.environ.get(ENV_OWNER_PID, "")
    if not raw.isdigit():
        return False
    owner = int(raw)
    if os.getppid() != owner:
        os._exit(70)

    def _watch() -> None:
        while True:
            threading.Event().wait(interval_s)
            if os.getppid() != owner:
                os._exit(70)

    threading.Thread(target=_watch, name="agentrl-owner-watch", daemon=True).start()
    return True


_REAPER = """
import os, signal, sys, time
owner, child, group = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "group"
grace = float(sys.argv[4])
def send(sig):
    try:
        os.killpg(child, sig) if group else os.kill(child, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while os.getppid() == owner and alive(child):
    time.sleep(0.5)
if os.getppid() != owner and send(signal.SIGTERM):
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and send(0):
        time.sleep(0.25)
    send(signal.SIGKILL)
"""
"""The reaper's program (argv: owner pid, child pid, ``group`` or ``pid``, grace seconds)."""


def start_reaper(
    child: int, *, group: bool = False, grace_s: float = 10.0
) -> subprocess.Popen[bytes]:
    """Start a reaper of ``child`` (a pid; with ``group``, the leader of its own process group)
    owned by this process: once this process is gone (the reaper is re-parented, whatever killed
    us), it sends SIGTERM to the child (or its group), and SIGKILL after ``grace_s`` to what is
    left. It exits by itself as soon as the child is gone. Needs nothing but our python."""
    mode = "group" if group else "pid"
    return subprocess.Popen(
        [sys.executable, "-c", _REAPER, str(os.getpid()), str(child), mode, str(grace_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C of the owner's terminal must not stop the reaper
    )
