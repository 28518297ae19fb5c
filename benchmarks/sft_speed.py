"""SFT seconds per step: one padded batch vs length-bucketed micro-batches, side by side; JSON.

The quickstart's two SFT stages are most of its wall time. Their batches mix conversations of
~95 tokens (no tools block) and ~213 tokens (with it), and stage 2 adds ~54-token guesses, so
one padded ``[16, 213]`` batch spends a third or more of its compute on padding.
:func:`agentrl.training.sft.micro_batches` splits each step's rows by length instead (same
token-mean loss over the whole batch). This script runs both on the same model, data and seed,
interleaved (A, B, A, B), each round a fresh copy of the shipped warm start trained for
``--steps`` steps on the recipe's data, and prints per stage and mode the seconds per step
(min / median over rounds), the final losses (equal up to float rounding) and the load.

    python benchmarks/sft_speed.py [--steps 40] [--rounds 3]
    python benchmarks/sft_speed.py --smoke      # 2 steps, 1 round, one thread (CI; numbers meaningless)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = {
    "stage1_tool": "configs/sft_calculator_tool.yaml",
    "stage2_mixed": "configs/sft_calculator.yaml",
}


def _one_batch(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The old behaviour: every row in one padded micro-batch."""
    return [list(range(len(lengths)))]


def run_once(model: Any, tokenizer: Any, convs: list[dict], cfg: Any, steps: int, mode: str):
    import agentrl.training.sft as sft

    settings = sft.SFTSettings(
        steps=steps,
        batch_size=cfg.data.batch_size,
        lr=cfg.trainer.lr,
        warmup_steps=cfg.trainer.warmup_steps,
        schedule=cfg.trainer.lr_schedule,
        seed=cfg.trainer.seed,
        max_seq_len=cfg.data.max_seq_len,
        log_every=steps,
        micro_batch_max_tokens=cfg.trainer.micro_batch_max_tokens,
    )
    original = sft.micro_batches
    if mode.startswith("one_padded_batch"):
        sft.micro_batches = _one_batch  # type: ignore[assignment]  # the A side of the A/B
    try:
        model = copy.deepcopy(model)
        final = sft.train_sft(model, tokenizer, convs, settings)
    finally:
        sft.micro_batches = original  # type: ignore[assignment]
    # One epoch of exactly these conversations: every real token is trained once, so the
    # loop's tokens/s (timed after tokenizing) gives the seconds per step.
    real_tokens = sum(
        len(sft.tokenize_conversation(tokenizer, c["messages"], c.get("tools")).input_ids)
        for c in convs
    )
    return {
        "s_per_step": real_tokens / final["perf/tokens_per_s"] / steps,
        "tokens_per_s": final["perf/tokens_per_s"],
        "final_loss": final["sft/loss"],
        "load_avg_1m": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--threads",
        type=int,
        nargs="*",
        default=None,
        help="torch thread counts to compare too (default: the thread plan's share only)",
    )
    p.add_argument("--model-dir", type=Path, default=ROOT / "checkpoints" / "calculator-sft")
    p.add_argument("--smoke", action="store_true", help="2 steps, 1 round, one thread (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.rounds, args.threads = 2, 1, [1]

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.config import load_sft_config
    from agentrl.threads import make_plan
    from agentrl.training.sft_cli import load_sft_data

    plan = make_plan(0)
    plan.trainer.apply()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    report: dict[str, Any] = {
        "benchmark": "sft_speed",
        "threads": plan.describe(),
        "steps_per_run": args.steps,
        "load_avg_1m_at_start": os.getloadavg()[0],
    }
    modes = [
        f"{m}@{t}t"
        for t in (args.threads or [plan.trainer.threads])
        for m in ("one_padded_batch", "micro_batches")
    ]
    for stage, config in STAGES.items():
        cfg = load_sft_config(ROOT / config)
        convs = load_sft_data(cfg)[: args.steps * cfg.data.batch_size]
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                torch.set_num_threads(int(mode.rsplit("@", 1)[1][:-1]))
                res = run_once(model, tokenizer, convs, cfg, args.steps, mode)
                runs[mode].append(res)
                print(f"{stage} {mode}: {res}", file=sys.stderr, flush=True)
        summary: dict[str, Any] = {}
        for mode in modes:
            per_step = [x["s_per_step"] for x in runs[mode]]
            summary[mode] = {
                "s_per_step_min": min(per_step),
                "s_per_step_median": statistics.median(per_step),
                "final_loss": runs[mode][0]["final_loss"],
                "load_avg_1m": [round(x["load_avg_1m"], 2) for x in runs[mode]],
            }
        best = min(modes, key=lambda m: summary[m]["s_per_step_median"])
        summary["fastest_median"] = best
        for a, b in zip(modes[::2], modes[1::2], strict=True):
            summary[f"speedup_median {a} / {b}"] = (
                summary[a]["s_per_step_median"] / summary[b]["s_per_step_median"]
            )
        report[stage] = summary
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
