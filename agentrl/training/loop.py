"""The one training loop: bounded-staleness asynchronous RL for every ``max_staleness``.

Why one loop: synchronous on-policy training (η = 0), one-step-off (η = 1) and fully
asynchronous training (η = k) differ only in how far rollouts may run ahead of the trainer,
which is the admission rule, not a different trainer (verl grew three; we keep one).

Data flow (DESIGN section 1)::

    RunState.task_stream -> AgentLoopManager.stream (admission: StalenessAdmission(η))
        -> scored Trajectory -> TrajectoryBuffer (GRPO groups; stale groups dropped, counted)
    train_step(batch) -> CheckpointEngine.push(v + 1), verified -> admission.set_version(v + 1)
        -> metrics to the reporters (tracker, progress, samples, plots)

Invariants:

- No trained trajectory is staler than η at the step that consumes it (the buffer drops and
  counts the rest, and the admission budget is told, so replacement episodes start).
- Every dispatched task is trained, dropped (counted) or pending, and pending tasks are saved
  with the step (:mod:`agentrl.training.state`), so resume loses none and trains none twice.
- An episode that ends without a trajectory (a reward that failed, a prompt over the limit)
  or whose agent raised (``stop_reason=error``, counted ``rollout/dropped/agent_error``) drops
  its whole group (counted ``incomplete_group``), never a 0.0 reward or a broken episode that
  is trained on.
  When a batch's worth of episodes in a row end that way or with ``stop_reason=error``, or a
  drop is fatal by configuration, the run stops with the first error — never a zero-gradient
  step, never rc 0 on a run that learned nothing.
- A failed weight push never leaves a server paused (CheckpointEngine's invariant); it is
  retried ``checkpoint.push_retries`` times, then the run stops with the push report.
- Colocated mode (``distributed.colocate``): no generation runs while the trainer updates.
  Each step, once its batch is in: admission holds (no episode starts), the policy servers
  sleep (level 2 when this step pushes full weights, else 1), the trainer updates and gives
  the memory it freed back to the OS, the push wakes them with the new version, verified (a step without a push wakes them without one),
  admission resumes. Episodes still running when the servers sleep are held, not dropped: their
  next tokens come from the new version (per-token versions say so), staleness ≤ η as always.
- A server of the run's own that dies is ejected, restarted and rejoins at the version of the
  next verified push (``run.servers``, :mod:`agentrl.training.run_servers`); pushes go on on
  the live servers meanwhile. Once every server failed for good the run stops (RunFailed).

Shutdown order: stop admitting (cancel the rollout stream: running episodes end as counted
drops, their tools released) -> close the buffer -> reporters -> (the builder's exit stack)
stop the servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.rollout.manager import EpisodeKey, StalenessAdmission
from agentrl.training.buffer import TrajectoryBuffer
from agentrl.training.build import Run
from agentrl.training.errors import RunFailed
from agentrl.training.metrics import (
    TokenCounts,
    compute_data_metrics,
    compute_reward_component_metrics,
    compute_rollout_timing_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    compute_tool_metrics,
)
from agentrl.training.state import RunState
from agentrl.training.step import train_step, trajectory_metrics
from agentrl.types import StopReason, Trajectory
from agentrl.weightsync.engine import PushReport, WeightPushError

__all__ = ["RunFailed", "TrainResult", "push_weights", "train", "validate"]

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished run reports."""

    steps: int
    version: int
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    val_before: dict[str, float] = field(default_factory=dict)
    val_after: dict[str, float] = field(default_factory=dict)
    val_history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    run_location: str = ""
    output_dir: str = ""
    wall_time_s: float = 0.0
    episodes: dict[str, float] = field(default_factory=dict)
    """The run's episode counters at the end (:meth:`RolloutFeed.counts`): admitted, finished,
    dropped and errors by reason; what the printed summary and the failure check read."""


class _Admission(StalenessAdmission):
    """AReaL's admission rule, plus what the loop must hear about each finished episode."""

    def __init__(
        self, feed: RolloutFeed, batch_size: int, max_staleness: int, version: int, warmup: int
    ) -> None:
        super().__init__(batch_size, max_staleness, version=version, warmup=warmup)
        self.feed = feed

    def on_finished(self, key: EpisodeKey, traj: Trajectory | None) -> None:
        super().on_finished(key, traj)
        self.feed.episode_finished(key, traj)


