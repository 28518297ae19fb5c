"""The tool contract: what a tool is, how an episode calls it, and what the model sees back.

Read this module first when writing a tool. The vocabulary:

- a :class:`Tool` has a name, a description and a JSON schema of its arguments; it may keep
  per-episode state (``create`` -> ``execute`` ... -> ``release``);
- :func:`tool` turns a typed Python function (sync or async) into a :class:`FunctionTool`
  whose schema comes from the type hints and the docstring;
- a :class:`ToolSet` holds the tools of an agent and their limits (timeout, output size) and
  aggregates per-tool metrics across episodes;
- a :class:`ToolEpisode` (``async with toolset.episode() as ep``) runs calls for one episode.

Guarantees of :meth:`ToolEpisode.call`:

- it never raises, except ``asyncio.CancelledError``: an unknown tool, arguments that are not
  JSON or do not match the schema, an exception inside the tool and a timeout all come back as
  a :class:`ToolResult` with ``error=True`` and a message starting with ``error:`` that the
  model can read and react to;
- the content is at most ``max_output_chars`` characters plus a ``...[truncated N chars]``
  marker;
- a tool's state is created lazily on its first call in an episode and released exactly once
  when the episode ends, normally, by exception or by cancellation; a ``release`` that raises
  is logged and counted (``tools/<name>/release_errors``), never masks the original error;
- every wait on tool code has a deadline that holds even when the tool ignores cancellation:
  a call returns at its timeout, a cancelled call (e.g. the episode's deadline) re-raises at
  once, and a release gives up after ``release_timeout_s``. The tool's task is then cancelled
  and left behind; one still running ``ABANDON_GRACE_S`` later is counted in
  ``tools/<name>/abandoned`` (``tools/abandoned_running`` = how many are running now);
- sync ``@tool`` functions run on the ToolSet's own bounded pool of daemon threads
  (``sync_workers``), never on the event loop's default executor, so hung tools cannot starve
  what else uses that pool (weight staging), nor keep the process from exiting.

Example::

    @tool
    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: The first addend.
            b: The second addend.
        \"\"\"
        return a + b

    tools = ToolSet([add, get_tool("calculator")], timeout_s=5.0)
    async with tools.episode() as ep:
        result = await ep.call("add", '{"a": 2, "b": "3"}')
    assert result.content == "5"
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import importlib
import inspect
import json
import logging
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, overload

from pydantic import BaseModel, Field, ValidationError

from agentrl.registry import Registry
from tools.executor import DaemonThreadPool
from tools.schema import arguments_model, clean_schema, format_validation_error, parse_docstring

__all__ = [
    "ABANDON_GRACE_S",
    "TOOLS",
    "FunctionTool",
    "Tool",
    "ToolArgumentError",
    "ToolEpisode",
    "ToolResult",
    "ToolSet",
    "TruncateSide",
    "get_tool",
    "register_tool",
    "registered_tools",
    "tool",
    "truncate",
]

logger = logging.getLogger(__name__)

TruncateSide = Literal["left", "right", "middle"]

ABANDON_GRACE_S = 1.0
"""Seconds a cancelled tool call (or release) has to stop before it counts as abandoned."""


class ToolResult(BaseModel):
    """What one tool call returns to the agent.

    ``content`` is what the model reads (the tool message). ``reward`` is an optional step
    reward; ``stop`` asks the agent to end the episode (``StopReason.TOOL_STOP``); ``error``
    marks a failed call (the content then starts with ``error:``); ``timed_out`` marks a call
    the ToolSet cut off at its timeout (``error`` is then set too); ``metrics`` are numbers the
    tool wants averaged into ``tools/<name>/<key>``.
    """

    content: str
    reward: float | None = None
    stop: bool = False
    error: bool = False
    timed_out: bool = False
    metrics: dict[str, float] = Field(default_factory=dict)


class ToolArgumentError(ValueError):
    """Raised by :meth:`Tool.validate_arguments`; the message says which field is wrong."""


class Tool(ABC):
    """A tool the model can call.

    Subclasses set ``name``, ``description`` and either ``parameters`` (a JSON schema of the
    arguments object) or ``arguments_model`` (a pydantic model; the schema is derived from it
    and arguments are validated against it before ``execute``). Stateful tools override
    ``create`` (returns the per-episode state) and ``release`` (frees it); ``execute`` receives
    that state and the validated arguments.

    Per-tool overrides of the :class:`ToolSet` limits: ``timeout_s`` and ``max_output_chars``
    (``None`` = use the ToolSet's).
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {}  # noqa: RUF012 (class-level default, replaced per tool)
    arguments_model: ClassVar[type[BaseModel] | None] = None
    timeout_s: float | None = None
    max_output_chars: int | None = None

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling schema of this tool."""
        params = self.parameters
        if not params and self.arguments_model is not None:
            params = clean_schema(self.arguments_model)
        if not params:
            params = {"type": "object", "properties": {}}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": params,
            },
        }

    def validate_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check and coerce arguments; raise ``ValidationError`` or :class:`ToolArgumentError`.

        The default validates with ``arguments_model`` when set, and otherwise checks only
        that required properties of ``parameters`` are present.
        """
        if self.arguments_model is not None:
            model = self.arguments_model.model_validate(arguments)
            return {k: getattr(model, k) for k in type(model).model_fields}
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            raise ToolArgumentError("; ".join(f"{k}: Field required" for k in missing))
        return arguments

    async def create(self) -> Any:
        """Create the per-episode state (called lazily on the first call in an episode)."""
        return None

    @abstractmethod
    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult | str:
        """Run one call. Raise freely: the ToolSet turns exceptions into ``error:`` messages."""

    async def release(self, state: Any) -> None:
        """Free the per-episode state. Called exactly once per created state."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionTool(Tool):
    """A tool made from a plain function by :func:`tool` (stateless; sync runs in a thread).

    Calling the FunctionTool object directly calls the original function, so decorated
    functions stay usable (and testable) as functions.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = None,
        max_output_chars: int | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"@tool needs a function, got {type(fn).__name__}")
        doc_desc, arg_docs = parse_docstring(inspect.getdoc(fn))
        self.fn = fn
        self.name = name or fn.__name__
        self.description = description if description is not None else doc_desc
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.is_async = inspect.iscoroutinefunction(fn)
        self._model = arguments_model(fn, arg_docs, model_name=f"{self.name}_arguments")
        try:
            self.parameters = clean_schema(self._model)
        except Exception as exc:  # pydantic cannot express some type or default in JSON schema
            raise TypeError(
                f"tool {self.name!r}: cannot build a JSON schema from its signature ({exc}); "
                "use JSON-friendly types and defaults (str, int, float, bool, list, dict, "
                "Literal, Enum, pydantic models)"
            ) from exc
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]  # copies __doc__, __name__

    def validate_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """``arguments`` checked and coerced by the model built from the function's type hints."""
        model = self._model.model_validate(arguments)
        return {k: getattr(model, k) for k in type(model).model_fields}

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult | str:
        """Call the function (a sync one in the tool thread pool) and wrap what it returns."""
        if self.is_async:
            out = await self.fn(**arguments)
        else:
            call = _CURRENT_CALL.get(None)
            pool = call.pool if call is not None else _fallback_pool()
            context = contextvars.copy_context()
            future = pool.submit(context.run, functools.partial(self.fn, **arguments))
            if call is not None:
                call.thread = future
            out = await asyncio.wrap_future(future)
            if inspect.isawaitable(out):
                out = await out
        return _to_result(out)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> Any:
        # A module-level ``@tool`` replaces its function in the module, so pickle by reference
        # (like a function); anything else pickles by value, rebuilding the dynamic model.
        module = sys.modules.get(getattr(self.fn, "__module__", "") or "")
        qualname = getattr(self.fn, "__qualname__", "")
        if module is not None and "<locals>" not in qualname:
            obj: Any = module
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
            if obj is self:
                return (_import_attr, (module.__name__, qualname))
            if isinstance(obj, FunctionTool) and obj.fn is self.fn:
                # The function is only reachable through another tool made from it.
                ref = _Ref(module.__name__, qualname + ".fn")
                return (_rebuild_function_tool, (ref, *self._options()))
        return (_rebuild_function_tool, (self.fn, *self._options()))

    def _options(self) -> tuple[Any, ...]:
        return (self.name, self.description, self.timeout_s, self.max_output_chars)


