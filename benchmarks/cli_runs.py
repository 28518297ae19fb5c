"""Run ``agentrl train`` as a user does and read its per-step metrics back (for benchmarks).

Benchmarks that time whole training runs go through the public CLI, not the trainer's Python
API, so that refactors inside the trainer do not break them: :func:`run_train` runs
``python -m agentrl train CONFIG overrides --quiet`` in a subprocess and reads the step metrics
from the run's local MLflow store (``trainer.output_dir/mlruns/mlflow.db``, SQLite, read with
the standard library) and the summary JSON the command prints.
"""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "add_agent_workload_args",
    "interleaved_quickstart_runs",
    "median_after_first",
    "mlflow_metrics",
    "paired_ratio",
    "report",
    "rotated",
    "run_train",
]

ROOT = Path(__file__).resolve().parents[1]


def mlflow_metrics(db: Path, keys: Sequence[str] | None = None) -> dict[str, dict[int, float]]:
    """``{key: {step: value}}`` from a local MLflow SQLite store (all keys when ``keys`` is None)."""
    if not db.is_file():
        raise FileNotFoundError(f"{db}: no MLflow store (was tracking.enabled=false?)")
    con = sqlite3.connect(str(db))
    try:
        if keys:
            marks = ",".join("?" * len(keys))
            rows = con.execute(
                f"SELECT key, step, value FROM metrics WHERE key IN ({marks})", tuple(keys)
            ).fetchall()
        else:
            rows = con.execute("SELECT key, step, value FROM metrics").fetchall()
    finally:
        con.close()
    out: dict[str, dict[int, float]] = {}
    for key, step, value in rows:
        out.setdefault(key, {})[int(step)] = float(value)
    return out


def run_train(
    config: Path,
    output_dir: Path,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 1800,
) -> dict[str, Any]:
    """Run ``agentrl train`` to completion; returns its summary, wall time and step metrics.

    ``env`` replaces the named environment variables of this process for the child (a value of
    ``""`` removes the variable). Raises ``RuntimeError`` with the stderr tail on failure.
    """
    child_env = dict(os.environ)
    for k, v in (env or {}).items():
        if v == "":
            child_env.pop(k, None)
        else:
            child_env[k] = v
    cmd = [sys.executable, "-m", "agentrl", "train", str(config)]
    cmd += [f"trainer.output_dir={output_dir}", "tracking.enabled=true", *overrides, "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"agentrl train failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}"
        )
    start = proc.stdout.rfind("\n{")
    summary = json.loads(proc.stdout[start + 1 if start >= 0 else 0 :])
    return {
        "wall_s": wall,
        "summary": summary,
        "metrics": mlflow_metrics(output_dir / "mlruns" / "mlflow.db"),
        "load_avg_1m": os.getloadavg()[0],
    }


def rotated(names: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order of ``names``: each round starts one later, so load drifts hit every
    variant alike."""
    k = r % len(names)
    return [*names[k:], *names[:k]]


def median_after_first(series: Mapping[int, float]) -> float:
    """Median over the steps after the first (step 1 fills the pipeline from empty)."""
    steps = sorted(series)
    values = [series[s] for s in steps[1:]] or [series[s] for s in steps]
    return statistics.median(values)


def add_agent_workload_args(p: Any) -> None:
    """The agent-shaped workload both engine and trainer benchmarks build (an ``argparse``
    parser's options): the model, tasks x samples, a shared system block, each task's question,
    a model turn and a tool answer, in tokens."""
    p.add_argument("--model-dir", type=Path, default=ROOT / "checkpoints" / "calculator-sft")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=150)
    p.add_argument("--question-tokens", type=int, default=25)
    p.add_argument("--turn-tokens", type=int, default=24)
    p.add_argument("--tool-tokens", type=int, default=20)


def report(name: str, args: Any, result: dict[str, Any], started: float) -> dict[str, Any]:
    """A benchmark's JSON (printed too): its workload (``args`` but the model's path and
    ``--smoke``), the model's name, the machine's CPUs and load, its wall since ``started``
    (``time.perf_counter``), and ``result``."""
    out = {
        "benchmark": name,
        "level": args.level,
        "workload": {k: v for k, v in vars(args).items() if k not in ("model_dir", "smoke")},
        "model": args.model_dir.name,
        "cpus": len(os.sched_getaffinity(0)),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.perf_counter() - started, 1),
        "results": result,
    }
    print(json.dumps(out, indent=2))
    return out


def interleaved_quickstart_runs(
    variants: Mapping[str, tuple[Mapping[str, str], Sequence[str]]],
    args: Any,
    keys: Sequence[str],
    label: str,
) -> dict[str, dict[str, list[float]]]:
    """``agentrl train configs/quickstart.yaml`` from ``args.model_dir`` for ``args.steps`` steps
    (no validation), every variant (name -> (environment, overrides)) once per round of
    ``args.rounds``, in a rotated order; per variant and metric of ``keys``, the median after the
    first step of each round's run."""
    work = Path(tempfile.mkdtemp(prefix=f"agentrl-{label}-"))
    names = list(variants)
    out: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in names}
    for r in range(args.rounds):
        for n in rotated(names, r):
            env, overrides = variants[n]
            res = run_train(
                ROOT / "configs" / "quickstart.yaml",
                work / f"{n}-{r}",
                [
                    f"model.path={args.model_dir}",
                    f"trainer.total_steps={args.steps}",
                    "trainer.val_before_train=false",
                    "trainer.val_at_end=false",
                    *overrides,
                ],
                env=env,
            )
            for key in keys:
                out[n][key].append(median_after_first(res["metrics"][key]))
            got = " ".join(f"{k}={out[n][k][-1]:.3f}" for k in keys)
            print(f"round {r} {n}: {got}", file=sys.stderr)
    return out


def paired_ratio(before: Sequence[float], after: Sequence[float]) -> dict[str, Any]:
    """after / before per round (the rounds pair them), with the median."""
    pairs = [b / a for a, b in zip(before, after, strict=True)]
    return {"median": round(statistics.median(pairs), 3), "per_round": [round(p, 3) for p in pairs]}