class RolloutFeed:
    """The rollout side of the loop: admission, the manager's stream, the buffer, failures."""

    def __init__(self, run: Run, state: RunState, dataset: Any) -> None:
        cfg, plan = run.cfg, run.resolved.plan
        self.greedy = plan.advantage.needs_greedy_baseline
        self.group = cfg.data.n_samples + (1 if self.greedy else 0)
        self.batch_groups = cfg.data.batch_size
        self.buffer = TrajectoryBuffer(
            self.group,
            cfg.trainer.max_staleness,
            drop_uniform_reward_groups=cfg.rollout.dynamic_sampling,
        )
        if state.buffer:
            self.buffer.load_state_dict(state.buffer)
        self.admission = _Admission(
            self,
            self.batch_groups * self.group,
            cfg.trainer.max_staleness,
            state.version,
            cfg.trainer.staleness_warmup_steps,
        )
        self.admission.accepted = self.buffer.consumed
        self.manager = run.make_manager(admission=self.admission, greedy_baseline=self.greedy)
        self.max_uniform_drops = cfg.rollout.max_sampling_rounds * self.batch_groups
        self.agent_errors = 0
        """Episodes whose agent raised (``stop_reason=error``), dropped with their group."""
        self._failures_in_a_row = 0
        self._first_failure: str | None = None
        self._fatal: str | None = None
        self._error: BaseException | None = None
        if run.servers is not None:
            run.servers.on_lost(self.fail)
        self.last_trajs: list[Trajectory] = []
        self._stream = self.manager.stream(state.task_stream(dataset), n_samples=self.group)
        self._producer = asyncio.create_task(self._produce())

    async def _produce(self) -> None:
        try:
            async for traj in self._stream:
                if traj.stop_reason is StopReason.ERROR:
                    continue  # a counted drop (episode_finished): never trained on
                if not await self.buffer.put(traj):
                    self.admission.reject(1)  # a member of a dropped group: replace it
        except Exception as exc:  # surfaced by the consumer: never a silent hang
            self._error = exc
            await self.buffer.close()

    def episode_finished(self, key: EpisodeKey, traj: Trajectory | None) -> None:
        """Count failures in a row; drop the whole group of an episode that has no usable
        trajectory (none, or ``stop_reason=error``: its agent raised; counted ``agent_error``)."""
        if traj is not None and traj.stop_reason is StopReason.ERROR:
            self.agent_errors += 1
            self.admission.reject(1)  # accepted by on_finished, thrown away here
        if traj is None or traj.stop_reason is StopReason.ERROR:
            n = self.buffer.discard_group_nowait(key.uid, key.task_id)
            if n:
                self.admission.reject(n)
        if traj is None:
            failures = self.manager.failures
            reason, message = failures[-1] if failures else ("dropped", "episode dropped")
            if reason == "prompt_too_long" and "data.overlong_prompts" in message:
                self._fatal = message
            failed = True
        else:
            failed = traj.stop_reason is StopReason.ERROR
            message = f"episode {traj.uid}/{traj.index} ended with an error: {traj.error}"
        if not failed:
            self._failures_in_a_row = 0
            return
        self._first_failure = self._first_failure or message
        self._failures_in_a_row += 1
        if self._fatal is not None or self._failures_in_a_row >= self.admission.batch_size:
            asyncio.get_running_loop().create_task(self.buffer.close())

    def fail(self, message: str) -> None:
        """Stop the run: the batch being waited for raises :class:`RunFailed` with ``message``."""
        self._fatal = self._fatal or message
        asyncio.get_running_loop().create_task(self.buffer.close())

    def _raise_if_failed(self) -> None:
        if self._fatal is not None:
            raise RunFailed(self._fatal)
        if self._failures_in_a_row >= self.admission.batch_size:
            raise RunFailed(
                f"{self._failures_in_a_row} episodes in a row ended without a usable trajectory "
                f"(a batch is {self.admission.batch_size}); nothing could be trained on. First "
                f"error: {self._first_failure}"
            )
        if self._error is not None:
            raise RunFailed(f"the rollout stream failed: {self._error}") from self._error

    async def next_batch(self, version: int) -> tuple[list[list[Trajectory]], float]:
        """``data.batch_size`` usable groups at ``version`` (and the seconds waited for them)."""
        t0 = time.perf_counter()
        uniform_before = self.buffer.dropped["uniform_reward"]
        dropped_before = sum(self.buffer.dropped.values())
        try:
            groups = await self.buffer.get_groups(self.batch_groups, version)
        except Exception:
            self._raise_if_failed()
            raise
        self._raise_if_failed()
        dropped = sum(self.buffer.dropped.values()) - dropped_before
        if dropped:
            self.admission.reject(dropped)  # their slots go to replacement episodes
        uniform = (self.buffer.dropped["uniform_reward"] - uniform_before) // self.group
        if uniform > self.max_uniform_drops:
            raise RunFailed(
                f"dynamic sampling dropped {uniform} uniform-reward groups to fill one batch "
                f"(rollout.max_sampling_rounds={self.max_uniform_drops // self.batch_groups} x "
                f"{self.batch_groups} groups); the task is too easy or too hard for the policy"
            )
        return groups, time.perf_counter() - t0

    def counts(self) -> dict[str, float]:
        """The run's episode counts so far: the manager's ``rollout/`` counters, the buffer's
        drops (``async/dropped_*_total``) and ``rollout/dropped/agent_error``."""
        out = self.manager.stats()
        out.update(self.buffer.metrics())
        out["rollout/dropped/agent_error"] = float(self.agent_errors)
        return out

    def split(self, groups: list[list[Trajectory]]) -> tuple[list[Trajectory], torch.Tensor | None]:
        """The trajectories to train on, and ReMax's greedy baseline reward per row."""
        if not self.greedy:
            return [t for g in groups for t in g], None
        trajs, baselines = [], []
        for g in groups:
            greedy = [t for t in g if t.index == self.group - 1]
            sampled = [t for t in g if t.index != self.group - 1]
            trajs.extend(sampled)
            baselines.extend([greedy[0].reward] * len(sampled))
        return trajs, torch.tensor(baselines, dtype=torch.float32)

    async def close(self) -> None:
        """Stop admitting, cancel running episodes (counted drops), close the buffer."""
        self.manager.cancel()
        self._producer.cancel()
        with contextlib.suppress(BaseException):
            await self._producer
        with contextlib.suppress(BaseException):
            await self._stream.aclose()
        await self.buffer.close()