class _Ref:
    """A picklable pointer to ``module.qualname`` (resolved when the tool is rebuilt)."""

    def __init__(self, module: str, qualname: str) -> None:
        self.module = module
        self.qualname = qualname

    def resolve(self) -> Any:
        """The object ``module.qualname`` names (imported now)."""
        return _import_attr(self.module, self.qualname)


def _import_attr(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _rebuild_function_tool(
    fn: Callable[..., Any] | _Ref,
    name: str,
    description: str,
    timeout_s: float | None,
    max_output_chars: int | None,
) -> FunctionTool:
    return FunctionTool(
        fn.resolve() if isinstance(fn, _Ref) else fn,
        name=name,
        description=description,
        timeout_s=timeout_s,
        max_output_chars=max_output_chars,
    )


def _to_result(out: Any) -> ToolResult | str:
    if isinstance(out, (ToolResult, str)):
        return out
    if out is None:
        return ""
    if isinstance(out, BaseModel):
        return out.model_dump_json()
    if isinstance(out, (dict, list, tuple, bool)):
        try:
            return json.dumps(out, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return str(out)
    return str(out)


@overload
def tool(
    fn: Callable[..., Any],
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    max_output_chars: int | None = None,
) -> FunctionTool:
    """``@tool``: a :class:`FunctionTool` from ``fn`` with the defaults."""
    ...


@overload
def tool(
    fn: None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    max_output_chars: int | None = None,
) -> Callable[[Callable[..., Any]], FunctionTool]:
    """``@tool(name=..., ...)``: a decorator that makes a :class:`FunctionTool`."""
    ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    max_output_chars: int | None = None,
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """Make a tool from a typed function: ``@tool`` or ``@tool(name=..., timeout_s=...)``.

    The schema comes from the type hints (``int``, ``float``, ``str``, ``bool``,
    ``list[...]``, ``dict[...]``, ``Literal``, ``Optional``, ``Enum``, pydantic models,
    ``Annotated[..., Field(...)]``) and the docstring: the text before the first section is the
    description, an ``Args:`` (Google) or ``Parameters`` (NumPy) section gives the argument
    descriptions. Arguments are validated and coerced with pydantic before the call.
    """

    def wrap(f: Callable[..., Any]) -> FunctionTool:
        """A :class:`FunctionTool` of ``f`` with the options given to :func:`tool`."""
        return FunctionTool(
            f,
            name=name,
            description=description,
            timeout_s=timeout_s,
            max_output_chars=max_output_chars,
        )

    if fn is not None:
        return wrap(fn)
    return wrap


# ---- truncation ---------------------------------------------------------------------------


def truncate(text: str, max_chars: int | None, side: TruncateSide = "right") -> tuple[str, int]:
    """Keep at most ``max_chars`` characters of ``text``; return (text, characters dropped).

    ``side`` is the side that is cut: ``right`` keeps the head, ``left`` keeps the tail,
    ``middle`` keeps both ends. A marker ``...[truncated N chars]`` (not counted in
    ``max_chars``) shows where text was dropped. ``max_chars=None`` disables truncation.
    """
    if max_chars is None or len(text) <= max_chars:
        return text, 0
    max_chars = max(0, max_chars)
    dropped = len(text) - max_chars
    marker = f"...[truncated {dropped} chars]"
    if side == "right":
        return text[:max_chars] + marker, dropped
    if side == "left":
        return marker + text[len(text) - max_chars :], dropped
    if side == "middle":
        head = max_chars - max_chars // 2
        tail = max_chars // 2
        return text[:head] + marker + (text[len(text) - tail :] if tail else ""), dropped
    raise ValueError(f"truncate_side must be 'left', 'right' or 'middle', got {side!r}")


# ---- ToolSet and episodes -------------------------------------------------------------------


class _Stats:
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


class _Call:
    """One running tool call (or release): its task, and the thread of a sync tool."""

    __slots__ = ("pool", "task", "thread")

    def __init__(self, pool: DaemonThreadPool) -> None:
        self.pool = pool
        self.task: asyncio.Task[Any] | None = None
        self.thread: concurrent.futures.Future[Any] | None = None

    def running(self) -> bool:
        """Whether the tool's code still runs (its task, or a sync tool's thread)."""
        if self.task is not None and not self.task.done():
            return True
        return self.thread is not None and not self.thread.done()


_CURRENT_CALL: contextvars.ContextVar[_Call] = contextvars.ContextVar("agentrl_tool_call")
_FALLBACK_POOL: list[DaemonThreadPool] = []


def _fallback_pool() -> DaemonThreadPool:
    """The pool of a sync tool executed outside a ToolSet (e.g. ``await tool.execute(...)``)."""
    if not _FALLBACK_POOL:
        _FALLBACK_POOL.append(DaemonThreadPool(8, name="agentrl-tool"))
    return _FALLBACK_POOL[0]


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Done-callback: mark an abandoned task's exception as seen (no 'never retrieved' log)."""
    if not task.cancelled():
        task.exception()


class ToolSet:
    """The tools of an agent, their limits, and their metrics.

    Args:
        tools: The tools; names must be unique.
        timeout_s: Seconds one call may take (``None`` = no limit); a tool's own
            ``timeout_s`` overrides it.
        max_output_chars: Most characters of a tool message (``None`` = no limit); a tool's
            own ``max_output_chars`` overrides it.
        truncate_side: Which side of a long output is cut (``right`` keeps the head).
        release_timeout_s: Seconds one ``release`` may take before it is abandoned (counted
            as a release error).
        sync_workers: Most sync ``@tool`` functions running at once (threads of the ToolSet's
            own pool; more calls wait, within their timeout).
        clock: Where call latencies are read from (seconds; tests inject a fake clock).

    A ToolSet is shared by all episodes of an agent worker: it holds no per-episode state,
    only the tools and the metric counters (updated from the event loop, guarded by a lock
    so that worker threads may read them).
    """

    def __init__(
        self,
        tools: Sequence[Tool] = (),
        *,
        timeout_s: float | None = 10.0,
        max_output_chars: int | None = 4000,
        truncate_side: TruncateSide = "right",
        release_timeout_s: float = 10.0,
        sync_workers: int = 16,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if sync_workers < 1:
            raise ValueError(f"sync_workers must be >= 1, got {sync_workers}")
        if truncate_side not in ("left", "right", "middle"):
            raise ValueError(
                f"truncate_side must be 'left', 'right' or 'middle', got {truncate_side!r}"
            )
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(
                    f"ToolSet takes Tool objects, got {type(t).__name__} ({t!r}); decorate a "
                    "function with @tool or subclass tools.Tool"
                )
            if not t.name:
                raise ValueError(f"{t!r} has an empty name; set Tool.name")
            if t.name in self._tools:
                raise ValueError(f"two tools are named {t.name!r}; tool names must be unique")
            self._tools[t.name] = t
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.truncate_side: TruncateSide = truncate_side
        self.release_timeout_s = release_timeout_s
        self.sync_workers = sync_workers
        self.clock = clock
        self._lock = threading.Lock()
        self._stats: dict[str, _Stats] = {}
        self._unknown_calls = 0
        self._pool: DaemonThreadPool | None = None
        self._abandoned: set[_Call] = set()

    @classmethod
    def from_names(
        cls,
        names: Sequence[str],
        *,
        options: dict[str, dict[str, Any]] | None = None,
        extra: Sequence[Tool] = (),
        base_dir: Any = None,
        **limits: Any,
    ) -> ToolSet:
        """A ToolSet of tools looked up by name (:func:`get_tool`), e.g. from a config.

        ``options[name]`` are that tool's constructor arguments (options of known tools that
        are not in ``names`` are ignored, so a config may hold settings of disabled tools; a
        name no tool has is an error); ``extra`` are Tool objects added as they are; ``limits`` go to the constructor (``timeout_s``,
        ``max_output_chars``, ``truncate_side``, ``release_timeout_s``)::

            ToolSet.from_names(["calculator", "python"], options={"python": {"wall_time_s": 2}},
                               timeout_s=10, max_output_chars=2000)
        """
        options = options or {}
        unknown = set(options) - set(names) - set(registered_tools())
        if unknown:
            raise ValueError(
                f"options given for unknown tools: {sorted(unknown)}; known tools: "
                f"{', '.join(registered_tools())}"
            )
        built: list[Tool] = []
        for name in names:
            try:
                built.append(get_tool(name, base_dir=base_dir, **options.get(name, {})))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"cannot build tool {name!r}: {exc}") from exc
        return cls([*built, *extra], **limits)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_lock", "_pool", "_abandoned"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pool = None
        self._abandoned = set()

    def _sync_pool(self) -> DaemonThreadPool:
        if self._pool is None:
            self._pool = DaemonThreadPool(self.sync_workers, name="agentrl-tool")
        return self._pool

    # -- introspection --
    def names(self) -> list[str]:
        """The tool names, in order."""
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas of all tools, in order (pass as ``tools=`` to a chat API)."""
        return [t.schema() for t in self._tools.values()]

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or None."""
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def episode(self) -> ToolEpisode:
        """A new episode: ``async with toolset.episode() as ep: await ep.call(...)``."""
        return ToolEpisode(self)

    # -- metrics --
    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Per-tool counters since the start (or the last ``reset=True``).

        Keys: ``tools/<name>/calls``, ``errors``, ``timeouts``, ``cancelled`` (calls cut off by
        the caller's cancellation, e.g. the episode deadline), ``abandoned`` (timed-out or
        cancelled calls still running ``ABANDON_GRACE_S`` later), ``truncated``,
        ``release_errors``, ``latency_mean_s``, ``latency_max_s``, plus the mean of every
        number tools put in ``ToolResult.metrics``; and ``tools/unknown_calls``,
        ``tools/abandoned_running`` (abandoned calls still running now) and
        ``tools/sync_threads_busy`` (threads of the sync pool running a call now).
        """
        with self._lock:
            self._abandoned = {c for c in self._abandoned if c.running()}
            out: dict[str, float] = {
                "tools/unknown_calls": float(self._unknown_calls),
                "tools/abandoned_running": float(len(self._abandoned)),
                "tools/sync_threads_busy": float(self._pool.busy if self._pool else 0),
            }
            for name, s in self._stats.items():
                p = f"tools/{name}/"
                for key, values in s.result_metrics.items():
                    if values:
                        out[p + key] = sum(values) / len(values)
                out[p + "calls"] = float(s.calls)
                out[p + "errors"] = float(s.errors)
                out[p + "timeouts"] = float(s.timeouts)
                out[p + "cancelled"] = float(s.cancelled)
                out[p + "abandoned"] = float(s.abandoned)
                out[p + "truncated"] = float(s.truncated)
                out[p + "release_errors"] = float(s.release_errors)
                out[p + "latency_mean_s"] = s.latency_sum / s.calls if s.calls else 0.0
                out[p + "latency_max_s"] = s.latency_max
            if reset:
                self._stats = {}
                self._unknown_calls = 0
            return out

    def _stat(self, name: str) -> _Stats:
        s = self._stats.get(name)
        if s is None:
            s = self._stats[name] = _Stats()
        return s

    def _record(
        self,
        name: str,
        latency: float,
        *,
        error: bool,
        timeout: bool,
        truncated: bool,
        metrics: dict[str, float],
    ) -> None:
        with self._lock:
            s = self._stat(name)
            s.calls += 1
            s.errors += int(error)
            s.timeouts += int(timeout)
            s.truncated += int(truncated)
            s.latency_sum += latency
            s.latency_max = max(s.latency_max, latency)
            for key, value in metrics.items():
                try:
                    s.result_metrics.setdefault(key, []).append(float(value))
                except (TypeError, ValueError):
                    continue

    def _record_release_error(self, name: str) -> None:
        with self._lock:
            self._stat(name).release_errors += 1

    def _record_cancelled(self, name: str, latency: float) -> None:
        with self._lock:
            s = self._stat(name)
            s.calls += 1
            s.cancelled += 1
            s.latency_sum += latency
            s.latency_max = max(s.latency_max, latency)

    def _abandon(self, name: str, call: _Call) -> None:
        """Cancel a call the caller stopped waiting for; count it if it keeps running."""
        if call.task is not None:
            call.task.cancel()
        if call.thread is not None:
            call.thread.cancel()  # only stops a call still queued for a thread

        def check() -> None:
            """Count the call as abandoned (and warn) if it still runs after the grace time."""
            if call.running():
                logger.warning(
                    "tool %r is still running %.1f s after it was abandoned (it ignores "
                    "cancellation, or a sync tool's thread cannot be stopped)",
                    name,
                    ABANDON_GRACE_S,
                )
                with self._lock:
                    self._stat(name).abandoned += 1
                    self._abandoned.add(call)

        asyncio.get_running_loop().call_later(ABANDON_GRACE_S, check)

    def _record_unknown(self) -> None:
        with self._lock:
            self._unknown_calls += 1


class ToolEpisode:
    """The tool calls of one episode; owns the per-episode state of every tool it used.

    Use as an async context manager (``async with toolset.episode() as ep``), or call
    :meth:`aclose` yourself in a ``finally``. Calls may run concurrently (parallel tool calls);
    a tool's state is created once even when two calls race for it.
    """

    def __init__(self, toolset: ToolSet) -> None:
        self.toolset = toolset
        self._states: dict[str, Any] = {}
        self._create_locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    async def __aenter__(self) -> ToolEpisode:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """The episode has been closed (every tool state released)."""
        return self._closed

    def state(self, name: str) -> Any:
        """The live state of tool ``name`` in this episode (``KeyError`` if not created)."""
        return self._states[name]

    async def call(self, name: str, arguments: dict[str, Any] | str | None) -> ToolResult:
        """Run tool ``name`` with ``arguments`` (a dict or a JSON string). Never raises.

        See the module docstring for the error messages; the only exception that escapes is
        ``asyncio.CancelledError``, after which the episode still releases the states.
        """
        ts = self.toolset
        t = ts.get(name)
        if t is None:
            ts._record_unknown()
            available = ", ".join(ts.names()) or "(none)"
            return ToolResult(
                content=f"error: unknown tool {name!r}; available: {available}", error=True
            )
        start = ts.clock()
        try:
            result, timed_out = await self._run(t, arguments)
        except asyncio.CancelledError:
            ts._record_cancelled(name, ts.clock() - start)
            raise
        latency = ts.clock() - start
        limit = t.max_output_chars if t.max_output_chars is not None else ts.max_output_chars
        content, dropped = truncate(result.content, limit, ts.truncate_side)
        if dropped:
            result = result.model_copy(update={"content": content})
        ts._record(
            name,
            latency,
            error=result.error,
            timeout=timed_out,
            truncated=dropped > 0,
            metrics=result.metrics,
        )
        return result

    async def _run(
        self, t: Tool, arguments: dict[str, Any] | str | None
    ) -> tuple[ToolResult, bool]:
        if self._closed:
            return ToolResult(
                content=f"error: tool {t.name!r} called after its episode ended", error=True
            ), False
        try:
            args = _parse_arguments(arguments)
            args = t.validate_arguments(args)
        except (ValidationError, ToolArgumentError, ValueError) as exc:
            msg = format_validation_error(exc)
            return ToolResult(
                content=f"error: invalid arguments for {t.name!r}: {msg}", error=True
            ), False
        except Exception as exc:  # a broken validate_arguments override
            return ToolResult(
                content=f"error: invalid arguments for {t.name!r}: {type(exc).__name__}: {exc}",
                error=True,
            ), False

        timeout = t.timeout_s if t.timeout_s is not None else self.toolset.timeout_s
        out = await self._guarded(t.name, self._execute(t, args), timeout)
        if out is _TIMED_OUT:
            return ToolResult(
                content=f"error: tool {t.name!r} timed out after {_fmt_s(timeout)} s",
                error=True,
                timed_out=True,
            ), True
        if isinstance(out, _CreateError):
            cause = out.__cause__
            return ToolResult(
                content=f"error: tool {t.name!r} failed to start: {_describe(cause)}",
                error=True,
            ), False
        if isinstance(out, BaseException):
            return ToolResult(content=f"error: {_describe(out)}", error=True), False
        if isinstance(out, str):
            return ToolResult(content=out), False
        if isinstance(out, ToolResult):
            return out, False
        return ToolResult(
            content=f"error: tool {t.name!r} returned {type(out).__name__}, expected "
            "ToolResult or str",
            error=True,
        ), False

    async def _execute(self, t: Tool, args: dict[str, Any]) -> Any:
        """The tool's own work, in its own task; its exceptions become values (so a
        TimeoutError raised by the tool is never mistaken for the call's deadline)."""
        try:
            state = await self._ensure_state(t)
            return await t.execute(state, args)
        except Exception as exc:
            return exc

    async def _guarded(self, name: str, work: Any, timeout: float | None) -> Any:
        """Run ``work`` (a coroutine) in its own task and wait at most ``timeout`` for it.

        Returns its value, or ``_TIMED_OUT``. The wait ends at the deadline, or at once when
        this task is cancelled, whatever the tool does with its own cancellation: the tool's
        task is then cancelled and abandoned (counted if it keeps running).
        """
        call = _Call(self.toolset._sync_pool())
        token = _CURRENT_CALL.set(call)
        try:
            task = asyncio.ensure_future(work)
        finally:
            _CURRENT_CALL.reset(token)
        call.task = task
        task.add_done_callback(_retrieve)
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:
            self.toolset._abandon(name, call)
            raise
        if not done:
            self.toolset._abandon(name, call)
            return _TIMED_OUT
        if task.cancelled():
            return asyncio.CancelledError(f"tool {name!r} cancelled its own call")
        return task.result()

    async def _ensure_state(self, t: Tool) -> Any:
        if t.name in self._states:
            return self._states[t.name]
        lock = self._create_locks.setdefault(t.name, asyncio.Lock())
        async with lock:
            if t.name in self._states:
                return self._states[t.name]
            if self._closed:
                raise RuntimeError("episode already ended")
            try:
                state = await t.create()
            except Exception as exc:
                raise _CreateError() from exc
            if self._closed:
                # The episode ended while this state was being created: free it now, since
                # aclose() has already run and will not see it.
                with contextlib.suppress(Exception):
                    await t.release(state)
                raise RuntimeError("episode already ended")
            self._states[t.name] = state
            return state

    async def aclose(self) -> None:
        """Release every created state, once. Survives failing releases and cancellation.

        A release that raises or exceeds ``release_timeout_s`` is logged and counted. If the
        closing task is cancelled while releasing, the remaining states are still released and
        the cancellation is re-raised at the end.
        """
        if self._closed:
            return
        self._closed = True
        cancelled: BaseException | None = None
        for name, state in list(self._states.items()):
            t = self.toolset.get(name)
            if t is None or getattr(t.release, "__func__", None) is Tool.release:
                continue  # the base release does nothing: skip its timer
            try:
                out = await self._guarded(name, _release(t, state), self.toolset.release_timeout_s)
            except asyncio.CancelledError as exc:
                cancelled = exc
                self.toolset._record_release_error(name)
                logger.warning("release of tool %r was cancelled; state may leak", name)
                continue
            if out is _TIMED_OUT or isinstance(out, BaseException):
                self.toolset._record_release_error(name)
                if isinstance(out, BaseException):
                    logger.error("release of tool %r failed", name, exc_info=out)
                else:
                    logger.error(
                        "release of tool %r took more than %s s; abandoned",
                        name,
                        _fmt_s(self.toolset.release_timeout_s),
                    )
        self._states.clear()
        if cancelled is not None:
            raise cancelled


_TIMED_OUT = object()
"""Sentinel: a guarded wait reached its deadline."""


async def _release(t: Tool, state: Any) -> BaseException | None:
    """``t.release(state)``, its exception returned as a value."""
    try:
        await t.release(state)
    except Exception as exc:
        return exc
    return None


class _CreateError(Exception):
    """Internal marker: ``Tool.create`` raised (the cause is chained)."""


def _parse_arguments(arguments: dict[str, Any] | str | None) -> dict[str, Any]:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ToolArgumentError(f"not valid JSON ({exc})") from exc
        arguments = parsed
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    return arguments


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    msg = str(exc)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return f"{seconds:g}"


# ---- registry of built-in and user tools ----------------------------------------------------


def _check_tool(obj: Any) -> None:
    if isinstance(obj, Tool) or (isinstance(obj, type) and issubclass(obj, Tool)):
        return
    raise TypeError(
        f"a tool must be a Tool instance (e.g. made by @tool) or a Tool subclass, got {obj!r}"
    )


TOOLS: Registry[Tool | type[Tool]] = Registry(
    "tool",
    config_key="tools.enabled",
    check=_check_tool,
    how_to_register="decorate it with @register_tool (above @tool) in a module listed under "
    "`imports:`, or give 'module:attr' / 'path/file.py:attr'",
)
"""Tools by name: instances (``@tool`` functions) or Tool subclasses built with options."""
TOOLS.add_lazy("calculator", "tools.calculator:Calculator")
TOOLS.add_lazy("python", "tools.python_sandbox:PythonTool")
TOOLS.add_lazy("search", "tools.search:SearchTool")


def register_tool(t: Any) -> Any:
    """Register a tool (a ``Tool`` instance or a ``Tool`` subclass) under its ``name``.

    Returns ``t`` unchanged, so it also works as a decorator above ``@tool`` or a class.
    Registering a different tool under a taken name raises ``ValueError``.
    """
    _check_tool(t)
    name = getattr(t, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool {t!r} has no name; set its `name`")
    TOOLS.add(name, t)
    return t


def get_tool(name: str, *, key: str = "tools.enabled", base_dir: Any = None, **kwargs: Any) -> Tool:
    """A tool by name: a built-in (``calculator``, ``python``, ``search``), a registered one, or
    a ``module:attr`` / ``path/file.py:attr`` spec.

    ``kwargs`` go to a Tool subclass's constructor (e.g. ``get_tool("python", wall_time_s=2)``,
    ``get_tool("search", corpus_path="docs.jsonl")``).
    """
    obj = TOOLS.get(name, key=key, base_dir=base_dir)
    if isinstance(obj, type):
        return obj(**kwargs)
    if kwargs:
        raise TypeError(
            f"{key}: tool {name!r} is a ready-made tool instance and takes no options; "
            f"got {sorted(kwargs)}"
        )
    return obj


def registered_tools() -> list[str]:
    """Names :func:`get_tool` accepts."""
    return TOOLS.names()
