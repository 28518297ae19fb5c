"""The quickstart recipe under different thread settings, interleaved; JSON.

The claim checked: ``agentrl train configs/quickstart.yaml`` from the shipped warm start with
the default settings (the thread plan: on 2 cores the trainer and each of the two embedded
servers get one thread) is within 10 % of the best hand-tuned thread setting, and its weight
push takes at most 0.5 s per step (``max_staleness: 2``, tiny model).

Each variant is the same command (``--steps`` steps, the recipe's held-out evaluation before
and after included) with other environment variables or ``distributed.*`` overrides; every
round runs all variants, in a rotated order, so that load drifts hit them alike. Printed per
variant: the command's wall time and the median seconds per step (min and median over rounds),
the push time per step (median and max over all steps after the first), the reward of the last
three steps, held-out accuracy before and after, and the 1-minute load average after each run.

    python benchmarks/threads.py [--steps 10] [--rounds 2] [--variants default omp1 ...]
    python benchmarks/threads.py --smoke   # the default variant, 2 steps of 2 x 2 (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cli_runs import median_after_first, rotated, run_train  # noqa: E402

# Variables a user's shell may carry that would change the default: cleared for every variant
# ("" removes), then each variant sets its own.
_CLEAR = {
    k: ""
    for k in (
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "OMP_WAIT_POLICY",
        "AGENTRL_THREADS",
        "AGENTRL_CPUS",
        "AGENTRL_NICE",
    )
}
ONE = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}

VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "default": ({}, []),
    "servers_not_niced": ({}, ["distributed.server_nice=0"]),
    "omp1": (ONE, []),
    "trainer2": ({}, ["distributed.trainer_threads=2"]),
    "trainer2_passive": (PASSIVE, ["distributed.trainer_threads=2"]),
    "all2": ({}, ["distributed.trainer_threads=2", "distributed.server_threads=2"]),
    "all2_passive": (PASSIVE, ["distributed.trainer_threads=2", "distributed.server_threads=2"]),
    "one_server": ({}, ["inference.num_servers=1"]),
}
"""name -> (environment, overrides). ``all2`` is the old default (every process sized to the
whole machine); ``one_server`` changes the layout, not only threads (1 server + trainer)."""


SMOKE_OVERRIDES = [
    "data.batch_size=2",
    "data.n_samples=2",
    "trainer.mini_batch_size=2",
    "data.generator_val_size=2",
    "inference.max_tokens_per_turn=16",
    # On a loaded CI machine a niced server can miss its start-up deadline; the smoke checks
    # plumbing, not speed.
    "distributed.server_nice=0",
]
"""What ``--smoke`` adds to every run: the smallest batch and evaluation (numbers meaningless)."""


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    walls = [r["wall_s"] for r in runs]
    steps = [median_after_first(r["metrics"]["timing_s/step"]) for r in runs]
    pushes = [v for r in runs for s, v in sorted(r["metrics"]["timing_s/push"].items()) if s > 1]
    rewards = [r["metrics"]["reward/mean"] for r in runs]
    return {
        "wall_s_min": min(walls),
        "wall_s_median": statistics.median(walls),
        "s_per_step_min": min(steps),
        "s_per_step_median": statistics.median(steps),
        "push_s_median": statistics.median(pushes),
        "push_s_max": max(pushes),
        "reward_last3": statistics.mean(
            statistics.mean(v for _, v in sorted(r.items())[-3:]) for r in rewards
        ),
        "val_accuracy_before": [r["summary"]["val_before"].get("val/accuracy") for r in runs],
        "val_accuracy_after": [r["summary"]["val_after"].get("val/accuracy") for r in runs],
        "wall_s_runs": [round(w, 1) for w in walls],
        "load_avg_1m_after": [round(r["load_avg_1m"], 2) for r in runs],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--model-dir", type=Path, default=ROOT / "checkpoints" / "calculator-sft")
    p.add_argument("--smoke", action="store_true", help="default variant, 2 tiny steps (CI)")
    args = p.parse_args(argv)
    smoke = SMOKE_OVERRIDES if args.smoke else []
    if args.smoke:  # 2 steps: the push of step 2 is the first one measured
        args.steps, args.rounds, args.variants = 2, 1, ["default"]

    work = Path(tempfile.mkdtemp(prefix="agentrl-threads-"))
    names = list(args.variants)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    report: dict[str, Any] = {
        "benchmark": "thread_settings",
        "recipe": f"configs/quickstart.yaml, {args.steps} steps from {args.model_dir.name}",
        "cpu_count": len(os.sched_getaffinity(0)),
        "load_avg_1m_at_start": os.getloadavg()[0],
    }
    for r in range(args.rounds):
        for name in rotated(names, r):
            env, overrides = VARIANTS[name]
            res = run_train(
                ROOT / "configs" / "quickstart.yaml",
                work / f"{name}-{r}",
                [
                    f"model.path={args.model_dir}",
                    f"trainer.total_steps={args.steps}",
                    *smoke,
                    *overrides,
                ],
                env={**_CLEAR, **env},
            )
            runs[name].append(res)
            print(
                f"round {r} {name}: {res['wall_s']:.1f}s, "
                f"step {median_after_first(res['metrics']['timing_s/step']):.3f}s, "
                f"load {res['load_avg_1m']:.2f}",
                file=sys.stderr,
                flush=True,
            )
    for name in names:
        report[name] = summarize(runs[name])
    best = min(names, key=lambda n: report[n]["wall_s_median"])
    report["best_by_median_wall"] = best
    if "default" in report:
        d = report["default"]
        report["default_over_best_wall_median"] = d["wall_s_median"] / report[best]["wall_s_median"]
        report["target_default_within_10pct_of_best"] = (
            report["default_over_best_wall_median"] <= 1.10
        )
        report["target_push_le_0_5s"] = d["push_s_max"] <= 0.5
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