async def push_weights(run: Run, version: int) -> PushReport:
    """Push the actor's weights as ``version`` to every server, verified (through
    ``run.servers`` when it watches them: the live ones and those rejoining); retried
    ``checkpoint.push_retries`` times, then :class:`WeightPushError` with the report."""
    actor = run.policies.actor
    attempts = 1 + run.cfg.checkpoint.push_retries
    state = actor.state_dict_for_push()
    engine = run.servers if run.servers is not None else run.engine
    report = None
    for attempt in range(attempts):
        report = await engine.push(state, version, score=actor.score_tokens)
        if report.ok:
            return report
        logger.warning(
            "weight push attempt %d/%d failed:\n%s", attempt + 1, attempts, report.describe()
        )
    assert report is not None
    raise WeightPushError(report)


async def validate(run: Run, step: int, reporters: Sequence[Any]) -> dict[str, float]:
    """Held-out evaluation (never trained on): ``trainer.val_n`` samples per task at
    ``trainer.val_temperature``, verl's statistics per data source (mean_at_N, best/worst/maj_at_k,
    pass_at_k; :mod:`agentrl.evaluation`), reported at ``step``. The rollout stream keeps
    generating meanwhile; validation itself runs on the weights of ``step``."""
    from agentrl.evaluation import evaluate

    tasks = run.resolved.val_tasks if run.resolved is not None else []
    if not tasks:
        return {}
    t = run.cfg.trainer
    manager = run.make_manager(temperature=t.val_temperature)
    report = await evaluate(
        manager,
        tasks,
        n=t.val_n,
        temperature=t.val_temperature,
        ks=t.val_k,
        n_bootstrap=t.val_bootstrap_samples,
        seed=t.val_seed,
    )
    for r in reporters:
        r.on_validation(step, report.metrics, report)
    return dict(report.metrics)


