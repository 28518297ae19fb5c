"""A mixture of reasoning-gym tasks trains and validates through ``agentrl train``, from another
working directory, with every task reported on its own (``val/<task>/...``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
TASKS = {"leg_counting": 3, "basic_arithmetic": 3, "letter_counting": 6}  # weights 1, 1, 2 of 12


def test_reasoning_gym_mixture_trains_with_per_task_validation(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [
        *(sys.executable, "-m", "agentrl", "train", str(ROOT / "configs/reasoning_gym_mix.yaml")),
        *("--quiet", "trainer.total_steps=2", f"trainer.output_dir={tmp_path / 'out'}"),
    ]
    out = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout[out.stdout.index("{") :])
    assert summary["steps"] == 2 and summary["weight_pushes"]["verified"] == 2
    for when in ("val_before", "val_after"):
        val = summary[when]
        assert val["val/num_tasks"] == sum(TASKS.values())
        assert val["val/reward_errors"] == 0
        for task, n in TASKS.items():
            assert val[f"val/{task}/num_tasks"] == n
            assert 0.0 <= val[f"val/{task}/reward/mean_at_1"] <= 1.0
