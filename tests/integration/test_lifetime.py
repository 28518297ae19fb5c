"""Children never outlive their owner (issue 21): SIGTERM / SIGKILL of a real ``agentrl train``
and ``agentrl serve`` (CLI subprocesses that launch the embedded tiny server) leaves 0 of their
child processes alive 10 s later.

A child is found by its environment: every server a run launches carries
``AGENTRL_OWNER_PID=<the run's pid>`` (:mod:`agentrl.lifetime`), and so do its own children.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.lifetime import ENV_OWNER_PID

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 10.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def children_of(owner: int) -> list[int]:
    """Live processes started (directly or not) by the run ``owner``, from their environment."""
    marker = f"{ENV_OWNER_PID}={owner}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return [p for p in found if _alive(p)]


def _command(kind: str, model_dir: Path, tmp: Path) -> list[str]:
    common = [
        str(ROOT / "configs" / "quickstart.yaml"),
        f"model.path={model_dir}",
        "inference.num_servers=1",
        "tracking.enabled=false",
        f"trainer.output_dir={tmp / 'out'}",
        f"checkpoint.shared_dir={tmp / 'weights'}",
    ]
    if kind == "train":
        return [sys.executable, "-m", "agentrl", "train", *common, "trainer.total_steps=1000"]
    return [
        sys.executable,
        "-m",
        "agentrl",
        "serve",
        *common,
        "--port",
        "0",
        "--store",
        str(tmp / "svc.sqlite"),
    ]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("kind", ["train", "serve"])
def test_no_child_outlives_its_owner(kind: str, sig: int, tiny_model_dir: Path, tmp_path: Path):
    log = tmp_path / f"{kind}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as f:
        proc = subprocess.Popen(
            _command(kind, tiny_model_dir, tmp_path), stdout=f, stderr=subprocess.STDOUT, env=env
        )
    try:
        deadline = time.monotonic() + 240
        while not children_of(proc.pid):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, (
                "no inference server started: " + log.read_text()[-3000:]
            )
            time.sleep(0.2)
        time.sleep(3.0)  # let the server come up (a kill during startup must work too)
        children = children_of(proc.pid)
        assert children, log.read_text()[-3000:]
        proc.send_signal(sig)
        proc.wait(60)
        time.sleep(GRACE_S)
        left = [p for p in children if _alive(p)] + children_of(proc.pid)
        assert left == [], f"{len(set(left))} child process(es) outlived `agentrl {kind}`"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in children_of(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# An owner that starts a process group that is not ours (like vLLM: a leader that forks a worker,
# neither watching us, the leader ignoring SIGTERM) from a thread, arms a group reaper, prints the
# pids and waits to be killed.
_OWNER = """
import subprocess, sys, threading, time
from agentrl.lifetime import start_reaper
LEADER = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print(w.pid, flush=True); time.sleep(600)"
)
def launch():
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    worker = int(leader.stdout.readline())
    reaper = start_reaper(leader.pid, group=True, grace_s=float(sys.argv[1]))
    print(leader.pid, worker, reaper.pid, flush=True)
threading.Thread(target=launch).start()
time.sleep(600)
"""


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_a_group_that_is_not_ours_dies_with_its_killed_owner() -> None:
    """What vLLM needs (its API server and engine processes never watch us; the server may be
    started from a thread, where PR_SET_PDEATHSIG does not hold): SIGKILL the owner, and the
    reaper ends the whole group, SIGKILL after the grace for a leader that ignores SIGTERM."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, "1.0"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        leader, worker, reaper = (int(x) for x in owner.stdout.readline().split())  # type: ignore[union-attr]
        time.sleep(1.0)
        assert _alive(leader) and _alive(worker) and _alive(reaper)
        owner.kill()
        owner.wait(10)
        assert _wait_gone([leader, worker, reaper], 15.0) == []
    finally:
        owner.kill()
        for pid in (leader, worker):
            with contextlib.suppress(ProcessLookupError, UnboundLocalError):
                os.kill(pid, signal.SIGKILL)


def test_a_reaper_leaves_by_itself_when_its_child_is_stopped() -> None:
    from agentrl.lifetime import start_reaper

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    reaper = start_reaper(child.pid)
    time.sleep(1.0)
    assert reaper.poll() is None  # the owner (this test) lives: the reaper waits
    child.kill()
    child.wait(10)
    assert reaper.wait(5) == 0  # it saw the child gone and left, killing nothing
