"""The one training loop: bounded-staleness asynchronous RL for every ``max_staleness``.

Why one loop: synchronous on-policy training (η = 0), one-step-off (η = 1) and fully
asynchronous training (η = k) differ only in how far rollouts may run ahead of the trainer,
which is the admission rule, not a different trainer (verl grew three; we keep one).

Data flow (DESIGN section 1)::

    TaskDataset -> AgentLoopManager.stream (admission: StalenessAdmission(η))
        -> scored Trajectory -> TrajectoryBuffer (GRPO groups; stale groups dropped, counted)
    Trainer.step: batch -> π_old (decoupled) -> correction (IS / RS, diagnostics)
        -> advantages -> Actor.update -> CheckpointEngine.push(v + 1) -> verify
        -> admission.set_version(v + 1) -> metrics to the tracker

Invariants:

- No trained trajectory is staler than η at the step that consumes it (the buffer drops and
  counts the rest, and the admission budget is told, so a replacement episode starts).
- A step is counted once: the version, the step number, the dataset position and the pending
  (dispatched, not yet consumed) tasks are saved together after the weight push, and a resumed
  run re-dispatches the pending tasks first: no admitted task is lost, none trained twice.
- A failed weight push never leaves a server paused (CheckpointEngine's invariant); the trainer
  retries it ``checkpoint.push_retries`` times, then stops with the push report as the error.

Shutdown order: stop admitting (cancel the rollout stream: running episodes end as counted
drops, their tools released) -> close the buffer -> finish the tracker -> stop the servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import correction
from agentrl.algos import compute_advantage
from agentrl.batch import non_tensor_list, trajectories_to_batch
from agentrl.config import ExperimentConfig
from agentrl.inference.client import PolicyClient
from agentrl.inference.handle import ServerHandle
from agentrl.inference.pool import ServerPool
from agentrl.rollout.manager import AgentLoopManager, StalenessAdmission, WorkerConfig
from agentrl.rollout.rewards import RewardManager
from agentrl.threads import ThreadPlan, make_plan
from agentrl.tracking import Tracker, make_tracker, plot_metric_history
from agentrl.training.actor import Actor, ActorConfig, FrozenPolicy
from agentrl.training.buffer import TrajectoryBuffer
from agentrl.training.checkpoint_engine import (
    CheckpointEngine,
    WeightPushError,
    WeightTransport,
    make_transport,
)
from agentrl.training.critic import Critic, CriticConfig, value_metrics
from agentrl.types import SamplingParams, Task, Trajectory
from tools import ToolSet

__all__ = ["TrainResult", "Trainer", "build_tasks", "build_toolset", "evaluate_checkpoint"]

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


@dataclass
class TrainResult:
    steps: int
    version: int
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    val_before: dict[str, float] = field(default_factory=dict)
    val_after: dict[str, float] = field(default_factory=dict)
    run_location: str = ""
    output_dir: str = ""
    wall_time_s: float = 0.0


# ---- building blocks from the config -------------------------------------------------------
def build_toolset(cfg: ExperimentConfig) -> ToolSet:
    """The ``tools`` section as a ToolSet (settings of disabled tools are ignored)."""
    search = cfg.tools.search.model_dump()
    return ToolSet.from_names(
        cfg.tools.enabled,
        options={
            "python": cfg.tools.python.model_dump(),
            **({"search": search} if search.get("corpus_path") else {}),
        },
        timeout_s=cfg.tools.timeout_s,
        max_output_chars=cfg.tools.max_output_chars,
        truncate_side=cfg.tools.truncate_side,
    )


def build_tasks(
    files: list[str], cfg: ExperimentConfig, *, split: str, default_n: int
) -> list[Task]:
    """Tasks from files, or from the configured generator (train and val use different seeds)."""
    from agentrl.rollout.datasets import load_tasks

    if files:
        tasks: list[Task] = []
        for f in files:
            tasks.extend(load_tasks(f))
        return tasks
    if cfg.data.generator is None:
        raise ValueError(f"data.{split}_files is empty and data.generator is null: no tasks")
    if cfg.data.generator != "calculator":
        raise ValueError(f"data.generator={cfg.data.generator!r}; the built-in is 'calculator'")
    from agentrl.rollout.calculator_task import generate_calculator_tasks

    kwargs = dict(cfg.data.generator_kwargs)
    # `n` sizes the training set; the held-out set is `n_val` (default `default_n`), so a big
    # training set does not make every evaluation as long.
    n_train = kwargs.pop("n_train", kwargs.pop("n", default_n))
    n_val = kwargs.pop("n_val", default_n)
    kwargs.pop("n", None)
    n = int(n_train if split == "train" else n_val)
    # Held-out tasks come from another seed: val never overlaps train by construction.
    seed = int(kwargs.pop("seed", cfg.data.seed)) + (0 if split == "train" else 10_000)
    return generate_calculator_tasks(n, seed=seed, **kwargs)


def thread_plan(cfg: ExperimentConfig) -> ThreadPlan:
    """The run's CPU-thread plan: the trainer and each local embedded server get a share."""
    d, inf = cfg.distributed, cfg.inference
    return make_plan(
        inf.num_servers,
        cpus=d.cpus,
        trainer_threads=d.trainer_threads,
        server_threads=d.server_threads,
        pin=d.pin_cpus,
        external_servers=inf.backend != "embedded" or d.backend == "ray",
    )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def _is_correct(t: Trajectory) -> bool:
    correct = t.reward_info.get("correct")
    return bool(correct) if correct is not None else t.reward > 0.5


