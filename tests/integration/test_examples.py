"""The user projects in ``examples/`` train through the public entry point, as a user runs them.

Each project lives outside the packages, with its own data, reward, agent and (for
``examples/units``) its own package named ``tools``. ``agentrl train <project>/config.yaml`` runs
from an unrelated working directory, without PYTHONPATH, locally and on a real local Ray cluster,
for a few steps; every weight push must be verified on every server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["units", "openai_agent"]
AGENTRL = Path(sys.executable).parent / "agentrl"


def _train(example: str, cwd: Path, *overrides: str, log: list[str] | None = None) -> dict:
    """The run's JSON summary; with ``log``, the run logs at info and its stderr is appended."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    config = ROOT / "examples" / example / "config.yaml"
    level = "--quiet" if log is None else "--log-level=info"
    args = [str(AGENTRL), "train", str(config), level, "trainer.total_steps=2", *overrides]
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, out.stderr[-4000:]
    if log is not None:
        log.append(out.stderr)
    return json.loads(out.stdout[out.stdout.index("{") :])


def _check(summary: dict) -> None:
    assert summary["steps"] == 2 and summary["version"] == 2
    pushes = summary["weight_pushes"]
    assert pushes["verified"] == 2 and pushes["failed_servers"] == 0
    assert pushes["max_abs_diff"] <= 1e-3
    assert summary["val_before"]["val/num_tasks"] > 0  # the project's own held-out file


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_trains_locally_from_another_directory(example: str, tmp_path: Path) -> None:
    _check(_train(example, tmp_path, f"trainer.output_dir={tmp_path / 'out'}"))


@pytest.mark.ray
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_trains_on_ray(example: str, tmp_path: Path, ray_cluster: str) -> None:
    """Also what the user reads: the trainer actor's step lines reach the console, prefixed by
    Ray with the actor (issue 22: they went only to Ray's log files)."""
    log: list[str] = []
    _check(
        _train(
            example,
            tmp_path,
            f"trainer.output_dir={tmp_path / 'out'}",
            "distributed.backend=ray",
            f"distributed.ray_address={ray_cluster}",
            log=log,
        )
    )
    step_lines = [line for line in log[0].splitlines() if "agentrl.run: step 2/2 v2" in line]
    assert step_lines and all("(TrainerActor pid=" in line for line in step_lines), log[0][-3000:]


def test_eval_report_writes_the_report_and_episode_traces(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``agentrl eval --report`` (public CLI, another cwd): the JSON report, and the evaluation
    as an MLflow run of its own with one trace per episode."""
    import mlflow

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env["OMP_NUM_THREADS"] = "1"
    report = tmp_path / "report.json"
    args = [
        str(AGENTRL),
        "eval",
        str(ROOT / "examples" / "units" / "config.yaml"),
        "--checkpoint",
        str(tiny_model_dir),
        "--report",
        str(report),
        "--max-traces",
        "3",
        f"trainer.output_dir={tmp_path / 'out'}",
        "tracking.enabled=true",
        "tracking.experiment=units-eval",
    ]
    out = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(report.read_text())["metrics"]["val/num_tasks"] > 0
    assert "3 episode traces" in out.stdout, out.stdout[-2000:]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlruns' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("units-eval")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "eval tiny-qwen2" and run.info.status == "FINISHED"
    traces = client.search_traces(locations=[exp.experiment_id], run_id=run.info.run_id)
    assert len(traces) == 3 and all(t.info.tags["agentrl.phase"] == "eval" for t in traces)
    assert all(t.data.spans[0].name == "episode" for t in traces)
