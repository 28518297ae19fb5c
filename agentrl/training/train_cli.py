"""``agentrl train CONFIG [key=value ...] [--resume]``: one experiment, tracked in MLflow."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from agentrl.config import ConfigError, load_config

__all__ = ["add_arguments", "configure_logging", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML (e.g. configs/quickstart.yaml)")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. trainer.max_staleness=2"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from trainer.output_dir/checkpoint (same MLflow run, same data position)",
    )
    parser.add_argument("--quiet", action="store_true", help="log warnings only")


def configure_logging(quiet: bool) -> None:
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run(args: argparse.Namespace) -> int:
    from agentrl.training.trainer import Trainer

    configure_logging(args.quiet)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.distributed.backend == "ray":
        from agentrl.distributed.ray_backend import run_with_ray

        result = run_with_ray(cfg, resume=args.resume)
    else:
        result = Trainer(cfg, resume=args.resume).run_sync()
    summary = {
        "steps": result.steps,
        "version": result.version,
        "val_before": result.val_before,
        "val_after": result.val_after,
        "wall_time_s": round(result.wall_time_s, 1),
        "output_dir": result.output_dir,
        "mlflow": result.run_location,
    }
    print(json.dumps(summary, indent=2))
    return 0