def advantage_kwargs(a: Any, *, critic: bool) -> dict[str, Any]:
    """The estimator options that ``algorithm`` config ``a`` sets (see ``compute_advantage``).

    GRPO takes its std normalization, REINFORCE++ its discount, GAE (with a critic) gamma and
    lambda; the other estimators take none.
    """
    kwargs: dict[str, Any] = {}
    if a.adv_estimator == "grpo":
        kwargs["norm_adv_by_std_in_grpo"] = a.norm_adv_by_std_in_grpo
    elif a.adv_estimator == "reinforce_plus_plus":
        kwargs["gamma"] = a.gamma
    if critic:
        kwargs.update(gamma=a.gamma, lam=a.lam)
    return kwargs


class Trainer:
    """Owns the servers, the rollout manager, the buffer, the actor and the tracker for one run.

    Use as ``result = await Trainer(cfg).run()`` (or ``Trainer.run_sync``). ``servers`` lets a
    caller pass already-running servers (tests, Ray placement); otherwise the trainer starts the
    configured backend and stops it at the end.
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        resume: bool = False,
        server_urls: list[str] | None = None,
        stop_after_step: int | None = None,
        workers: list[Any] | None = None,
        transport: WeightTransport | None = None,
        progress: bool | None = None,
    ) -> None:
        self.cfg = cfg
        # Ready-made agent-loop workers (e.g. Ray actor adapters with ``run_episode`` and
        # ``counts``, see agentrl.distributed); None = in-process workers over the server pool.
        self._workers = workers
        self.out = Path(cfg.trainer.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.resume = resume
        self.stop_after_step = stop_after_step
        self._server_urls = server_urls
        self._transport_override = transport
        # A rich progress line on an interactive terminal; off in tests / pipes unless asked.
        self._progress_enabled = progress
        self._handles: list[ServerHandle] = []
        self.version = 0
        self.step = 0
        self.corr = cfg.algorithm.correction.to_correction_config()
        self.group_size = cfg.data.n_samples
        self.batch_trajs = cfg.data.batch_size * cfg.data.n_samples
        self._pending: Counter[str] = Counter()
        self._task_by_id: dict[str, Task] = {}
        self._replay: list[Task] = []
        # Task-level accounting of this process (tests assert no admitted task is lost).
        self.dispatched_task_ids: list[str] = []
        self.trained_task_ids: list[str] = []
        self.dropped_task_ids: list[str] = []
        self.dispatched_at_save = 0  # len(dispatched_task_ids) when the last checkpoint was written
        self._rollout_error: BaseException | None = None
        self._max_staleness_seen = 0
        self.tracker: Tracker | None = None
        self.critic: Critic | None = None  # built by run() for algorithm.adv_estimator=gae

    # ---- setup ------------------------------------------------------------------------------
    def _model_dir(self) -> Path:
        if self.cfg.model.path:
            return Path(self.cfg.model.path)
        from agentrl.inference.tiny_model import build_tiny_model

        target = self.out / "tiny-model"
        if not (target / "config.json").exists():
            build_tiny_model(target, seed=self.cfg.trainer.seed)
        return target

    def _start_servers(self, model_dir: Path) -> list[str]:
        cfg = self.cfg.inference
        if self._server_urls is not None:
            return list(self._server_urls)
        if cfg.backend == "external":
            return list(cfg.urls)
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for i in range(cfg.num_servers):
            if cfg.backend == "embedded":
                from agentrl.inference.server import launch_embedded_server

                handle = launch_embedded_server(
                    model_dir,
                    log_path=logs / f"server-{i}.log",
                    env=thread_plan(self.cfg).servers[i].env(),
                    extra_args=[
                        "--max-batch-size",
                        str(cfg.max_batch_size),
                        "--seed",
                        str(self.cfg.trainer.seed + i),
                    ],
                )
            else:
                from agentrl.inference.vllm_backend import launch_vllm_server

                handle = launch_vllm_server(
                    model_dir,
                    python=cfg.vllm_python,
                    log_path=logs / f"vllm-{i}.log",
                    seed=self.cfg.trainer.seed + i,
                    extra_args=cfg.vllm_extra_args,
                )
            self._handles.append(handle)
        return [h.base_url for h in self._handles]

    def _stop_servers(self) -> None:
        for h in self._handles:
            with contextlib.suppress(Exception):
                h.stop()
        self._handles.clear()

    def _optimizer_settings(self, *, lr: float, micro_batch_max_tokens: int) -> dict[str, Any]:
        """The :class:`OptimizerSettings` fields shared by the actor and the critic."""
        t = self.cfg.trainer
        return {
            "lr": lr,
            "weight_decay": t.weight_decay,
            "betas": (float(t.betas[0]), float(t.betas[1])),
            "grad_clip": t.grad_clip,
            "warmup_steps": t.warmup_steps,
            "total_steps": t.total_steps,
            "lr_schedule": t.lr_schedule,
            "micro_batch_max_tokens": micro_batch_max_tokens,
            "ppo_epochs": t.ppo_epochs,
            "mini_batch_size": t.mini_batch_size * self.group_size,
            "loss_agg_mode": self.cfg.algorithm.loss_agg_mode,
        }

    def _critic_config(self) -> CriticConfig:
        t = self.cfg.trainer
        micro = t.critic_micro_batch_max_tokens or t.micro_batch_max_tokens
        return CriticConfig(
            **self._optimizer_settings(lr=t.critic_lr, micro_batch_max_tokens=micro),
            cliprange_value=self.cfg.algorithm.cliprange_value,
        )

    def _actor_config(self) -> ActorConfig:
        a, t = self.cfg.algorithm, self.cfg.trainer
        loss_name = a.policy_loss
        if self.corr.bypass:
            loss_name = "bypass" if self.corr.loss_type.value == "ppo_clip" else "reinforce"
        loss_kwargs: dict[str, Any] = {}
        if loss_name in ("vanilla", "bypass", "gspo", "cispo"):
            loss_kwargs = {"clip_ratio_low": a.clip_ratio_low, "clip_ratio_high": a.clip_ratio_high}
            if loss_name in ("vanilla", "bypass"):
                loss_kwargs["clip_ratio_c"] = a.clip_ratio_c
        return ActorConfig(
            **self._optimizer_settings(lr=t.lr, micro_batch_max_tokens=t.micro_batch_max_tokens),
            temperature=self.cfg.inference.temperature or 1.0,
            policy_loss=loss_name,
            loss_kwargs=loss_kwargs,
            entropy_coeff=a.entropy_coeff,
            use_kl_loss=a.use_kl_loss,
            kl_loss_coef=a.kl_loss_coef,
            kl_loss_type=a.kl_loss_type,
        )

    # ---- task stream with pending-task accounting (resume never loses an admitted task) -------
    def _task_stream(self, dataset: Any) -> Iterator[Task]:
        while self._replay:
            task = self._replay.pop(0)
            self._mark_dispatched(task)
            yield task
        for task in dataset:
            self._mark_dispatched(task)
            yield task

    def _mark_dispatched(self, task: Task) -> None:
        self.dispatched_task_ids.append(task.id)
        self._pending[task.id] += 1
        self._task_by_id[task.id] = task

    def _mark_done(self, task_id: str) -> None:
        self._pending[task_id] -= 1
        if self._pending[task_id] <= 0:
            del self._pending[task_id]

    # ---- checkpoints --------------------------------------------------------------------------
    def _ckpt_dir(self) -> Path:
        return self.out / "checkpoint"

    def _save(self, dataset: Any, admission: StalenessAdmission) -> None:
        ckpt = self._ckpt_dir()
        tmp = ckpt.with_name(ckpt.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(self.actor.state_dict(), tmp / "actor.pt")
        if self.critic is not None:
            torch.save(self.critic.state_dict(), tmp / "critic.pt")
        torch.save(
            {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
            },
            tmp / "rng.pt",
        )
        pending = [
            self._task_by_id[tid].model_dump(mode="json")
            for tid, n in self._pending.items()
            for _ in range(n)
        ]
        state = {
            "step": self.step,
            "version": self.version,
            "dataset": dataset.state_dict(),
            "pending_tasks": pending,
            "consumed_trajectories": self.buffer.consumed,
            "buffer": self.buffer.state_dict(),
            # Diagnostics only: on resume, accepted = consumed (buffered and running episodes
            # were lost with the process; their tasks are in pending_tasks and re-dispatched).
            "admission": {
                "version": admission.version,
                "accepted": admission.accepted,
                "running": admission.running,
            },
            "mlflow_run_id": self.tracker.run_id if self.tracker else None,
        }
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        self.dispatched_at_save = len(self.dispatched_task_ids)
        if ckpt.exists():
            import shutil

            shutil.rmtree(ckpt)
        tmp.rename(ckpt)

    def _load(self) -> dict[str, Any] | None:
        ckpt = self._ckpt_dir()
        if not (ckpt / STATE_FILE).exists():
            return None
        return json.loads((ckpt / STATE_FILE).read_text())

    # ---- evaluation ---------------------------------------------------------------------------
    async def evaluate(
        self, pool: ServerPool, tasks: list[Task], tokenizer: Any
    ) -> dict[str, float]:
        """Held-out accuracy and reward (one greedy-ish sample per task; never trained on)."""
        if not tasks:
            return {}
        manager = AgentLoopManager(
            pool,
            tokenizer,
            tools=build_toolset(self.cfg),
            reward=RewardManager.from_config(self.cfg.reward),
            config=self._worker_config(temperature=0.0),
            max_concurrency=self.cfg.rollout.max_concurrency,
        )
        trajs = await manager.generate(tasks, n_samples=1)
        return {
            "val/accuracy": _mean([float(_is_correct(t)) for t in trajs]),
            "val/reward_mean": _mean([t.reward for t in trajs]),
            "val/tool_calls_mean": _mean([float(sum(t.tool_calls.values())) for t in trajs]),
            "val/num_tasks": float(len(trajs)),
        }

    def _worker_config(self, temperature: float | None = None) -> WorkerConfig:
        inf = self.cfg.inference
        sampling = SamplingParams(
            max_tokens=inf.max_tokens_per_turn,
            temperature=inf.temperature if temperature is None else temperature,
            top_p=inf.top_p,
            top_k=inf.top_k,
        )
        return WorkerConfig.from_config(self.cfg.agent, sampling)

    # ---- the loop -----------------------------------------------------------------------------
    def run_sync(self) -> TrainResult:
        return asyncio.run(self.run())

    async def run(self) -> TrainResult:
        from transformers import AutoTokenizer

        from agentrl.rollout.datasets import TaskDataset

        cfg = self.cfg
        t_start = time.perf_counter()
        _seed_everything(cfg.trainer.seed)
        self.thread_plan = thread_plan(cfg)
        self.thread_plan.trainer.apply()
        logger.info("thread plan: %s", self.thread_plan.describe())
        model_dir = self._model_dir()
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if tokenizer.pad_token_id is None:
            raise ValueError(f"the tokenizer of {model_dir} has no pad token; set one")
        train_tasks = build_tasks(cfg.data.train_files, cfg, split="train", default_n=512)
        val_tasks = build_tasks(cfg.data.val_files, cfg, split="val", default_n=64)
        dataset = TaskDataset(train_tasks, seed=cfg.data.seed, shuffle=cfg.data.shuffle)

        saved = self._load() if self.resume else None
        self.actor = Actor(
            model_dir, self._actor_config(), device=cfg.trainer.device, dtype=cfg.model.dtype
        )
        needs_ref = cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.ref = (
            FrozenPolicy(
                model_dir,
                temperature=self.actor.temperature,
                micro_batch_max_tokens=cfg.trainer.micro_batch_max_tokens,
                device=cfg.trainer.device,
                dtype=cfg.model.dtype,
            )
            if needs_ref
            else None
        )
        # The value model exists only for GAE: other estimators pay no memory or time for it.
        self.critic = (
            Critic(
                model_dir, self._critic_config(), device=cfg.trainer.device, dtype=cfg.model.dtype
            )
            if cfg.algorithm.adv_estimator == "gae"
            else None
        )
        if self.critic is None and cfg.trainer.critic_warmup_steps:
            logger.warning(
                "trainer.critic_warmup_steps=%d is ignored: algorithm.adv_estimator=%r has no "
                "critic (use gae)",
                cfg.trainer.critic_warmup_steps,
                cfg.algorithm.adv_estimator,
            )
        self.buffer = TrajectoryBuffer(
            self.group_size,
            cfg.trainer.max_staleness,
            drop_uniform_reward_groups=cfg.rollout.dynamic_sampling,
        )
        if saved is not None:
            self.actor.load_state_dict(
                torch.load(self._ckpt_dir() / "actor.pt", weights_only=False)
            )
            critic_path = self._ckpt_dir() / "critic.pt"
            if self.critic is not None and critic_path.exists():
                self.critic.load_state_dict(torch.load(critic_path, weights_only=False))
            elif self.critic is not None:
                logger.warning(
                    "%s has no critic.pt (saved by a run without gae): the critic starts fresh",
                    self._ckpt_dir(),
                )
            self.step = int(saved["step"])
            self.version = int(saved["version"])
            dataset.load_state_dict(saved["dataset"])
            self._replay = [Task.model_validate(t) for t in saved["pending_tasks"]]
            self.buffer.load_state_dict(saved["buffer"])
            rng_path = self._ckpt_dir() / "rng.pt"
            if rng_path.exists():
                rng = torch.load(rng_path, weights_only=False)
                random.setstate(rng["python"])
                np.random.set_state(rng["numpy"])
                torch.set_rng_state(rng["torch"])
            logger.info("resumed at step %d (version %d)", self.step, self.version)

        self.tracker = make_tracker(
            enabled=cfg.tracking.enabled,
            backend=cfg.tracking.backend,
            tracking_uri=cfg.tracking.tracking_uri,
            experiment=cfg.tracking.experiment,
            run_name=cfg.tracking.run_name,
            run_id=saved.get("mlflow_run_id") if saved else None,
            local_dir=self.out / "mlruns",
        )
        self.tracker.log_params(cfg.flatten())
        (self.out / "config.yaml").write_text(cfg.to_yaml())

        urls = self._start_servers(model_dir)
        pool = ServerPool(
            urls,
            health_check_interval_s=cfg.inference.health_check_interval_s,
            timeout_s=cfg.inference.request_timeout_s,
        )
        control = [PolicyClient(u, timeout_s=cfg.checkpoint.push_timeout_s) for u in urls]
        transport = self._transport_override or make_transport(
            cfg.checkpoint.transport, cfg.checkpoint.resolved_shared_dir()
        )
        self.engine = CheckpointEngine(
            control,
            transport,
            # `rollout.partial_rollout` and `checkpoint.pause_mode` name the same choice from the
            # rollout and the server side; either one set to `abort` aborts in-flight turns
            # (the agent loop resumes them on the new weights, per-token versions recorded).
            pause_mode=(
                "abort"
                if "abort" in (cfg.rollout.partial_rollout, cfg.checkpoint.pause_mode)
                else "keep"
            ),
            verify=cfg.checkpoint.verify,
            verify_tolerance=cfg.checkpoint.verify_tolerance,
            probe_tokens=cfg.checkpoint.probe_tokens,
            temperature=self.actor.temperature,
            push_timeout_s=cfg.checkpoint.push_timeout_s,
        )
        result = TrainResult(steps=0, version=self.version, output_dir=str(self.out))
        status = "FAILED"
        try:
            pool.start()
            # Every server starts from the trainer's weights at the trainer's version (fresh runs
            # verify the served model is the trained one; resumed runs load the saved weights).
            await self._push(self.version)
            if saved is None and cfg.trainer.val_every >= 0 and val_tasks:
                result.val_before = await self.evaluate(pool, val_tasks, tokenizer)
                self.tracker.log_metrics(result.val_before, step=self.step)
            await self._train(pool, tokenizer, dataset, result)
            if val_tasks:
                result.val_after = await self.evaluate(pool, val_tasks, tokenizer)
                self.tracker.log_metrics(result.val_after, step=self.step)
            self._final_artifacts(tokenizer)
            status = "FINISHED"
        finally:
            await pool.aclose()
            for c in control:
                await c.aclose()
            result.run_location = self.tracker.location
            history = getattr(self.tracker, "history", {})
            result.history = {k: list(v) for k, v in history.items()}
            self.tracker.finish(status)
            self._stop_servers()
            if hasattr(transport, "remove") and cfg.checkpoint.shared_dir is None:
                transport.remove()  # type: ignore[attr-defined]
        result.steps = self.step
        result.version = self.version
        result.wall_time_s = time.perf_counter() - t_start
        return result

    async def _train(
        self, pool: ServerPool, tokenizer: Any, dataset: Any, result: TrainResult
    ) -> None:
        cfg = self.cfg
        admission = StalenessAdmission(
            self.batch_trajs, cfg.trainer.max_staleness, version=self.version
        )
        admission.accepted = self.buffer.consumed
        manager = AgentLoopManager(
            pool,
            tokenizer,
            tools=build_toolset(cfg),
            reward=RewardManager.from_config(cfg.reward),
            config=self._worker_config(),
            num_workers=cfg.rollout.num_workers,
            max_concurrency=cfg.rollout.max_concurrency,
            admission=admission,
            workers=self._workers,
        )
        stream = manager.stream(self._task_stream(dataset), n_samples=self.group_size)

        async def produce() -> None:
            try:
                async for traj in stream:
                    await self.buffer.put(traj)
            except Exception as exc:  # surfaced by the consumer: never a silent hang
                self._rollout_error = exc
                await self.buffer.close()

        producer = asyncio.create_task(produce())
        tokens_total = 0
        try:
            while self.step < cfg.trainer.total_steps:
                t0 = time.perf_counter()
                dropped_before = sum(self.buffer.dropped.values())
                try:
                    groups = await self.buffer.get_groups(cfg.data.batch_size, self.version)
                except Exception:
                    if self._rollout_error is not None:
                        raise RuntimeError("the rollout stream failed") from self._rollout_error
                    raise
                dropped = sum(self.buffer.dropped.values()) - dropped_before
                if dropped:
                    admission.reject(dropped)  # their slots go to replacement episodes
                for task_id in self.buffer.pop_dropped_task_ids():
                    self.dropped_task_ids.append(task_id)
                    self._mark_done(task_id)  # dropped groups are settled, not pending
                t_wait = time.perf_counter() - t0
                trajs = [t for g in groups for t in g]
                metrics = await self.train_step(trajs)
                for g in groups:
                    self.trained_task_ids.append(g[0].task_id)
                    self._mark_done(g[0].task_id)
                self.step += 1
                t1 = time.perf_counter()
                report = await self._push(self.version + 1)
                self.version += 1
                admission.set_version(self.version)
                t_push = time.perf_counter() - t1
                tokens = sum(len(t.response_ids) + len(t.prompt_ids) for t in trajs)
                tokens_total += tokens
                metrics.update(report.metrics())
                metrics.update(self.buffer.metrics())
                metrics.update(manager.stats())
                metrics.update(
                    {
                        "timing_s/wait_rollout": t_wait,
                        "timing_s/push": t_push,
                        "timing_s/step": time.perf_counter() - t0,
                        "perf/tokens_per_s": tokens / max(time.perf_counter() - t0, 1e-9),
                        "async/admission_capacity": float(admission.capacity),
                        "async/running": float(admission.running),
                        "trainer/version": float(self.version),
                    }
                )
                if self.step % cfg.tracking.log_every == 0:
                    assert self.tracker is not None
                    self.tracker.log_metrics(metrics, step=self.step)
                self._log_samples(trajs)
                logger.info(
                    "step %d v%d reward %.3f staleness max %d push %.2fs",
                    self.step,
                    self.version,
                    metrics.get("reward/mean", 0.0),
                    int(metrics.get("async/staleness_max", 0)),
                    t_push,
                )
                self._show_progress(metrics)
                stopping = self.stop_after_step is not None and self.step >= self.stop_after_step
                saving = cfg.trainer.save_every and self.step % cfg.trainer.save_every == 0
                last = stopping or self.step >= cfg.trainer.total_steps
                if saving or (last and cfg.trainer.save_every):
                    self._save(dataset, admission)
                if stopping:
                    break
        finally:
            self._close_progress()
            manager.cancel()
            producer.cancel()
            with contextlib.suppress(BaseException):
                await producer
            with contextlib.suppress(BaseException):
                await stream.aclose()
            await self.buffer.close()

    # ---- console progress (rich) ---------------------------------------------------------------
    def _show_progress(self, metrics: dict[str, float]) -> None:
        """One live line: step, reward, staleness, tokens/s (only on a terminal unless asked)."""
        import sys

        enabled = self._progress_enabled
        if enabled is None:
            enabled = sys.stderr.isatty()
        if not enabled:
            return
        info = (
            f"v{self.version} reward {metrics.get('reward/mean', 0.0):.3f} "
            f"staleness {metrics.get('async/staleness_mean', 0.0):.2f}"
            f"/{int(metrics.get('async/staleness_max', 0))} "
            f"{metrics.get('perf/tokens_per_s', 0.0):.0f} tok/s"
        )
        if not sys.stderr.isatty():
            # Asked for progress but writing to a pipe or a log: one plain line per step.
            print(
                f"[train] step {self.step}/{self.cfg.trainer.total_steps} {info}",
                file=sys.stderr,
                flush=True,
            )
            return
        if getattr(self, "_progress", None) is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(stderr=True),
            )
            self._progress_task = self._progress.add_task(
                "train", total=self.cfg.trainer.total_steps, completed=self.step - 1, info=""
            )
            self._progress.start()
        progress = self._progress
        assert progress is not None
        progress.update(self._progress_task, completed=self.step, info=info)

    def _close_progress(self) -> None:
        progress = getattr(self, "_progress", None)
        if progress is not None:
            progress.stop()
            self._progress = None

    async def _push(self, version: int):
        attempts = 1 + self.cfg.checkpoint.push_retries
        state = self.actor.state_dict_for_push()
        report = None
        for attempt in range(attempts):
            report = await self.engine.push(state, version, score=self.actor.score_tokens)
            if report.ok:
                return report
            logger.warning(
                "weight push attempt %d/%d failed:\n%s", attempt + 1, attempts, report.describe()
            )
        assert report is not None
        raise WeightPushError(report)

    # ---- one optimizer step on a batch of trajectories ----------------------------------------
    async def train_step(self, trajs: list[Trajectory]) -> dict[str, float]:
        cfg, a = self.cfg, self.cfg.algorithm
        m: dict[str, float] = {}
        t0 = time.perf_counter()
        staleness = [t.staleness(self.version) for t in trajs]
        self._max_staleness_seen = max(self._max_staleness_seen, max(staleness))
        if max(staleness) > cfg.trainer.max_staleness:
            raise AssertionError(
                f"a trajectory with staleness {max(staleness)} > trainer.max_staleness="
                f"{cfg.trainer.max_staleness} reached the trainer (buffer invariant broken)"
            )
        batch = trajectories_to_batch(trajs, pad_token_id=self._pad_id())
        mask = batch["response_mask"].float()
        rollout = batch["rollout_log_probs"]
        loop = asyncio.get_running_loop()
        if self.corr.needs_old_log_probs:
            old = await loop.run_in_executor(None, self.actor.compute_log_probs, batch)
            batch["old_log_probs"] = old
            train_lp = old
        else:
            batch["old_log_probs"] = rollout.clone()
            train_lp = None
            if self.corr.is_level is not None or self.corr.rs_rules:
                train_lp = await loop.run_in_executor(None, self.actor.compute_log_probs, batch)
        m["timing_s/old_log_prob"] = time.perf_counter() - t0
        if train_lp is not None:
            # ℓ = train − rollout is formed inside the pass, block by block (the fast path).
            out = correction.apply_correction(
                self.corr, None, mask, rollout_log_probs=rollout, train_log_probs=train_lp
            )
            if out.weights is not None:
                batch["rollout_is_weights"] = out.weights
            batch["response_mask"] = out.response_mask.to(batch["response_mask"].dtype)
            m.update({f"rollout_corr/{k}": v for k, v in out.metrics.items()})
        if self.ref is not None:
            batch["ref_log_prob"] = await loop.run_in_executor(
                None, self.ref.compute_log_probs, batch
            )
        scores = batch["token_level_scores"]
        batch["token_level_rewards"] = scores
        uids = non_tensor_list(batch, "uid")
        adv_kwargs = advantage_kwargs(a, critic=self.critic is not None)
        values: torch.Tensor | None = None
        if self.critic is not None:
            # V(s_t) of the post-RS sampled tokens, before the critic's update on this batch.
            t_v = time.perf_counter()
            values = await loop.run_in_executor(None, self.critic.compute_values, batch)
            batch["values"] = values
            m["timing_s/values"] = time.perf_counter() - t_v
        adv, returns = compute_advantage(
            a.adv_estimator,
            batch["token_level_rewards"],
            batch["response_mask"].float(),
            index=uids,
            values=values,
            **adv_kwargs,
        )
        batch["advantages"] = adv
        batch["returns"] = returns
        # Critic warmup: the first `critic_warmup_steps` steps train only the critic. The actor's
        # weights, optimizer and LR schedule stay untouched; the step still pushes (same weights,
        # new version), so versions and staleness advance as on any other step.
        frozen = self.critic is not None and self.step < cfg.trainer.critic_warmup_steps
        if self.critic is not None:
            assert values is not None
            m.update(value_metrics(values, returns, batch["response_mask"]))
            t_c = time.perf_counter()
            m.update(await loop.run_in_executor(None, self.critic.update, batch))
            m["timing_s/update_critic"] = time.perf_counter() - t_c
            m["actor/frozen"] = float(frozen)
        first_lp: torch.Tensor | None = None
        if not frozen:
            t1 = time.perf_counter()
            actor_metrics, first_lp = await loop.run_in_executor(
                None, self.actor.update_with_log_probs, batch
            )
            m["timing_s/update_actor"] = time.perf_counter() - t1
            m.update(actor_metrics)
        if train_lp is None:
            # Bypass without IS/RS: diagnostics from the first update pass (π_θ before the step),
            # or, while the actor is frozen, from one forward pass of the unchanged policy.
            theta_lp: torch.Tensor = (
                first_lp
                if first_lp is not None
                else await loop.run_in_executor(None, self.actor.compute_log_probs, batch)
            )
            diag = correction.offpolicy_metrics(theta_lp, rollout, mask)
            m.update({f"rollout_corr/{k}": v for k, v in diag.items()})
        rewards = [t.reward for t in trajs]
        m.update(
            {
                "reward/mean": _mean(rewards),
                "reward/max": max(rewards),
                "reward/min": min(rewards),
                "reward/accuracy": _mean([float(_is_correct(t)) for t in trajs]),
                "async/staleness_mean": _mean([float(s) for s in staleness]),
                "async/staleness_max": float(max(staleness)),
                "rollout/response_length_mean": _mean([float(len(t.response_ids)) for t in trajs]),
                "rollout/num_turns_mean": _mean([float(t.num_turns) for t in trajs]),
                "rollout/tool_calls_mean": _mean(
                    [float(sum(t.tool_calls.values())) for t in trajs]
                ),
                "critic/advantages_mean": float((adv * mask).sum() / mask.sum().clamp(min=1)),
                "critic/advantages_abs_max": float(adv.abs().max()),
            }
        )
        for reason, n in Counter(t.stop_reason.value for t in trajs).items():
            m[f"rollout/stop_reason/{reason}"] = float(n) / len(trajs)
        return m

    def _pad_id(self) -> int:
        from transformers import AutoTokenizer

        if not hasattr(self, "_pad"):
            tok = AutoTokenizer.from_pretrained(str(self._model_dir()))
            self._pad = int(tok.pad_token_id)
        return self._pad

    def _log_samples(self, trajs: list[Trajectory]) -> None:
        n = self.cfg.tracking.num_sample_trajectories
        if not n or self.tracker is None:
            return
        every = max(1, self.cfg.trainer.total_steps // 5)
        if self.step % every and self.step != 1:
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
            for t in trajs[:n]
        ]
        self.tracker.log_dict(rows, f"trajectories/step_{self.step:05d}.json")

    def _final_artifacts(self, tokenizer: Any) -> None:
        assert self.tracker is not None
        final = self.out / "final_model"
        self.actor.save_pretrained(final)
        tokenizer.save_pretrained(final)
        self.tracker.log_artifact(self.out / "config.yaml")
        history = getattr(self.tracker, "history", {})
        plots = self.out / "plots"
        plots.mkdir(exist_ok=True)
        for name, keys in {
            "reward": ["reward/mean", "reward/accuracy", "val/accuracy"],
            "staleness": ["async/staleness_mean", "async/staleness_max"],
            "is_weights": ["rollout_corr/is_weight_mean", "rollout_corr/is_weight_max"],
            "kl": ["rollout_corr/kl", "rollout_corr/k3_kl", "actor/ppo_kl"],
        }.items():
            png = plot_metric_history(history, keys, plots / f"{name}.png")
            if png is not None:
                self.tracker.log_artifact(png, "plots")
        self.tracker.log_artifact(final, "final_model")


async def evaluate_checkpoint(cfg: ExperimentConfig) -> dict[str, float]:
    """Serve ``cfg.model.path`` with the configured backend and report held-out metrics."""
    from transformers import AutoTokenizer

    if not cfg.model.path:
        raise ValueError("model.path is empty: pass the model directory to evaluate")
    trainer = Trainer(cfg)
    model_dir = Path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tasks = build_tasks(cfg.data.val_files, cfg, split="val", default_n=64)
    urls = trainer._start_servers(model_dir)
    pool = ServerPool(urls, health_check_interval_s=None, timeout_s=cfg.inference.request_timeout_s)
    try:
        return await trainer.evaluate(pool, tasks, tokenizer)
    finally:
        await pool.aclose()
        trainer._stop_servers()
