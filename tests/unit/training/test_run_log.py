"""What a run writes to its log and prints at the end (issue 22): the step line, start-up
phases, quiet request loggers, the summary by reason, the failure share, the Ctrl-C line."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentrl.training.run_log import (
    NOISY_LOGGERS,
    PhaseTimer,
    StepLog,
    add_log_level_argument,
    configure_logging,
    step_line,
)
from agentrl.training.summary import drops_and_errors, failed_share, failure_check, summary
from agentrl.training.train_cli import interrupted_line, resume_command

METRICS = {
    "reward/mean": 0.4567,
    "reward/accuracy": 0.25,
    "async/staleness_mean": 0.5,
    "async/staleness_max": 1.0,
    "perf/tokens_per_s": 1234.4,
    "rollout/dropped/reward_error": 3.0,
    "rollout/dropped/prompt_too_long": 1.0,
    "async/dropped_stale_total": 2.0,
    "timing_s/push": 0.25,
}


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_step_line_has_every_number_a_reader_needs() -> None:
    line = step_line(5, 20, 5, METRICS, elapsed_s=50.0, done=5)
    assert line == (
        "step 5/20 v5 reward 0.457 acc 0.25 staleness 0.50/1 1234 tok/s drops 6 push 0.25s "
        "eta 2m30s"
    )
    assert step_line(1, 400, 1, {}, elapsed_s=10.0, done=1).endswith("eta 1h06m")
    assert step_line(3, 3, 3, {}, elapsed_s=3.0, done=3).endswith("eta 0s")


def test_step_log_counts_the_eta_from_this_process_steps(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = StepLog(10, enabled=True, clock=clock)
    with caplog.at_level(logging.INFO, logger="agentrl.run"):
        log.on_step(6, 6, {"timing_s/step": 4.0}, [])  # a resumed run: its first step is 6
        clock.now += 6.0
        log.on_step(7, 7, {}, [])
        log.on_validation(7, {"val/accuracy": 0.5, "val/num_samples": 8, "val/reward_errors": 2})
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("step 6/10 v6") and lines[0].endswith("eta 16s")
    assert lines[1].endswith("eta 15s")  # 10 s over 2 steps, 3 left
    assert lines[2] == (
        "validation at step 7: accuracy 0.500 reward 0.000 (8 samples, 2 reward errors)"
    )
    quiet = StepLog(10, enabled=False)
    caplog.clear()
    quiet.on_step(1, 1, {}, [])
    assert not caplog.records


def test_phase_timer_logs_and_keeps_each_phase(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    timer = PhaseTimer(clock)
    start = clock()
    clock.now += 3.25
    with caplog.at_level(logging.INFO, logger="agentrl.run"):
        assert timer.done("servers up", start) == 3.25
    assert timer.timings == {"servers up": 3.25}
    assert caplog.records[0].getMessage() == "start-up: servers up in 3.2 s"


def test_phase_timer_milestones_count_from_the_launch(caplog: pytest.LogCaptureFixture) -> None:
    timer = PhaseTimer(Clock(), launched=lambda: 4.125)
    with caplog.at_level(logging.INFO, logger="agentrl.run"):
        assert timer.reached("first rollout answered") == 4.125
    assert timer.timings == {"first rollout answered": 4.125}
    assert caplog.records[0].getMessage() == "start-up: first rollout answered 4.12 s after launch"


def test_since_launch_counts_this_process_lifetime() -> None:
    import psutil

    from agentrl.training.run_log import since_launch

    age = time.time() - psutil.Process().create_time()
    assert 0.0 < since_launch() <= age + 1.0


def test_request_loggers_are_quiet_unless_debug() -> None:
    try:
        configure_logging("info")
        assert all(logging.getLogger(n).level == logging.WARNING for n in NOISY_LOGGERS)
        assert logging.getLogger().level == logging.INFO
        configure_logging("debug")
        assert logging.getLogger("httpx").level == logging.DEBUG
        configure_logging("error")
        assert logging.getLogger("httpx").level == logging.ERROR
        with pytest.raises(ValueError, match="--log-level must be one of"):
            configure_logging("loud")
    finally:
        configure_logging("warning")


def test_log_level_flag_and_quiet() -> None:
    parser = argparse.ArgumentParser()
    add_log_level_argument(parser)
    assert parser.parse_args([]).log_level == "info"
    assert parser.parse_args(["--log-level", "debug"]).log_level == "debug"
    assert parser.parse_args(["--quiet"]).quiet
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "loud"])


COUNTS = {
    "rollout/admitted": 44.0,
    "rollout/finished": 30.0,
    "rollout/cancelled": 4.0,
    "rollout/running": 0.0,
    "rollout/dropped/reward_error": 6.0,
    "rollout/dropped/agent_error": 2.0,
    "rollout/dropped/prompt_too_long": 1.0,
    "rollout/worker_errors": 3.0,
    "rollout/redispatched": 2.0,
    "rollout/timeouts": 1.0,
    "async/consumed_total": 24.0,
    "async/dropped_stale_total": 4.0,
    "async/dropped_incomplete_group_total": 5.0,
}


def test_the_summary_lists_failures_and_drops_by_reason() -> None:
    d = drops_and_errors(COUNTS)
    assert d["failed"] == {"rewards": 6, "agents": 2, "workers": 1}
    assert d["dropped"] == {
        "stale": 4,
        "prompt_too_long": 1,
        "uniform_reward": 0,
        "incomplete_group": 5,
        "cancelled_at_shutdown": 4,
    }
    assert d["episodes"] == {
        "admitted": 44,
        "finished": 30,
        "without_trajectory": 0,
        "trained": 24,
    }
    assert failed_share(COUNTS) == (9, 40)
    result = SimpleNamespace(
        steps=3,
        version=3,
        history={},
        val_before={},
        val_after={},
        wall_time_s=1.0,
        output_dir="out",
        run_location="",
        episodes=COUNTS,
    )
    printed = summary(result)
    assert printed["failed"]["rewards"] == 6 and printed["dropped"]["stale"] == 4
    json.dumps(printed)
    assert printed["servers"] == {"ejected": 0, "restarts": 0, "rejoined": 0, "failed": 0}
    result.history = {"servers/restarts": [(1, 0.0), (2, 1.0)], "servers/ejected": [(2, 1.0)]}
    assert summary(result)["servers"] == {"ejected": 1, "restarts": 1, "rejoined": 0, "failed": 0}


def test_a_run_fails_above_the_configured_share() -> None:
    result = SimpleNamespace(episodes=COUNTS)  # 9 of 40 = 22.5 %
    message = failure_check(result, 0.1)
    assert message is not None
    assert message.startswith("9 of 40 episodes failed (22 %: rewards 6, agents 2, workers 1)")
    assert "trainer.max_failed_episode_share=0.1" in message
    assert failure_check(result, 0.25) is None
    assert failure_check(SimpleNamespace(episodes={}), 0.0) is None  # nothing ended


def _args(*overrides: str, log_level: str = "info") -> argparse.Namespace:
    return argparse.Namespace(
        config="my project/config.yaml", overrides=list(overrides), log_level=log_level, quiet=False
    )


def test_ctrl_c_names_the_checkpoint_and_the_exact_resume_command(tmp_path: Path) -> None:
    cfg = SimpleNamespace(trainer=SimpleNamespace(output_dir=str(tmp_path), save_every=0))
    args = _args("trainer.lr=1e-4", log_level="debug")
    assert interrupted_line(cfg, args) == (
        "interrupted: no checkpoint was saved yet (trainer.save_every=0); rerun to start over: "
        "agentrl train 'my project/config.yaml' trainer.lr=1e-4"
    )
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 7}))
    assert interrupted_line(cfg, args) == (
        f"interrupted: checkpoint {tmp_path / 'checkpoint'} holds step 7; resume with: "
        "agentrl train 'my project/config.yaml' trainer.lr=1e-4 --log-level debug --resume"
    )
    assert resume_command(_args()) == "agentrl train 'my project/config.yaml' --resume"
