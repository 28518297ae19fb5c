"""AgentLoopManager: run tasks x n samples across workers and stream scored trajectories.

Why it exists: the trainer wants finished, scored episodes as soon as they exist (so slow
episodes never block fast ones), a bound on how many run at once, and a hook to stop admitting
new episodes when the rollouts would run too far ahead of the weights (the staleness budget).

Invariants (what is always true):

- Every admitted episode ends as exactly one trajectory or one counted drop:
  ``admitted == finished + dropped + running`` at every await point. A trajectory is yielded by
  the stream, or, if the stream is closed before it is read, counted as ``undelivered``.
- An agent that raises ends as a trajectory with ``stop_reason=error`` (what it recorded before the
  error, the message in ``Trajectory.error``), counted and logged; an episode that runs past
  ``episode_timeout_s`` ends as ``stop_reason=aborted`` with the tokens recorded so far. Neither
  hangs the stream. A drop happens only on cancellation, when not even the prompt can be
  rendered (logged), or when the episode's worker failed twice (below).
- A worker that fails (its ``run_episode`` raises anything but a cancellation or
  :class:`~agentrl.types.EpisodeDropped`: e.g. the Ray actor running it died) does not lose the
  episode: it is re-dispatched once (``max_redispatches``), to another available worker when
  there is one, as the same admitted episode (same key, ``on_admitted``/``on_finished`` still
  once each, ``running`` meanwhile), counted ``redispatched``. Only the re-dispatched run can
  deliver a trajectory (the failed one returned none), so nothing is trained twice; a second
  failure is a counted drop (``worker_errors`` counts every failure). A worker whose
  ``available`` attribute is false (gone for good) gets no new episode while another is
  available.
- Admission is atomic: an episode starts only when ``admission.may_start()`` is true, and
  ``on_admitted`` is called in the same event-loop step, so a rule like AReaL's
  ``(η + v + 1) · batch_size > accepted + running`` is never overshot. ``on_admitted`` is called
  exactly once per admitted episode and ``on_finished`` exactly once after it (with the
  trajectory, or ``None`` for a drop).
- A trajectory is yielded only after it is scored (when a reward manager is given); a scorer that
  raises leaves reward 0.0 and ``reward_info["error"]`` (counted), never a lost trajectory.
- All samples of one task share a ``uid``; ``index`` is the sample number; every turn of an
  episode uses the session id ``"{uid}/{index}"`` (sticky routing to one server's prefix cache).

Shutdown order (``stream.aclose()``, leaving ``async with``, or ``manager.cancel()``): stop
admitting -> cancel running episodes (each agent's tool episode releases its tools on the way
out) -> count each as a drop and call ``on_finished(key, None)`` -> close the stream.

Workers: ``num_workers`` :class:`AgentLoopWorker` objects, each a plain class whose state pickles
(policy, tokenizer, tools, reward, config); in one process they run as asyncio tasks, and the
manager sends each episode to the worker with the fewest episodes in flight. Placing workers in
Ray actors needs only ``run_episode`` as a remote method.

Example::

    manager = AgentLoopManager(policy, tokenizer, tools=toolset, reward=rewards,
                               config=WorkerConfig(limits=AgentLimits(max_turns=4)),
                               max_concurrency=64)
    async with manager.stream(tasks, n_samples=4) as stream:
        async for traj in stream:        # in completion order, scored
            buffer.add(traj)
    batch = await manager.generate(tasks, n_samples=4)   # whole batch, in task order
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentrl.config import AgentConfig, RolloutConfig
from agentrl.episode import EpisodeRecorder
from agentrl.types import EpisodeDropped, Policy, SamplingParams, StopReason, Task, Trajectory
from agents import AgentContext, AgentLimits, get_agent_class, get_parser
from tools import ToolSet

__all__ = [
    "AdmissionController",
    "AgentLoopManager",
    "AgentLoopWorker",
    "AlwaysAdmit",
    "EpisodeKey",
    "EpisodeRunner",
    "Scorer",
    "StalenessAdmission",
    "TrajectoryStream",
    "WorkerConfig",
]

logger = logging.getLogger(__name__)

_AGENT_DEFAULTS = AgentConfig()
_ROLLOUT_DEFAULTS = RolloutConfig()
"""The config's defaults (``agentrl.config`` is their only home)."""


