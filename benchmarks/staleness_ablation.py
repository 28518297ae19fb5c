"""Does off-policy correction matter? The calculator task at max_staleness 0 and at a forced lag.

Why it exists: the project's core claim is that correction lets training run asynchronously
without losing learning. This script measures it on a laptop: GRPO on the quickstart's calculator
task (``configs/quickstart.yaml``, from the shipped warm start ``checkpoints/calculator-sft``),
driven through the public API (``load_config`` + ``Trainer(cfg).run_sync()``), under:

- ``sync``: ``trainer.max_staleness=0`` with ``decoupled_token_is`` (on-policy its weights are 1
  up to rounding, so the preset does not matter here); on-policy, the baseline;
- ``stale/<preset>``: ``trainer.max_staleness=ETA`` (default 8) with
  ``checkpoint.push_every=ETA``, so the servers get new weights only every ETA steps and rollouts
  really lag the trainer by up to ETA - 1 .. ETA versions (checked: ``async/staleness_mean/max``
  are in the output), under each correction preset: ``disabled`` (decoupled π_old, no IS, no
  RS), ``decoupled_token_is``, ``decoupled_seq_is_rs``, ``decoupled_geo_rs``, ``bypass_ppo_clip``,
  ``icepop``, and the newer variants: ``decoupled_m2po`` (AReaL's M2PO), ``decoupled_loglinear``
  (AReaL's proximal approximation), ``decoupled_token_is_opsm`` and ``bypass_ppo_clip_opsm``
  (OPSM, slime/TRL), ``decoupled_token_is_stale_rs`` (the staleness-adaptive bound)
  (docs/correction.md). A step whose every sequence is masked is skipped without moving the
  weights (``actor/skipped_all_masked``); the records count those steps.

Every condition runs with each seed (``trainer.seed`` = ``data.seed`` = seed), seed-major and
interleaved (seed 0 of every condition, then seed 1, ...) so that load drift on a shared machine
hits every condition alike. Each run is its own subprocess (one thread plan per run, as
``agentrl train`` would make); its trained model is then evaluated by
:func:`agentrl.training.trainer.evaluate_checkpoint` (``trainer.val_n`` samples per held-out task
at ``trainer.val_temperature``, exactly as the trainer's end-of-run validation), which also keeps
the per-task samples, so a condition's seeds can be pooled into one task-bootstrap CI.

Printed JSON (also written to ``--out``.json, with a plot ``--out``.png) per condition:

- ``final_mean_at_n``: held-out ``acc/mean_at_N`` per seed with its 95% task-bootstrap CI
  (``val/<source>/acc/mean_at_N/ci95_lo/hi``), the mean and std over seeds, and ``pooled``: the
  mean over seeds with a 95% CI from resampling tasks (each task's accuracy averaged over seeds);
- ``reward_curve``: ``reward/mean`` per step, mean and std over seeds (and per seed);
- ``diagnostics``: means over steps and seeds of ``rollout_corr/*`` (kl, k3_kl, chi2, IS
  weight statistics, RS masked fractions) and of ``actor/pg_clipfrac``;
- ``staleness``: mean of ``async/staleness_mean`` and max of ``async/staleness_max``; pushes;
- ``skipped_all_masked_steps``: per seed, the steps whose update was skipped (all masked);
- wall time per run.

``--smoke`` runs the plumbing in a few minutes (2 steps, η = 2, one seed, 4 held-out tasks, three
conditions; numbers meaningless) and writes into the work directory, not ``benchmarks/results``.

    OMP_NUM_THREADS=1 python benchmarks/staleness_ablation.py            # the full ablation
    python benchmarks/staleness_ablation.py --steps 8 --seeds 0 --conditions sync stale/disabled
    python benchmarks/staleness_ablation.py --smoke                      # the CI check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHECKPOINT = ROOT / "checkpoints" / "calculator-sft"
CONFIG = ROOT / "configs" / "quickstart.yaml"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "staleness_ablation"
STALE_PRESETS = (
    "disabled",
    "decoupled_token_is",
    "decoupled_seq_is_rs",
    "decoupled_geo_rs",
    "bypass_ppo_clip",
    "icepop",
    "decoupled_m2po",
    "decoupled_loglinear",
    "decoupled_token_is_opsm",
    "bypass_ppo_clip_opsm",
    "decoupled_token_is_stale_rs",
)
SMOKE = {"steps": 2, "eta": 2, "seeds": [0], "val_tasks": 4, "val_n": 1, "bootstrap": 50}
"""``--smoke``: the settings of the plumbing check (see the module docstring)."""
SMOKE_CONDITIONS = ["sync", "stale/decoupled_loglinear", "stale/decoupled_token_is_stale_rs"]
DIAGNOSTICS = (
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/chi2_token",
    "rollout_corr/chi2_seq",
    "rollout_corr/log_ppl_abs_diff",
    "rollout_corr/is_weight_mean",
    "rollout_corr/is_weight_max",
    "rollout_corr/is_weight_min",
    "rollout_corr/is_weight_std",
    "rollout_corr/is_frac_truncated",
    "rollout_corr/is_ess",
    "rollout_corr/rs_masked_frac_token",
    "rollout_corr/rs_masked_frac_seq",
    "rollout_corr/masked_frac_token",
    "rollout_corr/masked_frac_seq",
    "rollout_corr/m2po_masked_frac_token",
    "rollout_corr/opsm_masked_frac_seq",
    "rollout_corr/stale_rs_masked_frac_seq",
    "rollout_corr/prox_alpha_mean",
    "actor/pg_clipfrac",
    "actor/skipped_all_masked",
)
"""Per-step metrics averaged over steps and seeds (those a condition logs)."""
KEPT_SERIES = (
    "reward/mean",
    "reward/accuracy",
    "async/staleness_mean",
    "async/staleness_max",
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/rs_masked_frac_token",
    "rollout_corr/rs_masked_frac_seq",
    "rollout_corr/masked_frac_seq",
    "actor/pg_clipfrac",
    "actor/skipped_all_masked",
)
"""Per-step series kept per run (curves in the output: mean and std over seeds)."""


@dataclass(frozen=True)
class Condition:
    """One arm of the ablation: a staleness bound, a push period and a correction preset."""

    name: str
    eta: int
    push_every: int
    preset: str

    def overrides(self) -> list[str]:
        return [
            f"trainer.max_staleness={self.eta}",
            "trainer.staleness_warmup_steps=0",  # the lag from the first step, as measured
            f"checkpoint.push_every={self.push_every}",
            f"algorithm.correction.preset={self.preset}",
        ]


def make_conditions(eta: int) -> dict[str, Condition]:
    """``sync`` and one ``stale/<preset>`` per preset in :data:`STALE_PRESETS`."""
    conds = {"sync": Condition("sync", 0, 1, "decoupled_token_is")}
    for p in STALE_PRESETS:
        conds[f"stale/{p}"] = Condition(f"stale/{p}", eta, eta, p)
    return conds


# ---- one run (child process) ----------------------------------------------------------------
def _base_overrides(args: argparse.Namespace, out: Path, seed: int) -> list[str]:
    return [
        f"model.path={CHECKPOINT}",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={args.steps}",
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        f"data.generator_val_size={args.val_tasks}",
        f"trainer.val_n={args.val_n}",
        f"trainer.val_temperature={args.val_temperature}",
        f"trainer.val_seed={seed}",
        "trainer.val_before_train=false",
        "trainer.val_at_end=false",  # evaluated below, keeping per-task samples
        "tracking.enabled=false",
        f"checkpoint.shared_dir={out / 'weights'}",
        *args.overrides,
    ]


def _evaluate(cfg: Any) -> dict[str, Any]:
    """Held-out report of ``cfg.model.path``: flat metrics and per-task accuracies."""
    import asyncio

    from agentrl.training.trainer import evaluate_checkpoint

    report = asyncio.run(evaluate_checkpoint(cfg))
    return {
        "metrics": dict(report.metrics),
        "task_acc": {t.task_id: sum(t.correct) / max(len(t.correct), 1) for t in report.tasks},
        "eval_wall_s": report.wall_time_s,
    }


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Train one (condition, seed) and evaluate the final model; the run's record."""
    from agentrl.config import load_config
    from agentrl.training.trainer import Trainer

    out = Path(args.work_dir) / args.run_one.replace("/", "_") / f"seed{args.seed}"
    base = _base_overrides(args, out, args.seed)
    t0 = time.perf_counter()
    if args.run_one == "warm_start":
        cfg = load_config(CONFIG, base)
        return {"condition": "warm_start", "seed": args.seed, **_evaluate(cfg)}
    cond = make_conditions(args.eta)[args.run_one]
    cfg = load_config(CONFIG, [*base, *cond.overrides()])
    result = Trainer(cfg, progress=False).run_sync()
    train_wall = time.perf_counter() - t0
    evaluated = _evaluate(
        load_config(CONFIG, [*base, *cond.overrides(), f"model.path={out / 'final_model'}"])
    )
    h = result.history
    series = {k: [v for _, v in h[k]] for k in KEPT_SERIES if k in h}
    means = {k: statistics.fmean(v for _, v in h[k]) for k in DIAGNOSTICS if h.get(k)}
    return {
        "condition": cond.name,
        "seed": args.seed,
        "steps": result.steps,
        "version": result.version,
        "series": series,
        "diagnostic_means": means,
        "pushes": len(h.get("weight_sync/verified_servers", [])),
        "verified_servers": [v for _, v in h.get("weight_sync/verified_servers", [])],
        "verify_max_abs_diff": max(
            (v for _, v in h.get("weight_sync/verify_max_abs_diff", [])), default=None
        ),
        "skipped_all_masked_steps": sum(v for _, v in h.get("actor/skipped_all_masked", [])),
        "dropped_stale_total": max(
            (v for _, v in h.get("async/dropped_stale_total", [])), default=0.0
        ),
        "train_wall_s": train_wall,
        "load_average": list(os.getloadavg()),  # 1/5/15 min, at the end of the run
        "wall_s": time.perf_counter() - t0,
        **evaluated,
    }


