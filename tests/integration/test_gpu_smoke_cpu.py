"""``benchmarks/gpu_smoke.py`` runs its whole path on the CPU (``--size tiny``), so the prepared
GPU script cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_smoke_script_runs_on_cpu(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_smoke.py"),
            "--size",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--out",
            str(tmp_path),
            "--gradient-checkpointing",
        ],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout[out.stdout.index("{") :])
    assert report["steps"] == 2 and report["parameters"] > 0
    assert report["generation_tokens_per_s"] > 0 and report["train_tokens_per_s"] > 0
    assert report["verify_max_abs_diff"] is not None and report["verify_max_abs_diff"] <= 1e-3
    assert report["ok"] and report["failures"] == [] and report["gradient_checkpointing"]
    assert report["push_gb_per_s"] > 0 and report["peak_rss_mb"] > 0
    assert report["colocate"] and report["colocated_steps"] == 2  # slept and woke every step
