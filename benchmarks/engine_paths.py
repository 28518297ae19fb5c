"""The embedded engine's two speed-ups, each on and off, interleaved: the lean forward and the
prefix cache; JSON.

Two levels, both interleaved (every round runs every variant, in a rotated order):

- ``--level engine`` (seconds): one process, four engines on the same model (default the shipped
  warm start), one thread each: ``transformers`` forward / lean forward x prefix cache off / on.
  A round is one agent-shaped rollout: ``--tasks`` tasks x ``--samples`` samples whose prompts
  share a ``--system-tokens`` block (each task adds ``--question-tokens``); each episode's turn 1
  makes up to ``--turn-tokens`` tokens, and as soon as it ends its turn 2 (its prompt + its
  output + ``--tool-tokens`` of tool answer) is submitted, as an agent loop does. Before each
  round the prefix cache is emptied (in training every step brings new weights, which empty it).
  Printed per variant: seconds per round (min, median), prompt tokens computed and served from
  the cache, decode steps; the speed-up of each over the old engine (transformers, no cache),
  paired per round; and, against the old engine, the share of identical token sequences and the
  largest logprob difference on the tokens they share.
- ``--level train`` (minutes): ``agentrl train configs/quickstart.yaml`` from the warm start,
  ``--steps`` steps, synchronous (``trainer.max_staleness=0``) and the async default, each with
  the old engine (``AGENTRL_LEAN_FORWARD=0``, ``inference.prefix_cache_mb=0``) and the new one.
  Printed: median seconds per step (after the first) per variant, and new/old per mode.

    python benchmarks/engine_paths.py --level engine [--rounds 5]
    python benchmarks/engine_paths.py --level train [--rounds 2] [--steps 12]
    python benchmarks/engine_paths.py --smoke          # one tiny engine round (CI)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cli_runs import add_agent_workload_args, report, rotated  # noqa: E402

ENGINE_VARIANTS = {
    "old": (False, 0.0),
    "lean": (True, 0.0),
    "prefix_cache": (False, 256.0),
    "new": (True, 256.0),
}
"""name -> (lean forward, prefix cache MiB). ``old`` is the engine before both; ``new`` is the
default now."""
OLD_ENGINE = ({"AGENTRL_LEAN_FORWARD": "0"}, ["inference.prefix_cache_mb=0"])
TRAIN_VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "sync_old": (OLD_ENGINE[0], ["trainer.max_staleness=0", *OLD_ENGINE[1]]),
    "sync_new": ({}, ["trainer.max_staleness=0"]),
    "async_old": OLD_ENGINE,
    "async_new": ({}, []),
}


# ---- engine level --------------------------------------------------------------------------------
def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``tasks x samples`` prompts: a shared system block, then each task's question."""
    import random

    rng = random.Random(0)
    system = [rng.randrange(0, 250) for _ in range(args.system_tokens)]
    tasks = [
        [rng.randrange(0, 250) for _ in range(args.question_tokens)] for _ in range(args.tasks)
    ]
    return [system + q for q in tasks for _ in range(args.samples)]


