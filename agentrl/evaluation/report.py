"""Run a held-out evaluation (each task ``n`` times) and report it as metrics, JSON and a table.

Why it exists: periodic validation in the trainer and ``agentrl eval`` must compute the same
numbers the same way. :func:`evaluate` runs the tasks through anything with
``async generate(tasks, n_samples) -> list[Trajectory]`` (an
:class:`~agentrl.rollout.manager.AgentLoopManager`, or a plain async function), turns each
trajectory into a :class:`~agentrl.evaluation.stats.ValSample` and returns an
:class:`EvalReport`: flat metrics for :meth:`agentrl.tracking.Tracker.log_metrics`, a JSON
document, and rows for :meth:`agentrl.tracking.Tracker.log_dict` (:func:`log_report`).

What each sample contributes:

- ``reward``: ``traj.reward``; ``acc``: 1.0 when :func:`is_correct` (``reward_info["correct"]``
  when the reward function reports it, else ``reward > 0.5``, the trainer's
  ``reward/accuracy`` rule); pass_at_k uses the same flag;
- the vote for maj_at_k (:func:`answer_of`): ``reward_info["answer"]`` when the reward function
  reports that key (None there abstains), else the marked answer of the final assistant message
  (``\\boxed{}`` or ``####``, :func:`agentrl.rollout.rewards.extract_answer`); numbers are
  canonicalised (``"42.0"`` and ``"42"`` vote together), text is whitespace-collapsed;
- a trajectory whose reward function failed (``reward_info["error"]``) is not a known wrong
  answer: it is left out of every statistic and counted in ``val/reward_errors``.

Guarantees: importing this module imports no server, tokenizer or tracker; the report is plain
data (pydantic) and round-trips JSON; with the same trajectories and seed the numbers are
identical. Evaluation never trains: the caller gives a manager built for evaluation (its own
sampling temperature, no admission control).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from agentrl.evaluation.stats import (
    ValSample,
    default_ks,
    flatten_statistics,
    validation_statistics,
)
from agentrl.rollout.answers import extract_answer, final_answer_text, parse_number
from agentrl.types import StopReason, Task, Trajectory

if TYPE_CHECKING:
    from agentrl.tracking import Tracker

__all__ = [
    "EpisodeGenerator",
    "EvalReport",
    "TaskResult",
    "answer_of",
    "evaluate",
    "is_correct",
    "log_report",
    "report_from_trajectories",
]

logger = logging.getLogger(__name__)

GenerateFn = Callable[[Sequence[Task], int], Awaitable[list[Trajectory]]]
"""``async fn(tasks, n_samples) -> trajectories`` (every task run ``n_samples`` times)."""


@runtime_checkable
class EpisodeGenerator(Protocol):
    """Anything with the AgentLoopManager's ``generate`` (a fake in tests)."""

    async def generate(self, tasks: Sequence[Task], n_samples: int = 1) -> list[Trajectory]:
        """Run every task ``n_samples`` times; the trajectories, scored."""
        ...


def is_correct(traj: Trajectory) -> bool:
    """``reward_info["correct"]`` when the reward reports it, else ``reward > 0.5``."""
    correct = traj.reward_info.get("correct")
    return bool(correct) if correct is not None else traj.reward > 0.5


def _canonical(answer: Any) -> str | None:
    if answer is None:
        return None
    text = " ".join(str(answer).split())
    if not text:
        return None
    number = parse_number(text)
    return str(number) if number is not None else text


def answer_of(traj: Trajectory) -> str | None:
    """The answer ``traj`` votes for in maj_at_k (None abstains); rule in the module docstring."""
    if "answer" in traj.reward_info:
        return _canonical(traj.reward_info["answer"])
    return _canonical(extract_answer(final_answer_text(traj)))


class TaskResult(BaseModel):
    """One task's samples, for the JSON report (in sample order)."""

    task_id: str
    uid: str
    data_source: str
    rewards: list[float]
    correct: list[bool]
    answers: list[str | None]
    stop_reasons: list[str]
    reward_info: list[dict[str, Any]] = Field(default_factory=list)
    """Each sample's ``reward_info`` (the reward's components, its answer, an error)."""


