"""The agent contract: an :class:`AgentLoop` runs one task with an :class:`AgentContext`.

Read this module first when writing an agent. The vocabulary:

- an :class:`AgentLoop` is a class with one ``async run(task, ctx) -> Trajectory``; a fresh
  instance runs each episode, so it may keep per-episode state on ``self``;
- the :class:`AgentContext` is everything the agent may use: the policy (token ids in, token ids
  + logprobs out), the tokenizer, the tools, the sampling parameters, the limits, the tool-call
  parser, and helpers that keep the token bookkeeping exact (:meth:`AgentContext.start_episode`,
  :meth:`AgentContext.generate`, :meth:`AgentContext.add_messages`,
  :meth:`AgentContext.call_tools`, :meth:`AgentContext.finish`);
- agents are registered by name (:func:`register_agent`); a task's ``agent`` column picks one.

Guarantees the helpers give an agent (see ``agentrl.episode``): each request's prompt is
the previous prompt plus exactly the generated tokens plus the tokenized delta of the new
messages; budgets (``max_response_tokens``, ``max_context_tokens``) are enforced by truncation;
the manager can always build a partial trajectory from ``ctx.recorder`` when an agent raises or
times out.

A complete agent with a custom tool::

    from agents import AgentLoop, register_agent
    from agentrl.types import StopReason
    from tools import tool

    @tool
    def lookup(word: str) -> str:
        \"\"\"Look a word up.

        Args:
            word: The word.
        \"\"\"
        return {"agentrl": "an RL library"}.get(word, "not found")

    @register_agent("lookup_agent")
    class LookupAgent(AgentLoop):
        async def run(self, task, ctx):
            ctx.start_episode(task.initial_messages(ctx.system_prompt), tools=[lookup.schema()])
            async with ctx.tool_episode([lookup]) as tools:
                while True:
                    turn = await ctx.turn(tools)  # generate, parse, answer every call
                    if turn.stop is not None:     # the framework's stop policy decided
                        return ctx.finish(turn.stop)

An agent that needs its own per-turn logic calls :meth:`AgentContext.turn` in the same loop
and acts on ``turn.generation`` / ``turn.parsed`` / ``turn.messages`` between turns; the stop
policy (budgets, abort, ``max_turns``, ``tool_stop``, malformed calls answered and counted in
every turn) stays the framework's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from agentrl.config import AgentConfig, DataConfig
from agentrl.episode import EpisodeRecorder, get_delta_renderer, render_prompt_ids
from agentrl.registry import Registry
from agentrl.types import (
    EpisodeDropped,
    Generation,
    Message,
    Policy,
    SamplingParams,
    StopReason,
    Task,
    Trajectory,
    TurnSample,
)
from agents.parsers import ParseResult, ToolCallParser, get_parser
from tools import Tool, ToolEpisode, ToolResult, ToolSet

__all__ = [
    "AGENTS",
    "INVALID_TOOL",
    "AgentContext",
    "AgentLimits",
    "AgentLoop",
    "Turn",
    "create_agent",
    "get_agent_class",
    "list_agents",
    "register_agent",
]

logger = logging.getLogger(__name__)

INVALID_TOOL = "<invalid>"
"""Key of ``Trajectory.tool_calls`` that counts malformed calls and calls to unknown tools."""


def _no_calls() -> dict[str, float]:
    """One tool's ``tool_stats`` entry before its first call."""
    return {"calls": 0.0, "errors": 0.0, "timeouts": 0.0, "latency_s": 0.0, "latency_max_s": 0.0}


def _schema_names(schemas: Sequence[dict[str, Any]]) -> list[str]:
    """The tool names of OpenAI function schemas (``{"function": {"name": ...}}``, or a bare
    ``{"name": ...}``); a schema without a name is skipped."""
    names = []
    for schema in schemas:
        fn = schema.get("function")
        name = (fn if isinstance(fn, dict) else schema).get("name")
        if isinstance(name, str):
            names.append(name)
    return names


_DEFAULTS = AgentConfig()
_DATA_DEFAULTS = DataConfig()