async def train(
    run: Run,
    state: RunState,
    dataset: Any,
    *,
    reporters: Sequence[Any] = (),
    stop_after_step: int | None = None,
    push: Callable[[int], Awaitable[PushReport]] | None = None,
) -> TrainResult:
    """Train ``run`` from ``state`` until ``trainer.total_steps`` (or ``stop_after_step``).

    ``push(version)`` pushes the actor's weights (default :func:`push_weights`).
    """
    t = run.cfg.trainer
    push = push or functools.partial(push_weights, run)
    result = TrainResult(steps=state.step, version=state.version, output_dir=str(run.output_dir))
    # Every run starts by pushing its weights at its version: the servers provably serve the
    # trainer's weights (fresh: the initial model; resumed: the saved one) before any rollout.
    t0 = time.perf_counter()
    await push(state.version)
    logger.info("start-up: weights v%d pushed in %.1f s", state.version, time.perf_counter() - t0)
    if t.val_before_train and not state.resumed:
        t0 = time.perf_counter()
        result.val_before = await validate(run, state.step, reporters)
        logger.info("start-up: validation before training in %.1f s", time.perf_counter() - t0)
    feed = RolloutFeed(run, state, dataset)
    logger.info("training: steps %d..%d, first batch on its way", state.step + 1, t.total_steps)
    try:
        while state.step < t.total_steps:
            metrics = await _one_step(run, state, feed, push)
            for r in reporters:
                r.on_step(state.step, state.version, metrics, feed.last_trajs)
            if t.val_every and state.step % t.val_every == 0 and state.step < t.total_steps:
                result.val_history.append((state.step, await validate(run, state.step, reporters)))
            stopping = stop_after_step is not None and state.step >= stop_after_step
            last = stopping or state.step >= t.total_steps
            if (t.save_every and state.step % t.save_every == 0) or (last and t.save_every):
                _save(run, state, dataset, feed)
            if stopping:
                break
    finally:
        await feed.close()
        result.episodes = feed.counts()
    if t.val_at_end and state.step >= t.total_steps:
        result.val_after = await validate(run, state.step, reporters)
    result.steps, result.version = state.step, state.version
    return result


async def _one_step(
    run: Run, state: RunState, feed: RolloutFeed, push: Callable[[int], Awaitable[PushReport]]
) -> dict[str, float]:
    """Wait for a batch, train on it, push the new version; the step's metrics."""
    cfg = run.cfg
    t0 = time.perf_counter()
    groups, waited = await feed.next_batch(state.version)
    for task_id in feed.buffer.pop_dropped_task_ids():
        state.dropped(task_id)
    trajs, baselines = feed.split(groups)
    plan = run.resolved.plan
    frozen = plan.needs_critic and state.step < cfg.trainer.critic_warmup_steps
    pushes = (state.step + 1) % cfg.checkpoint.push_every == 0 or (
        state.step + 1 >= cfg.trainer.total_steps
    )
    colocated = await _sleep_servers(run, feed, pushes) if cfg.distributed.colocate else {}
    out = await train_step(
        trajs,
        run.policies,
        plan,
        pad_token_id=run.pad_token_id,
        train_actor=not frozen,
        reward_baselines=baselines,
        version=state.version,
    )
    for g in groups:
        state.trained(g[0].task_id)
    state.step += 1
    t1 = time.perf_counter()
    state.version += 1
    report = None
    if cfg.distributed.colocate:
        colocated.update(_trim_trainer())
    if pushes:
        report = await push(state.version)
    if cfg.distributed.colocate:
        colocated.update(await _wake_servers(run, feed))
    feed.admission.set_version(state.version)
    feed.last_trajs = trajs
    m = out.metrics
    m.update(trajectory_metrics(trajs, state.version - 1, out.batch))
    m.update(
        compute_data_metrics(
            out.batch,
            trajs,
            max_response_tokens=cfg.agent.max_response_tokens,
            max_prompt_tokens=cfg.data.max_prompt_tokens,
        )
    )
    m.update(compute_rollout_timing_metrics(trajs))
    m.update(compute_tool_metrics(trajs))
    m.update(compute_reward_component_metrics(trajs))
    if report is not None:
        m.update(report.metrics())
    m.update(colocated)
    m.update(feed.buffer.metrics())
    m.update(feed.counts())
    m.update(run.rewards.metrics())
    if run.servers is not None:
        m.update(run.servers.metrics())
    counts = TokenCounts.from_trajectories(trajs)
    elapsed = time.perf_counter() - t0
    phases = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("timing_s/")}
    phases.update(wait_rollout=waited, push=time.perf_counter() - t1, step=elapsed)
    m.update(compute_timing_metrics(phases, counts))
    m.update(compute_throughput_metrics(counts, elapsed))
    m.update(
        {
            "perf/tokens_per_s": counts.total / max(elapsed, 1e-9),
            "async/admission_capacity": float(feed.admission.capacity),
            "async/staleness_bound": float(feed.admission.staleness_bound),
            "async/running": float(feed.admission.running),
            "trainer/version": float(state.version),
        }
    )
    if state.step == 1:
        m.update(_model_size(run))
        if "startup" in run.timings:
            m["timing_s/startup"] = run.timings["startup"]
    return m


