"""AgentLoopWorker: run one episode of a task, end to end, and say how it ended.

Why it exists: an episode is more than ``agent.run``: its context (policy, tools, sampling,
limits, parser, session id) is built, the agent is run under ``episode_timeout_s``, a failure is
turned into what can still be learned from, and the result is scored. The worker does that for
one episode at a time, as many at once as the manager sends it; the manager
(:mod:`agentrl.rollout.manager`) decides which episodes run and accounts for them.

Invariants of :meth:`AgentLoopWorker.run_episode` (what is always true):

- it returns a trajectory, or raises only :class:`asyncio.CancelledError` or
  :class:`~agentrl.types.EpisodeDropped` (a counted drop, never trained on: a reward that
  failed, a prompt over ``max_prompt_tokens``); it returns ``None`` only when not even the
  prompt can be rendered (counted ``dropped_unrenderable``, logged);
- an agent that raises ends as a trajectory with ``stop_reason=error`` (what it recorded before
  the error, the message in ``Trajectory.error``), counted ``errors`` and logged; an episode
  past ``episode_timeout_s`` ends as ``stop_reason=aborted`` with the tokens recorded so far,
  counted ``timeouts``;
- a trajectory is returned only after it is scored (when a scorer is given); a scorer that
  raises, or reports ``reward_info["error"]``, drops the episode (``EpisodeDropped
  ("reward_error")``, counted ``reward_errors``); with ``WorkerConfig.overlong`` set, DAPO's
  soft overlong penalty is added to the score (:mod:`agentrl.rollout.rewards.overlong`);
- every turn of an episode uses the session id ``"{uid}/{index}"`` (sticky routing to one
  server's prefix cache); sample ``greedy_sample_index`` runs at temperature 0.

A worker is a plain class whose state pickles (policy, tokenizer, tools, reward, config,
counters), so it can live in another process or a Ray actor (:class:`EpisodeRunner` is what the
manager needs of it). Its counters are summed into the manager's ``rollout/`` stats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentrl.config import AgentConfig
from agentrl.episode import EpisodeRecorder
from agentrl.rollout.rewards.overlong import OverlongPenalty
from agentrl.types import EpisodeDropped, Policy, SamplingParams, StopReason, Task, Trajectory
from agents import AgentContext, AgentLimits, get_agent_class, get_parser
from tools import ToolSet

__all__ = ["AgentLoopWorker", "EpisodeRunner", "Scorer", "WorkerConfig"]

logger = logging.getLogger(__name__)

_AGENT_DEFAULTS = AgentConfig()
"""The config's defaults (``agentrl.config`` is their only home)."""


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
        """Run sample ``index`` of group ``uid`` of ``task``: its trajectory. Raising anything
        but a cancellation or :class:`~agentrl.types.EpisodeDropped` means the worker failed
        (the manager re-dispatches the episode, :mod:`agentrl.rollout.manager`)."""
        ...


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
    history: str = _AGENT_DEFAULTS.history
    """``concat`` or ``per_turn`` (``agent.history``; an agent class's ``history`` wins)."""
    overlong: OverlongPenalty | None = None
    """DAPO's soft overlong punishment added to each scored episode's reward (None = off)."""

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
        overlong_buffer_len: int = 0,
        overlong_penalty_factor: float = 1.0,
        default: str | None = None,
    ) -> WorkerConfig:
        """From the ``agent`` config section (``agentrl.config.AgentConfig``, or any object
        with its fields: ``default``, ``max_turns``, ``max_response_tokens``,
        ``max_parallel_calls``, ``tool_call_format``, ``system_prompt``, ``episode_timeout_s``);
        ``overlong_buffer_len`` > 0 turns on the overlong penalty (``reward.overlong_*``);
        ``default`` replaces ``agent.default`` (e.g. the run's environment)."""
        overlong = (
            OverlongPenalty(agent.max_response_tokens, overlong_buffer_len, overlong_penalty_factor)
            if overlong_buffer_len > 0
            else None
        )
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
            default_agent=default if default is not None else agent.default,
            greedy_sample_index=greedy_sample_index,
            base_dir=base_dir,
            overlong=overlong,
            history=agent.history,
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
            history=cfg.history,
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
            if self.config.overlong is not None:
                traj = self.config.overlong.apply(traj)
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
            if agent.history is not None:  # the agent's own choice wins over agent.history
                ctx.history = agent.history
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
