"""Shared prompts in the trainer (``trainer.share_prompts``), on and off, interleaved; JSON.

Two levels, both interleaved (every round runs every variant, in a rotated order):

- ``--level update`` (seconds): one process, one thread, two actors on the same model (default
  the shipped warm start) with the same weights, one sharing prompts and one not. A round is one
  ``Actor.update`` (forward, backward, AdamW step) of an agent-shaped GRPO batch: ``--tasks``
  tasks x ``--samples`` samples whose prompts share a ``--system-tokens`` block (each task adds
  ``--question-tokens``), each response 1-3 turns of ``--turn-tokens`` sampled tokens followed by
  ``--tool-tokens`` of tool answer. Printed per variant: seconds per update (min, median), the
  share of prompt tokens reused, and on/off paired per round; and how far the two actors'
  weights are apart after all the rounds (the same updates, up to float rounding).
- ``--level train`` (minutes): ``agentrl train configs/quickstart.yaml`` from the warm start,
  ``--steps`` steps, synchronous (``trainer.max_staleness=0``) and the async default, each with
  ``trainer.share_prompts`` true and false. Printed: median seconds per step and per actor update
  (after the first step) per variant, and on/off per mode.

    python benchmarks/shared_prompts.py --level update [--rounds 10]
    python benchmarks/shared_prompts.py --level train [--rounds 3] [--steps 12]
    python benchmarks/shared_prompts.py --smoke          # two tiny update rounds (CI)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cli_runs import add_agent_workload_args, report, rotated  # noqa: E402

TRAIN_VARIANTS: dict[str, list[str]] = {
    "sync_off": ["trainer.max_staleness=0", "trainer.share_prompts=false"],
    "sync_on": ["trainer.max_staleness=0", "trainer.share_prompts=true"],
    "async_off": ["trainer.share_prompts=false"],
    "async_on": ["trainer.share_prompts=true"],
}


# ---- update level ------------------------------------------------------------------------------
def make_batch(args: argparse.Namespace, vocab: int, pad: int, seed: int) -> Any:
    """An agent-shaped GRPO batch (see the module docstring) with advantages and π_rollout."""
    import torch

    from agentrl.batch import trajectories_to_batch
    from agentrl.types import StopReason, Trajectory

    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(args.system_tokens)]
    trajs = []
    for task in range(args.tasks):
        prompt = system + [rng.randrange(vocab) for _ in range(args.question_tokens)]
        for i in range(args.samples):
            mask: list[int] = []
            for turn in range(rng.randint(1, 3)):
                mask += [1] * args.turn_tokens + ([0] * args.tool_tokens if turn < 2 else [])
            trajs.append(
                Trajectory(
                    prompt_ids=list(prompt),
                    response_ids=[rng.randrange(vocab) for _ in mask],
                    loss_mask=mask,
                    rollout_logprobs=[-1.0 if m else 0.0 for m in mask],
                    policy_version=[0 if m else -1 for m in mask],
                    uid=f"t{task}",
                    index=i,
                    reward=float(rng.random() < 0.5),
                    stop_reason=StopReason.EOS,
                )
            )
    batch = trajectories_to_batch(trajs, pad_token_id=pad)
    rewards = torch.tensor([t.reward for t in trajs])
    batch["advantages"] = (rewards - rewards.mean())[:, None] * batch["response_mask"].float()
    batch["old_log_probs"] = batch["rollout_log_probs"].clone()
    return batch


def run_update_level(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from agentrl.config import load_config
    from agentrl.training.actor import Actor, ActorConfig
    from agentrl.training.algorithm import build_algorithm

    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"model.path={args.model_dir}"])
    base = ActorConfig.from_config(cfg, build_algorithm(cfg.algorithm))
    actors = {}
    for name, share in (("off", False), ("on", True)):
        config = ActorConfig(**{**vars(base), "share_prompts": share})
        actors[name] = Actor(
            args.model_dir, config, device="cpu", dtype="float32", trust_remote_code=False
        )
    vocab = int(actors["on"].model.get_input_embeddings().weight.shape[0])
    pad = int(actors["on"].model.config.pad_token_id or 0)
    seconds: dict[str, list[float]] = {n: [] for n in actors}
    reused: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for r in range(args.rounds):
        batch = make_batch(args, min(vocab, 256), pad, seed=r)
        tokens = {
            "prompt": int(batch["attention_mask"][:, : batch["prompts"].shape[1]].sum()),
            "response": int(batch["attention_mask"][:, batch["prompts"].shape[1] :].sum()),
        }
        for name in rotated(list(actors), r):
            t0 = time.perf_counter()
            metrics = actors[name].update(batch.clone())
            seconds[name].append(time.perf_counter() - t0)
            reused[name] = metrics["actor/prompt_tokens_reused"]
            print(f"round {r} {name}: {seconds[name][-1]:.3f} s", file=sys.stderr)
    drift = max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(
            actors["on"].model.parameters(), actors["off"].model.parameters(), strict=True
        )
    )
    ratios = [on / off for on, off in zip(seconds["on"], seconds["off"], strict=True)]
    return {
        "tokens_per_batch": tokens,
        **{
            n: {
                "s_per_update_min": round(min(v), 4),
                "s_per_update_median": round(statistics.median(v), 4),
                "prompt_tokens_reused": round(reused[n], 3),
            }
            for n, v in seconds.items()
        },
        "on_over_off": {
            "median": round(statistics.median(ratios), 3),
            "per_round": [round(x, 3) for x in ratios],
        },
        "max_abs_weight_diff_after_all_rounds": drift,
    }


# ---- train level -------------------------------------------------------------------------------
def run_train_level(args: argparse.Namespace) -> dict[str, Any]:
    from cli_runs import interleaved_quickstart_runs, paired_ratio

    keys = ["timing_s/step", "timing_s/update_actor"]
    variants = {n: ({}, overrides) for n, overrides in TRAIN_VARIANTS.items()}
    runs = interleaved_quickstart_runs(variants, args, keys, "shared-prompts")
    step = {n: r["timing_s/step"] for n, r in runs.items()}
    update = {n: r["timing_s/update_actor"] for n, r in runs.items()}
    out: dict[str, Any] = {
        n: {
            "s_per_step_median": round(statistics.median(step[n]), 4),
            "s_per_update_median": round(statistics.median(update[n]), 4),
            "steps": [round(x, 4) for x in step[n]],
            "updates": [round(x, 4) for x in update[n]],
        }
        for n in runs
    }
    for mode in ("sync", "async"):
        for what, series in (("step", step), ("update", update)):
            out[f"{mode}_{what}_on_over_off"] = paired_ratio(
                series[f"{mode}_off"], series[f"{mode}_on"]
            )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--level", choices=["update", "train"], default="update")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=12, help="train level: steps per run")
    add_agent_workload_args(p)
    p.add_argument("--smoke", action="store_true", help="two update rounds of 2 x 2 (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.level, args.rounds, args.tasks, args.samples = "update", 2, 2, 2
    t0 = time.perf_counter()
    result = run_update_level(args) if args.level == "update" else run_train_level(args)
    return report("shared_prompts", args, result, t0)


if __name__ == "__main__":
    main()