@dataclass(frozen=True)
class EpisodeKey:
    """Identifies one admitted episode."""

    uid: str
    index: int
    task_id: str


@runtime_checkable
class Scorer(Protocol):
    """Anything with ``async score(traj, task) -> Trajectory`` (e.g. ``RewardManager``)."""

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        """``traj`` with its reward (and ``reward_info``) filled in for ``task``."""
        ...


@runtime_checkable
class EpisodeRunner(Protocol):
    """What the manager needs of a worker: :class:`AgentLoopWorker`, or a stand-in for one that
    runs elsewhere (the Ray backend's ``RemoteWorker``). A worker may also have an
    ``available`` attribute: while it is false the manager sends it no new episode."""

    @property
    def counts(self) -> dict[str, int]:
        """The worker's counters (errors, timeouts, ...), summed into the manager's stats."""
        ...

    async def run_episode(self, task: Task, uid: str, index: int) -> Trajectory | None:
        """Run sample ``index`` of group ``uid`` of ``task``: its trajectory (module docstring:
        what raising means)."""
        ...


# ---- admission -------------------------------------------------------------------------------


@runtime_checkable
class AdmissionController(Protocol):
    """The trainer's hook on when episodes may start (the staleness budget).

    The manager calls, per episode: ``await wait_for_admission()`` (returns when ``may_start()``
    is likely true), then ``may_start()`` (re-checked; if false it waits again), then, in the
    same event-loop step, ``on_admitted(key)``; when the episode ends, ``on_finished(key, traj)``
    (``traj`` is ``None`` for a drop). Hooks must not block; exceptions in ``on_*`` are logged
    and counted (``rollout/hook_errors``).
    """

    def may_start(self) -> bool:
        """True when one more episode may start now."""
        ...

    async def wait_for_admission(self) -> None:
        """Return when ``may_start()`` is likely true (the manager re-checks)."""
        ...

    def on_admitted(self, key: EpisodeKey) -> None:
        """Episode ``key`` was admitted (same event-loop step as ``may_start()``)."""
        ...

    def on_finished(self, key: EpisodeKey, traj: Trajectory | None) -> None:
        """Episode ``key`` ended: with ``traj``, or ``None`` for a drop."""
        ...


class AlwaysAdmit:
    """No staleness budget: admit whenever a concurrency slot is free."""

    def may_start(self) -> bool:
        """Always true."""
        return True

    async def wait_for_admission(self) -> None:
        """Returns at once."""
        return None

    def on_admitted(self, key: EpisodeKey) -> None:
        """Nothing to record."""
        return None

    def on_finished(self, key: EpisodeKey, traj: Trajectory | None) -> None:
        """Nothing to record."""
        return None


