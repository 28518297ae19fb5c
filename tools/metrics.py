"""Per-tool counters: what the tools of a run did, summed over every episode that used them.

Why it exists: the counters are one object (:class:`ToolMetrics`) apart from the tools and
their limits, so every episode that runs calls reports into the same place, whoever built the
episode, and the trainer reads one window per step (``snapshot(reset=True)``).

What it guarantees: counters are updated from the event loop and read from any thread under
one lock, so a snapshot is consistent; ``reset=True`` starts a new window atomically; a
``ToolMetrics`` pickles with its counters (without its lock and without the calls it watches).

Keys of a snapshot, per tool that was called: ``tools/<name>/calls``, ``errors``,
``timeouts``, ``cancelled`` (calls cut off by the caller's cancellation, e.g. the episode
deadline), ``abandoned`` (timed-out or cancelled calls still running ``ABANDON_GRACE_S``
later), ``truncated``, ``release_errors``, ``latency_mean_s``, ``latency_max_s``, plus the
mean of every number tools put in ``ToolResult.metrics``; and ``tools/unknown_calls``,
``tools/abandoned_running`` (abandoned calls still running now) and
``tools/sync_threads_busy`` (threads of the sync pool running a call now).
"""

from __future__ import annotations

import threading
from typing import Any

from tools.call import ToolCall

__all__ = ["ToolMetrics"]


class _Stats:
    """The counters of one tool."""

    __slots__ = (
        "abandoned",
        "calls",
        "cancelled",
        "errors",
        "latency_max",
        "latency_sum",
        "release_errors",
        "result_metrics",
        "timeouts",
        "truncated",
    )

    def __init__(self) -> None:
        self.calls = 0
        self.errors = 0
        self.timeouts = 0
        self.cancelled = 0
        self.abandoned = 0
        self.truncated = 0
        self.release_errors = 0
        self.latency_sum = 0.0
        self.latency_max = 0.0
        self.result_metrics: dict[str, list[float]] = {}

    def add_latency(self, latency: float) -> None:
        """Count one call that took ``latency`` seconds."""
        self.calls += 1
        self.latency_sum += latency
        self.latency_max = max(self.latency_max, latency)

    def report(self, prefix: str, out: dict[str, float]) -> None:
        """Write this tool's keys (``prefix`` = ``tools/<name>/``) into ``out``."""
        for key, values in self.result_metrics.items():
            if values:
                out[prefix + key] = sum(values) / len(values)
        out[prefix + "calls"] = float(self.calls)
        out[prefix + "errors"] = float(self.errors)
        out[prefix + "timeouts"] = float(self.timeouts)
        out[prefix + "cancelled"] = float(self.cancelled)
        out[prefix + "abandoned"] = float(self.abandoned)
        out[prefix + "truncated"] = float(self.truncated)
        out[prefix + "release_errors"] = float(self.release_errors)
        out[prefix + "latency_mean_s"] = self.latency_sum / self.calls if self.calls else 0.0
        out[prefix + "latency_max_s"] = self.latency_max


class ToolMetrics:
    """The counters of a set of tools (see the module docstring for the keys)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, _Stats] = {}
        self._unknown_calls = 0
        self._abandoned: set[ToolCall] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_lock", "_abandoned"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._abandoned = set()

    def snapshot(self, reset: bool = False, *, sync_threads_busy: int = 0) -> dict[str, float]:
        """The counters since the start (or the last ``reset=True``), as metric keys.

        ``sync_threads_busy`` is reported as ``tools/sync_threads_busy`` (the pool's own
        count, read by the caller).
        """
        with self._lock:
            self._abandoned = {c for c in self._abandoned if c.running()}
            out: dict[str, float] = {
                "tools/unknown_calls": float(self._unknown_calls),
                "tools/abandoned_running": float(len(self._abandoned)),
                "tools/sync_threads_busy": float(sync_threads_busy),
            }
            for name, s in self._stats.items():
                s.report(f"tools/{name}/", out)
            if reset:
                self._stats = {}
                self._unknown_calls = 0
            return out

    def _stat(self, name: str) -> _Stats:
        s = self._stats.get(name)
        if s is None:
            s = self._stats[name] = _Stats()
        return s

    def record_call(
        self,
        name: str,
        latency: float,
        *,
        error: bool,
        timeout: bool,
        truncated: bool,
        metrics: dict[str, float],
    ) -> None:
        """Count one finished call of tool ``name`` and the numbers its result reported."""
        with self._lock:
            s = self._stat(name)
            s.add_latency(latency)
            s.errors += int(error)
            s.timeouts += int(timeout)
            s.truncated += int(truncated)
            for key, value in metrics.items():
                try:
                    s.result_metrics.setdefault(key, []).append(float(value))
                except (TypeError, ValueError):
                    continue

    def record_cancelled(self, name: str, latency: float) -> None:
        """Count a call cut off by its caller's cancellation after ``latency`` seconds."""
        with self._lock:
            s = self._stat(name)
            s.add_latency(latency)
            s.cancelled += 1

    def record_release_error(self, name: str) -> None:
        """Count a ``release`` of tool ``name`` that raised, timed out or was cancelled."""
        with self._lock:
            self._stat(name).release_errors += 1

    def record_abandoned(self, name: str, call: ToolCall) -> None:
        """Count a call still running after it was abandoned; watch it until it ends."""
        with self._lock:
            self._stat(name).abandoned += 1
            self._abandoned.add(call)

    def record_unknown(self) -> None:
        """Count a call of a tool name the set does not have."""
        with self._lock:
            self._unknown_calls += 1