@dataclass
class AgentLimits:
    """Limits of one episode (the ``agent`` config section; defaults are the config's)."""

    max_turns: int = _DEFAULTS.max_turns
    """Most model turns (generate calls)."""
    max_response_tokens: int = _DEFAULTS.max_response_tokens
    """Budget for all tokens after the prompt, model and tool turns together."""
    max_context_tokens: int | None = None
    """Budget for prompt + response (the model's context length); None = unlimited."""
    max_parallel_calls: int = _DEFAULTS.max_parallel_calls
    """Most tool calls of one turn that run at the same time."""
    max_prompt_tokens: int | None = None
    """Longest rendered prompt; a longer one drops the episode (or stops the run); None = any."""
    overlong_prompts: str = _DATA_DEFAULTS.overlong_prompts
    """``drop`` (counted) or ``error`` (the run stops, naming the task)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_response_tokens", "max_parallel_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"agent.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_context_tokens", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or null, got {value}")
        if self.overlong_prompts not in ("drop", "error"):
            raise ValueError(
                f"data.overlong_prompts={self.overlong_prompts!r}; use 'drop' or 'error'"
            )


@dataclass
class Turn:
    """One model turn under the framework's stop policy (:meth:`AgentContext.turn`)."""

    generation: Generation
    parsed: ParseResult
    messages: list[Message]
    """The tool (and error) messages appended after the turn."""
    stop: StopReason | None
    """Why the episode ends after this turn; None = it continues."""


