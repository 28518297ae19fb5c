"""GPU smoke run: a ~0.5B random Qwen2 trains a few async steps against an embedded server on the
same GPU; prints tokens/s (generation and training), the train step's MFU, push latency and the
verify difference, as JSON.

Prepared to run in ≤ 8 minutes on one accelerator (``python benchmarks/gpu_smoke.py``); on a
machine without one, ``--size tiny --device cpu`` runs the same path in seconds (CI does, so the
script cannot rot). The model is built by the project's own builder (no download); the run goes
through the public ``Trainer`` with the quickstart's task and agent.

What each figure is:

- ``generation_tokens_per_s``: sampled tokens / seconds of 32 concurrent single-turn requests to
  the embedded server (before training, so nothing else runs on the device);
- ``train_tokens_per_s``: (prompt + response) tokens of a step / ``timing_s/update_actor``;
- ``train_mfu``: 6 · parameters · trained tokens / update time / the device's peak bf16 FLOP/s
  (``--peak-tflops``; default 989, an H100/H200 SXM's dense bf16);
- ``push_s`` and ``verify_max_abs_diff``: the CheckpointEngine's figures of the last step;
  ``push_gb_per_s``: the pushed bytes (parameters x bytes per element of the serving dtype) / ``push_s``;
- ``peak_rss_mb``: this process's peak resident memory (trainer, embedded server and driver
  share it); ``peak_device_mb``: the torch allocator's peak on CUDA (null on CPU).

It fails loudly (exit status 1, ``"ok": false`` and the reasons in ``failures``) when a step is
missing, the verify difference is absent or above the tolerance, or a rate is not positive.
``--gradient-checkpointing`` and ``--cpu-offload`` run the same check with
``trainer.gradient_checkpointing`` / ``trainer.cpu_offload`` (the latter trains through the
FSDP2 rank path with one rank). The steps are colocated (``distributed.colocate``: the server
sleeps at level 2 while the trainer updates and wakes with each verified push; ``colocated_steps``
counts the steps that slept and woke, and a step that did not is a failure);
``--no-colocate`` runs them side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SIZES: dict[str, dict[str, Any]] = {
    # ~0.49B parameters (Qwen2-0.5B's shape; byte-level vocabulary, tied embeddings)
    "0.5b": dict(
        num_layers=24, hidden_size=896, num_heads=14, num_kv_heads=2, intermediate_size=4864
    ),
    "tiny": dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256),
}


def _build(size: str, out: Path) -> tuple[Path, int]:
    """The model directory and its parameter count (tied embeddings counted once)."""
    from safetensors.torch import load_file

    from agentrl.inference.tiny_model import build_tiny_model

    path = build_tiny_model(out / f"qwen2-{size}", tie_embeddings=True, **SIZES[size])
    params = sum(t.numel() for t in load_file(str(path / "model.safetensors")).values())
    return path, params


async def _generation_rate(policy: object, concurrency: int, max_tokens: int) -> float:
    """Sampled tokens per second of ``concurrency`` single-turn requests through ``policy``."""
    from agentrl.types import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    t0 = time.perf_counter()
    gens = await asyncio.gather(
        *(policy.generate([1, 2, 3, 4 + i % 50], sampling) for i in range(concurrency))  # type: ignore[attr-defined]
    )
    return sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--out", default=None, help="working directory (default: a temp dir)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--cpu-offload", action="store_true", help="trainer.cpu_offload")
    parser.add_argument(
        "--colocate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="distributed.colocate",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out or tempfile.mkdtemp(prefix="agentrl-gpu-smoke-"))
    t_all = time.perf_counter()
    path, params = _build(args.size, out)
    result, rate = _run(args, path, out)
    h = result.history

    def last(key: str) -> float | None:
        values = h.get(key) or []
        return float(values[-1][1]) if values else None

    update_s = last("timing_s/update_actor") or float("nan")
    tokens = last("perf/total_num_tokens") or 0.0
    cuda = args.device.startswith("cuda")
    push_s = last("timing_s/push")
    pushed_bytes = params * (2 if cuda else 4)  # bf16 on the accelerator, float32 on CPU
    report = {
        "device": args.device,
        "size": args.size,
        "parameters": params,
        "steps": result.steps,
        "generation_tokens_per_s": round(rate, 1),
        "train_tokens_per_s": round(tokens / update_s, 1),
        "train_mfu": 6 * params * tokens / update_s / (args.peak_tflops * 1e12),
        "push_s": push_s,
        "push_gb_per_s": round(pushed_bytes / push_s / 1e9, 3) if push_s else None,
        "verify_max_abs_diff": last("weight_sync/verify_max_abs_diff"),
        "reward_mean_last": last("reward/mean"),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_device_mb": _peak_device_mb(cuda),
        "gradient_checkpointing": args.gradient_checkpointing,
        "cpu_offload": args.cpu_offload,
        "colocate": args.colocate,
        "colocated_steps": sum(
            1
            for (_, slept), (_, woken) in zip(
                h.get("colocate/slept_servers", []),
                h.get("colocate/woken_servers", []),
                strict=False,
            )
            if slept == woken == 1.0
        ),
        "wall_s": round(time.perf_counter() - t_all, 1),
    }
    failures = _failures(report, args.steps, _tolerance(cuda))
    if args.colocate and report["colocated_steps"] != args.steps:
        failures.append(
            f"colocated_steps={report['colocated_steps']}: a step did not sleep and wake"
        )
    report["ok"] = not failures
    report["failures"] = failures
    print(json.dumps(report, indent=2))
    return 0 if not failures else 1


def _tolerance(cuda: bool) -> float:
    """The verify tolerance: bf16 serving vs bf16 training differ by rounding (docs/design.md)."""
    return 0.1 if cuda else 1e-3


def _peak_device_mb(cuda: bool) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None


def _failures(report: dict, steps: int, tolerance: float) -> list[str]:  # type: ignore[type-arg]
    """Why the check failed (empty when it passed)."""
    out = []
    if report["steps"] != steps:
        out.append(f"ran {report['steps']} steps, expected {steps}")
    diff = report["verify_max_abs_diff"]
    if diff is None or not diff <= tolerance:
        out.append(f"verify_max_abs_diff={diff} (tolerance {tolerance}): served != trained")
    for key in ("generation_tokens_per_s", "train_tokens_per_s", "push_gb_per_s"):
        if not (report[key] or 0) > 0:
            out.append(f"{key}={report[key]}: not measured")
    return out


def _run(args: argparse.Namespace, path: Path, out: Path):  # type: ignore[no-untyped-def]
    from agentrl.config import load_config
    from agentrl.training.trainer import Trainer

    cuda = args.device.startswith("cuda")
    cfg = load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            f"model.path={path}",
            f"model.dtype={'bfloat16' if cuda else 'float32'}",
            f"trainer.device={'cuda' if cuda else 'cpu'}",
            f"inference.device={'cuda' if cuda else 'cpu'}",
            f"trainer.output_dir={out / 'run'}",
            f"trainer.total_steps={args.steps}",
            "trainer.val_before_train=false",
            "trainer.val_at_end=false",
            "inference.num_servers=1",
            "data.max_prompt_tokens=2048",
            "tracking.enabled=false",
            # bf16 serving vs bf16 training differ by rounding; the diff is reported either way
            f"checkpoint.verify_tolerance={_tolerance(cuda)}",
            f"trainer.gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
            f"trainer.cpu_offload={str(args.cpu_offload).lower()}",
            f"distributed.colocate={str(args.colocate).lower()}",
        ],
    )
    trainer = Trainer(cfg)
    rate = {"value": 0.0}
    original = trainer._push

    async def push_and_measure(version: int):  # type: ignore[no-untyped-def]
        report = await original(version)
        if version == 0 and trainer.run_obj is not None:  # the servers are up, nothing else runs
            # the run's own pool: it holds the servers' bearer key
            rate["value"] = await _generation_rate(trainer.run_obj.pool, 32, 64)
        return report

    trainer._push = push_and_measure  # type: ignore[method-assign]
    result = trainer.run_sync()
    return result, rate["value"]


if __name__ == "__main__":
    sys.exit(main())
