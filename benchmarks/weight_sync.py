"""Weight-sync latency: CheckpointEngine pushes vs model size, server count and transport; JSON.

For each model size (tiny-model-builder Qwen2 models, about 1M to 100M parameters, fp32) this
starts embedded servers as subprocesses (once per size, reused for 1, 2 and 4 servers as
subsets) and times full pushes (pause -> transfer -> reset prefix cache -> set version ->
resume, then the verify probe against a ``transformers`` forward pass of the same weights) with
each transport:

- ``shared_dir``: safetensors written once to tmpfs (``/dev/shm``), each server loads the file;
- ``http``: the safetensors bytes POSTed to each server.

The baseline, measured in the same run on the same bytes and interleaved with the pushes
(copy, push, copy, push, ...; the machine's load moves both alike): a plain file copy
(``shutil.copyfile``) of the staged safetensors file on the same tmpfs. Each row reports
``push_s`` (the whole push, verify included), ``verify_s`` (the probe part),
``push_without_verify_s`` (stage + every server's pause..resume), ``bytes_per_s`` = model
bytes x servers / ``push_without_verify_s`` and ``vs_file_copy`` = the median over the pairs of
(servers x copy time / push time), i.e. that rate over the copy's (1.0 would mean a push to
every server costs as little as copying the bytes once per server; ``vs_file_copy_min`` /
``_max`` give the spread), and ``timing_s`` the median of each stage of the push (stage,
pause, transfer, verify, resume; ``PushReport.metrics``). Times are medians over ``--repeats``
pushes; every push must succeed (verify included), else the row says which server failed.

    python benchmarks/weight_sync.py [--sizes 1M,10M,100M] [--servers 1,2,4] [--repeats 2]
        [--no-verify]

Memory: 4 servers on the 100M model hold 4 x 0.4 GB of weights, plus a transient copy per
server while loading (about 4 GB peak in all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from agentrl.inference.client import PolicyClient
from agentrl.inference.handle import ServerHandle
from agentrl.inference.server import launch_embedded_server
from agentrl.inference.tiny_model import build_tiny_model
from agentrl.training.checkpoint_engine import (
    CheckpointEngine,
    HttpStreamTransport,
    SharedDirTransport,
    WeightTransport,
)

SIZES: dict[str, dict[str, int]] = {
    "1M": dict(hidden_size=128, num_layers=4, intermediate_size=512, num_heads=4, num_kv_heads=2),
    "10M": dict(hidden_size=256, num_layers=8, intermediate_size=1280, num_heads=8, num_kv_heads=4),
    "30M": dict(
        hidden_size=512, num_layers=8, intermediate_size=2048, num_heads=16, num_kv_heads=8
    ),
    "100M": dict(
        hidden_size=1024, num_layers=8, intermediate_size=3072, num_heads=32, num_kv_heads=8
    ),
}
"""Model shapes by approximate parameter count (head_dim 32, untied embeddings, vocab 263)."""

TRANSPORTS = ("shared_dir", "http")


def log(msg: str) -> None:
    print(f"[weight_sync {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def launch_servers(model_dir: Path, n: int, log_dir: Path) -> list[ServerHandle]:
    """Start ``n`` embedded servers concurrently; stop the started ones if any fails."""

    def one(i: int) -> ServerHandle:
        return launch_embedded_server(
            model_dir,
            log_path=log_dir / f"server{i}.log",
            extra_args=["--max-batch-size", "4"],
            startup_timeout_s=900,
        )

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
    handles = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for h in handles:
            h.stop()
        raise errors[0]  # type: ignore[misc] - a ServerStartError with the server's log tail
    return handles


def file_copy_seconds(src: Path) -> float:
    """Seconds of one ``shutil.copyfile`` of ``src`` next to it (same filesystem)."""
    dst = src.parent.parent / ".copy-baseline.safetensors"
    try:
        t0 = time.perf_counter()
        shutil.copyfile(src, dst)
        return time.perf_counter() - t0
    finally:
        dst.unlink(missing_ok=True)


def file_copy_bytes_per_s(src: Path, repeats: int) -> float:
    """Best-of-``repeats`` bytes/s of ``shutil.copyfile`` next to ``src`` (same filesystem)."""
    return src.stat().st_size / min(file_copy_seconds(src) for _ in range(max(repeats, 3)))


def make_scorer(model_dir: Path) -> Callable[[list[int], list[int]], list[float]]:
    """The trainer side of verification: log softmax(logits / 1.0) of the probe tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def score(prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        ids = torch.tensor([prompt_ids + token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, torch.tensor(token_ids)[:, None])[:, 0].tolist()

    return score


async def bench_size(
    name: str,
    shape: dict[str, int],
    server_counts: list[int],
    repeats: int,
    verify: bool,
    work: Path,
) -> dict[str, Any]:
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    model_dir = build_tiny_model(
        work / name / "model",
        seed=0,
        hidden_size=shape["hidden_size"],
        num_layers=shape["num_layers"],
        intermediate_size=shape["intermediate_size"],
        num_heads=shape["num_heads"],
        num_kv_heads=shape["num_kv_heads"],
    )
    state = load_file(str(model_dir / "model.safetensors"))
    num_params = sum(t.numel() for t in state.values())
    log(f"{name}: built {num_params / 1e6:.1f}M parameters in {time.perf_counter() - t0:.1f}s")
    score = make_scorer(model_dir) if verify else None

    t0 = time.perf_counter()
    handles = await asyncio.to_thread(launch_servers, model_dir, max(server_counts), work / name)
    log(f"{name}: {len(handles)} servers up in {time.perf_counter() - t0:.1f}s")
    clients = [PolicyClient(h.base_url, timeout_s=1800) for h in handles]
    rows: list[dict[str, Any]] = []
    version = 0
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shared_root = Path(tempfile.mkdtemp(prefix="agentrl-bench-weights-", dir=shm_root))
    try:
        # Resolve each client's backend outside the timing (one /weight_info each).
        await asyncio.gather(*(c.weight_version() for c in clients))
        baseline = SharedDirTransport(shared_root / "baseline").stage(state, 0)
        assert baseline.path is not None
        copy_src = baseline.path / "model.safetensors"
        copy_bps = file_copy_bytes_per_s(copy_src, repeats)
        log(f"{name}: file copy {copy_bps / 1e9:.2f} GB/s")
        for kind in TRANSPORTS:
            transport: WeightTransport = (
                SharedDirTransport(shared_root / "push")
                if kind == "shared_dir"
                else HttpStreamTransport()
            )
            for n in server_counts:
                engine = CheckpointEngine(
                    clients[:n], transport, verify=verify, verify_tolerance=1e-4
                )
                pushes, stages, server_s, verify_s, diffs, failures = [], [], [], [], [], []
                ratios: list[float] = []
                timings: dict[str, list[float]] = {}
                num_bytes = 0
                for _ in range(repeats):
                    version += 1
                    copy_s = file_copy_seconds(copy_src)  # interleaved: copy, push, copy, ...
                    report = await engine.push(state, version, score=score)
                    num_bytes = report.num_bytes
                    if not report.ok:
                        failures.append(report.describe())
                        continue
                    pushes.append(report.total_seconds)
                    stages.append(report.stage_seconds)
                    server_s.append(max(s.seconds for s in report.servers.values()))
                    verify_s.append(report.verify_seconds)
                    ratios.append(n * copy_s / (report.total_seconds - report.verify_seconds))
                    for key, value in report.metrics().items():
                        if key.startswith("timing_s/push/"):
                            timings.setdefault(key.rsplit("/", 1)[1], []).append(value)
                    if report.max_abs_diff is not None:
                        diffs.append(report.max_abs_diff)
                row: dict[str, Any] = {
                    "model": name,
                    "params": num_params,
                    "bytes": num_bytes,
                    "transport": kind,
                    "servers": n,
                    "pushes_ok": len(pushes),
                    "pushes_failed": len(failures),
                }
                if failures:
                    row["failure"] = failures[0]
                if pushes:
                    push_s = statistics.median(pushes)
                    sync_s = statistics.median(p - v for p, v in zip(pushes, verify_s, strict=True))
                    bps = num_bytes * n / sync_s
                    row.update(
                        push_s=round(push_s, 4),
                        push_without_verify_s=round(sync_s, 4),
                        stage_s=round(statistics.median(stages), 4),
                        slowest_server_s=round(statistics.median(server_s), 4),
                        verify_s=round(statistics.median(verify_s), 4),
                        bytes_per_s=round(bps),
                        vs_file_copy=round(statistics.median(ratios), 4),
                        vs_file_copy_min=round(min(ratios), 4),
                        vs_file_copy_max=round(max(ratios), 4),
                        timing_s={k: round(statistics.median(v), 4) for k, v in timings.items()},
                    )
                    if diffs:
                        row["verify_max_abs_diff"] = max(diffs)
                rows.append(row)
                log(f"{name} {kind} x{n}: {row.get('push_s')}s, vs copy {row.get('vs_file_copy')}")
            if isinstance(transport, SharedDirTransport):
                transport.cleanup(keep_version=-1)
        return {"rows": rows, "file_copy_bytes_per_s": round(copy_bps)}
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
        for h in handles:
            h.stop()
        shutil.rmtree(shared_root, ignore_errors=True)
        shutil.rmtree(work / name / "model", ignore_errors=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    server_counts = [int(x) for x in args.servers.split(",")]
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {unknown}; choose from {', '.join(SIZES)}")
    work = Path(tempfile.mkdtemp(prefix="agentrl-bench-weight-sync-"))
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    copy: dict[str, int] = {}
    try:
        for name in sizes:
            out = await bench_size(
                name, SIZES[name], server_counts, args.repeats, not args.no_verify, work
            )
            rows += out["rows"]
            copy[name] = out["file_copy_bytes_per_s"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "weight_sync",
        "what": "CheckpointEngine push latency (pause, transfer, reset, version"
        + (", verify while paused" if not args.no_verify else "")
        + ", resume) to embedded servers; vs_file_copy = median over interleaved pairs of "
        "servers x file-copy seconds / push_without_verify seconds",
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "repeats": args.repeats,
        "file_copy_bytes_per_s": copy,
        "results": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="1M,10M,100M", help=f"comma list of {list(SIZES)}")
    parser.add_argument("--servers", default="1,2,4", help="server counts (subsets of the max)")
    parser.add_argument("--repeats", type=int, default=2, help="pushes per configuration")
    parser.add_argument(
        "--no-verify", action="store_true", help="skip the verify probe (transfer only)"
    )
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
