"""MlflowTracker against a real MLflow store (SQLite, local): params, metrics, artifacts, resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agentrl.tracking import MlflowTracker, NullTracker, make_tracker, plot_metric_history

pytestmark = pytest.mark.integration


def test_run_logs_and_resume_continues_same_run(tmp_path: Path, monkeypatch) -> None:
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = MlflowTracker(
        tracking_uri=None, experiment="exp", run_name="r1", local_dir=tmp_path / "mlruns"
    )
    tracker.log_params({"trainer.max_staleness": 2, "algorithm.adv_estimator": "grpo"})
    tracker.log_metrics({"reward/mean": 0.25, "rollout_corr/kl": 0.01, "bad": math.nan}, step=1)
    tracker.log_dict({"hello": "world"}, "trajectories/step_1.json")
    run_id = tracker.run_id
    tracker.finish()
    assert tracker.skipped_non_finite == 1

    resumed = MlflowTracker(
        tracking_uri=None, experiment="exp", run_id=run_id, local_dir=tmp_path / "mlruns"
    )
    assert resumed.run_id == run_id
    resumed.log_params({"trainer.max_staleness": 2, "new.param": 1})  # no conflict on resume
    resumed.log_metrics({"reward/mean": 0.75}, step=2)
    resumed.finish()

    client = mlflow.MlflowClient(tracking_uri=tracker.tracking_uri)
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    run = client.get_run(run_id)
    assert run.data.params["trainer.max_staleness"] == "2"
    assert run.data.params["new.param"] == "1"
    artifacts = [a.path for a in client.list_artifacts(run_id, "trajectories")]
    assert artifacts == ["trajectories/step_1.json"]


def test_tracking_uri_env_is_honored(tmp_path: Path, monkeypatch) -> None:
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracker = make_tracker(
        enabled=True,
        backend="mlflow",
        tracking_uri=None,
        experiment="env-exp",
        run_name=None,
        run_id=None,
        local_dir=tmp_path / "unused",
    )
    tracker.log_metrics({"x": 1.0}, step=0)
    tracker.finish()
    assert isinstance(tracker, MlflowTracker) and tracker.tracking_uri == uri
    assert (tmp_path / "elsewhere.db").exists()
    assert not (tmp_path / "unused").exists()


def test_disabled_tracking_and_plots(tmp_path: Path) -> None:
    tracker = make_tracker(
        enabled=False,
        backend="mlflow",
        tracking_uri=None,
        experiment="x",
        run_name=None,
        run_id=None,
        local_dir=tmp_path,
    )
    assert isinstance(tracker, NullTracker)
    for step in range(3):
        tracker.log_metrics({"reward/mean": step / 2}, step=step)
    png = plot_metric_history(tracker.history, ["reward/mean", "missing"], tmp_path / "r.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
    assert plot_metric_history(tracker.history, ["missing"], tmp_path / "n.png") is None
    with pytest.raises(ValueError, match=r"tracking\.backend"):
        make_tracker(
            enabled=True,
            backend="wandb",
            tracking_uri=None,
            experiment="x",
            run_name=None,
            run_id=None,
            local_dir=tmp_path,
        )


def test_episodes_become_traces_linked_to_the_run(tmp_path: Path, monkeypatch) -> None:
    """Sample episodes are MLflow traces of the run: a span per model turn, tool call and
    reward, with tokens, latency and weight version (what the UI shows)."""
    import mlflow

    from agentrl.episode import EpisodeRecorder
    from agentrl.tracking import SampleReporter
    from agentrl.types import Generation

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = MlflowTracker(
        tracking_uri=None, experiment="traces", run_name="t", local_dir=tmp_path / "mlruns"
    )
    rec = EpisodeRecorder([1, 2])
    rec.add_generation(
        Generation(token_ids=[3, 4], logprobs=[-0.5, -0.5], finish_reason="stop", weight_version=2)
    )
    rec.add_environment_tokens([5])
    rec.add_generation(
        Generation(token_ids=[6], logprobs=[-0.1], finish_reason="stop", weight_version=2)
    )
    messages = [
        {"role": "user", "content": "probe 7"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "probe", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "higher"},
        {"role": "assistant", "content": "<answer>9</answer>"},
    ]
    traj = rec.to_trajectory(uid="g0", reward=0.5, messages=messages, tool_calls={"probe": 1})
    SampleReporter(tracker, n=1, total_steps=5).on_step(1, 2, {}, [traj, traj])
    run_id = tracker.run_id
    tracker.finish()

    traces = mlflow.search_traces(run_id=run_id, return_type="list")
    assert len(traces) == 1  # n=1 of the two episodes
    spans = {s.name: s for s in traces[0].data.spans}
    assert set(spans) == {"episode", "model turn 1", "tool: probe", "model turn 2", "reward"}
    assert spans["model turn 1"].attributes["weight_version"] == 2
    assert spans["model turn 1"].attributes["tokens"] == 2
    assert spans["tool: probe"].outputs == [{"role": "tool", "content": "higher"}]
    assert spans["episode"].attributes["reward"] == 0.5
    assert spans["episode"].attributes["step"] == 1
    assert traces[0].info.tags["agentrl.phase"] == "train"
    assert all(s.parent_id == spans["episode"].span_id for n, s in spans.items() if n != "episode")
