"""``agentrl eval CONFIG --checkpoint DIR``: held-out accuracy of a saved model."""

from __future__ import annotations

import argparse
import asyncio
import json

from agentrl.training.train_cli import configure_logging, load_and_resolve

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML (its data/agent/reward/inference sections)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides")
    parser.add_argument(
        "--checkpoint", required=True, help="a Hugging Face model directory (e.g. final_model)"
    )


def run(args: argparse.Namespace) -> int:
    from agentrl.training.trainer import evaluate_checkpoint

    configure_logging(True)
    cfg = load_and_resolve(args.config, [*args.overrides, f"model.path={args.checkpoint}"])
    if cfg is None:
        return 2
    metrics = asyncio.run(evaluate_checkpoint(cfg))
    print(json.dumps(metrics, indent=2))
    return 0
