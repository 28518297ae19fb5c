"""``make quickstart``: watch a tiny model learn to use a calculator tool, on a CPU, in minutes.

Steps (each printed as it happens):

1. Warm start: the tiny model (built on the spot) gets two ``agentrl sft`` stages
   (``configs/sft_calculator_tool.yaml``: learn to call the calculator and copy;
   ``configs/sft_calculator.yaml``: mix in wrong guesses, for an imperfect start), about
   1.5 minutes on 2 idle cores. Each runs as its own ``agentrl sft`` process (the command is
   printed), so its torch threads, seeds and MLflow run never leak into the RL stage.
   ``--shipped-warm-start`` skips them and uses the committed output of the same two commands,
   ``checkpoints/calculator-sft`` (see its ``sft_manifest.json``).
2. Async GRPO (``configs/quickstart.yaml``: max_staleness 2 after a 6-step staleness warmup,
   bypass-mode PPO clip) against two embedded inference servers, with a verified weight push
   after every step.
3. Held-out accuracy before and after, and where the MLflow run is.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIPPED_CHECKPOINT = REPO / "checkpoints" / "calculator-sft"
SFT_STAGE1_CONFIG = REPO / "configs" / "sft_calculator_tool.yaml"
SFT_CONFIG = REPO / "configs" / "sft_calculator.yaml"
RL_CONFIG = REPO / "configs" / "quickstart.yaml"


def _say(msg: str) -> None:
    print(f"[quickstart] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentrl.quickstart", description=__doc__)
    parser.add_argument("overrides", nargs="*", help="dotted overrides for configs/quickstart.yaml")
    parser.add_argument(
        "--shipped-warm-start",
        action="store_true",
        help=f"skip the supervised warm start: use {SHIPPED_CHECKPOINT.relative_to(REPO)} "
        "(made by the same recipe)",
    )
    parser.add_argument("--output-dir", default="outputs/quickstart", help="where the run goes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("agentrl.run").setLevel(logging.INFO)  # the step lines off a terminal
    # Before torch loads OpenMP (here and in the SFT processes, which inherit it): idle OpenMP
    # threads sleep instead of spinning, so other work on the machine slows the run down
    # instead of stalling it (measured 4-7x on a shared 2-core machine; docs/training.md).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from agentrl.config import load_config
    from agentrl.training.trainer import Trainer

    t0 = time.perf_counter()
    out = Path(args.output_dir)
    if not args.shipped_warm_start:
        stage1, warm = out / "sft_tool", out / "sft"
        _say(
            f"1/3 supervised warm start: agentrl sft {SFT_STAGE1_CONFIG.relative_to(REPO)}, "
            f"then {SFT_CONFIG.relative_to(REPO)} (about 1.5 minutes on 2 idle CPU cores)"
        )
        for config, dest, extra in (
            (SFT_STAGE1_CONFIG, stage1, []),
            (SFT_CONFIG, warm, [f"model.path={stage1}"]),
        ):
            overrides = [*extra, f"trainer.output_dir={dest}", "--output-dir", str(dest)]
            _say(f"$ agentrl sft {config.relative_to(REPO)} {' '.join(overrides)}")
            subprocess.run(
                [sys.executable, "-m", "agentrl", "sft", str(config), *overrides], check=True
            )
    else:
        warm = SHIPPED_CHECKPOINT
        manifest = json.loads((warm / "sft_manifest.json").read_text())
        _say(
            f"1/3 warm start: using the shipped checkpoint {warm.relative_to(REPO)} "
            f"(made by `agentrl sft {SFT_STAGE1_CONFIG.relative_to(REPO)}` and "
            f"`{SFT_CONFIG.relative_to(REPO)}`, {_total_steps(manifest)} SFT steps)"
        )
    cfg = load_config(
        RL_CONFIG,
        [f"model.path={warm}", f"trainer.output_dir={out / 'rl'}", *args.overrides],
    )
    _say(
        f"2/3 async GRPO: {cfg.trainer.total_steps} steps, max_staleness "
        f"{cfg.trainer.max_staleness}, {cfg.inference.num_servers} embedded servers, "
        f"correction {cfg.algorithm.correction.preset}"
    )
    result = Trainer(cfg, progress=True).run_sync()
    before = result.val_before.get("val/accuracy", float("nan"))
    after = result.val_after.get("val/accuracy", float("nan"))
    wall = time.perf_counter() - t0
    _say("3/3 done")
    print(
        json.dumps(
            {
                "held_out_accuracy_before": round(before, 3),
                "held_out_accuracy_after": round(after, 3),
                "improvement_points": round(100 * (after - before), 1),
                "steps": result.steps,
                "wall_time_s": round(wall, 1),
                "mlflow_run": result.run_location,
                "final_model": str(Path(result.output_dir) / "final_model"),
            },
            indent=2,
        )
    )
    db = Path(result.output_dir) / "mlruns" / "mlflow.db"
    if db.exists():
        _say(f"open the run: mlflow ui --backend-store-uri sqlite:///{db.resolve()}")
    return 0


def _total_steps(manifest: dict) -> int:
    """SFT steps of a checkpoint, counting the stages it started from (``init_manifest``)."""
    steps = 0
    while manifest:
        steps += int(manifest.get("steps", 0))
        manifest = manifest.get("init_manifest") or {}
    return steps


if __name__ == "__main__":
    sys.exit(main())
