"""A local ``agentrl train`` loses one of its own inference servers (SIGKILL) mid-run and goes
on (issue 21): the run finishes every step with exit status 0, the dead server is ejected,
launched again and counted, it rejoins only at the trainer's weight version (its own
``/weight_info`` says so at the end), and every admitted episode is a trajectory or a counted
drop. A real CLI subprocess, two embedded servers of the tiny model, 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.test_lifetime import children_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
KEY = "train-faults-key"
STEPS = 12


def _command(model_dir: Path, tmp: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "agentrl",
        "train",
        str(ROOT / "configs" / "quickstart.yaml"),
        f"model.path={model_dir}",
        f"trainer.total_steps={STEPS}",
        "data.batch_size=2",
        "data.n_samples=2",
        "trainer.mini_batch_size=2",
        "trainer.max_staleness=1",
        "inference.num_servers=2",
        "inference.max_tokens_per_turn=16",
        "inference.health_check_interval_s=0.5",
        "inference.max_server_restarts=1",
        "agent.max_turns=2",
        "agent.max_response_tokens=64",
        "data.generator_val_size=4",
        "trainer.val_before_train=false",
        "tracking.enabled=false",
        f"trainer.output_dir={tmp / 'out'}",
        f"checkpoint.shared_dir={tmp / 'weights'}",
    ]


def _servers(owner: int) -> list[int]:
    """The pids of the embedded servers the run ``owner`` started."""
    found = []
    for pid in children_of(owner):
        with contextlib.suppress(OSError):
            if b"serve-model" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        assert proc.poll() is None, log.read_text()[-4000:]
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in the log:\n{log.read_text()[-4000:]}")


def _hold_the_trainer_while_the_replacement_starts(
    proc: subprocess.Popen, logs: Path, log: Path
) -> None:
    """SIGSTOP the trainer from the moment it launched the replacement server until that server
    listens, then SIGCONT: the run cannot finish its steps before a server start (a few seconds
    to a minute on a loaded machine) whatever the machine's speed, and the replacement starts
    without the trainer competing for the CPUs. Nothing else of the run is touched."""
    deadline = time.monotonic() + 60
    while not list(logs.glob("*-restart1.log")):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.05)
    (started,) = logs.glob("*-restart1.log")
    # The launcher opens the log before it forks the server: stopped in between, the trainer
    # never starts it (CI8: an empty log after 180 s). The server's first line proves it runs.
    while not started.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 180
        while " on http://" not in started.read_text():
            assert time.monotonic() < deadline, started.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGCONT)


class VersionWatch:
    """Reads a server's ``/weight_info`` every 0.1 s until stopped; the last version seen."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.last: int | None = None
        self.seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(timeout=2.0, headers=headers) as http:
            while not self._stop.is_set():
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    r = http.get(f"{self.url}/weight_info")
                    version = r.json().get("weight_version") if r.status_code == 200 else None
                    if version is not None and version != self.last:
                        self.seen.append(version)
                        self.last = version
                time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_a_killed_server_of_agentrl_train_rejoins_at_the_version_and_the_run_finishes(
    tiny_model_dir: Path, tmp_path: Path, report_metric
) -> None:
    log, out = tmp_path / "train.log", tmp_path / "summary.json"
    env = {
        **os.environ,
        "AGENTRL_API_KEY": KEY,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    t0 = time.monotonic()
    with log.open("ab") as err, out.open("wb") as stdout:
        proc = subprocess.Popen(
            _command(tiny_model_dir, tmp_path), stdout=stdout, stderr=err, env=env
        )
    watch = None
    try:
        # mid-run: a step trained and pushed, the next batch's episodes in flight on both
        _wait_for(log, r"step 1/", proc, 240)
        servers = _servers(proc.pid)
        assert len(servers) == 2, log.read_text()[-3000:]
        os.kill(servers[0], signal.SIGKILL)
        t_kill = time.monotonic()
        _hold_the_trainer_while_the_replacement_starts(proc, tmp_path / "out" / "logs", log)
        restarted = _wait_for(log, r"server \d restarted at (http://\S+) \(restart 1\)", proc, 120)
        watch = VersionWatch(restarted.group(1))
        _wait_for(log, r"rejoined the pool at the current version", proc, 120)
        rejoin_s = time.monotonic() - t_kill
        rc = proc.wait(240)
    finally:
        if watch is not None:
            watch.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    summary = json.loads(out.read_text())
    assert summary["steps"] == STEPS and summary["version"] == STEPS
    assert summary["servers"] == {"ejected": 1, "restarts": 1, "rejoined": 1, "failed": 0}
    # SIGKILL: its process exited, or (while the kernel tears it down) it stopped answering
    assert re.search(
        r"server \d at \S+ ejected: (its process \d+ exited|it failed two health)", text
    )
    # the rejoined server served the trainer's last pushed version, read from the server itself
    assert watch is not None
    assert watch.last == summary["version"], (watch.seen, summary["version"])
    assert watch.seen == sorted(watch.seen), watch.seen  # versions only grew on it
    e = summary["episodes"]
    assert e["admitted"] == e["finished"] + e["without_trajectory"], e
    assert e["trained"] == STEPS * 2 * 2
    assert sum(summary["failed"].values()) == 0, summary
    report_metric("train_server_kill_rejoin_s", round(rejoin_s, 1))
    report_metric("train_server_kill_wall_s", round(time.monotonic() - t0, 1))
    report_metric("train_server_kill_without_trajectory", e["without_trajectory"])
