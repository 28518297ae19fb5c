"""Weight-sync latency: CheckpointEngine pushes vs model size, server count and transport; JSON.

For each model size (tiny-model-builder Qwen2 models, about 1M to 100M parameters, fp32) this
starts embedded servers as subprocesses (once per size, reused for 1, 2 and 4 servers as
subsets) and times full pushes (pause -> transfer -> reset prefix cache -> set version ->
resume, then the verify probe against a ``transformers`` forward pass of the same weights) with
each transport:

- ``shared_dir``: safetensors written once to tmpfs (``/dev/shm``), each server loads the file;
- ``http``: each server pulls the safetensors bytes from the trainer's weight server;
- ``collective``: one gloo weight group (trainer + servers), the weights broadcast in
  ``--bucket-mb`` buckets (the group is set up by an untimed warm-up push, as each transport
  gets one).

Two baselines, measured in the same run on the same bytes and interleaved with the pushes
(copy, push, copy, push, ...; the machine's load moves all alike): a memory copy of the model's
bytes into a reused buffer of the same size (``Tensor.copy_``, the floor for moving bytes on one
machine) and a plain file copy (``shutil.copyfile``) of the staged safetensors file on the same
tmpfs. Each row reports ``push_s`` (the whole push, verify included), ``verify_s`` (the probe
part), ``push_without_verify_s`` (stage + every server's pause..resume), ``bytes_per_s`` = model
bytes x servers / ``push_without_verify_s``, ``vs_memory_copy`` and ``vs_file_copy`` = the
median over the pairs of (servers x copy time / push time), i.e. that rate over the copy's (1.0
would mean a push to every server costs as little as copying the bytes once per server;
``*_min`` / ``*_max`` give the spread), and ``timing_s`` the median of each stage of the push
(stage, pause, transfer, verify, resume; ``PushReport.metrics``). Times are medians over
``--repeats`` pushes; every push must succeed (verify included), else the row says which server
failed.

    python benchmarks/weight_sync.py [--sizes 1M,10M,100M] [--servers 1,2,4] [--repeats 2]
        [--transports shared_dir,http,collective] [--bucket-mb 256] [--no-verify]
    python benchmarks/weight_sync.py --smoke   # 1M model, 1 server, 1 push per transport (CI)

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
from agentrl.weightsync.collective import CollectiveTransport
from agentrl.weightsync.engine import (
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

TRANSPORTS = ("shared_dir", "http", "collective")


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


class MemoryCopy:
    """A copy of the model's bytes (one flat buffer) into a reused buffer of the same size."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.src = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in state.values()])
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # map the pages once, as the servers' reused buffers are

    def seconds(self) -> float:
        """Seconds of one copy."""
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0


def make_transport(kind: str, shared_root: Path, bucket_mb: float) -> WeightTransport:
    """The transport named ``kind`` (the collective one on gloo: CPU servers)."""
    if kind == "shared_dir":
        return SharedDirTransport(shared_root / "push")
    if kind == "http":
        return HttpStreamTransport()
    return CollectiveTransport(bucket_mb=bucket_mb, backend="gloo", timeout_s=300)


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


def _ratios(n: int, copy_s: list[float], sync_s: list[float]) -> dict[str, float]:
    """Median, min and max over interleaved pairs of ``n`` x copy seconds / push seconds."""
    ratios = [n * c / p for c, p in zip(copy_s, sync_s, strict=True)]
    return {
        "": round(statistics.median(ratios), 4),
        "_min": round(min(ratios), 4),
        "_max": round(max(ratios), 4),
    }


async def bench_config(
    engine: CheckpointEngine,
    n: int,
    state: dict[str, torch.Tensor],
    versions: list[int],
    score: Callable[[list[int], list[int]], list[float]] | None,
    copy_src: Path,
    memory: MemoryCopy,
) -> dict[str, Any]:
    """Time one (transport, server count): a warm-up push, then memory copy, file copy and push,
    interleaved, once per version in ``versions``."""
    versions[0] += 1
    warmup = await engine.push(state, versions[0], score=score)  # e.g. sets up the weight group
    pushes, failures = [], [] if warmup.ok else [warmup.describe()]
    mem_s, file_s = [], []
    for _ in range(versions[1]):
        versions[0] += 1
        mem_s.append(memory.seconds())
        file_s.append(file_copy_seconds(copy_src))
        report = await engine.push(state, versions[0], score=score)
        if report.ok:
            pushes.append(report)
        else:
            failures.append(report.describe())
            mem_s.pop()
            file_s.pop()
    row: dict[str, Any] = {
        "bytes": warmup.num_bytes,
        "servers": n,
        "pushes_ok": len(pushes),
        "pushes_failed": len(failures),
    }
    if failures:
        row["failure"] = failures[0]
    if not pushes:
        return row
    sync = [r.total_seconds - r.verify_seconds for r in pushes]
    timings = {
        k.rsplit("/", 1)[1]: round(statistics.median(r.metrics()[k] for r in pushes), 4)
        for k in pushes[0].metrics()
        if k.startswith("timing_s/push/")
    }
    row.update(
        push_s=round(statistics.median(r.total_seconds for r in pushes), 4),
        push_without_verify_s=round(statistics.median(sync), 4),
        stage_s=round(statistics.median(r.stage_seconds for r in pushes), 4),
        verify_s=round(statistics.median(r.verify_seconds for r in pushes), 4),
        bytes_per_s=round(warmup.num_bytes * n / statistics.median(sync)),
        memory_copy_bytes_per_s=round(warmup.num_bytes / statistics.median(mem_s)),
        timing_s=timings,
    )
    row.update({f"vs_memory_copy{k}": v for k, v in _ratios(n, mem_s, sync).items()})
    row.update({f"vs_file_copy{k}": v for k, v in _ratios(n, file_s, sync).items()})
    diffs = [r.max_abs_diff for r in pushes if r.max_abs_diff is not None]
    if diffs:
        row["verify_max_abs_diff"] = max(diffs)
    return row


