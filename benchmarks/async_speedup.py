"""Wall time per trained sample: synchronous (max_staleness 0) vs asynchronous (max_staleness 2).

Both runs train the same tiny model on the same multi-turn calculator workload, side by side in
one process, against the same two embedded servers. So that the overlap of generation and
training is measured (not two CPU cores fighting over a tiny model), generation goes through a
latency-emulating pool: after each real generation it sleeps ``--latency`` seconds per generated
token times a per-episode long-tail factor (Pareto, ``--tail-alpha``, capped at ``--tail-cap``),
like an accelerator serving a batch whose episodes have very different lengths. The sleep holds
no CPU, so the trainer's step can run during it, as on a GPU cluster.

Printed JSON: per mode the wall time per trained sample (sum of ``timing_s/step`` over the
measured steps / trained samples), the speedup, and the real limit of that speedup, derived
from two quantities measured in the same run:

- generation time per step at full concurrency, ``G``: a third run on the same pool with
  training replaced by a no-op and unbounded staleness, so nothing but the rollout side (and
  the weight pushes that pause it) limits how fast trajectories finish; ``G`` = a batch's
  trajectories / the rate they finished (consumed plus buffered, over the measured steps);
- training time per step, ``T``: the synchronous run's step minus its wait for rollouts
  (train + push; with overlap the trainer still does both, one after the other).

Perfect overlap runs a step in ``max(G, T)``; the synchronous run took ``S`` per step, so no
asynchronous schedule beats ``S / max(G, T)``. The report gives that ``limit_speedup`` and
``speedup / limit_speedup`` (1.0 = the overlap is perfect; above 1 would mean the bound is
wrong, so the JSON says so).

    .venv/bin/python benchmarks/async_speedup.py --steps 8 --latency 0.02
    .venv/bin/python benchmarks/async_speedup.py --smoke   # 2 steps of 2 x 2 (CI; numbers meaningless)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentrl.config import load_config  # noqa: E402
from agentrl.inference.pool import ServerPool  # noqa: E402
from agentrl.types import Generation, SamplingParams  # noqa: E402


def make_latency_pool(latency_s: float, alpha: float, cap: float) -> type[ServerPool]:
    class LatencyPool(ServerPool):
        """A ServerPool whose generations take accelerator-like, long-tailed time."""

        async def generate(
            self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
        ) -> Generation:
            gen = await super().generate(prompt_ids, sampling, session_id)
            seed = int(hashlib.sha256((session_id or "").encode()).hexdigest()[:8], 16)
            factor = min(cap, random.Random(seed).paretovariate(alpha))
            await asyncio.sleep(latency_s * max(1, len(gen.token_ids)) * factor)
            return gen

    return LatencyPool


_DONE_KEYS = ("async/consumed_total", "async/buffer_ready_groups", "async/buffer_partial_groups")


async def _no_training(
    trajs: list, policies: Any, plan: Any, *, pad_token_id: int, **kw: Any
) -> Any:
    """Stands in for ``agentrl.training.step.train_step`` in the generation-capacity run: the
    batch, its rewards and advantages are built (the loop's metrics read them), no model runs."""
    from agentrl.batch import trajectories_to_batch
    from agentrl.training.step import StepOutput, compute_advantages, compute_rewards

    batch = trajectories_to_batch(list(trajs), pad_token_id=pad_token_id)
    metrics: dict[str, float] = {}
    compute_rewards(batch, plan, metrics)
    baselines = kw.get("reward_baselines")
    compute_advantages(batch, plan, baselines, [t.reward_info for t in trajs])
    return StepOutput(batch, metrics)


def run_mode(
    args: argparse.Namespace, eta: int, model_dir: Path, urls: list[str], train: bool = True
) -> dict:
    import agentrl.inference.pool as pool_mod
    import agentrl.training.loop as loop_mod
    import agentrl.training.trainer as trainer_mod

    out = Path(tempfile.mkdtemp(prefix=f"async-speedup-eta{eta}-"))
    cfg = load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            f"model.path={model_dir}",
            f"trainer.output_dir={out}",
            f"trainer.total_steps={args.steps}",
            f"trainer.max_staleness={eta}",
            "trainer.staleness_warmup_steps=0",  # η from the first step: the mode compared
            f"data.batch_size={args.batch_size}",
            f"data.n_samples={args.n_samples}",
            f"trainer.mini_batch_size={args.batch_size}",
            "data.generator_val_size=2",
            f"inference.max_tokens_per_turn={args.max_tokens}",
            "agent.max_turns=3",
            f"agent.max_response_tokens={args.max_tokens * 3}",
            "rollout.max_concurrency=64",
            "tracking.enabled=false",
            f"checkpoint.shared_dir={out / 'weights'}",
        ],
    )
    # The benchmark's latency emulation: build_run makes its pool from agentrl.inference.pool.
    pool_mod.ServerPool = make_latency_pool(args.latency, args.tail_alpha, args.tail_cap)  # type: ignore[misc]
    real_step = loop_mod.train_step
    if not train:  # the generation-only run
        loop_mod.train_step = _no_training  # type: ignore[assignment]
    try:
        result = trainer_mod.Trainer(cfg, server_urls=urls).run_sync()
    finally:
        pool_mod.ServerPool = ServerPool  # type: ignore[misc]
        loop_mod.train_step = real_step
    h = result.history
    # The first step includes filling the pipeline from empty: skipped when training. The
    # generation-only run counts from the start: with no staleness limit it may generate the
    # whole run during its first step (CI10's smoke measured 0 trajectories after it).
    skip = 1 if train else 0
    steps = [v for s, v in h["timing_s/step"] if s > skip]
    wait = [v for s, v in h["timing_s/wait_rollout"] if s > skip]
    samples = len(steps) * args.batch_size * args.n_samples
    # Trajectories the rollout side finished, consumed or waiting in the buffer (a partial group
    # counted as n - 1 finished: this over- rather than under-states the capacity).
    series = {k: dict(h[k]) for k in _DONE_KEYS if k in h}
    done = {
        s: series["async/consumed_total"][s]
        + args.n_samples * series["async/buffer_ready_groups"].get(s, 0.0)
        + (args.n_samples - 1) * series["async/buffer_partial_groups"].get(s, 0.0)
        for s in series.get("async/consumed_total", {})
    }
    end = max(done) if done else skip
    start = done[skip] if skip else 0.0
    finished_per_s = (done[end] - start) / sum(steps) if end > skip else float("nan")
    return {
        "max_staleness": eta,
        "measured_steps": len(steps),
        "trained_samples": samples,
        "loop_s": round(sum(steps), 3),
        "s_per_sample": sum(steps) / samples,
        "generate_wait_s_per_step": sum(wait) / len(wait),
        "s_per_step": sum(steps) / len(steps),
        "finished_trajectories_per_s": finished_per_s,
        "train_s_per_step": (sum(steps) - sum(wait)) / len(steps),
        # (Logged by the training step; the generation-only run has none.)
        "staleness_max": max((v for _, v in h.get("async/staleness_max", [])), default=None),
        "load_avg_1m_after": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4, help="tasks per step")
    p.add_argument("--n-samples", type=int, default=2, help="samples per task (GRPO group)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per turn")
    p.add_argument("--latency", type=float, default=0.02, help="seconds per generated token")
    p.add_argument("--tail-alpha", type=float, default=1.5, help="Pareto shape of episode length")
    p.add_argument("--tail-cap", type=float, default=8.0, help="cap of the long-tail factor")
    p.add_argument("--smoke", action="store_true", help="2 steps of 2 tasks x 2 samples (CI)")
    args = p.parse_args(argv)
    if args.smoke:  # 2 steps: the first is excluded from the measurement, one is measured
        args.steps, args.batch_size, args.n_samples, args.max_tokens = 2, 2, 2, 8
        args.latency = 0.001

    from agentrl.inference.server import launch_embedded_server
    from agentrl.inference.tiny_model import build_tiny_model
    from agentrl.threads import make_plan

    plan = make_plan(num_servers=2)  # this process trains; each server gets its share
    plan.trainer.apply()
    work = Path(tempfile.mkdtemp(prefix="async-speedup-"))
    model_dir = build_tiny_model(work / "tiny", seed=0)
    handles = [
        launch_embedded_server(
            model_dir,
            log_path=work / f"server-{i}.log",
            startup_timeout_s=300,
            env=plan.servers[i].env(),
        )
        for i in range(2)
    ]
    try:
        urls = [h.base_url for h in handles]
        sync = run_mode(args, 0, model_dir, urls)
        asyn = run_mode(args, 2, model_dir, urls)
        gen_only = run_mode(args, 1000, model_dir, urls, train=False)
    finally:
        for h in handles:
            h.stop()
    # Generation at full concurrency (pushes included): a batch's worth of trajectories at the
    # rate the rollout side finished them when nothing held it back.
    g = args.batch_size * args.n_samples / gen_only["finished_trajectories_per_s"]
    t = sync["train_s_per_step"]  # train + push
    limit = sync["s_per_step"] / max(g, t, 1e-9)
    speedup = sync["s_per_sample"] / asyn["s_per_sample"]
    report = {
        "workload": {k: v for k, v in vars(args).items()},
        "thread_plan": plan.describe(),
        "sync": sync,
        "async": asyn,
        "generation_only": gen_only,
        "generate_s_per_step_full_concurrency": g,
        "train_s_per_step": t,
        "speedup": speedup,
        "limit_speedup": limit,
        "speedup_over_limit": speedup / limit,
        "limit_holds": speedup <= limit * 1.05,  # 5 %: run-to-run noise of a shared machine
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
