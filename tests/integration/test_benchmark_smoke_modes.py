"""Every benchmark script runs: the ``--smoke`` modes not covered by test_benchmark_smoke.py
(issue 21: ``benchmarks/service.py`` once crashed as shipped and nothing noticed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def _smoke(script: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout[proc.stdout.index("{") :])


@pytest.mark.parametrize("script", ["agent_loop.py", "correction.py", "sandbox_overhead.py"])
def test_cheap_benchmarks_smoke(script: str) -> None:
    assert _smoke(script)


@pytest.mark.slow
def test_service_benchmark_smoke() -> None:
    report = _smoke("service.py")
    assert report["ratio"] > 0 and report["workload"]["smoke"] is True