def build_model(name: str, shape: dict[str, int], work: Path) -> tuple[Path, dict[str, Any]]:
    """The tiny-model-builder Qwen2 of ``shape`` and its state dict."""
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
    return model_dir, state


async def bench_size(
    name: str, shape: dict[str, int], args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    """Every transport x server count on one model size (servers started once)."""
    server_counts = [int(x) for x in args.servers.split(",")]
    model_dir, state = build_model(name, shape, work)
    num_params = sum(t.numel() for t in state.values())
    score = make_scorer(model_dir) if not args.no_verify else None
    t0 = time.perf_counter()
    handles = await asyncio.to_thread(launch_servers, model_dir, max(server_counts), work / name)
    log(f"{name}: {len(handles)} servers up in {time.perf_counter() - t0:.1f}s")
    clients = [PolicyClient(h.base_url, timeout_s=1800) for h in handles]
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shared_root = Path(tempfile.mkdtemp(prefix="agentrl-bench-weights-", dir=shm_root))
    rows: list[dict[str, Any]] = []
    versions = [0, args.repeats]  # [the last version pushed, pushes per configuration]
    try:
        await asyncio.gather(*(c.weight_version() for c in clients))  # resolve backends
        baseline = SharedDirTransport(shared_root / "baseline").stage(state, 0)
        assert baseline.path is not None
        copy_src = baseline.path / "model.safetensors"
        memory = MemoryCopy(state)
        copy_bps = file_copy_bytes_per_s(copy_src, args.repeats)
        log(f"{name}: file copy {copy_bps / 1e9:.2f} GB/s")
        for kind in args.transports.split(","):
            transport = make_transport(kind, shared_root, args.bucket_mb)
            for n in server_counts:
                engine = CheckpointEngine(clients[:n], transport, verify=score is not None)
                row = await bench_config(engine, n, state, versions, score, copy_src, memory)
                rows.append({"model": name, "params": num_params, "transport": kind, **row})
                log(
                    f"{name} {kind} x{n}: {row.get('push_s')}s, vs memory copy "
                    f"{row.get('vs_memory_copy')}, vs file copy {row.get('vs_file_copy')}"
                )
            if isinstance(transport, CollectiveTransport):
                transport.close()
        return {"rows": rows, "file_copy_bytes_per_s": round(copy_bps)}
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
        for h in handles:
            h.stop()
        shutil.rmtree(shared_root, ignore_errors=True)
        shutil.rmtree(work / name / "model", ignore_errors=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {unknown}; choose from {', '.join(SIZES)}")
    bad = [t for t in args.transports.split(",") if t not in TRANSPORTS]
    if bad:
        raise SystemExit(f"--transports: unknown {bad}; choose from {', '.join(TRANSPORTS)}")
    work = Path(tempfile.mkdtemp(prefix="agentrl-bench-weight-sync-"))
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    copy: dict[str, int] = {}
    try:
        for name in sizes:
            out = await bench_size(name, SIZES[name], args, work)
            rows += out["rows"]
            copy[name] = out["file_copy_bytes_per_s"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "weight_sync",
        "what": "CheckpointEngine push latency (pause, transfer, reset, version"
        + (", verify while paused" if not args.no_verify else "")
        + ", resume) to embedded servers; vs_memory_copy / vs_file_copy = median over "
        "interleaved pairs of servers x copy seconds / push_without_verify seconds",
        "bucket_mb": args.bucket_mb,
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
        "--transports", default=",".join(TRANSPORTS), help=f"comma list of {list(TRANSPORTS)}"
    )
    parser.add_argument(
        "--bucket-mb", type=float, default=256.0, help="the collective transport's bucket size"
    )
    parser.add_argument(
        "--no-verify", action="store_true", help="skip the verify probe (transfer only)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="1M model, 1 server, 1 timed push per transport, one thread everywhere (CI)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.servers, args.repeats = "1M", "1", 1
        os.environ["OMP_NUM_THREADS"] = "1"  # the servers inherit it
        torch.set_num_threads(1)
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
