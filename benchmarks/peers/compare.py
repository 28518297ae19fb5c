"""agentrl vs TRL's GRPOTrainer on the same model, prompts and batch shape, interleaved; JSON.

Both train the shipped warm start (``checkpoints/calculator-sft``) with GRPO on the same
calculator tasks (the same chat messages, the same tool schema), ``--batch-tasks`` tasks x
``--n-samples`` samples per step, ``--max-tokens`` tokens per model turn, lr 5e-4, no KL,
clip 0.2 / 0.28, token-mean loss, in two settings:

- ``single``: one completion per sample, no tools (agentrl's ``single_turn`` agent);
- ``tool``: up to ``--max-turns`` model turns with a calculator tool (agentrl's ``tool_agent``
  and its built-in calculator; TRL's tool-calling GRPO with a Python calculator function).

agentrl runs through its public CLI (``agentrl train configs/quickstart.yaml overrides``, its
defaults otherwise: async, max_staleness 2, two embedded servers, its own thread plan); the
per-step timings, tokens and rewards are read back from the run's MLflow store
(``OUTPUT/mlruns/mlflow.db``). TRL runs ``benchmarks/peers/trl_grpo.py`` in ``.venv-trl``
(``make setup-peers``) with the thread count the plan gives a single process (every usable
CPU) and ``OMP_WAIT_POLICY=PASSIVE`` (robust on a shared CPU). Runs alternate A, B / B, A per
round; the JSON has, per setting and system, seconds per step (median and min over rounds of
each run's median step, first step excluded), tokens per second (prompt + completion tokens
over step time), the mean reward of the first and of the last three steps, the wall time of the
whole command, and the load average after each run.

    python benchmarks/peers/compare.py [--steps 10] [--rounds 2] [--settings single tool]
    python benchmarks/peers/compare.py --smoke   # the tool setting, 2 steps of 2 x 2, 1 round (CI)
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cli_runs import run_train  # noqa: E402

SYSTEM_PROMPT = "Use the calculator tool for arithmetic. Answer with the result as \\boxed{N}."


SMOKE = {
    "steps": 2, "rounds": 1, "settings": ["tool"], "batch_tasks": 2, "n_samples": 2,
    "max_tokens": 24, "max_turns": 2, "num_tasks": 8,
}  # fmt: skip
"""``--smoke``: both systems' plumbing (2 steps: the first is excluded from the step times)."""


def write_tasks(work: Path, n: int, seed: int) -> dict[str, Path]:
    """The same tasks for both systems: agentrl task files per setting, TRL rows, tool schema."""
    from agentrl.rollout.calculator_task import calculator_tool_schemas, generate_calculator_tasks
    from agentrl.rollout.datasets import write_tasks_jsonl

    tasks = generate_calculator_tasks(n, seed=seed, min_digits=2, max_digits=3)
    paths = {
        "single": write_tasks_jsonl(
            [t.model_copy(update={"agent": "single_turn"}) for t in tasks], work / "single.jsonl"
        ),
        "tool": write_tasks_jsonl(tasks, work / "tool.jsonl"),
        "trl": work / "trl_tasks.jsonl",
        "tools_json": work / "tools.json",
    }
    with paths["trl"].open("w") as f:
        for t in tasks:
            row = {
                "prompt": t.initial_messages(SYSTEM_PROMPT),
                "answer": t.reward_spec["ground_truth"],
            }
            f.write(json.dumps(row) + "\n")
    paths["tools_json"].write_text(json.dumps(calculator_tool_schemas()))
    return paths


def run_agentrl(args: argparse.Namespace, setting: str, tasks: Path, out: Path) -> dict[str, Any]:
    turns = 1 if setting == "single" else args.max_turns
    overrides = [
        f"model.path={args.model_dir}",
        f"trainer.total_steps={args.steps}",
        f"data.train_files=[{tasks}]",
        "data.generator_val_size=0",
        f"data.batch_size={args.batch_tasks}",
        f"data.n_samples={args.n_samples}",
        f"trainer.mini_batch_size={args.batch_tasks}",
        f"inference.max_tokens_per_turn={args.max_tokens}",
        f"agent.max_turns={turns}",
        f"agent.max_response_tokens={args.max_tokens * turns}",
        "trainer.staleness_warmup_steps=0",  # speed per step at η = 2 from the first step
        *(["tools.enabled=[]"] if setting == "single" else []),
        *args.agentrl_overrides,
    ]
    res = run_train(ROOT / "configs" / "quickstart.yaml", out, overrides)
    m = res["metrics"]
    steps = sorted(m["timing_s/step"])
    return {
        "wall_s": res["wall_s"],
        "step_s": [m["timing_s/step"][s] for s in steps],
        "tokens": [m["perf/tokens_per_s"][s] * m["timing_s/step"][s] for s in steps],
        "reward": [m["reward/mean"][s] for s in steps],
        "push_s": [m["timing_s/push"][s] for s in steps],
    }