class EvalReport(BaseModel):
    """The result of one evaluation: flat metrics, statistics per data source, per-task samples."""

    n: int
    """Samples per task that were asked for."""
    temperature: float | None
    """Sampling temperature of the evaluation (None = not recorded)."""
    prefix: str = "val"
    """First segment of every metric key."""
    ks: list[int]
    """pass_at_k sizes."""
    n_bootstrap: int
    seed: int
    num_tasks: int
    """Tasks asked for."""
    num_samples: int
    """Trajectories returned (including those left out for reward errors)."""
    wall_time_s: float
    metrics: dict[str, float]
    """Flat ``{prefix}/...`` keys (see docs/tracking.md), ready for ``Tracker.log_metrics``."""
    per_source: dict[str, dict[str, float]]
    """``{data_source: {key: value}}`` from :func:`~agentrl.evaluation.stats.validation_statistics`."""
    tasks: list[TaskResult] = Field(default_factory=list)

    def log(self, tracker: Tracker, *, step: int, artifact_dir: str = "eval") -> None:
        """:func:`log_report` of this report (reporters call it without importing this module)."""
        log_report(tracker, self, step=step, artifact_dir=artifact_dir)

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON (:meth:`from_json` reads it back)."""
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, data: str | bytes) -> EvalReport:
        """A report from :meth:`to_json` output (validated)."""
        return cls.model_validate_json(data)

    def rows(self, step: int | None = None) -> list[dict[str, Any]]:
        """The table: one row per ``(data_source, metric)`` (``data_source`` is ``"all"`` for the
        summary keys), with a ``step`` column when ``step`` is given (rows of several
        evaluations concatenate into one table over steps)."""
        out: list[dict[str, Any]] = []
        for source, stats in sorted(self.per_source.items()):
            for metric, value in sorted(stats.items()):
                out.append({"data_source": source, "metric": metric, "value": value})
        summary = f"{self.prefix}/"
        for key, value in sorted(self.metrics.items()):
            rest = key[len(summary) :]
            if "/" not in rest:
                out.append({"data_source": "all", "metric": rest, "value": value})
        if step is not None:
            out = [{"step": step, **row} for row in out]
        return out


def _samples(trajs: Sequence[Trajectory]) -> tuple[list[ValSample], int]:
    samples, errors = [], 0
    for t in trajs:
        if "error" in t.reward_info:
            errors += 1
            continue
        ok = is_correct(t)
        samples.append(
            ValSample(
                data_source=t.data_source,
                group=t.uid,
                values={"reward": float(t.reward), "acc": float(ok)},
                answer=answer_of(t),
                correct=ok,
            )
        )
    return samples, errors


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def _summary(
    trajs: Sequence[Trajectory], scored: Sequence[Trajectory], prefix: str
) -> dict[str, float]:
    """Overall means (the keys the trainer logged before per-source statistics existed)."""
    return {
        f"{prefix}/accuracy": _mean([float(is_correct(t)) for t in scored]),
        f"{prefix}/reward_mean": _mean([t.reward for t in scored]),
        f"{prefix}/tool_calls_mean": _mean([float(sum(t.tool_calls.values())) for t in trajs]),
        f"{prefix}/num_turns_mean": _mean([float(t.num_turns) for t in trajs]),
        f"{prefix}/response_length_mean": _mean([float(t.response_length) for t in trajs]),
        f"{prefix}/aborted_ratio": _mean(
            [float(t.stop_reason in (StopReason.ABORTED, StopReason.ERROR)) for t in trajs]
        ),
    }


def _source_means(trajs: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
    """Per data source: mean turns and tool calls over all its samples (reward errors included)."""
    by_source: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_source.setdefault(t.data_source, []).append(t)
    return {
        source: {
            "num_turns/mean": _mean([float(t.num_turns) for t in ts]),
            "tool_call_counts/mean": _mean([float(sum(t.tool_calls.values())) for t in ts]),
        }
        for source, ts in by_source.items()
    }


def _task_results(trajs: Sequence[Trajectory]) -> list[TaskResult]:
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.uid, []).append(t)
    return [
        TaskResult(
            task_id=ts[0].task_id,
            uid=uid,
            data_source=ts[0].data_source,
            rewards=[t.reward for t in ts],
            correct=[is_correct(t) for t in ts],
            answers=[answer_of(t) for t in ts],
            stop_reasons=[t.stop_reason.value for t in ts],
            reward_info=[dict(t.reward_info) for t in ts],
        )
        for uid, ts in groups.items()
    ]


def report_from_trajectories(
    trajs: Sequence[Trajectory],
    *,
    n: int,
    num_tasks: int,
    temperature: float | None = None,
    ks: Sequence[int] | None = None,
    n_bootstrap: int = 1000,
    seed: int = 0,
    prefix: str = "val",
    wall_time_s: float = 0.0,
    dropped_reward_errors: int = 0,
) -> EvalReport:
    """The :class:`EvalReport` of trajectories that are already generated and scored.

    ``dropped_reward_errors``: samples whose reward failed and that the runner dropped (they
    never became trajectories); added to ``{prefix}/reward_errors``.

    Args:
        trajs: every sample (samples of one task share ``uid``).
        n: samples per task that were asked for; num_tasks: tasks that were asked for
            (``{prefix}/dropped_samples`` = ``n * num_tasks - len(trajs)``).
        temperature: recorded in the report.
        ks, n_bootstrap, seed: as :func:`~agentrl.evaluation.stats.validation_statistics`.
        prefix: first segment of every metric key.
        wall_time_s: recorded in the report.
    """
    ks_eff = list(ks) if ks is not None else default_ks(n)
    samples, errors = _samples(trajs)
    per_source = validation_statistics(samples, n=n, ks=ks_eff, n_bootstrap=n_bootstrap, seed=seed)
    for source, means in _source_means(trajs).items():
        per_source[source] = dict(sorted({**per_source.get(source, {}), **means}.items()))
    per_source = dict(sorted(per_source.items()))
    scored = [t for t in trajs if "error" not in t.reward_info]
    metrics = {
        **_summary(trajs, scored, prefix),
        f"{prefix}/num_tasks": float(num_tasks),
        f"{prefix}/num_samples": float(len(trajs)),
        f"{prefix}/dropped_samples": float(max(0, n * num_tasks - len(trajs))),
        f"{prefix}/reward_errors": float(errors + dropped_reward_errors),
        f"{prefix}/wall_time_s": float(wall_time_s),
        **flatten_statistics(per_source, prefix),
    }
    return EvalReport(
        n=n,
        temperature=temperature,
        prefix=prefix,
        ks=ks_eff,
        n_bootstrap=n_bootstrap,
        seed=seed,
        num_tasks=num_tasks,
        num_samples=len(trajs),
        wall_time_s=wall_time_s,
        metrics=metrics,
        per_source=per_source,
        tasks=_task_results(trajs),
    )


def _check_temperature(runner: Any, temperature: float | None) -> None:
    """A manager must already sample at ``temperature`` (evaluation never mutates its workers)."""
    from agentrl.rollout.manager import AgentLoopManager, AgentLoopWorker

    if temperature is None or not isinstance(runner, AgentLoopManager):
        return
    for worker in runner.workers:
        if not isinstance(worker, AgentLoopWorker):  # remote: its sampling is its own
            continue
        got = worker.config.sampling.temperature
        if got != temperature:
            raise ValueError(
                f"evaluate(temperature={temperature}): worker {worker.worker_id} of the manager "
                f"samples at temperature {got}; build the evaluation manager with "
                f"WorkerConfig(sampling=SamplingParams(temperature={temperature}, ...))"
            )


async def evaluate(
    runner: EpisodeGenerator | GenerateFn,
    tasks: Sequence[Task],
    *,
    n: int,
    temperature: float | None,
    ks: Sequence[int] | None = None,
    n_bootstrap: int = 1000,
    seed: int = 0,
    prefix: str = "val",
    keep: list[Trajectory] | None = None,
) -> EvalReport:
    """Run every task ``n`` times and compute the report (metrics keys in docs/tracking.md).

    Args:
        runner: an :class:`~agentrl.rollout.manager.AgentLoopManager` (its ``generate``) or an
            ``async fn(tasks, n_samples)``; it must score the trajectories (a reward manager).
        tasks: the held-out tasks (never trained on).
        n: samples per task (``>= 1``).
        temperature: the sampling temperature the runner uses; checked against an
            AgentLoopManager's workers (a mismatch is an error), recorded in the report.
        ks: pass_at_k sizes (default 1, 2, 4, ..., n); n_bootstrap, seed: the bootstrap's.
        prefix: first segment of every metric key.
        keep: when given, the scored trajectories are appended to it (e.g. for traces).
    """
    if n < 1:
        raise ValueError(f"evaluate: n (samples per task) must be >= 1, got {n}")
    tasks = list(tasks)
    _check_temperature(runner, temperature)
    if n > 1 and temperature == 0.0:
        logger.warning("evaluate: n=%d samples at temperature 0 are identical (greedy)", n)
    start = time.perf_counter()
    errors_before = _reward_drops(runner)
    if isinstance(runner, EpisodeGenerator):
        trajs = await runner.generate(tasks, n_samples=n)
    else:
        trajs = await runner(tasks, n)
    elapsed = time.perf_counter() - start
    if keep is not None:
        keep.extend(trajs)
    counts = Counter(t.stop_reason.value for t in trajs)
    logger.info(
        "evaluated %d tasks x %d samples in %.1f s (%s)", len(tasks), n, elapsed, dict(counts)
    )
    return report_from_trajectories(
        trajs,
        n=n,
        num_tasks=len(tasks),
        temperature=temperature,
        ks=ks,
        n_bootstrap=n_bootstrap,
        seed=seed,
        prefix=prefix,
        wall_time_s=elapsed,
        dropped_reward_errors=_reward_drops(runner) - errors_before,
    )


def _reward_drops(runner: Any) -> int:
    """Episodes a manager dropped because their reward failed (its ``stats()``), else 0."""
    counts: Any = getattr(runner, "stats", dict)()
    return int(counts.get("rollout/dropped/reward_error", 0.0))


def log_report(
    tracker: Tracker, report: EvalReport, *, step: int, artifact_dir: str = "eval"
) -> None:
    """Log ``report``: its metrics at ``step``, its table as ``{artifact_dir}/table_step_NNNNN.json``
    and the whole report as ``{artifact_dir}/report_step_NNNNN.json``."""
    tracker.log_metrics(report.metrics, step=step)
    tracker.log_dict(report.rows(step=step), f"{artifact_dir}/table_step_{step:05d}.json")
    tracker.log_dict(report.model_dump(), f"{artifact_dir}/report_step_{step:05d}.json")
