"""Memory savers of the trainer, measured: peak memory and update time with each on and off.

Each variant runs in its own fresh process (peak resident memory is per process), in the order
A, B, C, ..., A, B, C, ... (``--rounds``), so a slow stretch of a shared machine hits every
variant alike. A child builds an ``Actor`` on a random Qwen2 (the project's own builder, no
download), runs one warm-up update and ``--updates`` timed ones on a fixed GRPO batch, and
reports:

- ``peak_rss_mb``: the process's peak resident memory (``ru_maxrss``);
- ``update_peak_over_loaded_mb``: that peak minus the resident memory once the model and the
  optimizer state exist (what the updates themselves added: activations, gradients, AdamW's
  moments on the first step);
- ``update_s``: median seconds of one update (forward + backward + AdamW step);
- ``peak_allocated_mb``: the torch allocator's peak on CUDA (null on CPU: there is no CPU
  allocator peak to read).

Variants: ``baseline``; ``checkpointing`` (``trainer.gradient_checkpointing``); ``offload``
(``trainer.cpu_offload``: FSDP2 ``CPUOffloadPolicy`` on a one-rank group; on CPU the host *is* the
device, so only its time cost shows); ``small_micro`` (a quarter of the token budget) and
``checkpointing+small_micro`` (the two composed); ``grouped_plain`` and ``grouped_shared``: a
batch whose rows come in groups of 4 with one prompt (GRPO samples of one task), with
``trainer.share_prompts`` off and on (the other variants' prompts are all distinct, so sharing
has nothing to do there).

Usage: ``python benchmarks/memory_savers.py [--device cpu] [--rounds 2]``; prints JSON.
``--smoke`` runs ``offload`` and ``checkpointing+small_micro`` (every saver's code path; each child
costs ~6 s of imports) once, one update of 2 x 32 tokens on a 2-layer model, one thread per
child (the CI check; numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL: dict[str, Any] = dict(
    num_layers=6, hidden_size=384, num_heads=6, num_kv_heads=2, intermediate_size=1024
)
SMOKE_MODEL: dict[str, Any] = dict(
    num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128
)
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "checkpointing": {"gradient_checkpointing": True},
    "offload": {"cpu_offload": True},
    "small_micro": {"micro_divisor": 4},
    "checkpointing+small_micro": {"gradient_checkpointing": True, "micro_divisor": 4},
    "grouped_plain": {"grouped": True, "share_prompts": False},
    "grouped_shared": {"grouped": True, "share_prompts": True},
}


def _rss_mb() -> float:
    """Current resident memory of this process in MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _batch(rows: int, prompt: int, response: int, seed: int, group: int = 1) -> Any:
    """A GRPO batch: ``rows`` episodes of ``prompt + response`` random byte tokens, each run of
    ``group`` rows with one prompt (a task's samples)."""
    import random

    import torch

    from agentrl.batch import trajectories_to_batch
    from agentrl.types import StopReason, Trajectory

    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(prompt)] for _ in range(rows)]
    trajs = [
        Trajectory(
            prompt_ids=list(prompts[i - i % group]),
            response_ids=[rng.randrange(256) for _ in range(response)],
            loss_mask=[1] * response,
            rollout_logprobs=[-5.0] * response,
            policy_version=[0] * response,
            uid=f"g{i // 2}",
            index=i % 2,
            reward=float(i % 2),
            stop_reason=StopReason.EOS,
        )
        for i in range(rows)
    ]
    batch = trajectories_to_batch(trajs, pad_token_id=256)
    mask = batch["response_mask"].float()
    batch["old_log_probs"] = -5.0 * mask
    rewards = torch.tensor([t.reward for t in trajs])
    batch["advantages"] = (rewards - rewards.mean())[:, None] * mask
    return batch


def _dist_context(device: str) -> Any:
    """A one-rank FSDP2 context with host offload (what ``trainer.cpu_offload`` builds)."""
    import dataclasses

    import torch.distributed as dist

    from agentrl.training.fsdp import DistContext

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1
    )
    return dataclasses.replace(DistContext.current(device), cpu_offload=True)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process; returns its figures."""
    import torch

    from agentrl.config import load_config
    from agentrl.training.actor import Actor, ActorConfig
    from agentrl.training.algorithm import build_algorithm

    torch.manual_seed(0)
    v = VARIANTS[args.variant]
    tokens = args.rows * (args.prompt + args.response)
    budget = tokens // v.get("micro_divisor", 1)
    cfg = load_config(
        None,
        [
            f"trainer.micro_batch_max_tokens={budget}",
            f"trainer.gradient_checkpointing={str(v.get('gradient_checkpointing', False)).lower()}",
            f"trainer.mini_batch_size={args.rows}",
            f"trainer.share_prompts={str(v.get('share_prompts', True)).lower()}",
            "data.n_samples=1",
        ],
    )
    config = ActorConfig.from_config(cfg, build_algorithm(cfg.algorithm))
    dist_ctx = _dist_context(args.device) if v.get("cpu_offload") else None
    actor = Actor(
        args.model,
        config,
        device=args.device,
        dtype="float32",
        trust_remote_code=False,
        dist=dist_ctx,
    )
    batch = _batch(
        args.rows, args.prompt, args.response, seed=1, group=4 if v.get("grouped") else 1
    )
    loaded = _rss_mb()
    cuda = args.device == "cuda"
    times = []
    for i in range(args.updates + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        actor.update(batch)
        if cuda:
            torch.cuda.synchronize()
        if i > 0:  # the first update allocates AdamW's moments
            times.append(time.perf_counter() - t0)
    return {
        "variant": args.variant,
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "update_peak_over_loaded_mb": round(_peak_rss_mb() - loaded, 1),
        "update_s": round(statistics.median(times), 3),
        "peak_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
        "tokens_per_update": tokens,
        "micro_batch_max_tokens": budget,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=448)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads of each child (0 = every usable CPU)"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="two variants once, tiny (CI)")
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(child(args)))
        return 0
    shape = MODEL
    if args.smoke:
        shape = SMOKE_MODEL
        args.rounds, args.updates, args.rows, args.prompt, args.response = 1, 1, 2, 8, 24
        args.variants = "offload,checkpointing+small_micro"
        args.threads = 1
    threads = str(args.threads or len(os.sched_getaffinity(0)))  # one child runs at a time
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    from agentrl.inference.tiny_model import build_tiny_model

    model = build_tiny_model(Path(tempfile.mkdtemp(prefix="agentrl-mem-")) / "qwen2", **shape)
    names = args.variants.split(",")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:  # interleaved: A, B, C, ..., A, B, C, ...
            cmd = [sys.executable, __file__, "--variant", name, "--model", str(model)]
            cmd += [
                f"--{k}={getattr(args, k)}"
                for k in ("device", "updates", "rows", "prompt", "response")
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
            if out.returncode != 0:
                raise SystemExit(f"variant {name} failed:\n{out.stderr[-3000:]}")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {}
    for name, rs in runs.items():
        summary[name] = {
            key: statistics.median(r[key] for r in rs)
            for key in ("peak_rss_mb", "update_peak_over_loaded_mb", "update_s")
        }
        summary[name]["peak_allocated_mb"] = rs[0]["peak_allocated_mb"]
        summary[name]["micro_batch_max_tokens"] = rs[0]["micro_batch_max_tokens"]
    report = {
        "device": args.device,
        "model": shape,
        "tokens_per_update": args.rows * (args.prompt + args.response),
        "rounds": args.rounds,
        "median": summary,
        "runs": runs,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
