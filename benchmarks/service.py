"""Throughput of the rollout service vs the in-process AgentLoopManager, on the same jobs.

Both sides run the same calculator episodes (the config's train split, ``--tasks`` x ``--n``)
against the same embedded inference server(s) on the shipped warm start:

- ``in_process``: ``make_manager()`` of the service's own serving stack, ``manager.generate``;
- ``service``: ``agentrl serve`` in a subprocess over the same servers, driven through the SDK
  (``RolloutClient.submit`` + ``collect``: SSE, SQLite store, acks, JSON both ways).

Rounds alternate (A, B, A, B, ...) so drift hits both sides alike. Printed JSON: per-round
trajectories/s, the medians, and ``ratio`` = service / in-process (target >= 0.9).

    .venv/bin/python benchmarks/service.py --rounds 4 --tasks 64 --n 4
    .venv/bin/python benchmarks/service.py --smoke     # one round of 4 episodes (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentrl.client import AsyncRolloutClient  # noqa: E402
from agentrl.config import load_config  # noqa: E402
from tests.integration.service_helpers import (  # noqa: E402
    API_KEY,
    ServiceProcess,
    start_inference_servers,
    write_config,
)


async def in_process_round(serving: Any, tasks: list, n: int) -> tuple[list, float]:
    manager = serving.make_manager()  # a fresh manager per job, as the service makes one
    t0 = time.perf_counter()
    trajs = await manager.generate(tasks, n_samples=n)
    return trajs, time.perf_counter() - t0


async def service_round(client: AsyncRolloutClient, tasks: int, n: int) -> tuple[list, float]:
    t0 = time.perf_counter()
    job = await client.submit(dataset={"split": "train", "limit": tasks}, n=n)
    trajs = await client.collect(job.id)
    return trajs, time.perf_counter() - t0


def _shape(trajs: list) -> dict[str, float]:
    """What the episodes looked like (so a fast round can be told from a degenerate one)."""
    return {
        "turns_mean": statistics.mean(t.num_turns for t in trajs),
        "response_tokens_mean": statistics.mean(len(t.response_ids) for t in trajs),
        "errors": sum(t.stop_reason.value == "error" for t in trajs),
    }


async def _rounds(cfg: Any, tasks: list, url: str, args: Any) -> tuple[dict, dict]:
    """Interleaved rounds: in-process, service, in-process, service, ..."""
    from agentrl.service.serving import build_serving

    rows: dict[str, list[float]] = {"in_process": [], "service": []}
    shapes: dict[str, list[dict[str, float]]] = {"in_process": [], "service": []}
    async with build_serving(cfg) as serving, AsyncRolloutClient(url, api_key=API_KEY) as client:
        warm = min(8, len(tasks))
        await service_round(client, warm, 1)  # warm both paths once
        await in_process_round(serving, tasks[:warm], 1)
        for _ in range(args.rounds):
            local, secs = await in_process_round(serving, tasks, args.n)
            rows["in_process"].append(len(local) / secs)
            shapes["in_process"].append(_shape(local))
            remote, secs2 = await service_round(client, args.tasks, args.n)
            assert len(remote) == len(local) == args.tasks * args.n
            rows["service"].append(len(remote) / secs2)
            shapes["service"].append(_shape(remote))
    return rows, shapes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="rounds per side (interleaved)")
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="1 round of 4 x 1 episodes (plumbing)")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.tasks, args.n = 1, 4, 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from agentrl.inference.handle import free_port
    from agentrl.training.resolve import build_tasks

    work = Path(tempfile.mkdtemp(prefix="bench-service-"))
    handles = start_inference_servers(work, args.servers)
    try:
        config = write_config(work, [h.base_url for h in handles])
        cfg = load_config(config)
        tasks = build_tasks(cfg, split="train")[: args.tasks]
        svc = ServiceProcess(config, free_port(), work / "bench.sqlite", work / "svc.log").start()
        try:
            rows, shapes = asyncio.run(_rounds(cfg, tasks, svc.url, args))
        finally:
            svc.stop()
    finally:
        for h in handles:
            h.stop()
    med = {k: statistics.median(v) for k, v in rows.items()}
    report = {
        "workload": vars(args),
        "trajectories_per_s": rows,
        "episode_shape_per_round": shapes,
        "median_trajectories_per_s": med,
        "ratio": med["service"] / med["in_process"],
        "target_ratio": 0.9,
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
