"""``agentrl train CONFIG [key=value ...] [--resume]``: one experiment, tracked in MLflow."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from agentrl.config import ConfigError, load_config

__all__ = ["add_arguments", "configure_logging", "load_and_resolve", "run", "summary"]


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


def load_and_resolve(path: str, overrides: list[str]) -> Any:
    """The config, loaded and resolved (every name, file and user import checked) before
    anything starts; a user error prints ``error: ...`` and returns None (exit status 2)."""
    from agentrl.training.resolve import ResolutionError, resolve_experiment

    try:
        cfg = load_config(path, overrides)
        resolve_experiment(cfg)
    except (ConfigError, ResolutionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    return cfg


def run(args: argparse.Namespace) -> int:
    from agentrl.training.loop import RunFailed
    from agentrl.training.trainer import Trainer

    configure_logging(args.quiet)
    cfg = load_and_resolve(args.config, args.overrides)
    if cfg is None:
        return 2
    try:
        result = _train(cfg, args.resume, Trainer)
    except RunFailed as exc:
        print(f"error: the run stopped: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        if type(exc).__name__ != "RayAuthError":  # agentrl.distributed.cluster
            raise
        print(f"error: distributed.ray_address: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary(result), indent=2))
    return 0


def summary(result: Any) -> dict[str, Any]:
    """What ``agentrl train`` prints: steps, validation, weight pushes, where the run is."""
    diffs = [d for _, d in result.history.get("weight_sync/verify_max_abs_diff", [])]
    failed = [f for _, f in result.history.get("weight_sync/failed_servers", [])]
    return {
        "steps": result.steps,
        "version": result.version,
        "val_before": result.val_before,
        "val_after": result.val_after,
        "weight_pushes": {
            "verified": len(diffs),
            "failed_servers": sum(failed),
            "max_abs_diff": max(diffs) if diffs else None,
        },
        "wall_time_s": round(result.wall_time_s, 1),
        "output_dir": result.output_dir,
        "mlflow": result.run_location,
    }


def _train(cfg: Any, resume: bool, trainer_cls: Any) -> Any:
    if cfg.distributed.backend == "ray":
        from agentrl.distributed.ray_backend import run_with_ray

        return run_with_ray(cfg, resume=resume)
    return trainer_cls(cfg, resume=resume).run_sync()
