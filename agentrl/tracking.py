"""Experiment tracking: one MLflow run per experiment (DESIGN section 7).

A :class:`Tracker` has four verbs (params, metrics, artifacts, finish) so the trainer never
touches MLflow directly. :class:`MlflowTracker` logs to ``MLFLOW_TRACKING_URI`` when it is set,
else to a local SQLite store under the output directory that ``mlflow ui
--backend-store-uri sqlite:///...`` opens with no server. A resumed experiment passes the
saved ``run_id`` and continues the same run (same metric history, steps continue).

Guarantees: metric keys are sanitized the way MLflow requires (``rollout_corr/kl`` stays as is;
characters MLflow rejects become ``_``); non-finite values are skipped and counted, never sent
(MLflow rejects NaN in some stores); ``finish`` is idempotent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import secrets
import tempfile
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "BackgroundTracker",
    "MetricsReporter",
    "MlflowTracker",
    "NullTracker",
    "ProgressReporter",
    "Reporter",
    "SampleReporter",
    "Tracker",
    "fresh_run_name",
    "log_run_plots",
    "make_tracker",
    "sanitize_key",
    "tracker_for",
]

_BAD_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. /:]")


def sanitize_key(key: str) -> str:
    """MLflow accepts letters, digits, ``_ - . space / :``; everything else becomes ``_``."""
    return _BAD_KEY_CHARS.sub("_", key)


class Tracker(ABC):
    """The trainer's view of experiment tracking."""

    run_id: str | None = None

    @abstractmethod
    def log_params(self, params: dict[str, Any]) -> None:
        """Record the run's parameters (flattened config keys -> values)."""
        ...

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at training step ``step``."""
        ...

    @abstractmethod
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Attach a file or folder to the run (under ``artifact_path`` when given)."""
        ...

    def log_dict(self, data: Any, artifact_file: str) -> None:
        """Log JSON-able data as an artifact file (e.g. ``trajectories/step_10.json``)."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(artifact_file).name
            path.write_text(json.dumps(data, indent=2, default=str))
            parent = str(Path(artifact_file).parent)
            self.log_artifact(path, None if parent == "." else parent)

    def log_traces(self, trajs: list[Any], step: int | None = None, **tags: str) -> int:
        """Record episodes as traces (:mod:`agentrl.traces`); returns how many were written.
        Trackers without tracing write none."""
        return 0

    @abstractmethod
    def finish(self, status: str = "FINISHED") -> None:
        """End the run with ``status`` (``FINISHED`` or ``FAILED``); later calls do nothing."""
        ...

    @property
    def location(self) -> str:
        """Where a person finds the run (printed by the quickstart)."""
        return ""


class NullTracker(Tracker):
    """Tracking disabled: keeps the metric history in memory (tests and plots still use it)."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def log_params(self, params: dict[str, Any]) -> None:
        """Keep the params in :attr:`params`."""
        self.params.update(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Append each value to its key's :attr:`history`."""
        for k, v in metrics.items():
            self.history[k].append((step, float(v)))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Nothing is stored."""
        return None

    def finish(self, status: str = "FINISHED") -> None:
        """Nothing to end."""
        return None


class MlflowTracker(Tracker):
    """One MLflow run; ``run_id`` continues an earlier run (resume)."""

    def __init__(
        self,
        *,
        tracking_uri: str | None,
        experiment: str,
        run_name: str | None = None,
        run_id: str | None = None,
        local_dir: str | Path = "mlruns",
    ) -> None:
        import mlflow

        self._mlflow = mlflow
        uri = store_uri(tracking_uri, local_dir)
        self.tracking_uri = uri
        mlflow.set_tracking_uri(uri)
        ensure_experiment(uri, experiment)
        mlflow.set_experiment(experiment)
        name = None if run_id else (run_name or fresh_run_name())
        self._run = mlflow.start_run(run_id=run_id, run_name=name)
        self.run_id = self._run.info.run_id
        self.experiment = experiment
        self.skipped_non_finite = 0
        self._finished = False
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def log_params(self, params: dict[str, Any]) -> None:
        """Log the params the run does not hold yet (a resumed run keeps its first values)."""
        clean = {sanitize_key(k): str(v)[:6000] for k, v in params.items()}
        items = list(clean.items())
        client = self._mlflow.MlflowClient()
        existing = client.get_run(self.run_id).data.params if self.run_id else {}
        # A resumed run already holds its params; MLflow refuses to change a logged value.
        fresh = [(k, v) for k, v in items if k not in existing]
        for i in range(0, len(fresh), 100):
            self._mlflow.log_params(dict(fresh[i : i + 100]))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log the finite values (non-finite ones are counted in ``skipped_non_finite``)."""
        clean: dict[str, float] = {}
        for k, v in metrics.items():
            value = float(v)
            if not math.isfinite(value):
                self.skipped_non_finite += 1
                continue
            clean[sanitize_key(k)] = value
            self.history[k].append((step, value))
        if clean:
            self._mlflow.log_metrics(clean, step=step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file, or every file of a folder."""
        p = Path(path)
        if p.is_dir():
            self._mlflow.log_artifacts(str(p), artifact_path=artifact_path)
        else:
            self._mlflow.log_artifact(str(p), artifact_path=artifact_path)

    def log_traces(self, trajs: list[Any], step: int | None = None, **tags: str) -> int:
        """One MLflow trace per episode in this run's experiment, linked to the run."""
        from agentrl.traces import log_episode_traces

        return len(
            log_episode_traces(
                trajs,
                experiment_id=self._run.info.experiment_id,
                run_id=self.run_id,
                step=step,
                tags=tags,
            )
        )

    def finish(self, status: str = "FINISHED") -> None:
        """End the MLflow run with ``status`` (once)."""
        if not self._finished:
            self._finished = True
            self._mlflow.flush_trace_async_logging()  # traces are exported in the background
            self._mlflow.end_run(status=status)

    @property
    def location(self) -> str:
        """The tracking URI, experiment and run id."""
        return f"{self.tracking_uri} (experiment {self.experiment!r}, run {self.run_id})"


class BackgroundTracker(Tracker):
    """A tracker built and driven on its own thread, so that neither MLflow's set-up (importing
    it, creating and migrating the store: seconds) nor a slow store holds up the run.

    ``build`` (a function returning the real :class:`Tracker`) runs on a single worker thread,
    at once, or once :meth:`start` is called when ``deferred`` (the trainer starts it when the
    first rollout is answered: on a 2-core machine its CPU would otherwise delay that); every
    call that needs the tracker now (``run_id``, ``location``, ``history``, ``finish``) starts
    it too, and it starts by itself after ``DEFER_LIMIT_S``. Every later call is queued on that same thread, in order (MLflow's active run is
    per thread, so one thread must start, log to and end it). ``log_*`` return at once (their
    arguments copied); ``run_id``, ``location`` and ``history`` wait for the calls before them.
    An error of ``build`` or of a queued call is raised by the next call (``finish`` included),
    so a failing store still fails the run, one call later. ``ready`` is a future of the built
    tracker (None if the build failed); ``on_ready`` is called on the worker thread once it is
    built.
    """

    DEFER_LIMIT_S = 30.0
    """The longest a deferred build waits for :meth:`start`."""

    def __init__(
        self,
        build: Callable[[], Tracker],
        on_ready: Callable[[Tracker], object] | None = None,
        *,
        deferred: bool = False,
    ) -> None:
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="agentrl-tracking")
        self._error: BaseException | None = None
        self._finished = False
        self._go = threading.Event()
        if not deferred:
            self._go.set()
        self.ready = self._pool.submit(self._build, build, on_ready)

    def start(self) -> None:
        """Let a deferred build begin (idempotent; thread-safe)."""
        self._go.set()

    def _build(self, build: Callable[[], Tracker], on_ready: Any) -> Tracker | None:
        """The worker's first task: the tracker, or None with the build's error kept."""
        self._go.wait(self.DEFER_LIMIT_S)
        try:
            tracker = build()
        except BaseException as exc:  # kept, and raised by the next call
            self._error = exc
            return None
        if on_ready is not None:
            on_ready(tracker)
        return tracker

    def _tracker(self) -> Tracker | None:
        """The built tracker (None when the build failed: its error is kept in ``_error``)."""
        return self.ready.result()

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``name`` on the built tracker (on the worker thread); an error is kept."""
        tracker = self._tracker()
        if tracker is None:
            return None
        try:
            return getattr(tracker, name)(*args, **kwargs)
        except BaseException as exc:  # kept, and raised by the next call
            if self._error is None:
                self._error = exc
            return None

    def _raise_kept(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _queue(self, name: str, *args: Any, **kwargs: Any) -> None:
        self._raise_kept()
        if self._finished:
            raise RuntimeError(f"tracker.{name} after finish(): the run is ended")
        self._pool.submit(self._run, name, *args, **kwargs)

    def _wait(self, name: str) -> Any:
        """An attribute of the built tracker, after every call queued before this one."""
        self.start()
        if self._finished:  # the queue is drained and the thread stopped
            return getattr(self._tracker(), name, None)
        value = self._pool.submit(lambda: getattr(self._tracker(), name, None)).result()
        self._raise_kept()
        return value

    def log_params(self, params: dict[str, Any]) -> None:
        """Queued (a copy of ``params``)."""
        self._queue("log_params", dict(params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queued (a copy of ``metrics``)."""
        self._queue("log_metrics", dict(metrics), step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Queued: the file must stay until :meth:`finish` (the run's own files do)."""
        self._queue("log_artifact", path, artifact_path)

    def log_dict(self, data: Any, artifact_file: str) -> None:
        """Queued (``data`` is copied through JSON now, as it will be written)."""
        self._queue("log_dict", json.loads(json.dumps(data, default=str)), artifact_file)

    def log_traces(self, trajs: list[Any], step: int | None = None, **tags: str) -> int:
        """Queued; returns how many episodes were handed over (the traces are written later)."""
        self._queue("log_traces", list(trajs), step, **tags)
        return len(trajs)

    def finish(self, status: str = "FINISHED") -> None:
        """Run every queued call, end the run with ``status`` (once) and stop the thread. An
        error of the queue is raised after the run is ended; when ``status`` is ``FAILED`` (the
        run is failing already, with its own error) it is logged instead."""
        if self._finished:
            return
        self._finished = True
        self.start()
        self._pool.submit(self._run, "finish", status).result()
        self._pool.shutdown(wait=True)
        if status == "FAILED" and self._error is not None:
            logging.getLogger(__name__).error("tracking failed too: %s", self._error)
            self._error = None
        self._raise_kept()

    @property
    def run_id(self) -> str | None:  # type: ignore[override]
        return self._wait("run_id")

    @property
    def history(self) -> dict[str, list[tuple[int, float]]]:
        """The built tracker's metric history (every queued metric included)."""
        return self._wait("history") or {}

    @property
    def location(self) -> str:
        return self._wait("location") or ""


def fresh_run_name() -> str:
    """A run name in MLflow's style (``overjoyed-slug-911``) drawn from the OS's entropy: MLflow
    draws its names from the global RNG, which ``seed_everything`` has seeded, so every run of
    every store would get the same name."""
    rng = random.SystemRandom()
    try:
        from mlflow.utils import name_utils

        words = [
            rng.choice(name_utils._GENERATOR_PREDICATES),
            rng.choice(name_utils._GENERATOR_NOUNS),
        ]
    except (ImportError, AttributeError):  # MLflow moved its word lists: a plain unique name
        words = ["run", secrets.token_hex(3)]
    return f"{words[0]}-{words[1]}-{rng.randrange(1000)}"


def store_uri(tracking_uri: str | None, local_dir: str | Path) -> str:
    """``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else a sqlite store in ``local_dir``
    (its artifacts beside it: ``MLFLOW_ARTIFACT_ROOT`` is set unless set already)."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    local = Path(local_dir).resolve()
    local.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MLFLOW_ARTIFACT_ROOT", str(local / "artifacts"))
    return f"sqlite:///{local / 'mlflow.db'}"


def ensure_experiment(uri: str, experiment: str) -> None:
    """Create ``experiment`` in the store at ``uri`` unless it exists (a sqlite store keeps its
    artifacts in ``artifacts/`` beside the database). The first call on a new sqlite store
    creates and migrates it: seconds, which :class:`BackgroundTracker` moves off the critical path."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name(experiment) is not None:
        return
    artifact_root = None
    if uri.startswith("sqlite:///"):
        artifact_root = (Path(uri[len("sqlite:///") :]).parent / "artifacts").as_uri()
    with contextlib.suppress(Exception):  # another process created it meanwhile: fine
        client.create_experiment(experiment, artifact_location=artifact_root)


def make_tracker(
    *,
    enabled: bool,
    backend: str,
    tracking_uri: str | None,
    experiment: str,
    run_name: str | None,
    run_id: str | None,
    local_dir: str | Path,
) -> Tracker:
    """Build the configured tracker (``tracking.backend``: ``mlflow`` or ``none``)."""
    if not enabled or backend == "none":
        return NullTracker()
    if backend == "mlflow":
        return MlflowTracker(
            tracking_uri=tracking_uri,
            experiment=experiment,
            run_name=run_name,
            run_id=run_id,
            local_dir=local_dir,
        )
    raise ValueError(f"tracking.backend must be 'mlflow' or 'none' (got {backend!r})")


def tracker_for(cfg: Any, *, run_name: str | None = None, run_id: str | None = None) -> Tracker:
    """The tracker an experiment config asks for (its ``tracking:`` section), with the local
    store under ``trainer.output_dir/mlruns``; ``run_name`` defaults to ``tracking.run_name``,
    ``run_id`` continues a run (resume)."""
    t = cfg.tracking
    return make_tracker(
        enabled=t.enabled,
        backend=t.backend,
        tracking_uri=t.tracking_uri,
        experiment=t.experiment,
        run_name=run_name if run_name is not None else t.run_name,
        run_id=run_id,
        local_dir=Path(cfg.trainer.output_dir) / "mlruns",
    )


def plot_metric_history(
    history: dict[str, list[tuple[int, float]]], keys: list[str], out_path: str | Path
) -> Path | None:
    """Plot the given metric keys (one panel each) to a PNG; None if none has data."""
    present = [k for k in keys if history.get(k)]
    if not present:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(present), 1, figsize=(7, 2.4 * len(present)), squeeze=False)
    for ax, key in zip(axes[:, 0], present, strict=True):
        steps, values = zip(*history[key], strict=True)
        ax.plot(steps, values, marker=".")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


# ---- reporters: what the training loop tells the outside world each step ---------------------


class Reporter:
    """A training-loop callback (no-op defaults): ``on_step``, ``on_validation``, ``close``."""

    def on_step(self, step: int, version: int, metrics: dict[str, float], trajs: list[Any]) -> None:
        """After each step (its metrics and the trajectories it trained on)."""

    def on_validation(self, step: int, metrics: dict[str, float], report: Any = None) -> None:
        """After each validation (``report``: the ``agentrl.evaluation.EvalReport``)."""

    def close(self) -> None:
        """At the end of the run (also on failure)."""


class MetricsReporter(Reporter):
    """Step metrics to the tracker every ``log_every`` steps; validation metrics always."""

    def __init__(self, tracker: Tracker, log_every: int) -> None:
        self.tracker = tracker
        self.log_every = log_every

    def on_step(self, step: int, version: int, metrics: dict[str, float], trajs: list[Any]) -> None:
        """Log the step's metrics when ``step`` is a multiple of ``log_every``."""
        if step % self.log_every == 0:
            self.tracker.log_metrics(metrics, step=step)

    def on_validation(self, step: int, metrics: dict[str, float], report: Any = None) -> None:
        """Log the validation metrics, or the whole report (metrics, table, JSON) when given."""
        if report is None:
            self.tracker.log_metrics(metrics, step=step)
        else:
            report.log(self.tracker, step=step)  # metrics, a table and the JSON report


class SampleReporter(Reporter):
    """``n`` sample trajectories at step 1 and every ``total_steps // 5`` steps: a JSON table and
    one MLflow trace per episode (:mod:`agentrl.traces`)."""

    def __init__(self, tracker: Tracker, n: int, total_steps: int) -> None:
        self.tracker = tracker
        self.n = n
        self.every = max(1, total_steps // 5)

    def on_step(self, step: int, version: int, metrics: dict[str, float], trajs: list[Any]) -> None:
        """Log the first ``n`` trajectories of the step as a JSON table, on the reporting steps."""
        if not self.n or (step % self.every and step != 1):
            return
        rows = [
            {
                "uid": t.uid,
                "reward": t.reward,
                "stop_reason": t.stop_reason.value,
                "num_turns": t.num_turns,
                "tool_calls": t.tool_calls,
                "messages": t.messages,
            }
            for t in trajs[: self.n]
        ]
        self.tracker.log_dict(rows, f"trajectories/step_{step:05d}.json")
        self.tracker.log_traces(trajs[: self.n], step=step, **{"agentrl.phase": "train"})


class ProgressReporter(Reporter):
    """One live line per run: step, reward, staleness, tokens/s (rich on a terminal, else a
    plain line per step when asked for with ``enabled=True``)."""

    def __init__(self, total_steps: int, enabled: bool | None) -> None:
        import sys

        self.total = total_steps
        self.tty = sys.stderr.isatty()
        self.enabled = self.tty if enabled is None else enabled
        self._progress: Any = None
        self._task: Any = None

    def on_step(self, step: int, version: int, metrics: dict[str, float], trajs: list[Any]) -> None:
        """Advance the progress line (or print one line per step off a terminal)."""
        if not self.enabled:
            return
        info = (
            f"v{version} reward {metrics.get('reward/mean', 0.0):.3f} "
            f"staleness {metrics.get('async/staleness_mean', 0.0):.2f}"
            f"/{int(metrics.get('async/staleness_max', 0))} "
            f"{metrics.get('perf/tokens_per_s', 0.0):.0f} tok/s"
        )
        if not self.tty:
            import sys

            print(f"[train] step {step}/{self.total} {info}", file=sys.stderr, flush=True)
            return
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(stderr=True),
            )
            self._task = self._progress.add_task(
                "train", total=self.total, completed=step - 1, info=""
            )
            self._progress.start()
        self._progress.update(self._task, completed=step, info=info)

    def close(self) -> None:
        """Stop the live progress display."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


RUN_PLOTS: dict[str, list[str]] = {
    "reward": ["reward/mean", "reward/accuracy", "val/accuracy"],
    "staleness": ["async/staleness_mean", "async/staleness_max"],
    "is_weights": ["rollout_corr/is_weight_mean", "rollout_corr/is_weight_max"],
    "kl": ["rollout_corr/kl", "rollout_corr/k3_kl", "actor/ppo_kl"],
    "validation": ["val/accuracy", "val/reward_mean"],
}
"""The plots every run logs as artifacts (name -> metric keys)."""


def log_run_plots(tracker: Tracker, out_dir: str | Path) -> list[Path]:
    """Plot the run's metric history (:data:`RUN_PLOTS`) and log each PNG under ``plots/``."""
    history = getattr(tracker, "history", {})
    plots = Path(out_dir) / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys in RUN_PLOTS.items():
        png = plot_metric_history(history, keys, plots / f"{name}.png")
        if png is not None:
            tracker.log_artifact(png, "plots")
            written.append(png)
    return written
