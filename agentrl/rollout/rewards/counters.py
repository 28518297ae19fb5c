"""The reward counters: what happened to every reward call, per data source (``reward/...``).

Why it exists: a failed reward is a counted drop, never a silent 0.0, so every outcome of a
call is counted where it happens (the manager counts scores and failures, the executor counts
calls it abandoned or whose worker it killed) and reported as one family of metrics. Plain
data: it pickles with the manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SOURCE_COUNTS", "RewardCounts"]

SOURCE_COUNTS = ("scored", "errors", "timeouts", "abandoned", "killed")
"""The per-data-source counters (``reward/<source>/<name>``)."""
_TOTALS = ("scored", "errors", "timeouts")


@dataclass
class RewardCounts:
    """Cumulative reward counters since construction.

    ``timeouts`` are also ``errors``; ``abandoned`` are timed-out calls still running
    ``1 s`` later (an async function ignoring cancellation, a thread that cannot be stopped);
    ``killed`` are process workers killed at the deadline.
    """

    by_source: dict[str, dict[str, int]] = field(default_factory=dict)
    """``{data_source: {counter: n}}`` with the counters of :data:`SOURCE_COUNTS`."""
    in_flight: int = 0
    """Reward calls running now."""
    latency_sum: float = 0.0
    """Seconds spent in reward calls, summed."""
    latency_max: float = 0.0
    """The slowest call, in seconds."""

    def count(self, source: str, *keys: str) -> None:
        """Add one to each counter ``keys`` of ``source``."""
        counts = self.by_source.setdefault(source, dict.fromkeys(SOURCE_COUNTS, 0))
        for key in keys:
            counts[key] += 1

    def observe(self, elapsed: float) -> None:
        """Record one call's latency (seconds), whatever its outcome."""
        self.latency_sum += elapsed
        self.latency_max = max(self.latency_max, elapsed)

    def metrics(self, *, threads_busy: int = 0) -> dict[str, float]:
        """Totals ``reward/scored``, ``errors``, ``timeouts``, ``in_flight``, ``threads_busy``,
        the latency, then ``reward/<source>/<counter>`` for every data source seen."""
        totals = dict.fromkeys(_TOTALS, 0)
        out: dict[str, float] = {}
        for source, counts in sorted(self.by_source.items()):
            for key, value in counts.items():
                out[f"reward/{source}/{key}"] = float(value)
                if key in totals:
                    totals[key] += value
        n = totals["scored"] + totals["errors"]
        return {
            "reward/scored": float(totals["scored"]),
            "reward/errors": float(totals["errors"]),
            "reward/timeouts": float(totals["timeouts"]),
            "reward/in_flight": float(self.in_flight),
            "reward/threads_busy": float(threads_busy),
            "reward/latency_mean_s": self.latency_sum / n if n else 0.0,
            "reward/latency_max_s": self.latency_max,
            **out,
        }