class StalenessAdmission:
    """AReaL's admission rule: start an episode only while ``(η + v + 1) · B > accepted + running``.

    ``η`` = ``max_staleness``, ``v`` = the trainer's weight version (``set_version``), ``B`` =
    ``batch_size`` (episodes per trainer step). ``running`` counts admitted, unfinished episodes;
    ``accepted`` counts finished ones. The trainer calls ``set_version(v)`` after each weight
    push, and ``reject(n)`` for finished episodes it threw away (e.g. too stale) so that they are
    replaced. With η = 0 this is synchronous training: at most one batch per version.
    """

    def __init__(self, batch_size: int, max_staleness: int = 0, version: int = 0) -> None:
        if batch_size < 1 or max_staleness < 0:
            raise ValueError(
                f"StalenessAdmission(batch_size={batch_size}, max_staleness={max_staleness}): "
                "batch_size must be >= 1 and max_staleness >= 0"
            )
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.version = version
        self.accepted = 0
        self.running = 0
        self._changed = asyncio.Event()

    @property
    def capacity(self) -> int:
        """Episodes that may still start now."""
        limit = (self.max_staleness + self.version + 1) * self.batch_size
        return limit - (self.accepted + self.running)

    def may_start(self) -> bool:
        """True while the budget has room (``capacity > 0``)."""
        return self.capacity > 0

    async def wait_for_admission(self) -> None:
        """Wait until the budget has room (a version bump, a finish or a reject)."""
        while not self.may_start():
            self._changed.clear()
            await self._changed.wait()

    def on_admitted(self, key: EpisodeKey) -> None:
        """Count the episode as running."""
        self.running += 1

    def on_finished(self, key: EpisodeKey, traj: Trajectory | None) -> None:
        """Move the episode from running to accepted (a drop just stops running)."""
        self.running -= 1
        if traj is not None:
            self.accepted += 1
        self._changed.set()

    def set_version(self, version: int) -> None:
        """The trainer pushed weight version ``version`` (the budget grows a batch per version)."""
        self.version = version
        self._changed.set()

    def reject(self, n: int = 1) -> None:
        """``n`` finished episodes were thrown away by the trainer: admit as many replacements."""
        self.accepted -= n
        self._changed.set()


# ---- worker ----------------------------------------------------------------------------------


@dataclass
class WorkerConfig:
    """What every episode of a worker shares (plain data; pickles). Build it with
    :meth:`from_config`; the defaults here are the config's (``agentrl.config``)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    limits: AgentLimits = field(default_factory=AgentLimits)
    tool_call_format: str = _AGENT_DEFAULTS.tool_call_format
    system_prompt: str | None = None
    episode_timeout_s: float | None = None
    """Wall-clock limit of one episode; past it the episode ends with ``stop_reason=aborted``."""
    agent_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Agent name -> keyword arguments of its constructor."""
    max_abort_resumes: int = 3
    """How often a turn aborted by the server (weight push in abort mode) is resumed."""
    default_agent: str = _AGENT_DEFAULTS.default
    """The agent of tasks that name none (``agent.default``)."""
    greedy_sample_index: int | None = None
    """The sample index that runs greedily (temperature 0): ReMax's baseline sample."""
    base_dir: str | None = None
    """Folder that ``module:attr`` / path specs (agents) resolve against."""

    @classmethod
    def from_config(
        cls,
        agent: Any,
        sampling: SamplingParams | None = None,
        *,
        max_context_tokens: int | None = None,
        agent_kwargs: dict[str, dict[str, Any]] | None = None,
        max_prompt_tokens: int | None = None,
        overlong_prompts: str = "drop",
        greedy_sample_index: int | None = None,
        base_dir: str | None = None,
    ) -> WorkerConfig:
        """From the ``agent`` config section (``agentrl.config.AgentConfig``, or any object
        with its fields: ``default``, ``max_turns``, ``max_response_tokens``,
        ``max_parallel_calls``, ``tool_call_format``, ``system_prompt``, ``episode_timeout_s``)."""
        return cls(
            sampling=sampling or SamplingParams(),
            limits=AgentLimits(
                max_turns=agent.max_turns,
                max_response_tokens=agent.max_response_tokens,
                max_context_tokens=max_context_tokens,
                max_parallel_calls=agent.max_parallel_calls,
                max_prompt_tokens=max_prompt_tokens,
                overlong_prompts=overlong_prompts,
            ),
            tool_call_format=agent.tool_call_format,
            system_prompt=agent.system_prompt,
            episode_timeout_s=agent.episode_timeout_s,
            agent_kwargs=dict(agent_kwargs or {}),
            default_agent=agent.default,
            greedy_sample_index=greedy_sample_index,
            base_dir=base_dir,
        )


