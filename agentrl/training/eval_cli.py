"""``agentrl eval CONFIG --checkpoint DIR [--report FILE]``: held-out metrics of a saved model.

The same evaluation as periodic validation (``trainer.val_n`` samples per task at
``trainer.val_temperature``, verl's statistics per data source); prints the metrics and writes
the whole report (per-source statistics, per-task samples) as JSON with ``--report``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from agentrl.training.run_log import add_log_level_argument
from agentrl.training.train_cli import configure_logging, load_and_resolve

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    parser.add_argument("config", help="experiment YAML (its data/agent/reward/inference sections)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.val_n=8")
    parser.add_argument(
        "--checkpoint", required=True, help="a Hugging Face model directory (e.g. final_model)"
    )
    parser.add_argument(
        "--report",
        default=None,
        help="write the full JSON report here, and log the evaluation as an MLflow run "
        "(metrics, report, one trace per episode) unless tracking.enabled=false",
    )
    parser.add_argument(
        "--max-traces",
        type=int,
        default=100,
        help="episodes written as MLflow traces with --report (default 100; 0 = none)",
    )
    add_log_level_argument(parser, default="warning")


def run(args: argparse.Namespace) -> int:
    """Evaluate; exit status 2 on a config mistake (nothing started)."""
    from agentrl.training.trainer import evaluate_checkpoint

    configure_logging(args)
    loaded = load_and_resolve(args.config, [*args.overrides, f"model.path={args.checkpoint}"])
    if loaded is None:
        return 2
    cfg, resolved = loaded
    trajs: list[Any] = []
    report = asyncio.run(evaluate_checkpoint(cfg, keep=trajs, resolved=resolved))
    if args.report:
        Path(args.report).write_text(report.to_json())
        _track(cfg, args.checkpoint, report, trajs[: max(args.max_traces, 0)])
    print(json.dumps(report.metrics, indent=2))
    return 0


def _track(cfg: Any, checkpoint: str, report: Any, trajs: list[Any]) -> None:
    """Log the evaluation as its own MLflow run: metrics, the report and episode traces."""
    from agentrl.tracking import tracker_for

    tracker = tracker_for(cfg, run_name=f"eval {Path(checkpoint).name}")
    try:
        tracker.log_params({"eval.checkpoint": str(Path(checkpoint).resolve())})
        report.log(tracker, step=0)
        n = tracker.log_traces(trajs, step=0, **{"agentrl.phase": "eval"})
        tracker.finish()
    except BaseException:
        tracker.finish("FAILED")
        raise
    if tracker.location:
        print(f"evaluation logged to {tracker.location} ({n} episode traces)")
