"""Issue 25's knobs through the public entry point: ``agentrl train configs/quickstart.yaml``
as a user runs it (the tiny model, one embedded server, two steps), the metrics read back from
the run's MLflow store.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
AGENTRL = Path(sys.executable).parent / "agentrl"


def train(out: Path, *overrides: str) -> dict[str, list[float]]:
    """Run ``agentrl train`` for two small steps; every metric's values, in step order."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [
        str(AGENTRL),
        "train",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--quiet",
        f"trainer.output_dir={out}",
        "trainer.total_steps=2",
        "data.batch_size=2",
        "data.n_samples=2",
        "data.generator_val_size=0",
        "trainer.mini_batch_size=2",
        "inference.num_servers=1",
        "rollout.max_concurrency=4",
        f"tracking.tracking_uri=sqlite:///{out / 'mlflow.db'}",
        "tracking.experiment=issue25",
        "tracking.num_sample_trajectories=0",
        f"checkpoint.shared_dir={out / 'weights'}",
        *overrides,
    ]
    done = subprocess.run(
        args, cwd=out.parent, env=env, capture_output=True, text=True, timeout=840
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    assert summary["steps"] == 2 and summary["weight_pushes"]["verified"] == 2
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("issue25")
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    return {
        key: [
            m.value
            for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        ]
        for key in run.data.metrics
    }


def test_overlong_penalty_and_mask_truncated_through_agentrl_train(tmp_path: Path) -> None:
    # A 16-token budget the random tiny model always runs into (16 tokens per turn), an 8-token
    # overlong buffer: an episode cut at the budget scores its reward (0 here) minus 1.
    metrics = train(
        tmp_path / "run",
        "agent.max_response_tokens=16",
        "inference.max_tokens_per_turn=16",
        "reward.overlong_buffer_len=8",
        "algorithm.mask_truncated=true",
    )
    # nearly every episode is cut (an early EOS is possible, hence > 0, not == 1)
    assert len(metrics["actor/masked_truncated_frac"]) == 2
    assert all(frac > 0 for frac in metrics["actor/masked_truncated_frac"])
    assert min(metrics["reward/min"]) <= -1.0 + 1e-6  # at the budget: the full penalty


def test_per_turn_history_and_a_token_budget_for_tools_through_agentrl_train(
    tmp_path: Path,
) -> None:
    metrics = train(
        tmp_path / "run",
        "agent.history=per_turn",
        "tools.max_output_tokens=32",
        "inference.max_tokens_per_turn=16",
    )
    # every episode has at least one model turn, each trained as its own row (2 x 2 episodes)
    assert len(metrics["rollout/turn_samples"]) == 2
    assert all(n >= 4 for n in metrics["rollout/turn_samples"])
    assert all(math.isfinite(x) for x in metrics["actor/pg_loss"])