class AgentLoopWorker:
    """Runs episodes: builds the context, runs the agent, turns failures into trajectories, scores.

    A plain class whose state pickles (policy, tokenizer, tools, reward, config, counters), so it
    can live in another process or a Ray actor; pass ``tools`` as a factory (a module-level
    function returning a ToolSet) for that, since a ToolSet itself holds a lock.
    ``run_episode`` never raises except on cancellation and :class:`EpisodeDropped` (a reward
    that failed, a prompt over ``max_prompt_tokens``): a counted drop, never trained on. It
    returns ``None`` only when not even the prompt could be rendered.
    """

    def __init__(
        self,
        policy: Policy,
        tokenizer: Any,
        *,
        tools: ToolSet | Callable[[], ToolSet] | None = None,
        reward: Scorer | None = None,
        config: WorkerConfig | None = None,
        worker_id: int = 0,
    ) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self._tools_spec = tools
        self._tools: ToolSet | None = tools if isinstance(tools, ToolSet) else None
        self.reward = reward
        self.config = config or WorkerConfig()
        self.worker_id = worker_id
        get_parser(self.config.tool_call_format)  # fail at construction on an unknown format
        self.counts: dict[str, int] = {}

    @property
    def tools(self) -> ToolSet | None:
        """The worker's ToolSet, built on first use when a factory was given."""
        if self._tools is None and self._tools_spec is not None:
            factory = self._tools_spec
            assert callable(factory)
            self._tools = factory()
        return self._tools

    def __getstate__(self) -> dict[str, Any]:
        # A ToolSet holds a lock and possibly closures: ship the factory, rebuild on arrival.
        state = dict(self.__dict__)
        if not isinstance(self._tools_spec, ToolSet):
            state["_tools"] = None
        return state

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def _context(self, task: Task, agent_name: str, uid: str, index: int) -> AgentContext:
        cfg = self.config
        sampling = cfg.sampling
        if cfg.greedy_sample_index is not None and index == cfg.greedy_sample_index:
            sampling = sampling.model_copy(update={"temperature": 0.0})
        return AgentContext(
            policy=self.policy,
            tokenizer=self.tokenizer,
            tools=self.tools,
            sampling=sampling,
            limits=cfg.limits,
            parser=get_parser(cfg.tool_call_format),
            session_id=f"{uid}/{index}",
            uid=uid,
            index=index,
            agent_name=agent_name,
            system_prompt=cfg.system_prompt,
            max_abort_resumes=cfg.max_abort_resumes,
            logger=logging.LoggerAdapter(logger, {"uid": uid, "index": index}),
        )

    async def run_episode(self, task: Task, uid: str, index: int) -> Trajectory | None:
        """Run one episode of ``task`` (sample ``index`` of group ``uid``), scored."""
        cfg = self.config
        agent_name = task.agent or cfg.default_agent
        ctx = self._context(task, agent_name, uid, index)
        start = time.perf_counter()
        try:
            traj = await self._run_agent(task, agent_name, ctx)
        except EpisodeDropped as drop:
            self._count(f"dropped_{drop.reason}")
            raise
        if traj is None:
            return None
        timings = dict(traj.timings)
        timings["total"] = time.perf_counter() - start
        traj = traj.model_copy(
            update={
                "uid": uid,
                "index": index,
                "task_id": task.id,
                "agent": agent_name,
                "data_source": task.data_source,
                "timings": timings,
            }
        )
        if self.reward is not None:
            traj = await self._score(traj, task)
        return traj

    async def _run_agent(self, task: Task, agent_name: str, ctx: AgentContext) -> Trajectory | None:
        """The agent's trajectory; a raising or timed-out agent gives its partial trajectory."""
        cfg = self.config
        timeout = cfg.episode_timeout_s
        start = time.perf_counter()
        try:
            agent = get_agent_class(agent_name, key="agent", base_dir=cfg.base_dir)(
                **cfg.agent_kwargs.get(agent_name, {})
            )
            traj = await asyncio.wait_for(agent.run(task, ctx), timeout)
            if not isinstance(traj, Trajectory):
                raise TypeError(
                    f"agent {agent_name!r} returned {type(traj).__name__}; run() must return a "
                    "Trajectory (use ctx.finish(stop_reason))"
                )
            return traj
        except (asyncio.CancelledError, EpisodeDropped):
            raise
        except Exception as exc:
            elapsed = time.perf_counter() - start
            if isinstance(exc, TimeoutError) and timeout is not None and elapsed >= timeout * 0.99:
                self._count("timeouts")
                logger.warning("episode %s/%d timed out after %.1f s", ctx.uid, ctx.index, elapsed)
                return self._partial(
                    task, ctx, StopReason.ABORTED, f"episode timed out after {timeout:g} s"
                )
            self._count("errors")
            logger.exception("agent %r raised in episode %s/%d", agent_name, ctx.uid, ctx.index)
            return self._partial(task, ctx, StopReason.ERROR, f"{type(exc).__name__}: {exc}")

    def _partial(
        self, task: Task, ctx: AgentContext, reason: StopReason, error: str
    ) -> Trajectory | None:
        """What was recorded before a failure, as a trajectory (prompt only if nothing was)."""
        try:
            if ctx.recorder is None:
                tools = self.tools.schemas() if self.tools is not None and len(self.tools) else None
                messages = task.initial_messages(ctx.system_prompt)
                ctx.messages = messages
                ctx.recorder = EpisodeRecorder.from_messages(messages, self.tokenizer, tools=tools)
            return ctx.finish(reason, error=error)
        except Exception:
            self._count("dropped_unrenderable")
            logger.exception(
                "episode %s/%d: cannot even render the prompt; dropped", ctx.uid, ctx.index
            )
            return None

    async def _score(self, traj: Trajectory, task: Task) -> Trajectory:
        """The scored trajectory; a reward that fails or times out drops the episode (counted)."""
        assert self.reward is not None
        try:
            scored = await self.reward.score(traj, task)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            error = scored.reward_info.get("error")
            if error is None:
                return scored
        self._count("reward_errors")
        raise EpisodeDropped(
            "reward_error",
            f"reward of episode {traj.uid}/{traj.index} (task {task.id}, data_source "
            f"{task.data_source!r}) failed: {error}",
        )


