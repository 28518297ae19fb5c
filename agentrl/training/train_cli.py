"""``agentrl train CONFIG [key=value ...] [--resume]``: one experiment, tracked in MLflow.

What the command guarantees a user reading its output (a terminal or a log file):

- a config mistake prints ``error: ...`` and exits 2 before anything starts;
- Ctrl-C prints one line (what was saved, the exact command that resumes) and exits 130,
  no traceback;
- the printed summary lists the run's drops and errors by reason, and the exit status is 1
  when more than ``trainer.max_failed_episode_share`` of the episodes failed (a reward, an
  agent or a worker raised): a run that mostly failed never exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.config import ConfigError, ExperimentConfig, load_config
from agentrl.training.run_log import add_log_level_argument
from agentrl.training.run_log import configure_logging as _configure
from agentrl.training.summary import failure_check, summary

if TYPE_CHECKING:
    from agentrl.training.resolve import Resolved

__all__ = ["add_arguments", "configure_logging", "load_and_resolve", "run", "summary"]

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130
"""The shell's status for a process ended by SIGINT (128 + 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    parser.add_argument("config", help="experiment YAML (e.g. configs/quickstart.yaml)")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. trainer.max_staleness=2"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from trainer.output_dir/checkpoint (same MLflow run, same data position)",
    )
    add_log_level_argument(parser)


def configure_logging(args: argparse.Namespace | bool) -> None:
    """Logging for a command from its ``--log-level`` / ``--quiet`` (or a bare quiet flag)."""
    if isinstance(args, bool):
        _configure("warning" if args else "info")
        return
    quiet = getattr(args, "quiet", False)
    _configure("warning" if quiet else getattr(args, "log_level", "info"))


def load_and_resolve(path: str, overrides: list[str]) -> tuple[ExperimentConfig, Resolved] | None:
    """The config and its resolution (every name, file and user import checked) before anything
    starts, the run's only one: the command hands it down. A user error prints ``error: ...``
    and returns None (exit status 2)."""
    from agentrl.inference import zygote
    from agentrl.training.resolve import ResolutionError, resolve_experiment

    try:
        cfg = load_config(path, overrides)
        if cfg.distributed.backend == "local" and cfg.inference.backend == "embedded":
            zygote.prestart()  # the servers' imports overlap the resolution (start-up)
        resolved = resolve_experiment(cfg)
    except (ConfigError, ResolutionError) as exc:
        zygote.shutdown()
        print(f"error: {exc}", file=sys.stderr)
        return None
    return cfg, resolved


def run(args: argparse.Namespace) -> int:
    """Train; the exit status says how the run ended (module docstring)."""
    configure_logging(args)
    loaded = load_and_resolve(args.config, args.overrides)  # first: it starts the zygote
    if loaded is None:
        return 2
    cfg, resolved = loaded
    from agentrl.training.errors import RunFailed
    from agentrl.training.trainer import Trainer

    try:
        result = _train(cfg, resolved, args.resume, Trainer)
    except KeyboardInterrupt:
        print(interrupted_line(cfg, args), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except RunFailed as exc:
        print(f"error: the run stopped: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        if type(exc).__name__ != "RayAuthError":  # agentrl.distributed.cluster
            raise
        print(f"error: distributed.ray_address: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary(result), indent=2), flush=True)
    failed = failure_check(result, cfg.trainer.max_failed_episode_share)
    if failed:
        print(f"error: {failed}", file=sys.stderr)
        return 1
    return 0


def resume_command(args: argparse.Namespace) -> str:
    """The exact command line that continues this run (``--resume`` added once)."""
    words = ["agentrl", "train", args.config, *args.overrides]
    if getattr(args, "log_level", "info") != "info":
        words += ["--log-level", args.log_level]
    if getattr(args, "quiet", False):
        words.append("--quiet")
    return shlex.join([*words, "--resume"])


def interrupted_line(cfg: Any, args: argparse.Namespace) -> str:
    """What Ctrl-C prints: the checkpoint that holds the run (its step), and how to go on."""
    from agentrl.training.state import STATE_FILE

    ckpt = Path(cfg.trainer.output_dir) / "checkpoint"
    state = ckpt / STATE_FILE
    if not state.exists():
        return (
            f"interrupted: no checkpoint was saved yet (trainer.save_every="
            f"{cfg.trainer.save_every}); rerun to start over: "
            f"{shlex.join(['agentrl', 'train', args.config, *args.overrides])}"
        )
    step = json.loads(state.read_text()).get("step", "?")
    return f"interrupted: checkpoint {ckpt} holds step {step}; resume with: {resume_command(args)}"


def _train(cfg: ExperimentConfig, resolved: Resolved, resume: bool, trainer_cls: Any) -> Any:
    """The run, in this process or on Ray, with the command's resolution (not redone)."""
    if cfg.distributed.backend == "ray":
        from agentrl.distributed.ray_backend import run_with_ray

        return run_with_ray(cfg, resolved=resolved, resume=resume)
    return trainer_cls(cfg, resolved=resolved, resume=resume).run_sync()
