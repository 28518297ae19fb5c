"""Run names (issue 22): every run gets its own name, whatever the seed, or the user's; the
run's tracker built and driven on its own thread (issue 24, start-up)."""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.tracking import BackgroundTracker, MlflowTracker, NullTracker, Tracker, fresh_run_name


def test_run_names_do_not_follow_the_seeded_global_rng() -> None:
    names = set()
    for _ in range(5):
        random.seed(0)  # what seed_everything does before the tracker starts
        names.add(fresh_run_name())
    assert len(names) > 1
    assert all(re.fullmatch(r"[a-z]+-[a-z]+-\d{1,3}", n) for n in names), names


@pytest.mark.integration  # a real MLflow SQLite store (about 30 s to create on a busy machine)
def test_mlflow_runs_are_named_by_the_config_or_freshly(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    got = []
    for run_name in (None, None, "my-baseline"):
        random.seed(0)
        tracker = MlflowTracker(tracking_uri=uri, experiment="names", run_name=run_name)
        got.append(tracker._run.info.run_name)
        tracker.finish()
    assert got[0] != got[1] and got[2] == "my-baseline"


# ---- BackgroundTracker: the run's tracker is built and driven on its own thread (start-up) ----


class _Recording(NullTracker):
    """A tracker that records (thread, verb, args) of every call."""

    def __init__(self, calls: list[tuple[int, str, Any]]) -> None:
        super().__init__()
        self.calls = calls
        self.run_id = "run-1"
        calls.append((threading.get_ident(), "built", None))

    def log_params(self, params: dict[str, Any]) -> None:
        self.calls.append((threading.get_ident(), "params", params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "boom" in metrics:
            raise RuntimeError("the store refused the metric")
        super().log_metrics(metrics, step)
        self.calls.append((threading.get_ident(), "metrics", (metrics, step)))

    def finish(self, status: str = "FINISHED") -> None:
        self.calls.append((threading.get_ident(), "finish", status))


def test_calls_before_the_tracker_is_built_return_at_once_and_run_in_order_on_its_thread() -> None:
    calls: list[tuple[int, str, Any]] = []
    gate = threading.Event()

    def build() -> Tracker:
        assert gate.wait(10)
        return _Recording(calls)

    tracker = BackgroundTracker(build)
    metrics = {"reward/mean": 0.5}
    t0 = time.perf_counter()
    tracker.log_params({"lr": 1e-3})
    tracker.log_metrics(metrics, step=1)
    metrics["reward/mean"] = 9.0  # the caller reuses its dict: the queued call has a copy
    assert time.perf_counter() - t0 < 1.0 and calls == []  # nothing waited for the build
    gate.set()
    assert tracker.run_id == "run-1"  # waits for the build and the calls before it
    assert tracker.history == {"reward/mean": [(1, 0.5)]}
    tracker.finish()
    assert [c[1] for c in calls] == ["built", "params", "metrics", "finish"]
    assert {c[0] for c in calls} == {calls[0][0]} != {threading.get_ident()}  # one thread, not ours
    assert calls[2][2] == ({"reward/mean": 0.5}, 1)
    tracker.finish()  # idempotent
    assert [c[1] for c in calls].count("finish") == 1


def test_an_error_of_the_build_or_of_a_queued_call_is_raised_by_the_next_call() -> None:
    def broken() -> Tracker:
        raise ConnectionError("MLFLOW_TRACKING_URI refused the connection")

    tracker = BackgroundTracker(broken)
    tracker.ready.exception(timeout=10)
    with pytest.raises(ConnectionError, match="refused"):
        tracker.log_metrics({"a": 1.0}, step=1)
    tracker.finish()  # the error was raised once already

    calls: list[tuple[int, str, Any]] = []
    tracker = BackgroundTracker(lambda: _Recording(calls))
    tracker.log_metrics({"boom": 1.0}, step=1)
    with pytest.raises(RuntimeError, match="refused the metric"):
        tracker.finish()  # the run is still ended first
    assert calls[-1][1:] == ("finish", "FINISHED")


def test_a_failing_run_keeps_its_own_error_and_logs_the_trackers(caplog) -> None:
    def broken() -> Tracker:
        raise ConnectionError("store unreachable")

    tracker = BackgroundTracker(broken)
    tracker.ready.exception(timeout=10)
    tracker.finish("FAILED")  # does not raise over the run's own error
    assert "tracking failed too: store unreachable" in caplog.text
    with pytest.raises(RuntimeError, match="after finish"):
        tracker.log_metrics({"a": 1.0}, step=2)


@pytest.mark.integration  # a real MLflow SQLite store
def test_a_background_mlflow_run_gets_the_metrics_logged_from_another_thread(
    tmp_path: Path,
) -> None:
    """MLflow's active run is per thread: the run started on the tracker's thread must get
    every metric the training loop logs from its own thread, and end FINISHED."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = BackgroundTracker(lambda: MlflowTracker(tracking_uri=uri, experiment="bg"))
    tracker.log_params({"trainer.lr": 0.001})
    for step in (1, 2, 3):
        tracker.log_metrics({"reward/mean": step / 10}, step=step)
    run_id = tracker.run_id
    tracker.finish()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"trainer.lr": "0.001"}
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    experiment = client.get_experiment_by_name("bg")
    assert len(client.search_runs([experiment.experiment_id])) == 1  # no stray run


def test_a_deferred_build_waits_for_start_or_for_a_call_that_needs_the_tracker() -> None:
    calls: list[tuple[int, str, Any]] = []
    tracker = BackgroundTracker(lambda: _Recording(calls), deferred=True)
    tracker.log_metrics({"a": 1.0}, step=1)
    time.sleep(0.3)
    assert calls == [] and not tracker.ready.done()  # held: the first rollout comes first
    tracker.start()
    tracker.ready.result(timeout=10)
    tracker.finish()
    assert [c[1] for c in calls] == ["built", "metrics", "finish"]

    calls.clear()
    held = BackgroundTracker(lambda: _Recording(calls), deferred=True)
    assert held.run_id == "run-1"  # needed now: it starts the build itself
    held.finish()