# ---- manager ---------------------------------------------------------------------------------


class TrajectoryStream:
    """Async iterator of finished, scored trajectories; also an async context manager.

    Leaving ``async with`` (or ``aclose()``) before the end cancels the episodes still running.
    """

    def __init__(self, gen: AsyncGenerator[Trajectory, None]) -> None:
        self._gen = gen

    def __aiter__(self) -> TrajectoryStream:
        return self

    async def __anext__(self) -> Trajectory:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        """Stop the stream: cancel the episodes still running (counted drops)."""
        await self._gen.aclose()

    async def __aenter__(self) -> TrajectoryStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AgentLoopManager:
    """Runs tasks x ``n_samples`` episodes on ``num_workers`` workers, at most ``max_concurrency`` at once.

    Args:
        policy: what generates tokens (``PolicyClient``, ``ServerPool``, a fake).
        tokenizer: the model's tokenizer (chat template included).
        tools: the tools every episode may call (a ToolSet, or a factory that builds one).
        reward: a scorer (``RewardManager``); ``None`` = trajectories are not scored.
        config: sampling, limits, parser, system prompt, episode timeout, agent kwargs.
        num_workers: how many :class:`AgentLoopWorker` share the episodes.
        max_concurrency: most episodes in flight across all workers.
        admission: the trainer's admission hook (default: :class:`AlwaysAdmit`).
        workers: ready-made workers (instead of building ``num_workers`` from the above):
            :class:`AgentLoopWorker` s, or stand-ins for workers elsewhere (:class:`EpisodeRunner`).
        max_redispatches: how often an episode whose worker failed is sent to a worker again
            (module docstring); 0 = a failed worker's episode is a counted drop at once.
    """

    def __init__(
        self,
        policy: Policy | None = None,
        tokenizer: Any = None,
        *,
        tools: ToolSet | Callable[[], ToolSet] | None = None,
        reward: Scorer | None = None,
        config: WorkerConfig | None = None,
        num_workers: int = _ROLLOUT_DEFAULTS.num_workers,
        max_concurrency: int = _ROLLOUT_DEFAULTS.max_concurrency,
        admission: AdmissionController | None = None,
        workers: Sequence[EpisodeRunner] | None = None,
        max_redispatches: int = 1,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"rollout.max_concurrency must be >= 1, got {max_concurrency}")
        if workers is None:
            if policy is None or tokenizer is None:
                raise ValueError("AgentLoopManager needs policy= and tokenizer= (or workers=)")
            if num_workers < 1:
                raise ValueError(f"rollout.num_workers must be >= 1, got {num_workers}")
            workers = [
                AgentLoopWorker(
                    policy, tokenizer, tools=tools, reward=reward, config=config, worker_id=i
                )
                for i in range(num_workers)
            ]
        if not workers:
            raise ValueError("AgentLoopManager needs at least one worker")
        self.workers: list[EpisodeRunner] = list(workers)
        self.max_concurrency = max_concurrency
        self.admission: AdmissionController = admission or AlwaysAdmit()
        if max_redispatches < 0:
            raise ValueError(f"max_redispatches must be >= 0, got {max_redispatches}")
        self.max_redispatches = max_redispatches
        self._outstanding = [0] * len(self.workers)
        self._groups = itertools.count()
        self._counts: dict[str, int] = {}
        self._running = 0
        self._streaming = False
        self._cancel: asyncio.Event | None = None
        self._drop_reasons: dict[EpisodeKey, str] = {}
        self.failures: list[tuple[str, str]] = []
        """The first dropped episodes' (reason, message), for a run that must stop with them."""

    # ---- public API ------------------------------------------------------------------------
    def stream(self, tasks: Iterable[Task], n_samples: int = 1) -> TrajectoryStream:
        """Yield each trajectory as soon as it is finished and scored (completion order)."""
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        return TrajectoryStream(self._stream(tasks, n_samples))

    async def generate(self, tasks: Iterable[Task], n_samples: int = 1) -> list[Trajectory]:
        """Run everything and return the trajectories in task order, then sample index."""
        order: dict[str, int] = {}
        out: list[Trajectory] = []
        async with self.stream(tasks, n_samples) as stream:
            async for traj in stream:
                order.setdefault(traj.uid, len(order))
                out.append(traj)
        group_rank = {uid: self._group_number(uid) for uid in order}
        return sorted(out, key=lambda t: (group_rank[t.uid], t.index))

    def cancel(self) -> None:
        """Stop admitting and cancel the running episodes of the current stream (counted drops)."""
        if self._cancel is not None:
            self._cancel.set()

    @property
    def running(self) -> int:
        """Episodes in flight now."""
        return self._running

    def stats(self) -> dict[str, float]:
        """Counters since construction, under ``rollout/`` (admitted, finished, dropped, ...)."""
        counts = dict(self._counts)
        for w in self.workers:
            for k, v in w.counts.items():
                counts[k] = counts.get(k, 0) + v
        out = {f"rollout/{k}": float(v) for k, v in sorted(counts.items())}
        out["rollout/running"] = float(self._running)
        return out

    # ---- internals -------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        self._counts[key] = self._counts.get(key, 0) + n

    def drop_reason(self, key: EpisodeKey) -> str | None:
        """Why episode ``key`` ended without a trajectory (``reward_error``, ...); None for a
        cancellation or an unknown key. Each reason is returned once (popped)."""
        return self._drop_reasons.pop(key, None)

    def _note_failure(self, reason: str, message: str) -> None:
        if len(self.failures) < 16:  # the first ones are what a user needs; all are counted
            self.failures.append((reason, message))

    @staticmethod
    def _group_number(uid: str) -> int:
        return int(uid.rsplit("#", 1)[1])

    def _hook(self, name: str, *args: Any) -> None:
        try:
            getattr(self.admission, name)(*args)
        except Exception:
            self._count("hook_errors")
            logger.exception("admission hook %s raised", name)

    async def _stream(
        self, tasks: Iterable[Task], n_samples: int
    ) -> AsyncGenerator[Trajectory, None]:
        """The stream's generator: admit in the background, yield trajectories as they end."""
        if self._streaming:
            raise RuntimeError("this AgentLoopManager is already streaming; one stream at a time")
        self._streaming = True
        self._cancel = asyncio.Event()
        run = _StreamRun(self._cancel, asyncio.Semaphore(self.max_concurrency))
        producer = asyncio.create_task(self._produce(run, tasks, n_samples))
        watcher = asyncio.create_task(self._watch_cancel(run, producer))
        ended = 0  # episodes delivered or dropped
        produced = False
        try:
            while not (produced and ended == run.admitted):
                kind, value = await run.events.get()
                if kind == "produced":
                    produced = True
                elif kind == "error":
                    raise value
                else:
                    ended += 1
                    if kind == "traj":
                        self._count("delivered")
                        yield value
        finally:
            await self._close_stream(run, producer, watcher)

    async def _produce(self, run: _StreamRun, tasks: Iterable[Task], n_samples: int) -> None:
        """Admit every sample of every task, in order, as slots and the admission hook allow;
        end with a ``produced`` event (or an ``error`` event carrying what the tasks raised)."""
        try:
            for task in tasks:
                uid = f"{task.id}#{next(self._groups)}"
                for i in range(n_samples):
                    await self._wait_for_admission(run)
                    # No await between may_start() and on_admitted(): admission is atomic.
                    self._start_episode(run, EpisodeKey(uid=uid, index=i, task_id=task.id), task)
            run.events.put_nowait(("produced", None))
        except asyncio.CancelledError:
            run.events.put_nowait(("produced", None))
            raise
        except Exception as exc:
            run.events.put_nowait(("error", exc))

    async def _wait_for_admission(self, run: _StreamRun) -> None:
        """Return holding a concurrency slot, at a moment when ``admission.may_start()`` is true."""
        await run.slots.acquire()
        try:
            await self.admission.wait_for_admission()
            while not self.admission.may_start():
                await self.admission.wait_for_admission()
        except BaseException:
            run.slots.release()
            raise

    def _start_episode(self, run: _StreamRun, key: EpisodeKey, task: Task) -> None:
        """Count episode ``key`` as admitted and start it on the least-busy worker."""
        self._hook("on_admitted", key)
        run.admitted += 1
        self._count("admitted")
        self._running += 1
        self._dispatch(run, key, task, attempt=0, avoid=None)

    def _pick_worker(self, avoid: int | None) -> int:
        """The least-busy available worker, other than ``avoid`` when another one is available
        (any worker when none is: its failure is then counted like any other)."""
        ids = range(len(self.workers))
        usable = [w for w in ids if getattr(self.workers[w], "available", True)] or list(ids)
        others = [w for w in usable if w != avoid] or usable
        return min(others, key=self._outstanding.__getitem__)

    def _dispatch(
        self, run: _StreamRun, key: EpisodeKey, task: Task, *, attempt: int, avoid: int | None
    ) -> None:
        """Run (attempt ``attempt`` of) episode ``key`` on a worker."""
        w = self._pick_worker(avoid)
        self._outstanding[w] += 1
        ep = asyncio.create_task(self.workers[w].run_episode(task, key.uid, key.index))
        run.episodes.add(ep)
        ep.add_done_callback(functools.partial(self._on_episode_done, run, w, key, task, attempt))

    def _on_episode_done(
        self,
        run: _StreamRun,
        w: int,
        key: EpisodeKey,
        task: Task,
        attempt: int,
        ep: asyncio.Task[Trajectory | None],
    ) -> None:
        """Account for a finished episode: free its slot, count it, call ``on_finished`` and
        queue its trajectory (or a drop) for the stream; or re-dispatch it once if its worker
        failed.

        A done-callback, not a ``finally``: a task cancelled before its first step never runs its
        body, and every admitted episode must still be accounted for.
        """
        run.episodes.discard(ep)
        self._outstanding[w] -= 1
        if self._redispatch(run, w, key, task, attempt, ep):
            return
        traj = self._episode_result(w, key, ep)
        self._running -= 1
        run.slots.release()
        if traj is None:
            self._count("dropped")
        else:
            self._count("finished")
            self._count(f"stop_reason/{traj.stop_reason.value}")
        self._hook("on_finished", key, traj)
        run.events.put_nowait(("drop", None) if traj is None else ("traj", traj))

    def _redispatch(
        self,
        run: _StreamRun,
        w: int,
        key: EpisodeKey,
        task: Task,
        attempt: int,
        ep: asyncio.Task[Trajectory | None],
    ) -> bool:
        """If worker ``w`` failed this episode and it may be tried again (not cancelled, not
        stopping, ``max_redispatches`` not used up), send it to a worker again; True if so."""
        if ep.cancelled() or run.cancel.is_set() or attempt >= self.max_redispatches:
            return False
        exc = ep.exception()
        if exc is None or isinstance(exc, EpisodeDropped):
            return False
        self._count("worker_errors")
        self._count("redispatched")
        logger.warning(
            "worker %d failed on episode %s/%d (%s: %s); re-dispatching it (attempt %d of %d)",
            w,
            key.uid,
            key.index,
            type(exc).__name__,
            exc,
            attempt + 2,
            self.max_redispatches + 1,
        )
        self._dispatch(run, key, task, attempt=attempt + 1, avoid=w)
        return True

    def _episode_result(
        self, w: int, key: EpisodeKey, ep: asyncio.Task[Trajectory | None]
    ) -> Trajectory | None:
        """The episode's trajectory, or None after counting and logging why there is none
        (cancelled, dropped, or the worker failed)."""
        if ep.cancelled():
            self._count("cancelled")
            return None
        exc = ep.exception()
        if isinstance(exc, EpisodeDropped):
            self._count(f"dropped/{exc.reason}")
            self._note_failure(exc.reason, str(exc))
            self._drop_reasons[key] = exc.reason
            if len(self._drop_reasons) > 10_000:  # consumers pop theirs; bound the rest
                self._drop_reasons.pop(next(iter(self._drop_reasons)))
            logger.warning("episode %s/%d dropped: %s", key.uid, key.index, exc)
            return None
        if exc is not None:
            self._count("worker_errors")
            self._note_failure("worker_error", f"{type(exc).__name__}: {exc}")
            logger.error("worker %d failed on episode %s/%d", w, key.uid, key.index, exc_info=exc)
            return None
        return ep.result()

    @staticmethod
    async def _watch_cancel(run: _StreamRun, producer: asyncio.Task[None]) -> None:
        """On ``cancel()``: stop admitting and cancel every running episode."""
        await run.cancel.wait()
        producer.cancel()
        for ep in list(run.episodes):
            ep.cancel()

    async def _close_stream(
        self, run: _StreamRun, producer: asyncio.Task[None], watcher: asyncio.Task[None]
    ) -> None:
        """The shutdown order: stop admitting, cancel and await every episode (each counted by
        its done-callback), count the trajectories nobody read as ``undelivered``."""
        run.cancel.set()
        watcher.cancel()
        pending = [producer, watcher, *run.episodes]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        while not run.events.empty():
            kind, _ = run.events.get_nowait()
            if kind == "traj":
                self._count("undelivered")
        self._streaming = False
        self._cancel = None


@dataclass
class _StreamRun:
    """The bookkeeping of one stream (one call of ``AgentLoopManager.stream``)."""

    cancel: asyncio.Event
    slots: asyncio.Semaphore
    """One permit per episode that may be in flight (``max_concurrency``)."""
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    """``("traj", Trajectory) | ("drop", None) | ("produced", None) | ("error", exc)``."""
    episodes: set[asyncio.Task[Trajectory | None]] = field(default_factory=set)
    admitted: int = 0
