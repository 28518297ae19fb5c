"""The environment contract: the one way to write a stateful task (a game, a simulated user).

Read this module after :mod:`agents.base`. An :class:`Environment` is created **per episode from
its task** (it sees the task's fields), **owns the episode's state**, **exposes tools** bound to
that state (``@tool`` methods), **may answer turns without a tool call** (:meth:`respond`: a
game's move, a simulated user, a tutor's hint) and **may end the episode** (``self.done =
True``), and **hands its final state to the reward** (:meth:`final_state` ->
``Trajectory.env_state`` -> the ``reward(state, task)`` static method). Everything else is the
framework's: the loop (:class:`EnvironmentAgent`), the stop policy, the token recording, the
tool limits of the config's ``tools:`` section and the counting (``tools/<name>/...``).

A complete environment (``examples/secret_number/game.py`` is this, with its data and config)::

    from agents import Environment, register_environment
    from tools import ToolResult, tool

    @register_environment("secret_number")
    class SecretNumber(Environment):
        def __init__(self, task):
            self.target = int(task.extra["target"])   # this episode's hidden number
            self.probes = 0
            self.found = False

        @tool
        def probe(self, x: int) -> ToolResult:
            \"\"\"Compare a guess with the secret number.

            Args:
                x: The guess.
            \"\"\"
            self.probes += 1
            if x == self.target:
                self.found = True
                return ToolResult(content="correct", stop=True)
            return ToolResult(content="higher" if x < self.target else "lower")

        @staticmethod
        def reward(state, task):          # state = final_state(): the public attributes
            return {"score": float(state["found"]), "probes": state["probes"]}

and one config key names it: ``environment: secret_number`` (or ``game.py:SecretNumber``). Tasks
that name no agent run in it, tasks with no ``data_source`` are scored by its ``reward`` (each
number of a reward dict is logged per step as ``reward/<env>/<key>/mean``).

How the episode ends (:class:`EnvironmentAgent`): the framework's stop policy first
(:meth:`agents.base.AgentContext.turn`: budgets, abort, ``max_turns``, a tool's ``stop=True``);
then ``tool_stop`` when a tool call set ``done``; a turn without a tool call is handed to
:meth:`respond`: ``None`` (the default) ends the episode (``eos``), a string is the next user
message (unless ``done`` was set or no turn is left: ``eos`` / ``max_turns``).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

from agentrl.registry import Registry, RegistryError
from agentrl.types import Message, StopReason, Task, Trajectory
from agents.base import AgentContext, AgentLoop, register_agent
from tools import FunctionTool, Tool

__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "EnvironmentAgent",
    "EnvironmentReward",
    "check_environment",
    "get_environment_class",
    "register_environment",
]


class Environment:
    """One episode's world: state, tools, answers to plain turns, the end, the final state.

    Subclasses take the task in ``__init__(self, task, **kwargs)`` (``kwargs`` from the config's
    ``environment.kwargs``) and override only what they need; see the module docstring.
    """

    name: ClassVar[str] = ""
    """The name configs use (set by :func:`register_environment`; the class name otherwise)."""
    done: bool = False
    """Set ``self.done = True`` to end the episode after the current turn."""

    def __init__(self, task: Task, **kwargs: Any) -> None:
        del task, kwargs  # the base keeps nothing; subclasses read what they need

    def initial_messages(self, task: Task, system_prompt: str | None) -> list[Message]:
        """The conversation the episode starts from (default: the task's prompt)."""
        return task.initial_messages(system_prompt)

    def tools(self) -> list[Tool]:
        """The episode's tools: every ``@tool`` method, bound to this instance, in class order."""
        out: list[Tool] = []
        seen: set[str] = set()
        for klass in reversed(type(self).__mro__):
            for attr, value in vars(klass).items():
                if isinstance(value, FunctionTool) and value.is_method and attr not in seen:
                    seen.add(attr)
                    out.append(value.bind(self))
        return out

    def respond(self, text: str) -> str | Awaitable[str | None] | None:
        """Answer a model turn that made no tool call (``text`` is its content): the next user
        message, or ``None`` to end the episode. May be ``async``. Default: ``None``."""
        del text
        return None

    def final_state(self) -> dict[str, Any]:
        """What the reward reads (``Trajectory.env_state``): plain, JSON-able data. Default: the
        public attributes whose values are JSON-able (``done`` included)."""
        state: dict[str, Any] = {"done": self.done}
        for key, value in vars(self).items():
            if key.startswith("_"):
                continue
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
            state[key] = value
        return state

    async def close(self) -> None:
        """Free what the episode holds (called once, however the episode ended)."""
        return None


def _check_environment(obj: Any) -> None:
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise TypeError(f"an environment must be an Environment subclass, got {obj!r}")


ENVIRONMENTS: Registry[type[Environment]] = Registry(
    "environment",
    config_key="environment.name",
    check=_check_environment,
    how_to_register="decorate an Environment subclass with @register_environment('name') in a "
    "module listed under `imports:`, or give 'module:Class' / 'path/file.py:Class'",
)
"""Every environment by name; the config's ``environment.name`` picks one."""

E = TypeVar("E", bound=type[Environment])


def register_environment(name: str | None = None) -> Callable[[E], E]:
    """Class decorator: ``@register_environment("secret_number")`` makes the config key
    ``environment: secret_number`` run it."""

    def wrap(cls: E) -> E:
        """Check and register ``cls`` under ``name`` (or its ``name``/class name)."""
        _check_environment(cls)
        key = name or cls.name or cls.__name__
        ENVIRONMENTS.add(key, cls)
        if not cls.name:
            cls.name = key
        return cls

    return wrap


def get_environment_class(
    spec: str, *, key: str = "environment.name", base_dir: str | None = None
) -> type[Environment]:
    """The class of a registered name or a ``module:Class`` / ``path/file.py:Class`` spec."""
    return ENVIRONMENTS.get(spec, key=key, base_dir=base_dir)


def environment_label(cls: type[Environment]) -> str:
    """The environment's name in data sources and metrics (its ``name`` or class name)."""
    return cls.name or cls.__name__


def check_environment(
    spec: str, kwargs: dict[str, Any], *, base_dir: str | None = None
) -> type[Environment]:
    """Resolve ``spec`` and check what can be checked before any server starts: the class,
    that ``__init__`` takes the task and ``environment.kwargs``, every ``@tool`` method's
    schema (checked when the class was defined) and the arity of ``reward``."""
    cls = get_environment_class(spec, base_dir=base_dir)
    try:
        inspect.signature(cls.__init__).bind(None, None, **kwargs)
    except TypeError as exc:
        raise RegistryError(
            f"environment.kwargs {kwargs!r} do not fit {cls.__name__}.__init__(self, task, ...) "
            f"({exc}); give `__init__(self, task, ...)` those keywords or change "
            "environment.kwargs"
        ) from None
    fn = getattr(cls, "reward", None)
    if fn is not None:
        try:
            inspect.signature(fn).bind(None, None)
        except TypeError:
            raise RegistryError(
                f"environment {spec!r}: {cls.__name__}.reward{inspect.signature(fn)} must take "
                "(state, task): declare it `@staticmethod def reward(state, task) -> float | "
                "dict` (state is final_state(), task the episode's Task)"
            ) from None
    return cls


class EnvironmentReward:
    """The reward of an environment's episodes: ``Env.reward(traj.env_state, task)``.

    A plain picklable object (the environment is found again by name wherever it runs: a
    thread, a reward process, a Ray actor).
    """

    def __init__(self, spec: str, base_dir: str | None = None) -> None:
        self.spec = spec
        self.base_dir = base_dir
        self.__qualname__ = f"{spec}.reward"

    def __call__(self, traj: Trajectory, task: Task) -> Any:
        """The environment's score of the episode's final state."""
        cls = get_environment_class(self.spec, base_dir=self.base_dir)
        return cls.reward(traj.env_state, task)  # type: ignore[attr-defined]  # checked


@register_agent("environment")
class EnvironmentAgent(AgentLoop):
    """Runs an episode in an :class:`Environment` under the framework's stop policy.

    Args:
        name: The environment (registered name or ``module:Class`` spec).
        kwargs: Its keyword arguments (config ``environment.kwargs``).
        base_dir: The folder path specs resolve against (the config file's).
    """

    def __init__(
        self, name: str = "", kwargs: dict[str, Any] | None = None, base_dir: str | None = None
    ) -> None:
        if not name:
            raise TypeError(
                "agent 'environment' needs an environment: set the config key "
                "`environment: <name or path/file.py:Class>`"
            )
        self.env_name = name
        self.env_kwargs = dict(kwargs or {})
        self.base_dir = base_dir

    async def run(self, task: Task, ctx: AgentContext) -> Trajectory:
        """Turns of generate + tool calls (or the environment's answers) until the episode ends."""
        cls = get_environment_class(self.env_name, base_dir=self.base_dir)
        env = cls(task, **self.env_kwargs)
        base = ctx.tools.tools() if ctx.tools is not None else []
        try:
            async with ctx.tool_episode([*env.tools(), *base]) as calls:
                ctx.start_episode(env.initial_messages(task, ctx.system_prompt))
                while True:
                    turn = await ctx.turn(calls)
                    stop = turn.stop
                    if stop is None and env.done:
                        stop = StopReason.TOOL_STOP
                    elif stop is StopReason.EOS and not env.done:
                        stop = await self._answer(env, ctx, turn.parsed.content)
                    if stop is not None:
                        ctx.env_state = env.final_state()
                        return ctx.finish(stop)
        finally:
            if not ctx.env_state:  # an error or a timeout: the reward-free partial keeps it too
                ctx.env_state = env.final_state()
            await env.close()

    @staticmethod
    async def _answer(env: Environment, ctx: AgentContext, text: str) -> StopReason | None:
        """Hand a turn without tool calls to :meth:`Environment.respond`; the stop reason."""
        reply = env.respond(text)
        if inspect.isawaitable(reply):
            reply = await reply
        if reply is None or env.done:
            return StopReason.EOS
        assert ctx.recorder is not None
        if ctx.recorder.num_turns >= ctx.limits.max_turns:
            return StopReason.MAX_TURNS
        ctx.add_messages([{"role": "user", "content": str(reply)}])
        return StopReason.LENGTH if ctx.recorder.truncated else None