@dataclass
class AgentContext:
    """Everything an agent may use for one episode, plus the episode's running record.

    The manager builds one per episode; tests and scripts may build one by hand.
    """

    policy: Policy
    tokenizer: Any
    tools: ToolSet | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    limits: AgentLimits = field(default_factory=AgentLimits)
    parser: ToolCallParser = field(default_factory=lambda: get_parser("hermes"))
    session_id: str | None = None
    """Sticky-routing key: all turns of the episode go to the server holding its prefix cache."""
    uid: str = "episode"
    """Prompt-group id (all samples of one task share it)."""
    index: int = 0
    """Sample index within the group."""
    agent_name: str = ""
    system_prompt: str | None = None
    max_abort_resumes: int = 3
    """How often one turn aborted by the server is resumed before the episode ends ``aborted``."""
    history: str = "concat"
    """``concat``: every request's prompt is the previous one plus exact token deltas (one
    trained sequence); ``per_turn``: each request's prompt is the conversation re-rendered by the
    chat template (a Qwen3-style template strips earlier thinking), and each model turn becomes
    its own training sample (``Trajectory.turn_samples``)."""
    logger: logging.Logger | logging.LoggerAdapter = logger
    tool_schemas: list[dict[str, Any]] | None = None
    """The tools the prompt was rendered with (set by :meth:`start_episode`)."""
    turn_samples: list[TurnSample] = field(default_factory=list)
    """The per-turn samples recorded so far (``history: per_turn``)."""

    # ---- the running record (read by the manager for partial trajectories) ----------------
    recorder: EpisodeRecorder | None = None
    messages: list[Message] = field(default_factory=list)
    """The conversation for display (and the reward's answer extraction); never trained on."""
    tool_counts: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    tool_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    """Tool name -> this episode's ``calls``, ``errors``, ``timeouts``, ``latency_s`` (sum)
    and ``latency_max_s`` (summed per batch into ``tools/<name>/...``)."""
    env_state: dict[str, Any] = field(default_factory=dict)
    """The environment's final state (:mod:`agents.environment`), what its reward reads."""
    step_rewards: dict[int, float] = field(default_factory=dict)
    """Model turn (1-based) -> sum of the step rewards of the tools it called."""

    # ---- token bookkeeping ---------------------------------------------------------------
    def start_episode(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> EpisodeRecorder:
        """Render the first prompt and start recording. ``tools`` defaults to ``ctx.tools``."""
        if tools is None and self.tools is not None and len(self.tools):
            tools = self.tools.schemas()
        if self.history not in ("concat", "per_turn"):
            raise ValueError(f"agent.history={self.history!r}; use 'concat' or 'per_turn'")
        self.messages = [dict(m) for m in messages]
        self.tool_schemas = list(tools) if tools else None
        for name in _schema_names(self.tool_schemas or ()):
            # every offered tool is counted, so a tool the model never calls logs 0 calls
            self.tool_stats.setdefault(name, _no_calls())
        self.recorder = EpisodeRecorder.from_messages(
            self.messages,
            self.tokenizer,
            tools=tools,
            max_response_tokens=self.limits.max_response_tokens,
            max_context_tokens=self.limits.max_context_tokens,
        )
        limit = self.limits.max_prompt_tokens
        if limit is not None and len(self.recorder.prompt_ids) > limit:
            fatal = self.limits.overlong_prompts == "error"
            raise EpisodeDropped(
                "prompt_too_long",
                f"episode {self.uid}/{self.index}: the rendered prompt has "
                f"{len(self.recorder.prompt_ids)} tokens > data.max_prompt_tokens={limit}"
                + (" (set data.overlong_prompts: drop to skip such tasks)" if fatal else ""),
                fatal=fatal,
            )
        return self.recorder

    def _require_recorder(self) -> EpisodeRecorder:
        if self.recorder is None:
            raise RuntimeError("call ctx.start_episode(messages) before generating")
        return self.recorder

    async def generate(self, **sampling_overrides: Any) -> Generation:
        """Generate the next model turn from the recorded context and record it.

        ``max_tokens`` is capped by the remaining budget; with no budget left nothing is sent
        and an empty generation with ``finish_reason="length"`` comes back. A request aborted
        by the server (e.g. a weight push in abort mode) is resumed from the tokens generated so
        far, up to ``max_abort_resumes`` times (AReaL's interruptible generation): the turn
        continues, each token keeps the version that produced it, and the returned generation
        holds the whole turn (``weight_version`` = the last one).
        """
        rec = self._require_recorder()
        budget = rec.remaining_budget
        if budget <= 0:
            rec.truncated = True
            return Generation(token_ids=[], logprobs=[], finish_reason="length", weight_version=0)
        base = self.sampling
        max_tokens = min(sampling_overrides.pop("max_tokens", base.max_tokens), budget)
        if sampling_overrides or max_tokens != base.max_tokens:
            sampling = base.model_copy(update={"max_tokens": max_tokens, **sampling_overrides})
        else:  # the common case: the shared parameters as they are (no copy per turn)
            sampling = base
        start = time.perf_counter()
        per_turn = self.history == "per_turn"
        prompt = (
            render_prompt_ids(self.tokenizer, self.messages, self.tool_schemas)
            if per_turn
            else rec.context_ids()
        )
        before = len(rec.response_ids)
        gen = await self.policy.generate(prompt, sampling, self.session_id)
        rec.add_generation(gen)
        resumes = 0
        while gen.finish_reason == "abort" and resumes < self.max_abort_resumes:
            left = min(max_tokens - len(gen.token_ids), rec.remaining_budget)
            if left <= 0:
                gen = gen.model_copy(update={"finish_reason": "length"})
                break
            resumes += 1
            self._count("abort_resumes")
            context = prompt + gen.token_ids if per_turn else rec.context_ids()
            more = await self.policy.generate(
                context, sampling.model_copy(update={"max_tokens": left}), self.session_id
            )
            rec.add_generation(more, continue_turn=True)
            gen = Generation(
                token_ids=gen.token_ids + more.token_ids,
                logprobs=gen.logprobs + more.logprobs,
                finish_reason=more.finish_reason,
                weight_version=min(gen.weight_version, more.weight_version),
                server=more.server,
                token_versions=gen.versions() + more.versions(),
            )
        if per_turn:
            self._record_turn_sample(prompt, gen, len(rec.response_ids) - before)
        self.timings["generate"] = self.timings.get("generate", 0.0) + time.perf_counter() - start
        return gen

    def _record_turn_sample(self, prompt: list[int], gen: Generation, kept: int) -> None:
        """Keep the turn as the server saw it: its prompt and the ``kept`` tokens (a budget cut
        drops the tail, as in the concatenated record)."""
        if kept <= 0:
            return
        self.turn_samples.append(
            TurnSample(
                prompt_ids=list(prompt),
                token_ids=list(gen.token_ids[:kept]),
                logprobs=list(gen.logprobs[:kept]),
                versions=gen.versions()[:kept],
            )
        )

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated tokens, special tool tags kept, a trailing end-of-turn token dropped."""
        renderer = get_delta_renderer(self.tokenizer)
        text = renderer.decode(token_ids)
        eos = renderer.eos_token
        if eos and text.endswith(eos):
            text = text[: -len(eos)]
        return text

    def parse(self, gen: Generation) -> ParseResult:
        """Parse a model turn, append the assistant message, number the calls (``call_<turn>_<i>``)."""
        parsed = self.parser.parse(self.decode(gen.token_ids))
        turn = self.recorder.num_turns if self.recorder is not None else 0
        for i, call in enumerate(parsed.calls):
            call.id = f"call_{turn}_{i}"
        msg: Message = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            msg["tool_calls"] = [c.to_openai() for c in parsed.calls]
        self.messages.append(msg)
        return parsed

    def add_messages(self, messages: Sequence[Message]) -> list[int]:
        """Append tool/user messages as a token delta (mask 0); returns the ids appended."""
        rec = self._require_recorder()
        self.messages.extend(dict(m) for m in messages)
        return rec.add_messages(messages)

    # ---- tools ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def tool_episode(self, tools: Sequence[Tool] | None = None) -> AsyncIterator[ToolEpisode]:
        """The episode's tool calls: ``ctx.tools``, or ``tools`` instead (run under ``ctx.tools``'
        limits, thread pool and counters, i.e. the config's ``tools:`` section); released at exit.
        A ``max_output_tokens`` budget counts tokens of the episode's (the policy's) tokenizer."""
        if tools is None:
            toolset = self.tools or ToolSet()
        else:  # the agent's own tools, under the run's limits and counters (config `tools:`)
            toolset = self.tools.with_tools(tools) if self.tools is not None else ToolSet(tools)
            self.tools = toolset
        async with toolset.episode(tokenizer=self.tokenizer) as ep:
            yield ep

    async def call_tools(
        self, episode: ToolEpisode, parsed: ParseResult
    ) -> tuple[list[Message], bool]:
        """Run the parsed calls (at most ``max_parallel_calls`` at once) and count them.

        Returns the tool messages, in call order, then one error message per malformed call,
        and whether a tool asked to stop. Never raises, except on cancellation.
        """
        start = time.perf_counter()
        latencies: list[float] = [0.0] * len(parsed.calls)

        async def timed(i: int, name: str, args: Any) -> ToolResult:
            """Run call ``i``, its latency read from the episode's clock."""
            t0 = episode.clock()
            try:
                return await episode.call(name, args)
            finally:
                latencies[i] = episode.clock() - t0

        if len(parsed.calls) == 1:  # the common case: run inline, no task, no semaphore
            results = [await timed(0, parsed.calls[0].name, parsed.calls[0].arguments)]
        elif parsed.calls:
            sem = asyncio.Semaphore(self.limits.max_parallel_calls)

            async def one(i: int, name: str, args: dict[str, Any]) -> ToolResult:
                """Run one call while holding a ``max_parallel_calls`` slot."""
                async with sem:
                    return await timed(i, name, args)

            results = await asyncio.gather(
                *(one(i, c.name, c.arguments) for i, c in enumerate(parsed.calls))
            )
        else:
            results = []
        self.timings["tools"] = self.timings.get("tools", 0.0) + time.perf_counter() - start
        tools = self.tools
        out: list[Message] = []
        stop = False
        step_reward: float | None = None
        for call, res, latency in zip(parsed.calls, results, latencies, strict=True):
            key = call.name if tools is not None and call.name in tools else INVALID_TOOL
            self.tool_counts[key] = self.tool_counts.get(key, 0) + 1
            if key == INVALID_TOOL:
                self._count("tool_calls_unknown")
            else:
                self._record_call(key, res, latency)
            if res.error:
                self._count("tool_errors")
                if res.timed_out:
                    self._count("tool_timeouts")
            if res.reward is not None:
                step_reward = (step_reward or 0.0) + res.reward
            stop = stop or res.stop
            out.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": res.content}
            )
        for err in parsed.errors:
            self.tool_counts[INVALID_TOOL] = self.tool_counts.get(INVALID_TOOL, 0) + 1
            self._count("tool_calls_malformed")
            out.append({"role": "tool", "content": f"error: {err}"})
        if step_reward is not None:
            turn = self.recorder.num_turns if self.recorder is not None else 0
            self.step_rewards[turn] = self.step_rewards.get(turn, 0.0) + step_reward
        return out, stop

    def _record_call(self, name: str, res: ToolResult, latency: float) -> None:
        """Count one call of a known tool in the episode's ``tool_stats`` (``calls``,
        ``errors``, ``timeouts``, ``latency_s`` summed, ``latency_max_s``)."""
        st = self.tool_stats.setdefault(name, _no_calls())
        st["calls"] += 1
        st["errors"] += float(res.error)
        st["timeouts"] += float(res.timed_out)
        st["latency_s"] += latency
        st["latency_max_s"] = max(st["latency_max_s"], latency)

    def _count(self, key: str, n: float = 1.0) -> None:
        self.metrics[key] = self.metrics.get(key, 0.0) + n

    # ---- the episode stop policy ---------------------------------------------------------
    def stop_after(self, gen: Generation, parsed: ParseResult) -> StopReason | None:
        """The framework's stop policy after a model turn, first match wins:

        ``aborted`` (the server aborted the turn) > ``length`` (a budget cut the response) >
        ``eos``/``length`` (the turn made no tool call, well-formed or not) > ``max_turns``
        (the last allowed turn) > None (run the calls, continue).
        """
        rec = self._require_recorder()
        if gen.finish_reason == "abort":
            return StopReason.ABORTED
        if rec.truncated:
            return StopReason.LENGTH
        if not parsed.calls and not parsed.errors:
            return self.stop_reason_for(gen)
        if rec.num_turns >= self.limits.max_turns:
            return StopReason.MAX_TURNS
        return None

    async def turn(self, tools: ToolEpisode | None = None) -> Turn:
        """One model turn under the framework's stop policy (:meth:`stop_after`).

        Generates, parses, and, when the episode continues, runs the calls and appends every
        answer (malformed calls and unknown tools are answered with an error message and
        counted). When the episode ends on this turn, its calls are not run (no turn would
        read their results) but are counted (``tool_calls_unrun``), and malformed ones are
        still counted and answered on ``max_turns`` (mask-0 tokens, never trained on).
        """
        rec = self._require_recorder()
        if rec.remaining_budget <= 0:
            rec.truncated = True
            empty = Generation(token_ids=[], logprobs=[], finish_reason="length", weight_version=0)
            return Turn(empty, ParseResult(content="", calls=[], errors=[]), [], StopReason.LENGTH)
        gen = await self.generate()
        parsed = self.parse(gen)
        stop = self.stop_after(gen, parsed)
        messages: list[Message] = []
        if stop is None:
            messages, tool_stop = await self._answer_calls(tools, parsed)
            self.add_messages(messages)
            if rec.truncated:
                stop = StopReason.LENGTH
            elif tool_stop:
                stop = StopReason.TOOL_STOP
            return Turn(gen, parsed, messages, stop)
        if parsed.calls:
            self._count("tool_calls_unrun", len(parsed.calls))
        if parsed.errors:
            self.tool_counts[INVALID_TOOL] = self.tool_counts.get(INVALID_TOOL, 0) + len(
                parsed.errors
            )
            self._count("tool_calls_malformed", len(parsed.errors))
            if stop is StopReason.MAX_TURNS:
                messages = [{"role": "tool", "content": f"error: {e}"} for e in parsed.errors]
                self.add_messages(messages)
        return Turn(gen, parsed, messages, stop)

    async def _answer_calls(
        self, tools: ToolEpisode | None, parsed: ParseResult
    ) -> tuple[list[Message], bool]:
        if tools is not None:
            return await self.call_tools(tools, parsed)
        async with ToolSet().episode() as none:  # no tools: every call is answered as unknown
            return await self.call_tools(none, parsed)

    # ---- ending --------------------------------------------------------------------------
    @staticmethod
    def stop_reason_for(gen: Generation) -> StopReason:
        """The stop reason of a turn after which the agent stops (no tool call to run)."""
        if gen.finish_reason == "abort":
            return StopReason.ABORTED
        if gen.finish_reason == "length":
            return StopReason.LENGTH
        return StopReason.EOS

    def finish(
        self, stop_reason: StopReason, *, error: str | None = None, **meta: Any
    ) -> Trajectory:
        """The episode's trajectory from the record so far (also used for partial episodes)."""
        rec = self._require_recorder()
        fields: dict[str, Any] = {
            "uid": self.uid,
            "index": self.index,
            "agent": self.agent_name or "tool_agent",
            "stop_reason": stop_reason,
            "error": error,
            "tool_calls": dict(self.tool_counts),
            "tool_stats": {k: dict(v) for k, v in self.tool_stats.items()},
            "env_state": dict(self.env_state),
            "timings": dict(self.timings),
            "metrics": dict(self.metrics),
            "messages": list(self.messages),
            "turn_samples": list(self.turn_samples),
            # One entry per model turn (0.0 for turns whose tools gave no step reward); empty
            # when no tool gave one, so a reward function's own turn_rewards take over.
            "turn_rewards": [self.step_rewards.get(k, 0.0) for k in range(1, rec.num_turns + 1)]
            if self.step_rewards
            else [],
        }
        fields.update(meta)
        return rec.to_trajectory(**fields)