async def _sleep_servers(run: Run, feed: RolloutFeed, pushes: bool) -> dict[str, float]:
    """Colocated mode, before the update: hold admission and put the policy servers to sleep
    (level 2 when this step pushes full weights: they are replaced anyway; else level 1)."""
    level = 2 if pushes and run.cfg.model.lora.rank == 0 else 1
    feed.admission.hold()
    t0 = time.perf_counter()
    answers = await run.engine.sleep(level)
    elapsed = time.perf_counter() - t0
    logger.debug("colocate: %d server(s) asleep at level %d", len(answers), level)
    return {
        "colocate/sleep_level": float(level),
        "colocate/slept_servers": float(len(answers)),
        "colocate/sleep_s": elapsed,
        "colocate/freed_bytes": float(sum(a.get("freed_bytes", 0) for a in answers.values())),
        "colocate/server_rss_asleep_bytes": float(
            sum(a.get("rss_after", 0) for a in answers.values())
        ),
    }


def _trim_trainer() -> dict[str, float]:
    """Colocated mode, after the update, before the servers wake: give the update's freed
    memory (activations, temporaries) back to the OS, which the C allocator would otherwise keep
    (on a CPU the servers wake into the same memory); the trainer's resident bytes after it."""
    from agentrl.inference.engine.sleep import resident_bytes, trim_host_memory

    trim_host_memory()
    return {"colocate/trainer_rss_bytes": float(resident_bytes())}


async def _wake_servers(run: Run, feed: RolloutFeed) -> dict[str, float]:
    """Colocated mode, after the push: wake servers the push did not (a step without a push)
    and let episodes start again."""
    out: dict[str, float] = {}
    if run.engine.sleeping:
        t0 = time.perf_counter()
        woken = await run.engine.wake_up()
        out = {"colocate/woken_servers": float(woken), "colocate/wake_s": time.perf_counter() - t0}
    feed.admission.release()
    return out


def _model_size(run: Run) -> dict[str, float]:
    """``model/params``, ``model/trainable_params`` and the optimizer state's bytes (LoRA's
    saving shows here), logged once."""
    actor = run.policies.actor
    model = getattr(actor, "model", None)
    if model is None:
        return {}
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    optim = getattr(actor, "optimizer", None)
    state_bytes = 0
    if optim is not None:
        for st in optim.state.values():
            state_bytes += sum(
                v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor)
            )
    return {
        "model/params": float(sum(p.numel() for p in params)),
        "model/trainable_params": float(sum(p.numel() for p in trainable)),
        "model/optimizer_state_bytes": float(state_bytes),
    }


def _save(run: Run, state: RunState, dataset: Any, feed: RolloutFeed) -> None:
    plan = run.resolved.plan
    kl = plan.kl_in_reward.controller.value if plan.kl_in_reward is not None else None
    state.save(
        run.output_dir / "checkpoint",
        dataset=dataset,
        buffer=feed.buffer,
        actor=run.policies.actor,
        critic=run.policies.critic,
        admission=feed.admission,
        kl_coef=kl,
        mlflow_run_id=run.tracker.run_id if run.tracker is not None else None,
    )
