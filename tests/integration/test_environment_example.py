"""The environment example (``examples/secret_number``) trains through ``agentrl train`` from an
unrelated working directory, and its per-tool and reward-component metrics reach MLflow.

The tiny random model never writes a tool call, so the run that checks ``tools/<name>/*`` uses
the shipped calculator warm start (``checkpoints/calculator-sft``), which calls ``calculator``
on calculator-style prompts: the environment's episodes then run a config tool (enabled beside
the environment's ``probe``) under the run's limits, and the counts reach MLflow. The
environment's own tool is counted by the same path (tests/unit/agents/test_environment.py runs
``probe`` calls through a worker into ``tools/probe/*``).
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
CONFIG = ROOT / "examples" / "secret_number" / "config.yaml"
AGENTRL = Path(sys.executable).parent / "agentrl"


def _train(cwd: Path, *overrides: str) -> dict:
    """``agentrl train`` of the example for 2 steps from ``cwd``, its output in a log file."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    args = [str(AGENTRL), "train", str(CONFIG), "--quiet", "trainer.total_steps=2", *overrides]
    log = cwd / "train.log"
    with log.open("w") as out:
        proc = subprocess.run(
            args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=840
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return json.loads(text[text.index("{\n") : text.rindex("}") + 1])


def _metrics(uri: str) -> dict[str, float]:
    import mlflow

    mlflow.set_tracking_uri(uri)
    (run,) = mlflow.search_runs(experiment_names=["secret_number"], output_format="list")
    return dict(run.data.metrics)


def _calculator_tasks(path: Path) -> Path:
    from agentrl.rollout.calculator_task import format_prompt

    rows = [
        {"prompt": format_prompt(a, "+", b), "extra": {"target": a + b}}
        for a, b in [(12, 30), (7, 8), (40, 2), (19, 23), (5, 6), (31, 11), (9, 9), (14, 27)]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_secret_number_trains_from_another_directory_with_metrics_in_mlflow(
    tmp_path: Path,
) -> None:
    from agentrl.rollout.calculator_task import CALCULATOR_SYSTEM_PROMPT

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tasks = _calculator_tasks(tmp_path / "tasks.jsonl")
    summary = _train(
        tmp_path,
        f"trainer.output_dir={tmp_path / 'out'}",
        "tracking.enabled=true",
        f"tracking.tracking_uri={uri}",
        "tracking.experiment=secret_number",
        f"model.path={ROOT / 'checkpoints' / 'calculator-sft'}",
        "tools.enabled=[calculator]",
        f"data.train_files=[{tasks}]",
        f"agent.system_prompt={json.dumps(CALCULATOR_SYSTEM_PROMPT)}",
        # The warm start saw only the calculator's schema: with probe's beside it, ~1 turn in 20
        # is a well-formed calculator call; 128 episodes make at least one near certain.
        "data.batch_size=16",
        "data.n_samples=4",
        "trainer.mini_batch_size=16",
    )
    assert summary["steps"] == 2 and summary["weight_pushes"]["verified"] == 2, summary
    assert summary["val_before"]["val/secret_number/num_tasks"] == 8  # the example's own file
    m = _metrics(uri)
    # Every offered tool has its per-tool keys whether or not it was called: sampling decides
    # whether the warm start calls the calculator in these 2 steps (one CI run of three saw
    # none); that calls are counted is tests/unit/training/test_metrics.py's.
    for tool in ("calculator", "probe"):
        for key in ("calls", "errors", "timeouts", "latency_mean_s", "latency_max_s"):
            assert f"tools/{tool}/{key}" in m, (tool, key, m)
        calls, latency = m[f"tools/{tool}/calls"], m[f"tools/{tool}/latency_mean_s"]
        assert calls >= 0 and (latency > 0) == (calls > 0), (tool, calls, latency)
    # the environment's reward scored every episode, and its components are logged
    assert m["reward/secret_number/scored"] > 0 and m["reward/secret_number/errors"] == 0
    assert "reward/secret_number/probes/mean" in m
    assert "reward/secret_number/correct/mean" in m
