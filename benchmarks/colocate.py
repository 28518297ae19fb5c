"""Colocated vs side-by-side training, measured: peak resident memory of the whole run and wall time.

Each run is ``agentrl train configs/quickstart.yaml`` (a subprocess, as a user runs it) on a
random Qwen2 built by the project's tiny-model code (``build_tiny_model``), made wide enough that
the weights dominate (``MODEL``: ~67 M parameters, ~270 MB in float32). While it runs, the resident memory of the
whole process tree (the trainer, its embedded server, any helper) is summed every
``--interval-s`` from ``/proc``; the run's peak of that sum is ``peak_rss_mb``. The two modes
run in the order A, B, A, B (``--rounds``), so a slow stretch of a shared machine hits both.

- ``side_by_side``: the default: the server holds its weights, the last verified copy and the
  staging buffer for the whole run, while the trainer holds its weights, gradients and AdamW's
  moments;
- ``colocated``: ``distributed.colocate=true``: the server sleeps at level 2 while the trainer
  updates (weights and staging buffer released, given back to the OS with ``malloc_trim``) and
  wakes with the pushed version.

Per mode: ``peak_rss_mb`` (median over rounds, and each round's), the peaks of its parts
(``trainer_peak_rss_mb``: the ``agentrl train`` process; ``servers_peak_rss_mb``: its children,
the embedded server, summed; the parts need not peak together; ``*_at_peak_mb``: what each part
held at the moment of the whole run's peak), ``wall_s`` (the whole command,
start-up included), ``step_s`` (median step time after the first), and for colocated runs
``freed_mb`` (what the server released per sleep) and ``server_rss_asleep_mb``. ``ratios``:
colocated / side by side.

Usage: ``python benchmarks/colocate.py [--rounds 2] [--steps 3]``; prints JSON. ``--smoke``: one
round of one step each on the default tiny model (the code path; numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cli_runs import median_after_first, mlflow_metrics  # noqa: E402

MODEL: dict[str, Any] = dict(
    num_layers=6, hidden_size=1024, num_heads=8, num_kv_heads=2, intermediate_size=2816
)
"""~67 M parameters: the weights (not the libraries) dominate each process's memory."""
MODES = {"side_by_side": [], "colocated": ["distributed.colocate=true"]}
PAGE = os.sysconf("SC_PAGE_SIZE")


def _children() -> dict[int, list[int]]:
    """``{ppid: [pid, ...]}`` over every process (Linux ``/proc``)."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def tree_rss_bytes(root: int) -> tuple[int, int]:
    """Resident bytes of ``root`` alone and of all its descendants summed (the servers)."""
    kids, todo = _children(), [root]
    own = rest = 0
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * PAGE
        except OSError:
            continue
        if pid == root:
            own = rss
        else:
            rest += rss
    return own, rest


def _sample(proc: subprocess.Popen[str], interval_s: float, peak: dict[str, int]) -> None:
    """Keep the peaks of the sum, of the trainer process and of its children, until it ends."""
    while proc.poll() is None:
        own, rest = tree_rss_bytes(proc.pid)
        if own + rest > peak["sum"]:  # which part held what at the moment of the peak
            peak["sum"], peak["trainer_at_peak"], peak["servers_at_peak"] = own + rest, own, rest
        peak["trainer"] = max(peak["trainer"], own)
        peak["servers"] = max(peak["servers"], rest)
        time.sleep(interval_s)


def run_once(mode: str, args: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    """One ``agentrl train`` in ``mode`` on ``model``; its peak tree RSS, wall time and step
    metrics."""
    overrides = [
        f"model.path={model}",
        f"trainer.output_dir={out}",
        "tracking.enabled=true",
        f"trainer.total_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.val_at_end=false",
        "trainer.save_every=0",
        "data.batch_size=2",
        "data.n_samples=2",
        "trainer.mini_batch_size=2",
        # one episode per forward: the trainer's activation peak then hardly depends on the
        # sampled lengths, so the two modes compare at equal trainer memory
        "trainer.micro_batch_max_tokens=1024",
        "inference.num_servers=1",
        "agent.max_turns=2",
        "agent.max_response_tokens=64",
        "inference.max_tokens_per_turn=32",
        "checkpoint.transport=http",  # no tmpfs file: every byte is in some process's RSS
        *MODES[mode],
    ]
    cmd = [sys.executable, "-m", "agentrl", "train", str(ROOT / "configs" / "quickstart.yaml")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, *overrides, "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    peak = {"sum": 0, "trainer": 0, "servers": 0, "trainer_at_peak": 0, "servers_at_peak": 0}
    sampler = threading.Thread(target=_sample, args=(proc, args.interval_s, peak), daemon=True)
    sampler.start()
    _, stderr = proc.communicate(timeout=args.timeout_s)
    sampler.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    metrics = mlflow_metrics(out / "mlruns" / "mlflow.db")
    row: dict[str, Any] = {
        "peak_rss_mb": peak["sum"] / 2**20,
        "trainer_peak_rss_mb": peak["trainer"] / 2**20,
        "servers_peak_rss_mb": peak["servers"] / 2**20,
        "trainer_at_peak_mb": peak["trainer_at_peak"] / 2**20,
        "servers_at_peak_mb": peak["servers_at_peak"] / 2**20,
        "wall_s": wall,
        "step_s": median_after_first(metrics["timing_s/step"]),
    }
    if mode == "colocated":
        assert metrics["colocate/woken_servers"], "the colocated run never woke its server"
        row["freed_mb"] = max(metrics["colocate/freed_bytes"].values()) / 2**20
        asleep = metrics["colocate/server_rss_asleep_bytes"].values()
        row["server_rss_asleep_mb"] = min(asleep) / 2**20
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--interval-s", type=float, default=0.05)
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--smoke", action="store_true", help="one round of one step, default tiny model")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 1
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    shape: dict[str, Any] = {} if args.smoke else MODEL
    with tempfile.TemporaryDirectory() as tmp:
        from agentrl.inference.tiny_model import build_tiny_model

        model = build_tiny_model(Path(tmp) / "model", **shape)
        for r in range(args.rounds):
            for mode in MODES:  # A, B, A, B
                row = run_once(mode, args, model, Path(tmp) / f"{mode}-{r}")
                print(json.dumps({"round": r, "mode": mode, **row}), file=sys.stderr, flush=True)
                runs[mode].append(row)
    summary: dict[str, Any] = {}
    for mode, rows in runs.items():
        summary[mode] = {
            k: statistics.median(row[k] for row in rows) for k in rows[0] if k != "rounds"
        }
        summary[mode]["rounds"] = rows
    ratios = {
        k: summary["colocated"][k] / summary["side_by_side"][k]
        for k in ("peak_rss_mb", "trainer_peak_rss_mb", "servers_peak_rss_mb", "wall_s", "step_s")
    }
    print(
        json.dumps(
            {
                "model": shape or "default tiny",
                "steps": args.steps,
                "rounds": args.rounds,
                "cpus": len(os.sched_getaffinity(0)),
                **summary,
                "ratios": ratios,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