# ---- aggregation ------------------------------------------------------------------------------
def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _acc_key(metrics: dict[str, float], n: int) -> str:
    keys = [k for k in metrics if k.endswith(f"/acc/mean_at_{n}")]
    if len(keys) != 1:
        raise KeyError(f"expected one val/<source>/acc/mean_at_{n} key, got {keys}")
    return keys[0]


def _final(runs: list[dict[str, Any]], n: int, n_bootstrap: int) -> dict[str, Any]:
    from agentrl.evaluation.stats import task_ci95

    key = _acc_key(runs[0]["metrics"], n)
    per_seed = [
        {
            "seed": r["seed"],
            "mean": r["metrics"][key],
            "ci95": [r["metrics"][f"{key}/ci95_lo"], r["metrics"][f"{key}/ci95_hi"]],
        }
        for r in runs
    ]
    mean, std = _mean_std([p["mean"] for p in per_seed])
    tasks = sorted(runs[0]["task_acc"])
    pooled = [statistics.fmean(r["task_acc"][t] for r in runs) for t in tasks]
    lo, hi = task_ci95(pooled, n_bootstrap=n_bootstrap, seed=0)
    return {
        "key": key,
        "per_seed": per_seed,
        "mean_over_seeds": mean,
        "std_over_seeds": std,
        "pooled": {"mean": statistics.fmean(pooled), "ci95": [lo, hi], "tasks": len(tasks)},
    }


