"""Time to accuracy: wall-clock until held-out accuracy reaches TRL's, agentrl (sync, async) vs TRL.

What users buy is accuracy per hour, not seconds per step. This benchmark trains the shipped warm
start (``checkpoints/calculator-sft``) on the calculator tool task with three systems, on the same
model, training tasks, batch (``--batch-tasks`` x ``--n-samples``), token budget and number of
steps, interleaved per seed (A, B, C, A, B, C, ...):

- ``agentrl_sync``: agentrl with ``trainer.max_staleness=0`` (on-policy);
- ``agentrl_async``: agentrl's defaults (``configs/quickstart.yaml``: max_staleness 2 reached
  after a staleness warmup of 6 steps, two embedded servers, its thread plan);
- ``agentrl_async_no_warmup`` (on request): the same with max_staleness 2 from the first step;
- ``agentrl_sync_old_engine`` (on request): ``agentrl_sync`` with the embedded engine as it was
  before its prefix cache and lean forward (``inference.prefix_cache_mb=0``,
  ``AGENTRL_LEAN_FORWARD=0``);
- ``trl``: TRL's ``GRPOTrainer`` with its tool-calling loop (``benchmarks/peers/trl_grpo.py`` in
  ``.venv-trl``, ``make setup-peers``), one process with every CPU.

Each run saves its model every ``--eval-every`` steps and at the end; a snapshot's time is the
wall time since the run's process was launched, minus the time spent taking the snapshots so far
(so start-up counts, the benchmark's own saving does not). Every snapshot of every system is then
evaluated by the same evaluator, agentrl's held-out evaluation
(:func:`agentrl.training.trainer.evaluate_checkpoint`: ``--val-n`` samples per held-out task at
temperature ``--val-temperature``, the same ``val_seed`` for all), on held-out tasks disjoint from
the training tasks. A curve is (wall seconds, held-out ``acc/mean_at_N``), starting at the warm
start's accuracy at 0 s.

The headline is, per seed, ``time for agentrl to reach TRL's final held-out accuracy / TRL's time
to reach it`` (the first crossing of each curve, linearly interpolated between snapshots; None when
agentrl never reaches it), with its median, min and max over seeds; ``< 1`` means agentrl gets
there first. Printed as JSON (also ``--out``.json) with the curves, and plotted (``--out``.png).

    python benchmarks/peers/time_to_accuracy.py                 # 3 seeds, 30 steps (the full run)
    python benchmarks/peers/time_to_accuracy.py --smoke         # seconds-scale plumbing check
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from compare import write_tasks  # noqa: E402

CONFIG = ROOT / "configs" / "quickstart.yaml"
CHECKPOINT = ROOT / "checkpoints" / "calculator-sft"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "time_to_accuracy"
SYSTEMS = (
    "agentrl_sync",
    "agentrl_async",
    "agentrl_async_no_warmup",
    "agentrl_sync_old_engine",
    "trl",
)
AGENTRL_SYSTEMS = {
    "agentrl_sync": ["trainer.max_staleness=0"],
    "agentrl_async": [],
    "agentrl_async_no_warmup": ["trainer.staleness_warmup_steps=0"],
    "agentrl_sync_old_engine": ["trainer.max_staleness=0", "inference.prefix_cache_mb=0"],
}
"""What each agentrl system overrides in the quickstart (nothing: its own defaults)."""
AGENTRL_SYSTEM_ENV = {"agentrl_sync_old_engine": {"AGENTRL_LEAN_FORWARD": "0"}}
"""Environment a system adds: ``agentrl_sync_old_engine`` is the synchronous run with the
embedded engine as it was before its prefix cache and lean forward (docs/inference.md)."""


# ---- the runs (child processes) ---------------------------------------------------------------
def agentrl_overrides(args: argparse.Namespace, system: str, seed: int, out: Path) -> list[str]:
    """The quickstart plus the shared workload; only :data:`AGENTRL_SYSTEMS` differs between
    the agentrl systems."""
    return [
        f"model.path={args.model_dir}",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={args.steps}",
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        f"data.train_files=[{args.paths['tool']}]",
        f"data.val_files=[{args.paths['heldout']}]",
        f"data.batch_size={args.batch_tasks}",
        f"data.n_samples={args.n_samples}",
        f"trainer.mini_batch_size={args.batch_tasks}",
        f"inference.max_tokens_per_turn={args.max_tokens}",
        f"agent.max_turns={args.max_turns}",
        f"agent.max_response_tokens={args.max_tokens * args.max_turns}",
        "trainer.val_before_train=false",
        "trainer.val_at_end=false",
        "tracking.enabled=false",  # TRL runs without a tracker too
        f"checkpoint.shared_dir={out / 'weights'}",
        *AGENTRL_SYSTEMS[system],
        *args.agentrl_overrides,
    ]


def run_agentrl_child(args: argparse.Namespace) -> dict[str, Any]:
    """In the child: train with snapshots after the pushes of every ``--eval-every`` steps,
    started as ``agentrl train`` starts (its ``load_and_resolve``: the servers' zygote begins
    importing as soon as the config has loaded, before the trainer is imported)."""
    from agentrl.training.train_cli import load_and_resolve

    out = Path(args.run_dir)
    loaded = load_and_resolve(str(CONFIG), agentrl_overrides(args, args.child, args.seed, out))
    if loaded is None:
        raise SystemExit(2)  # the config error is printed already
    cfg, resolved = loaded
    from agentrl.training.trainer import Trainer

    snapshots: list[dict[str, Any]] = []

    class SnapshotTrainer(Trainer):
        async def _push(self, version: int) -> Any:
            report = await super()._push(version)
            every = args.eval_every
            if version > 0 and (version % every == 0 or version == args.steps):
                t0 = time.time()
                path = out / "snapshots" / f"step_{version:05d}"
                assert self.run_obj is not None
                self.run_obj.policies.actor.save_pretrained(path)
                self.run_obj.tokenizer.save_pretrained(path)
                snapshots.append(
                    {"step": version, "epoch_s": t0, "save_s": time.time() - t0, "path": str(path)}
                )
            return report

    result = SnapshotTrainer(cfg, resolved=resolved, progress=False).run_sync()
    return {"steps": result.steps, "snapshots": snapshots}


def run_trl(args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer in ``.venv-trl`` with the same workload; its snapshots and step times."""
    from agentrl.threads import make_plan

    share = make_plan(0).trainer  # TRL is one process: the whole machine
    env = {**os.environ, **share.env(), "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("PYTHONPATH", None)  # TRL's venv must not see ours
    cmd = [
        str(args.trl_python), str(ROOT / "benchmarks" / "peers" / "trl_grpo.py"),
        f"--model-dir={args.model_dir}", f"--tasks={args.paths['trl']}",
        f"--tools-json={args.paths['tools_json']}", "--mode=tool", f"--steps={args.steps}",
        f"--batch-tasks={args.batch_tasks}", f"--n-samples={args.n_samples}",
        f"--max-tokens={args.max_tokens}", f"--max-turns={args.max_turns}",
        f"--threads={share.threads}", f"--seed={seed}", f"--out={out / 'trl.json'}",
        f"--snapshot-every={args.eval_every}", f"--snapshot-dir={out / 'snapshots'}",
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((out / "trl.json").read_text())


def run_system(args: argparse.Namespace, system: str, seed: int) -> dict[str, Any]:
    """Launch one run; its snapshots with times relative to the launch (snapshot cost removed)."""
    out = Path(args.work_dir) / f"{system}-seed{seed}"
    launch = time.time()
    if system == "trl":
        res = run_trl(args, seed, out)
    else:
        record = out / "record.json"
        cmd = [
            sys.executable, __file__, "--child", system, "--seed", str(seed),
            "--run-dir", str(out), "--record", str(record), *args.shared_argv,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), **AGENTRL_SYSTEM_ENV.get(system, {})}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{system} seed {seed} failed:\n{proc.stderr[-3000:]}")
        res = json.loads(record.read_text())
    wall = time.time() - launch
    spent, snaps = 0.0, []
    for s in sorted(res["snapshots"], key=lambda s: s["step"]):
        snaps.append({**s, "wall_s": s["epoch_s"] - launch - spent})
        spent += s["save_s"]
    return {"system": system, "seed": seed, "process_wall_s": wall, "snapshots": snaps}


# ---- evaluation (one child process: every snapshot with the same evaluator) ---------------------
def eval_overrides(args: argparse.Namespace, model: str) -> list[str]:
    """The held-out evaluation every system's snapshots get (same tasks, samples and seed)."""
    return [
        f"model.path={model}",
        f"data.train_files=[{args.paths['tool']}]",
        f"data.val_files=[{args.paths['heldout']}]",
        f"agent.max_turns={args.max_turns}",
        f"agent.max_response_tokens={args.max_tokens * args.max_turns}",
        f"inference.max_tokens_per_turn={args.max_tokens}",
        f"trainer.val_n={args.val_n}",
        f"trainer.val_temperature={args.val_temperature}",
        "trainer.val_seed=0",
        "tracking.enabled=false",
        *args.agentrl_overrides,
    ]


def eval_child(args: argparse.Namespace) -> dict[str, Any]:
    """In the child: held-out ``acc/mean_at_N`` of every model directory in ``--models``."""
    import asyncio

    from agentrl.config import load_config
    from agentrl.training.trainer import evaluate_checkpoint

    out = {}
    for model in args.models:
        report = asyncio.run(evaluate_checkpoint(load_config(CONFIG, eval_overrides(args, model))))
        key = next(k for k in report.metrics if k.endswith(f"/acc/mean_at_{args.val_n}"))
        out[model] = {
            "acc": report.metrics[key],
            "ci95": [report.metrics[f"{key}/ci95_lo"], report.metrics[f"{key}/ci95_hi"]],
        }
    return out


def evaluate_models(args: argparse.Namespace, models: list[str], tag: str) -> dict[str, Any]:
    record = Path(args.work_dir) / f"eval-{tag}.json"
    cmd = [
        sys.executable, __file__, "--eval-child", "--record", str(record),
        "--models", *models, *args.shared_argv,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"evaluation {tag} failed:\n{proc.stderr[-3000:]}")
    return json.loads(record.read_text())


# ---- curves and ratios --------------------------------------------------------------------------
def first_crossing(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first wall time at which ``curve`` (time, acc) reaches ``target``, linearly
    interpolated between the two points around the crossing; None if it never does."""
    for (t0, a0), (t1, a1) in itertools.pairwise(curve):
        if a1 >= target > a0:
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
        if a0 >= target:
            return t0
    if curve and curve[-1][1] >= target:
        return curve[-1][0]
    return None


def summarize(
    runs: list[dict[str, Any]],
    warm: float,
    systems: list[str],
    fixed_targets: list[float] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """Per system: curves and finals; per agentrl system: the time-to-TRL-accuracy ratios (to
    each seed's TRL final accuracy, and to each of ``fixed_targets``: the same accuracy for
    every seed and system, which a noisy TRL final cannot move)."""
    by = {(r["system"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    curves = {
        key: [(0.0, warm)] + [(s["wall_s"], s["acc"]) for s in r["snapshots"]]
        for key, r in by.items()
    }
    out: dict[str, Any] = {"warm_start_acc": warm, "systems": {}}
    for system in systems:
        finals = [curves[(system, s)][-1][1] for s in seeds if (system, s) in curves]
        out["systems"][system] = {
            "final_acc_per_seed": finals,
            "final_acc_mean": statistics.fmean(finals) if finals else None,
            "train_wall_s_per_seed": [curves[(system, s)][-1][0] for s in seeds],
            "curves": {str(s): curves[(system, s)] for s in seeds if (system, s) in curves},
        }
    if "trl" in systems:
        for system in (s for s in systems if s != "trl"):
            vs = _ratios(curves, system, seeds, lambda seed: curves[("trl", seed)][-1][1])
            vs["fixed_targets"] = {
                str(t): _ratios(curves, system, seeds, lambda _, t=t: t) for t in fixed_targets
            }
            out["systems"][system]["vs_trl"] = vs
    return out


def _ratios(
    curves: dict[Any, Any], system: str, seeds: list[int], target_of: Any
) -> dict[str, Any]:
    """Per seed, agentrl's time to ``target_of(seed)`` over TRL's, with the spread."""
    per_seed = []
    for seed in seeds:
        target = target_of(seed)
        t_trl = first_crossing(curves[("trl", seed)], target)
        t_ours = first_crossing(curves[(system, seed)], target)
        ratio = t_ours / t_trl if t_ours is not None and t_trl else None
        note = None
        if not t_trl:
            note = f"TRL did not reach {target:.3f} after the warm start: no time to compare"
        elif t_ours is None:
            note = f"agentrl never reached {target:.3f}"
        per_seed.append(
            {
                "seed": seed,
                "target_acc": target,
                "trl_s": t_trl,
                "agentrl_s": t_ours,
                "ratio": ratio,
                "note": note,
            }
        )
    ratios = [p["ratio"] for p in per_seed if p["ratio"] is not None]
    return {
        "per_seed": per_seed,
        "reached": f"{len(ratios)}/{len(seeds)}",
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_min": min(ratios) if ratios else None,
        "ratio_max": max(ratios) if ratios else None,
        "target_le_0_7x_trl": bool(ratios) and len(ratios) == len(seeds) and max(ratios) <= 0.7,
    }


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    """Held-out accuracy vs wall time: each seed thin, TRL's final mean as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (system, entry) in enumerate(summary["systems"].items()):
        for j, curve in enumerate(entry["curves"].values()):
            xs, ys = zip(*curve, strict=True)
            ax.plot(xs, ys, color=f"C{i}", lw=1.4, marker=".", label=system if j == 0 else None)
    trl = summary["systems"].get("trl")
    if trl and trl["final_acc_mean"] is not None:
        ax.axhline(trl["final_acc_mean"], color="grey", ls=":", lw=1, label="TRL final (mean)")
    ax.set_xlabel("wall time since launch, s (start-up included)")
    ax.set_ylabel(f"held-out acc mean_at_{summary['val_n']} (agentrl's evaluator)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---- driver -------------------------------------------------------------------------------------
SMOKE = {
    "steps": 2, "eval_every": 2, "seeds": [0], "num_tasks": 32, "val_tasks": 4, "val_n": 1,
    "batch_tasks": 2, "n_samples": 2, "max_tokens": 24, "max_turns": 2,
}  # fmt: skip
"""``--smoke``: the plumbing of every system in about a minute per run, numbers meaningless."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per run (same for all)")
    p.add_argument("--eval-every", type=int, default=5, help="snapshot every K steps (+ the end)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--systems",
        nargs="+",
        default=["agentrl_sync", "agentrl_async", "trl"],
        choices=SYSTEMS,
    )
    p.add_argument("--batch-tasks", type=int, default=8)
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per model turn")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--num-tasks", type=int, default=256, help="training tasks")
    p.add_argument("--val-tasks", type=int, default=64, help="held-out tasks")
    p.add_argument("--val-n", type=int, default=4, help="samples per held-out task (mean_at_N)")
    p.add_argument("--val-temperature", type=float, default=1.0)
    p.add_argument(
        "--fixed-targets",
        type=float,
        nargs="*",
        default=[0.5, 0.6, 0.7],
        help="also time every system to these held-out accuracies (the same for every seed)",
    )
    p.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        default=None,
        help="summarize the runs of these earlier result JSONs together (no training, no "
        "evaluation: their snapshots carry their held-out accuracy) into OUT.json + OUT.png",
    )
    p.add_argument("--model-dir", type=Path, default=CHECKPOINT)
    p.add_argument("--trl-python", type=Path, default=ROOT / ".venv-trl" / "bin" / "python")
    p.add_argument("--out", type=Path, default=None, help="OUT.json + OUT.png")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny budget: checks the plumbing")
    p.add_argument(
        "--agentrl-overrides", nargs="*", default=[], help="extra agentrl config overrides"
    )
    p.add_argument("--child", choices=SYSTEMS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--eval-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--record", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def prepare(args: argparse.Namespace) -> None:
    """Work dir, the shared task files, and the argv every child gets (the same settings)."""
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="agentrl-tta-")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    args.paths = write_heldout(write_tasks(work, args.num_tasks, seed=0), work, args.val_tasks)
    args.shared_argv = [
        f"--work-dir={work}", f"--steps={args.steps}", f"--eval-every={args.eval_every}",
        f"--batch-tasks={args.batch_tasks}", f"--n-samples={args.n_samples}",
        f"--max-tokens={args.max_tokens}", f"--max-turns={args.max_turns}",
        f"--num-tasks={args.num_tasks}", f"--val-tasks={args.val_tasks}", f"--val-n={args.val_n}",
        f"--val-temperature={args.val_temperature}", f"--model-dir={args.model_dir}",
        "--agentrl-overrides", *args.agentrl_overrides,
    ]  # fmt: skip


def write_heldout(paths: dict[str, Path], work: Path, n: int) -> dict[str, Path]:
    """Held-out calculator tasks (the generator's validation seed), none equal to a training one."""
    from agentrl.rollout.calculator_task import generate_calculator_tasks
    from agentrl.rollout.datasets import load_tasks, write_tasks_jsonl

    train = {t.prompt for t in load_tasks(paths["tool"])}
    pool = generate_calculator_tasks(4 * n, seed=10000, min_digits=2, max_digits=3)
    held = [t for t in pool if t.prompt not in train][:n]
    return {**paths, "heldout": write_tasks_jsonl(held, work / "heldout.jsonl")}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    if args.child or args.eval_child:
        args.paths = {k: Path(args.work_dir) / f for k, f in _FILES.items()}
        record = run_agentrl_child(args) if args.child else eval_child(args)
        Path(args.record).write_text(json.dumps(record))
        return None
    if args.pool:
        return pool(args)
    if "trl" in args.systems and not args.trl_python.is_file():
        raise SystemExit(f"no TRL python at {args.trl_python}; run `make setup-peers` first")
    prepare(args)
    t0 = time.perf_counter()
    runs = []
    for seed in args.seeds:
        for system in args.systems:  # interleaved: A, B, C, A, B, C, ...
            run = run_system(args, system, seed)
            run["load_avg_1m_after"] = os.getloadavg()[0]
            runs.append(run)
            print(f"{system} seed {seed}: {run['process_wall_s']:.0f} s", file=sys.stderr)
    report = finish(args, runs, time.perf_counter() - t0)
    print(json.dumps(report, indent=2))
    return report


def pool(args: argparse.Namespace) -> dict[str, Any]:
    """``--pool``: the runs of several result JSONs (the same workload, other seeds) summarized
    as one, with this call's ``--fixed-targets``; the curves start from the mean of the files'
    warm-start evaluations (each is one sampled evaluation of the same model); refuses a seed
    run twice, or files evaluated with different ``val_n``."""
    if args.out is None:
        raise SystemExit("--pool needs --out OUT (it writes OUT.json and OUT.png)")
    reports = [json.loads(path.read_text()) for path in args.pool]
    warm = [r["warm_start_acc"] for r in reports]
    runs = [run for r in reports for run in r["runs"]]
    keys = [(run["system"], run["seed"]) for run in runs]
    if len(set(keys)) != len(keys):
        raise SystemExit("--pool: a (system, seed) appears in more than one file")
    systems = list(dict.fromkeys(run["system"] for run in runs))
    summary = summarize(runs, statistics.fmean(warm), systems, args.fixed_targets)
    val_n = {r.get("val_n", args.val_n) for r in reports}
    if len(val_n) != 1:
        raise SystemExit(f"--pool: the files evaluated different val_n ({sorted(val_n)})")
    summary.update(
        benchmark="time_to_accuracy",
        val_n=val_n.pop(),
        pooled_from=[str(p) for p in args.pool],
        warm_start_acc_per_file=warm,
        runs=runs,
    )
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    seeds = sorted({run["seed"] for run in runs})
    plot(summary, args.out.with_suffix(".png"), f"pooled: seeds {seeds}")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    return summary


_FILES = {"tool": "tool.jsonl", "trl": "trl_tasks.jsonl", "tools_json": "tools.json"}
_FILES["heldout"] = "heldout.jsonl"


def finish(args: argparse.Namespace, runs: list[dict[str, Any]], train_s: float) -> dict[str, Any]:
    """Evaluate every snapshot, summarize, write the JSON and the plot."""
    t0 = time.perf_counter()
    models = [str(args.model_dir)] + [s["path"] for run in runs for s in run["snapshots"]]
    scores = evaluate_models(args, models, "all")  # one process, one model at a time
    for run in runs:
        for s in run["snapshots"]:
            s.update(scores[s["path"]])
    summary = summarize(runs, scores[str(args.model_dir)]["acc"], args.systems, args.fixed_targets)
    summary.update(
        benchmark="time_to_accuracy",
        agentrl_overrides=args.agentrl_overrides,
        val_n=args.val_n,
        workload={k: v for k, v in vars(args).items() if k in SMOKE or k in ("val_temperature",)},
        smoke=args.smoke,
        cpus=os.cpu_count(),
        load_avg_1m_after_runs=[r["load_avg_1m_after"] for r in runs],
        train_phase_s=round(train_s, 1),
        eval_phase_s=round(time.perf_counter() - t0, 1),
        runs=runs,
    )
    out = args.out or (Path(args.work_dir) / "time_to_accuracy" if args.smoke else DEFAULT_OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    plot(summary, out.with_suffix(".png"),
         f"calculator tool task from the SFT warm start: {args.steps} steps of "
         f"{args.batch_tasks}x{args.n_samples}, seeds {args.seeds}")  # fmt: skip
    summary["out"] = str(out)
    return summary


if __name__ == "__main__":
    main()
