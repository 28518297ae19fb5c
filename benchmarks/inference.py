"""Inference throughput, side by side in one run, on the same requests; prints JSON.

Measures generated tokens per second for:

- the embedded server (continuous batching) at concurrency 1, 8, 32 and 64, over HTTP with the
  PolicyClient;
- a one-request-at-a-time ``transformers`` ``model.generate`` loop (the baseline);
- vLLM (the CPU build here, started by this script) at the same concurrencies, unless
  ``--skip-vllm`` or no vLLM python is found (then the JSON says why).

Every system gets the same requests: ``--num-requests`` prompts of varied lengths, each
sampling ``--max-tokens`` tokens at temperature 1 with a per-request seed. The tiny random model
may emit EOS early, so the servers get ``ignore_eos`` where they support it and throughput
always counts the tokens actually generated. The claim checked: continuous batching at
concurrency 32 is >= 4x the sequential loop (``ratios``).

    python benchmarks/inference.py [--model-dir DIR] [--num-requests 64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrl.inference.client import InferenceRequestError, PolicyClient
from agentrl.types import SamplingParams

CONCURRENCY = (1, 8, 32, 64)


def make_requests(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(8, 64))] for _ in range(n)]


async def run_server(
    base_url: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    extra_body: dict[str, Any] | None,
) -> dict[str, float]:
    """Send every prompt with at most ``concurrency`` in flight; tokens/s over the wall time."""
    sem = asyncio.Semaphore(concurrency)
    async with PolicyClient(base_url, timeout_s=3600) as client:
        # Warm-up (first-request costs, model name, backend detection) outside the timing.
        await client.generate(prompts[0], SamplingParams(max_tokens=2))

        async def one(i: int, prompt: list[int]) -> int:
            async with sem:
                gen = await client.generate(
                    prompt,
                    SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i),
                    extra_body=extra_body,
                )
                return len(gen.token_ids)

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    return {
        "tokens_per_s": sum(counts) / wall,
        "generated_tokens": float(sum(counts)),
        "wall_s": wall,
        "load_avg_1m": os.getloadavg()[0],  # a shared machine skews ratios; this says how much
    }


def run_hf_sequential(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    total = 0
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=True)  # warm-up
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            torch.manual_seed(i)
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,  # same token count as the servers' ignore_eos
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                eos_token_id=eos,
                pad_token_id=eos,
            )
            total += out.shape[1] - len(prompt)
        wall = time.perf_counter() - start
    return {
        "tokens_per_s": total / wall,
        "generated_tokens": float(total),
        "wall_s": wall,
        "load_avg_1m": os.getloadavg()[0],
    }


async def bench_server(
    base_url: str, prompts: list[list[int]], max_tokens: int, extra_body: dict | None
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    if extra_body:
        try:
            async with PolicyClient(base_url) as client:
                await client.generate(
                    prompts[0], SamplingParams(max_tokens=1), extra_body=extra_body
                )
        except InferenceRequestError as exc:
            # The server does not take these fields: run without (counts stay exact).
            results["extra_body_rejected"] = exc.message
            extra_body = None
    results["extra_body"] = extra_body
    for c in CONCURRENCY:
        results[f"concurrency_{c}"] = await run_server(base_url, prompts, max_tokens, c, extra_body)
        print(f"  c={c}: {results[f'concurrency_{c}']}", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: a tiny model")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument(
        "--vllm-python", default=None, help="default: AGENTRL_VLLM_PYTHON/.venv-vllm"
    )
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))
    model_dir = args.model_dir
    if model_dir is None:
        from agentrl.inference.tiny_model import build_tiny_model

        model_dir = build_tiny_model(tmp / "tiny-model", seed=0)
    prompts = make_requests(args.num_requests)
    report: dict[str, Any] = {
        "benchmark": "inference_throughput",
        "model_dir": str(model_dir),
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_start": os.getloadavg()[0],
    }

    print("transformers sequential loop ...", file=sys.stderr, flush=True)
    report["hf_generate_sequential"] = run_hf_sequential(model_dir, prompts, args.max_tokens)
    print(f"  {report['hf_generate_sequential']}", file=sys.stderr, flush=True)

    if not args.skip_embedded:
        from agentrl.inference.server import launch_embedded_server

        print("embedded server ...", file=sys.stderr, flush=True)
        with launch_embedded_server(model_dir, log_path=tmp / "embedded.log") as handle:
            report["embedded"] = asyncio.run(
                bench_server(handle.base_url, prompts, args.max_tokens, {"ignore_eos": True})
            )

    if not args.skip_vllm:
        from agentrl.inference.vllm_backend import (
            VLLMNotAvailableError,
            launch_vllm_server,
            resolve_vllm_python,
        )

        try:
            python = resolve_vllm_python(args.vllm_python)
        except VLLMNotAvailableError as exc:
            report["vllm"] = {"skipped": str(exc)}
        else:
            print("vLLM ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            with launch_vllm_server(
                model_dir, python=python, log_path=tmp / "vllm.log", dtype="float32"
            ) as handle:
                startup = time.perf_counter() - t0
                report["vllm"] = asyncio.run(
                    bench_server(handle.base_url, prompts, args.max_tokens, {"ignore_eos": True})
                )
                report["vllm"]["startup_s"] = startup

    base = report["hf_generate_sequential"]["tokens_per_s"]
    ratios: dict[str, float] = {}
    for system in ("embedded", "vllm"):
        for c in CONCURRENCY:
            entry = report.get(system, {}).get(f"concurrency_{c}")
            if entry:
                ratios[f"{system}_c{c}_over_hf_sequential"] = entry["tokens_per_s"] / base
    report["ratios"] = ratios
    if "embedded_c32_over_hf_sequential" in ratios:
        report["target_embedded_c32_ge_4x"] = ratios["embedded_c32_over_hf_sequential"] >= 4.0
    print(json.dumps(report, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)  # kept only when the run failed (server logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