def _curve(runs: list[dict[str, Any]], key: str, per_seed: bool = False) -> dict[str, Any]:
    series = [r["series"][key] for r in runs]
    steps = min(len(s) for s in series)
    cols = [[s[i] for s in series] for i in range(steps)]
    out: dict[str, Any] = {
        "mean": [statistics.fmean(c) for c in cols],
        "std": [statistics.stdev(c) if len(c) > 1 else 0.0 for c in cols],
    }
    if per_seed:
        out["per_seed"] = series
    return out


def _rounded(x: Any, digits: int = 4) -> Any:
    """``x`` with every float rounded to ``digits`` significant digits (small, readable JSON)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v, digits) for v in x]
    return x


def aggregate(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per condition: final accuracy, curves, diagnostics, staleness, wall time."""
    by_cond: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_cond.setdefault(r["condition"], []).append(r)
    out: dict[str, Any] = {}
    for name, runs in by_cond.items():
        runs.sort(key=lambda r: r["seed"])
        entry: dict[str, Any] = {"final_mean_at_n": _final(runs, args.val_n, args.bootstrap)}
        if name != "warm_start":
            cond = make_conditions(args.eta)[name]
            diag_keys = sorted({k for r in runs for k in r["diagnostic_means"]})
            entry.update(
                config={
                    "max_staleness": cond.eta,
                    "push_every": cond.push_every,
                    "correction": cond.preset,
                },
                reward_curve=_curve(runs, "reward/mean", per_seed=True),
                curves={
                    k: _curve(runs, k)
                    for k in KEPT_SERIES[1:]
                    if all(k in r["series"] for r in runs)
                },
                diagnostics={
                    k: statistics.fmean(
                        r["diagnostic_means"][k] for r in runs if k in r["diagnostic_means"]
                    )
                    for k in diag_keys
                },
                staleness={
                    "mean": statistics.fmean(
                        x for r in runs for x in r["series"]["async/staleness_mean"]
                    ),
                    "max": max(x for r in runs for x in r["series"]["async/staleness_max"]),
                    "dropped_stale_total_mean": statistics.fmean(
                        r["dropped_stale_total"] for r in runs
                    ),
                },
                pushes=[r["pushes"] for r in runs],
                skipped_all_masked_steps=[r.get("skipped_all_masked_steps", 0.0) for r in runs],
                verify_max_abs_diff=max((r["verify_max_abs_diff"] or 0.0) for r in runs),
                wall_s_per_run=[round(r["process_wall_s"], 1) for r in runs],
            )
        out[name] = _rounded(entry)
    return out


