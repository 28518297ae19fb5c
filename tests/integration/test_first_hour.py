"""The first hour of a new user, through the real ``agentrl train`` command (issue 22).

A user project in a temporary folder (its own reward file under ``imports:``, named by its
stem) trains the tiny model against an embedded server, with stdout and stderr going to a log
file, as under nohup or a scheduler:

- the log has one readable line per step and the start-up phases, and no request lines;
- a reward that fails on about a quarter of the tasks shows in the summary by reason, and the
  run exits 1 (above ``trainer.max_failed_episode_share``);
- SIGINT (Ctrl-C) ends the run with one line naming the checkpoint and the exact resume
  command, exit status 130, no traceback, in under 10 s; the resumed run says where it resumed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = '''
from agentrl.rollout.rewards.rules import calculator_reward


def flaky(traj, task):
    """The calculator reward, raising for every fourth task (ids end with their number)."""
    if int(task.id.rsplit("-", 1)[1]) % 4 == 0:
        raise ValueError(f"no reference answer for {task.id}")
    return calculator_reward(traj, task)
'''

CONFIG = """
kind: rl
imports: [plugin.py]
model: {path: null, dtype: float32}
data:
  generator: calculator
  generator_kwargs: {min_digits: 2, max_digits: 3}
  generator_train_size: 128
  generator_val_size: 8
  batch_size: 4
  n_samples: 2
  shuffle: false
agent: {default: tool_agent, max_turns: 2, max_response_tokens: 64, tool_call_format: hermes}
tools: {enabled: [calculator]}
reward: {sources: {calculator: REWARD}}
inference: {backend: embedded, num_servers: 1, max_tokens_per_turn: 24}
trainer:
  total_steps: 3
  max_staleness: 1
  device: cpu
  lr: 1.0e-4
tracking: {experiment: first_hour}
"""


def _project(tmp_path: Path, reward: str) -> Path:
    (tmp_path / "plugin.py").write_text(PLUGIN)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("REWARD", reward))
    return config


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT)
    return env


def _train(args: list[str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """``agentrl train ARGS`` with stdout and stderr appended to ``log`` (not a terminal)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "agentrl", "train", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=_env(),
            # As a terminal's foreground job: Ctrl-C's default action, even when this test runs
            # under a process that ignores SIGINT (a CI started with `&` from a script).
            preexec_fn=_default_sigint,
        )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The first log line matching ``pattern``; fails if the run ends or the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if re.search(pattern, line):
                return line
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}):\n{log.read_text()}"
        time.sleep(0.5)
    raise AssertionError(f"no line matching {pattern!r} in {timeout_s} s:\n{log.read_text()}")


def test_a_log_file_reads_well_and_the_summary_shows_failed_rewards(tmp_path: Path) -> None:
    config = _project(tmp_path, "plugin:flaky")
    log = tmp_path / "train.log"
    proc = _train([str(config), f"trainer.output_dir={tmp_path / 'out'}"], log, tmp_path)
    rc = proc.wait(timeout=800)
    text = log.read_text()
    assert rc == 1, text
    lines = text.splitlines()
    steps = [ln for ln in lines if re.search(r"agentrl\.run: step \d+/3 v\d+ reward", ln)]
    assert len(steps) == 3, text
    for field in ("acc ", "staleness ", "tok/s", "drops ", "push ", "eta "):
        assert field in steps[-1], steps[-1]
    assert any("start-up: " in ln and " server(s) up" in ln for ln in lines), text
    assert not [ln for ln in lines if "httpx" in ln or "HTTP Request" in ln], text
    assert "\r" not in text and "Loading weights" not in text  # no progress bars in a file
    summary = json.loads(text[text.index("\n{") + 1 : text.rindex("}") + 1])
    failed, ended = summary["failed"]["rewards"], summary["episodes"]["finished"]
    assert failed > 0 and summary["failed"]["agents"] == 0
    assert 0.15 < failed / (failed + ended) < 0.4, summary  # every 4th task, both samples
    assert summary["val_before"]["val/reward_errors"] > 0
    assert "trainer.max_failed_episode_share=0.1" in lines[-1] and "rewards" in lines[-1]
    assert lines[-1].startswith("error: ") and "Traceback" not in text


def test_ctrl_c_says_how_to_resume_and_the_resumed_run_says_where(tmp_path: Path) -> None:
    config = _project(tmp_path, "calculator")
    out = tmp_path / "out"
    overrides = [
        f"trainer.output_dir={out}",
        "trainer.total_steps=50",
        "trainer.save_every=1",
        "trainer.val_before_train=false",
    ]
    log = tmp_path / "train.log"
    proc = _train([str(config), *overrides], log, tmp_path)
    _wait_for(log, r"agentrl\.run: step 2/50 ", proc, timeout_s=600)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=60)
    took = time.monotonic() - sent
    text = log.read_text()
    assert rc == 130 and took < 10, (rc, took, text)
    assert "Traceback" not in text, text
    last = text.strip().splitlines()[-1]
    m = re.fullmatch(r"interrupted: checkpoint (\S+) holds step (\d+); resume with: (.+)", last)
    assert m is not None, last
    assert Path(m[1]) == out / "checkpoint" and int(m[2]) >= 2
    command = shlex.split(m[3])
    assert command[:2] == ["agentrl", "train"] and command[-1] == "--resume"
    step = int(m[2])

    log2 = tmp_path / "resume.log"
    resumed = _train([*command[2:], f"trainer.total_steps={step + 1}"], log2, tmp_path)
    assert resumed.wait(timeout=600) == 0, log2.read_text()
    text2 = log2.read_text()
    assert f"resumed from step {step} (checkpoint {out / 'checkpoint'})" in text2
    assert f"agentrl.run: step {step + 1}/{step + 1} " in text2
