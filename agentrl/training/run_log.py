"""What a run writes to its log, read in a terminal or (more often) in a log file.

Why it exists: most RL runs are read from log files (nohup, a scheduler, CI), where a live
progress bar shows nothing and third-party request lines (``httpx``: one per HTTP call) bury
the run's own lines. This module sets up logging for every ``agentrl`` command
(:func:`configure_logging`, ``--log-level``), writes one line per training step off a terminal
(:func:`step_line`, with an ETA), and logs the start-up phases with their timings
(:class:`PhaseTimer`).

Guarantees: at ``INFO`` and above, the request loggers of ``httpx``, ``httpcore``, ``urllib3``
and ``uvicorn.access`` (and MLflow's store set-up chatter) log warnings only; ``--log-level
debug`` shows them again. Off a terminal, Hugging Face progress bars are off
(``HF_HUB_DISABLE_PROGRESS_BARS``, unless set).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping

__all__ = [
    "LOG_LEVELS",
    "LOG_LEVEL_ENV",
    "NOISY_LOGGERS",
    "PhaseTimer",
    "add_log_level_argument",
    "configure_from_env",
    "configure_logging",
    "step_line",
]

LOG_LEVEL_ENV = "AGENTRL_LOG_LEVEL"
"""Where :func:`configure_logging` leaves the level for the processes a run starts (Ray actors
configure themselves from it: :func:`configure_from_env`)."""

LOG_LEVELS = ("debug", "info", "warning", "error")
"""The values of ``--log-level``."""

NOISY_LOGGERS = (
    "httpx",
    "httpcore",
    "urllib3",
    "uvicorn.access",
    "mlflow.store.db.utils",
    "alembic.runtime.migration",
    "mlflow.tracing.export.async_export_queue",  # "Flushing the async trace logging queue"
)
"""Third-party loggers that log every request (or every store set-up): warnings only unless
``--log-level debug``."""

logger = logging.getLogger("agentrl.run")


def add_log_level_argument(parser: argparse.ArgumentParser, default: str = "info") -> None:
    """``--log-level`` (and ``--quiet``, the same as ``--log-level warning``) on ``parser``."""
    add = parser.add_argument
    add(
        "--log-level",
        choices=LOG_LEVELS,
        default=default,
        help=f"what to log (default {default}; debug also shows every HTTP request)",
    )
    add("--quiet", action="store_true", help="log warnings only (= --log-level warning)")


def configure_logging(level: str = "info") -> None:
    """Log ``level`` and above to stderr as ``time LEVEL logger: message``; third-party request
    loggers (:data:`NOISY_LOGGERS`) log warnings only unless ``level`` is ``debug``."""
    if level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)} (got {level!r})")
    value = getattr(logging, level.upper())
    logging.basicConfig(
        level=value, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(value if level == "debug" else max(value, logging.WARNING))
    if not sys.stderr.isatty():  # progress bars in a log file are lines of carriage returns
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ[LOG_LEVEL_ENV] = level


def configure_from_env() -> None:
    """:func:`configure_logging` at the level the starting process chose (``AGENTRL_LOG_LEVEL``,
    default ``info``): Ray runs it in every actor process (``worker_process_setup_hook``), so an
    actor's lines (the trainer's step lines among them) reach the driver's console, prefixed
    by Ray with the actor's name and pid."""
    level = os.environ.get(LOG_LEVEL_ENV, "info")
    configure_logging(level if level in LOG_LEVELS else "info")


def _eta(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    s = round(max(seconds, 0.0))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def step_line(
    step: int, total: int, version: int, m: Mapping[str, float], elapsed_s: float, done: int
) -> str:
    """One readable line for training step ``step`` of ``total``: weight version, reward,
    accuracy, staleness, tokens/s, drops so far, push time and the ETA (``elapsed_s`` over
    the ``done`` steps this process ran, times the steps left)."""
    dropped = sum(v for k, v in m.items() if k.startswith("rollout/dropped/"))
    dropped += m.get("async/dropped_stale_total", 0.0)
    per_step = elapsed_s / max(done, 1)
    return (
        f"step {step}/{total} v{version} reward {m.get('reward/mean', 0.0):.3f} "
        f"acc {m.get('reward/accuracy', 0.0):.2f} "
        f"staleness {m.get('async/staleness_mean', 0.0):.2f}/{int(m.get('async/staleness_max', 0))} "
        f"{m.get('perf/tokens_per_s', 0.0):.0f} tok/s drops {int(dropped)} "
        f"push {m.get('timing_s/push', 0.0):.2f}s eta {_eta(per_step * (total - step))}"
    )


def since_launch() -> float:
    """Seconds since this process was launched (the interpreter's start and every import
    count): on Linux its start in clock ticks since boot against the uptime (10 ms steps),
    elsewhere psutil's creation time (whose boot time is rounded to the second)."""
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())


class PhaseTimer:
    """Logs each start-up phase with its duration: ``timer.done("servers up", t0)`` logs
    ``start-up: servers up in 3.2 s``; ``timer.reached("first rollout answered")`` logs
    ``start-up: first rollout answered 4.1 s after launch``; ``timings`` keeps the seconds of
    each (a milestone's are its seconds since launch)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        launched: Callable[[], float] = since_launch,
    ) -> None:
        self.clock = clock
        self.launched = launched
        self.timings: dict[str, float] = {}

    def done(self, name: str, since: float) -> float:
        """Record and log phase ``name`` that started at ``since`` (a ``clock()`` reading)."""
        return self.record(name, self.clock() - since)

    def record(self, name: str, took: float) -> float:
        """Record and log phase ``name`` that took ``took`` seconds (timed elsewhere)."""
        self.timings[name] = took
        logger.info("start-up: %s in %.1f s", name, took)
        return took

    def reached(self, name: str) -> float:
        """Record and log milestone ``name`` with the seconds since the process was launched."""
        at = self.launched()
        self.timings[name] = at
        logger.info("start-up: %s %.2f s after launch", name, at)
        return at


class StepLog:
    """A training-loop reporter: one :func:`step_line` per step at ``INFO`` (the log-file view;
    on a terminal the live progress line shows the same and this stays silent)."""

    def __init__(
        self, total_steps: int, enabled: bool, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.total = total_steps
        self.enabled = enabled
        self.clock = clock
        self._t0: float | None = None
        self._done = 0

    def on_step(self, step: int, version: int, metrics: dict[str, float], trajs: list) -> None:
        """Log the step's line (the ETA counts from the first step this process ran)."""
        now = self.clock()
        if self._t0 is None:
            self._t0 = now - metrics.get("timing_s/step", 0.0)
        self._done += 1
        if self.enabled:
            logger.info(step_line(step, self.total, version, metrics, now - self._t0, self._done))

    def on_validation(self, step: int, metrics: dict[str, float], report: object = None) -> None:
        """Log the validation headline (accuracy, mean reward, reward errors)."""
        if self.enabled and metrics:
            logger.info(
                "validation at step %d: accuracy %.3f reward %.3f (%d samples, %d reward errors)",
                step,
                metrics.get("val/accuracy", 0.0),
                metrics.get("val/reward_mean", 0.0),
                int(metrics.get("val/num_samples", 0)),
                int(metrics.get("val/reward_errors", 0)),
            )

    def close(self) -> None:
        """Nothing to stop."""