# ---- plot -------------------------------------------------------------------------------------
def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    """Three panels: training reward per step and the off-policy KL (k3) per step, mean ± std
    over seeds, and the final held-out mean_at_N per condition (bars ± std over seeds, a dot per
    seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = summary["conditions"]
    names = [n for n in conds if n != "warm_start"]
    fig, (ax1, ax2, ax3) = plt.subplots(
        1, 3, figsize=(18, 5), gridspec_kw={"width_ratios": [3, 2.2, 2]}
    )
    colors = {n: f"C{i}" for i, n in enumerate(names)}
    for name in names:
        _band(ax1, conds[name]["reward_curve"], name, colors[name])
        k3 = conds[name]["curves"].get("rollout_corr/k3_kl")
        if k3 is not None:
            floor = {"mean": [max(m, 1e-5) for m in k3["mean"]], "std": [0.0] * len(k3["std"])}
            _band(ax2, floor, name, colors[name])
    for ax in (ax1, ax2):
        for k in range(summary["eta"], summary["steps"], summary["eta"]):
            ax.axvline(k + 0.5, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("step  (dotted: weight pushes of the stale runs)")
    ax1.set_ylabel("training reward/mean (± std over seeds)")
    ax1.set_title("reward of the sampled batches")
    ax1.legend(fontsize=7.5, loc="lower right")
    ax2.set_yscale("log")
    ax2.set_ylabel("rollout_corr/k3_kl, mean over seeds (floor 1e-5)")
    ax2.set_title("off-policy KL(π_rollout ‖ π_train) per token")
    labels = ["warm_start", *names] if "warm_start" in conds else names
    finals = [conds[n]["final_mean_at_n"] for n in labels]
    ax3.bar(
        range(len(labels)),
        [f["mean_over_seeds"] for f in finals],
        yerr=[f["std_over_seeds"] for f in finals],
        capsize=4,
        color=["grey", *[colors[n] for n in names]][-len(labels) :],
        alpha=0.75,
    )
    for i, f in enumerate(finals):
        ax3.plot([i] * len(f["per_seed"]), [p["mean"] for p in f["per_seed"]], "k.", ms=5)
    ax3.set_xticks(range(len(labels)))
    ax3.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    ax3.set_ylabel(
        f"held-out acc mean_at_{summary['val_n']} at T={summary['val_temperature']} (± std over seeds)"
    )
    ax3.set_title(f"final held-out accuracy ({summary['val_tasks']} tasks)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _band(ax: Any, curve: dict[str, Any], label: str, color: str) -> None:
    steps = range(1, len(curve["mean"]) + 1)
    lo = [m - s for m, s in zip(curve["mean"], curve["std"], strict=True)]
    hi = [m + s for m, s in zip(curve["mean"], curve["std"], strict=True)]
    ax.plot(steps, curve["mean"], color=color, label=label, lw=2.2 if label == "sync" else 1.3)
    ax.fill_between(steps, lo, hi, color=color, alpha=0.1)


# ---- driver -----------------------------------------------------------------------------------
def _child(args: argparse.Namespace, cond: str, seed: int, record: Path) -> None:
    cmd = [
        sys.executable, __file__, "--run-one", cond, "--seed", str(seed),
        "--record", str(record), "--work-dir", args.work_dir, "--steps", str(args.steps),
        "--eta", str(args.eta), "--val-tasks", str(args.val_tasks), "--val-n", str(args.val_n),
        "--val-temperature", str(args.val_temperature), "--overrides", *args.overrides,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = record.with_suffix(".log")
    with log.open("w") as fh:
        rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"run {cond} seed {seed} failed (rc {rc}); log {log}:\n{tail}")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a run's record depends on besides its condition and seed."""
    keys = ("steps", "eta", "val_tasks", "val_n", "val_temperature", "overrides")
    return {k: getattr(args, k) for k in keys}


