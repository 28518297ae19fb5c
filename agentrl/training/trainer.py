"""``Trainer``: one experiment, end to end — resolve, build, (resume), train, report.

Why it exists: the public entry point of training (``agentrl train``, the quickstart, the Ray
trainer actor, tests). It only composes the pieces, each of which lives in its own module:

    resolve_experiment (resolve.py)  every name and file, before anything starts (skipped when
                                     the caller hands its ``Resolved`` in: resolved once per run)
    build_run          (build.py)    servers, pool, CheckpointEngine, models, one exit stack
    RunState           (state.py)    what is saved and resumed
    watch_servers      (run_servers.py) a dead server of its own restarted, rejoining verified
    train              (loop.py)     the loop; train_step (step.py) the math of one step
    reporters          (tracking.py) MLflow metrics, sample tables, progress, plots

Example::

    result = Trainer(cfg).run_sync()      # or: await Trainer(cfg, resume=True).run()
    Trainer(cfg, resolved=resolve_experiment(cfg))   # a caller that resolved already (the CLI)
    result.val_before, result.val_after, result.history["reward/mean"]
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.config import ExperimentConfig
from agentrl.tracking import (
    BackgroundTracker,
    MetricsReporter,
    ProgressReporter,
    SampleReporter,
    Tracker,
    log_run_plots,
    tracker_for,
)
from agentrl.training.build import Run, build_run, build_serving
from agentrl.training.masking import MaskingWatch
from agentrl.training.resolve import (
    Resolved,
    build_tasks,
    build_toolset,
    ensure_resolved,
)
from agentrl.training.run_log import PhaseTimer, StepLog
from agentrl.training.state import RunState, seed_everything

if TYPE_CHECKING:
    from agentrl.training.loop import TrainResult

__all__ = [
    "TrainResult",
    "Trainer",
    "build_tasks",
    "build_toolset",
    "evaluate_checkpoint",
]

logger = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    """``TrainResult`` is re-exported lazily: the training loop (torch, tensordict: seconds of
    imports) is imported when a run starts, after the servers' zygote (``Trainer._resolve``)."""
    if name == "TrainResult":
        from agentrl.training.loop import TrainResult

        return TrainResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Trainer:
    """One experiment (see the module docstring).

    ``server_urls`` attaches to running servers instead of starting the configured backend
    (tests, Ray placement); ``workers`` are ready-made agent-loop workers (Ray actor adapters);
    ``transport`` overrides the weight transport; ``progress`` forces the progress line on/off.
    ``resolved`` is the caller's :func:`~agentrl.training.resolve.resolve_experiment` of ``cfg``
    (the CLI's, the Ray driver's): given, the run does not resolve again; None, it resolves.
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        resume: bool = False,
        server_urls: list[str] | None = None,
        stop_after_step: int | None = None,
        workers: list[Any] | None = None,
        transport: Any = None,
        progress: bool | None = None,
        on_built: Callable[[Run], Awaitable[None]] | None = None,
        resolved: Resolved | None = None,
    ) -> None:
        self.cfg = cfg
        self.resolved = resolved
        self.on_built = on_built
        """Awaited with the built :class:`Run` before training starts (placement layers use it)."""
        self.resume = resume
        self.server_urls = server_urls
        self.stop_after_step = stop_after_step
        self.workers = workers
        self.transport = transport
        self.progress = progress
        self.out = Path(cfg.trainer.output_dir)
        self.state = RunState.fresh()
        self.run_obj: Run | None = None

    # ---- what tests and callers read --------------------------------------------------------
    @property
    def step(self) -> int:
        return self.state.step

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def actor(self) -> Any:
        return self.run_obj.policies.actor if self.run_obj is not None else None

    @property
    def critic(self) -> Any:
        return self.run_obj.policies.critic if self.run_obj is not None else None

    @property
    def dispatched_task_ids(self) -> list[str]:
        return self.state.dispatched_task_ids

    @property
    def trained_task_ids(self) -> list[str]:
        return self.state.trained_task_ids

    @property
    def dropped_task_ids(self) -> list[str]:
        return self.state.dropped_task_ids

    @property
    def dispatched_at_save(self) -> int:
        return self.state.dispatched_at_save

    # ---- running ----------------------------------------------------------------------------
    def run_sync(self) -> TrainResult:
        """:meth:`run` in a fresh event loop."""
        return asyncio.run(self.run())

    async def _push(self, version: int) -> Any:
        """Push the actor's weights as ``version`` (a hook: subclasses may observe pushes)."""
        assert self.run_obj is not None
        from agentrl.training.loop import push_weights

        return await push_weights(self.run_obj, version)

    async def run(self) -> TrainResult:
        """Resolve (unless resolved already), build, train and report; the servers are stopped
        whatever happens."""
        from agentrl.rollout.datasets import TaskDataset

        cfg = self.cfg
        t0 = time.perf_counter()
        phases = PhaseTimer()
        resolved = self._resolve()
        if self.resolved is None:
            phases.done("config resolved", t0)
        else:  # the caller resolved (the CLI): its time, not this call's
            phases.record("config resolved", resolved.seconds)
        saved = self._load_state()
        dataset = TaskDataset(resolved.train_tasks, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        if saved is not None:
            dataset.load_state_dict(saved.dataset)
        t1 = time.perf_counter()
        # The tracker (MLflow's import, store and run) is built on its own thread once the first
        # rollout is answered, and the run does not wait for it: its calls queue until it is ready.
        tracker = self._tracker(saved, lambda _: phases.done("tracking ready", t1))
        try:
            result = await self._serve_and_train(resolved, saved, dataset, tracker, phases)
        except BaseException:  # a run that never reached training still ends its MLflow run
            tracker.finish("FAILED")
            raise
        result.wall_time_s = time.perf_counter() - t0
        return result

    async def _serve_and_train(
        self,
        resolved: Resolved,
        saved: RunState | None,
        dataset: Any,
        tracker: Tracker,
        phases: PhaseTimer,
    ) -> TrainResult:
        """Start the servers (or attach), restore a resumed run, train; servers stopped after."""
        from agentrl.training.run_servers import watch_servers

        t1 = time.perf_counter()
        async with build_run(
            self.cfg,
            resolved=resolved,
            server_urls=self.server_urls,
            transport=self.transport,
            workers=self.workers,
        ) as run:
            phases.done(f"{len(run.server_urls)} server(s) up and models loaded", t1)
            first = asyncio.ensure_future(_first_rollout(run.pool, phases, tracker))
            try:
                self.run_obj = run
                if self.on_built is not None:
                    await self.on_built(run)
                if saved is not None:
                    self._restore(run, saved)
                run.tracker = tracker
                async with watch_servers(run):  # the servers this run launched: restarted if dead
                    return await self._train(run, tracker, dataset)
            finally:
                first.cancel()

    def _resolve(self) -> Resolved:
        """Check, seed and resolve (unless the caller resolved), with the embedded servers'
        zygote importing alongside from the start (as under ``agentrl train``: an SDK run
        starts as soon), and stopped again when this fails."""
        from agentrl.inference import zygote

        cfg = self.cfg
        early = (
            self.resolved is None
            and self.server_urls is None
            and cfg.inference.backend == "embedded"
            and not zygote.running()  # one this process uses already is left alone
        )
        if early:
            zygote.prestart()
        try:
            check_colocate(cfg)
            seed_everything(cfg.trainer.seed)
            return ensure_resolved(cfg, self.resolved)
        except BaseException:
            if early:
                zygote.shutdown()
            raise

    def _load_state(self) -> RunState | None:
        """The saved state when resuming (logged: which step, which checkpoint), else None;
        :attr:`state` is set either way."""
        ckpt = self.out / "checkpoint"
        saved = RunState.load(ckpt, world_size=self.cfg.trainer.world_size) if self.resume else None
        if saved is not None:
            logger.info("resumed from step %d (checkpoint %s)", saved.step, ckpt.resolve())
        elif self.resume:
            logger.warning("--resume: no checkpoint in %s; starting from step 0", ckpt.resolve())
        self.state = saved or RunState.fresh()
        return saved

    def _restore(self, run: Run, saved: RunState) -> None:
        RunState.load_weights(self.out / "checkpoint", run.policies.actor, run.policies.critic)
        kl = run.resolved.plan.kl_in_reward if run.resolved is not None else None
        if kl is not None and saved.kl_coef is not None:
            kl.controller.value = saved.kl_coef

    def _tracker(self, saved: RunState | None, on_ready: Callable[[Tracker], object]) -> Tracker:
        """The run's tracker with the config's params: MLflow's is built in the background once
        started (:class:`BackgroundTracker`, ``deferred``), tracking off is the in-memory one
        at once; ``config.yaml`` is written now."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(self.cfg.to_yaml())
        run_id = saved.mlflow_run_id if saved else None
        t = self.cfg.tracking
        if not t.enabled or t.backend == "none":
            tracker = tracker_for(self.cfg, run_id=run_id)
        else:
            tracker = BackgroundTracker(
                lambda: tracker_for(self.cfg, run_id=run_id), on_ready, deferred=True
            )
        tracker.log_params(self.cfg.flatten())
        return tracker

    async def _train(self, run: Run, tracker: Tracker, dataset: Any) -> TrainResult:
        from agentrl.training.loop import train

        cfg = self.cfg
        tty = sys.stderr.isatty()  # a terminal gets the live line, a log file a line per step
        reporters = [
            MetricsReporter(tracker, cfg.tracking.log_every),
            SampleReporter(tracker, cfg.tracking.num_sample_trajectories, cfg.trainer.total_steps),
            ProgressReporter(cfg.trainer.total_steps, self.progress if tty else False),
            StepLog(cfg.trainer.total_steps, enabled=not tty),
            MaskingWatch(cfg.algorithm.correction),
        ]
        status = "FAILED"
        try:
            result = await train(
                run,
                self.state,
                dataset,
                reporters=reporters,
                stop_after_step=self.stop_after_step,
                push=self._push,
            )
            self._final_artifacts(run, tracker)
            status = "FINISHED"
        finally:
            for r in reporters:
                r.close()
            result_location = tracker.location
            history = getattr(tracker, "history", {})
            tracker.finish(status)
        result.run_location = result_location
        result.history = {k: list(v) for k, v in history.items()}
        return result

    def _final_artifacts(self, run: Run, tracker: Tracker) -> None:
        final = self.out / "final_model"
        run.policies.actor.save_pretrained(final)
        run.tokenizer.save_pretrained(final)
        tracker.log_artifact(self.out / "config.yaml")
        log_run_plots(tracker, self.out)
        tracker.log_artifact(final, "final_model")


def check_colocate(cfg: ExperimentConfig) -> None:
    """``distributed.colocate`` with vLLM needs CUDA (its sleep mode does): refused before any
    server starts where there is none (the config's own check covers device: cpu)."""
    if cfg.distributed.colocate and cfg.inference.backend == "vllm":
        import torch

        from agentrl.config.experiment import VLLM_CPU_COLOCATE

        if not torch.cuda.is_available():
            raise ValueError(VLLM_CPU_COLOCATE)


async def _first_rollout(pool: Any, phases: PhaseTimer, tracker: Tracker) -> None:
    """Log ``start-up: first rollout answered N s after launch`` when a server first answers
    a generation request of this run (a rollout's or validation's); then the tracker's build
    may start (a deferred :class:`BackgroundTracker`)."""
    event = getattr(pool, "first_answer", None)
    try:
        if event is not None:
            await event.wait()
            phases.reached("first rollout answered")
    finally:
        if isinstance(tracker, BackgroundTracker):
            tracker.start()


async def evaluate_checkpoint(
    cfg: ExperimentConfig, keep: list[Any] | None = None, *, resolved: Resolved | None = None
) -> Any:
    """Serve ``cfg.model.path`` with the configured backend and evaluate it on the held-out
    tasks, as periodic validation does (``trainer.val_*``); returns the ``EvalReport`` (and
    appends the scored trajectories to ``keep`` when given). ``resolved``: the caller's
    resolution of ``cfg`` (``agentrl eval``'s), else ``cfg`` is resolved here."""
    from agentrl.evaluation import evaluate

    if not cfg.model.path:
        raise ValueError("model.path is empty: pass the model directory to evaluate")
    resolved = ensure_resolved(cfg, resolved)
    if not resolved.val_tasks:
        raise ValueError("no held-out tasks: set data.val_files (or data.generator_val_size)")
    t = cfg.trainer
    async with build_serving(cfg) as serving:
        return await evaluate(
            serving.make_manager(temperature=t.val_temperature),
            resolved.val_tasks,
            n=t.val_n,
            temperature=t.val_temperature,
            ks=t.val_k,
            n_bootstrap=t.val_bootstrap_samples,
            seed=t.val_seed,
            keep=keep,
        )