class AgentLoop(ABC):
    """An agent: one ``async run(task, ctx) -> Trajectory``. A fresh instance runs each episode.

    Subclasses may take keyword arguments in ``__init__`` (from ``agent_kwargs`` in the
    manager). ``run`` should end with ``ctx.finish(stop_reason)``; if it raises, the manager
    turns what was recorded into a trajectory with ``stop_reason=error``.
    """

    history: ClassVar[str | None] = None
    """``concat`` or ``per_turn`` for this agent's episodes (None = the config's
    ``agent.history``); see :attr:`AgentContext.history`."""

    name: ClassVar[str] = ""

    @abstractmethod
    async def run(self, task: Task, ctx: AgentContext) -> Trajectory:
        """Run one episode of ``task`` with ``ctx`` and return ``ctx.finish(stop_reason)``."""
        ...


def _check_agent(obj: Any) -> None:
    if not (isinstance(obj, type) and issubclass(obj, AgentLoop)):
        raise TypeError(f"an agent must be an AgentLoop subclass, got {obj!r}")


AGENTS: Registry[type[AgentLoop]] = Registry(
    "agent",
    config_key="agent.default",
    check=_check_agent,
    how_to_register="decorate an AgentLoop subclass with @register_agent('name') in a module "
    "listed under `imports:`, or give 'module:Class' / 'path/file.py:Class'",
)
"""Every agent by name; a task's ``agent`` column or ``agent.default`` picks one."""

A = TypeVar("A", bound=type[AgentLoop])


def register_agent(name: str | None = None) -> Callable[[A], A]:
    """Class decorator: ``@register_agent("my_agent")`` makes tasks with ``agent="my_agent"`` use it."""

    def wrap(cls: A) -> A:
        """Check and register ``cls`` under ``name`` (or its ``name``/class name)."""
        _check_agent(cls)
        key = name or cls.name or cls.__name__
        AGENTS.add(key, cls)
        if not cls.name:
            cls.name = key
        return cls

    return wrap


def list_agents() -> list[str]:
    """Names of the registered agents."""
    return AGENTS.names()


def get_agent_class(
    name: str, *, key: str = "agent", base_dir: str | None = None
) -> type[AgentLoop]:
    """The agent class for a registered name or a ``module:Class`` spec (``key`` names the
    config key or column in errors)."""
    return AGENTS.get(name, key=key, base_dir=base_dir)


def create_agent(name: str, **kwargs: Any) -> AgentLoop:
    """A fresh instance of the agent registered as ``name``."""
    return get_agent_class(name)(**kwargs)