def _check_resumable(record: Path, args: argparse.Namespace) -> None:
    """A kept record must come from the same settings; else resuming would mix experiments."""
    saved = json.loads(record.read_text()).get("settings")
    if saved != _settings(args):
        raise SystemExit(
            f"{record} was made with settings {saved}, not {_settings(args)}: "
            "use another --work-dir (or the original settings) to resume"
        )


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="GRPO steps per run")
    p.add_argument("--eta", type=int, default=8, help="max_staleness = push_every of stale runs")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--conditions", nargs="+", default=None, help="default: all")
    p.add_argument("--val-tasks", type=int, default=64, help="held-out tasks")
    p.add_argument("--val-n", type=int, default=4, help="samples per held-out task (mean_at_N)")
    p.add_argument("--val-temperature", type=float, default=1.0)
    p.add_argument("--bootstrap", type=int, default=1000, help="task resamples of pooled CIs")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="writes OUT.json and OUT.png")
    p.add_argument("--work-dir", default=None, help="run directories (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="tiny budget: checks the plumbing")
    p.add_argument("--overrides", nargs="*", default=[], help="extra config overrides (all runs)")
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--record", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.conditions = args.conditions or SMOKE_CONDITIONS
    if args.run_one is not None:
        record = {**run_one(args), "settings": _settings(args)}
        Path(args.record).write_text(json.dumps(record))
        return None
    conds = make_conditions(args.eta)
    names = args.conditions or list(conds)
    unknown = [n for n in names if n not in conds]
    if unknown:
        p.error(f"--conditions: unknown {unknown}; choose from {list(conds)}")
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="staleness-ablation-")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    plan = [("warm_start", args.seeds[0])] + [(n, s) for s in args.seeds for n in names]
    records, resumed = [], 0
    for i, (name, seed) in enumerate(plan):
        record = work / f"{name.replace('/', '_')}-seed{seed}.json"
        if record.exists():  # a finished run is kept: rerun with the same --work-dir to resume
            _check_resumable(record, args)
            resumed += 1
        else:
            t1 = time.perf_counter()
            _child(args, name, seed, record)
            data = json.loads(record.read_text())
            data["process_wall_s"] = time.perf_counter() - t1  # start-up and servers included
            record.write_text(json.dumps(data))
            print(f"[{i + 1}/{len(plan)}] {name} seed {seed}: {data['process_wall_s']:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
        records.append(json.loads(record.read_text()))
    summary = {
        "task": "calculator (configs/quickstart.yaml) from checkpoints/calculator-sft",
        "steps": args.steps,
        "eta": args.eta,
        "seeds": args.seeds,
        "val_tasks": args.val_tasks,
        "val_n": args.val_n,
        "val_temperature": args.val_temperature,
        "command": "python benchmarks/staleness_ablation.py " + " ".join(argv or sys.argv[1:]),
        "ablation_wall_s": round(sum(r["process_wall_s"] for r in records), 1),
        "driver_wall_s": round(time.perf_counter() - t0, 1),
        "resumed_runs": resumed,
        "cpus": os.cpu_count(),
        "conditions": aggregate(records, args),
    }
    out = Path(args.out)
    if args.smoke and out == DEFAULT_OUT:  # never overwrite the committed results
        out = work / "staleness_ablation_smoke"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    plot(summary, out.with_suffix(".png"),
         f"calculator GRPO from the SFT warm start: {args.steps} steps, {len(args.seeds)} seeds; "
         f"stale = max_staleness {args.eta}, push_every {args.eta}")  # fmt: skip
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