def run_trl(args: argparse.Namespace, setting: str, paths: dict[str, Path], out: Path) -> dict:
    from agentrl.threads import make_plan

    share = make_plan(0).trainer  # TRL is one process: the whole machine
    env = {**os.environ, **share.env(), "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("PYTHONPATH", None)  # TRL's venv must not see ours
    cmd = [
        str(args.trl_python),
        str(ROOT / "benchmarks" / "peers" / "trl_grpo.py"),
        f"--model-dir={args.model_dir}",
        f"--tasks={paths['trl']}",
        f"--tools-json={paths['tools_json']}",
        f"--mode={setting}",
        f"--steps={args.steps}",
        f"--batch-tasks={args.batch_tasks}",
        f"--n-samples={args.n_samples}",
        f"--max-tokens={args.max_tokens}",
        f"--max-turns={args.max_turns}",
        f"--threads={share.threads}",
        f"--out={out}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"TRL failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(out.read_text())
    steps = res["steps"]
    cumulative = [s.get("num_tokens", float("nan")) for s in steps]
    return {
        "wall_s": wall,
        "step_s": [s["step_s"] for s in steps],
        "tokens": [b - a for a, b in zip([0.0, *cumulative[:-1]], cumulative, strict=True)],
        "reward": [s.get("reward", float("nan")) for s in steps],
        "threads": res["torch_threads"],
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system: each run's median step (step 1 excluded: start-up), then min/median of those."""
    medians = [statistics.median(r["step_s"][1:] or r["step_s"]) for r in runs]
    tok_s = [sum(r["tokens"][1:]) / sum(r["step_s"][1:]) for r in runs if len(r["step_s"]) > 1]
    out = {
        "s_per_step_median": statistics.median(medians),
        "s_per_step_min": min(medians),
        "s_per_step_runs": [round(x, 3) for x in medians],
        "tokens_per_s_median": statistics.median(tok_s) if tok_s else None,
        "reward_first_step": statistics.mean(r["reward"][0] for r in runs),
        "reward_last3_steps": statistics.mean(statistics.mean(r["reward"][-3:]) for r in runs),
        "wall_s_runs": [round(r["wall_s"], 1) for r in runs],
        "load_avg_1m_after": [round(r["load_avg_1m"], 2) for r in runs],
    }
    if "push_s" in runs[0]:
        pushes = [p for r in runs for p in r["push_s"][1:]]
        out["push_s_median"] = statistics.median(pushes)
        out["push_s_max"] = max(pushes)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--settings", nargs="+", default=["single", "tool"], choices=["single", "tool"])
    p.add_argument("--batch-tasks", type=int, default=8)
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--num-tasks", type=int, default=256)
    p.add_argument("--model-dir", type=Path, default=ROOT / "checkpoints" / "calculator-sft")
    p.add_argument("--trl-python", type=Path, default=ROOT / ".venv-trl" / "bin" / "python")
    p.add_argument(
        "--agentrl-overrides", nargs="*", default=[], help="extra `agentrl train` overrides"
    )
    p.add_argument("--smoke", action="store_true", help="tool setting, 2 tiny steps (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        # A niced server can miss its start-up deadline on a loaded CI machine: un-niced.
        args.agentrl_overrides = ["distributed.server_nice=0", *args.agentrl_overrides]
    if not args.trl_python.is_file():
        raise SystemExit(f"no TRL python at {args.trl_python}; run `make setup-peers` first")

    work = Path(tempfile.mkdtemp(prefix="agentrl-peers-"))
    paths = write_tasks(work, args.num_tasks, seed=0)
    report: dict[str, Any] = {
        "benchmark": "peers_grpo",
        "workload": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cpu_count": len(os.sched_getaffinity(0)),
        "load_avg_1m_at_start": os.getloadavg()[0],
    }
    for setting in args.settings:
        runs: dict[str, list[dict[str, Any]]] = {"agentrl": [], "trl": []}
        for r in range(args.rounds):
            order = ("agentrl", "trl") if r % 2 == 0 else ("trl", "agentrl")
            for system in order:
                out = work / f"{setting}-{system}-{r}"
                if system == "agentrl":
                    res = run_agentrl(args, setting, paths[setting], out)
                else:
                    res = run_trl(args, setting, paths, out.with_suffix(".json"))
                res["load_avg_1m"] = os.getloadavg()[0]
                runs[system].append(res)
                print(
                    f"{setting} {system} round {r}: median step "
                    f"{statistics.median(res['step_s'][1:] or res['step_s']):.3f}s, "
                    f"reward {res['reward'][0]:.2f} -> {res['reward'][-1]:.2f}, "
                    f"load {res['load_avg_1m']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
        a, t = summarize(runs["agentrl"]), summarize(runs["trl"])
        report[setting] = {
            "agentrl": a,
            "trl": t,
            "agentrl_over_trl_s_per_step_median": a["s_per_step_median"] / t["s_per_step_median"],
            "agentrl_over_trl_s_per_step_min": a["s_per_step_min"] / t["s_per_step_min"],
            "target_agentrl_s_per_step_le_trl": a["s_per_step_median"] <= t["s_per_step_median"],
        }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