def one_round(engine: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """One rollout: turn 1 of every episode at once, each turn 2 as soon as its turn 1 ends."""
    from agentrl.types import SamplingParams

    engine.reset_prefix_cache()
    before = dict(engine.stats)
    tool = [(7 * j) % 250 for j in range(args.tool_tokens)]
    sp = [SamplingParams(max_tokens=args.turn_tokens, seed=i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    first = {engine.submit(p, s): i for i, (p, s) in enumerate(zip(prompts, sp, strict=True))}
    outs: dict[tuple[int, int], Any] = {}
    second = {}
    for fut in concurrent.futures.as_completed(first):
        i, out = first[fut], fut.result()
        outs[(i, 1)] = out
        second[engine.submit(prompts[i] + out.token_ids + tool, sp[i])] = i
    for fut in concurrent.futures.as_completed(second):
        outs[(second[fut], 2)] = fut.result()
    wall = time.perf_counter() - t0
    delta = {k: engine.stats[k] - before.get(k, 0) for k in engine.stats}
    return {
        "wall_s": wall,
        "prompt_tokens_computed": delta.get("prompt_tokens", 0),
        "prompt_tokens_cached": delta.get("prefix_cache_hit_tokens", 0),
        "decode_steps": delta.get("decode_steps", 0),
        "outputs": [outs[k] for k in sorted(outs)],
    }


def agreement(a: list[Any], b: list[Any]) -> dict[str, float]:
    """Share of identical token sequences, and the largest logprob difference on shared tokens."""
    same, worst = 0, 0.0
    for x, y in zip(a, b, strict=True):
        same += x.token_ids == y.token_ids
        for tx, ty, lx, ly in zip(x.token_ids, y.token_ids, x.logprobs, y.logprobs, strict=False):
            if tx != ty:
                break
            worst = max(worst, abs(lx - ly))
    return {"same_sequences": same / len(a), "max_abs_logprob_diff": worst}


def run_engine_level(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from agentrl.inference.engine import InferenceEngine

    torch.set_num_threads(1)
    engines = {}
    for name, (lean, mb) in ENGINE_VARIANTS.items():
        os.environ["AGENTRL_LEAN_FORWARD"] = "1" if lean else "0"
        engines[name] = InferenceEngine(args.model_dir, max_batch_size=64, prefix_cache_mb=mb)
    os.environ.pop("AGENTRL_LEAN_FORWARD", None)
    prompts = make_prompts(args)
    names = list(engines)
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        for n in names:  # warm-up (first-call costs), not timed
            one_round(engines[n], prompts[:2], args)
        for r in range(args.rounds):
            for n in rotated(names, r):
                rounds[n].append(one_round(engines[n], prompts, args))
                print(f"round {r} {n}: {rounds[n][-1]['wall_s']:.3f} s", file=sys.stderr)
        forwards = {n: type(e._sched.forward).__name__ for n, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()
    return summarize_engine(rounds, forwards)


def summarize_engine(rounds: dict[str, list[dict[str, Any]]], forwards: dict[str, str]) -> dict:
    out: dict[str, Any] = {}
    old = rounds["old"]
    for n, runs in rounds.items():
        walls = [r["wall_s"] for r in runs]
        paired = [o["wall_s"] / r["wall_s"] for o, r in zip(old, runs, strict=True)]
        agree = [agreement(o["outputs"], r["outputs"]) for o, r in zip(old, runs, strict=True)]
        out[n] = {
            "forward": forwards[n],
            "s_per_round_min": round(min(walls), 4),
            "s_per_round_median": round(statistics.median(walls), 4),
            "speedup_vs_old_median": round(statistics.median(paired), 3),
            "speedup_vs_old_min_max": [round(min(paired), 3), round(max(paired), 3)],
            "prompt_tokens_computed": runs[0]["prompt_tokens_computed"],
            "prompt_tokens_cached": runs[0]["prompt_tokens_cached"],
            "decode_steps": runs[0]["decode_steps"],
            "same_sequences_as_old": min(a["same_sequences"] for a in agree),
            "max_abs_logprob_diff_vs_old": max(a["max_abs_logprob_diff"] for a in agree),
        }
    return out


# ---- train level -------------------------------------------------------------------------------
def run_train_level(args: argparse.Namespace) -> dict[str, Any]:
    from cli_runs import interleaved_quickstart_runs, paired_ratio

    variants = {
        n: ({"AGENTRL_LEAN_FORWARD": "", **env}, o) for n, (env, o) in TRAIN_VARIANTS.items()
    }
    runs = interleaved_quickstart_runs(variants, args, ["timing_s/step"], "engine-paths")
    steps = {n: r["timing_s/step"] for n, r in runs.items()}
    out: dict[str, Any] = {
        n: {"s_per_step_median": round(statistics.median(v), 4), "runs": [round(x, 4) for x in v]}
        for n, v in steps.items()
    }
    for mode in ("sync", "async"):
        out[f"{mode}_new_over_old"] = paired_ratio(steps[f"{mode}_old"], steps[f"{mode}_new"])
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--level", choices=["engine", "train"], default="engine")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=12, help="train level: steps per run")
    add_agent_workload_args(p)
    p.add_argument("--smoke", action="store_true", help="one engine round of 2 x 2 (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.level, args.rounds, args.tasks, args.samples, args.turn_tokens = "engine", 1, 2, 2, 4
    t0 = time.perf_counter()
    result = run_engine_level(args) if args.level == "engine" else run_train_level(args)
    return report("engine_paths", args, result, t0)


if __name__ == "__main__":
    main()
