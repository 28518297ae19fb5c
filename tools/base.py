"""The tool contract: what a tool is, and what one call of it returns.

Read this module first when writing a tool. The vocabulary:

- a :class:`Tool` has a ``name``, a ``description`` and a JSON schema of its arguments; it may
  keep per-episode state: ``create`` (once per episode, on the first call) -> ``execute`` (each
  call) ... -> ``release`` (exactly once per created state);
- :func:`tool` turns a typed Python function (sync or async) into a :class:`FunctionTool`
  whose schema comes from the type hints and the docstring;
- a :class:`ToolResult` is what one call returns: the text the model reads, and optionally a
  step reward, a request to stop the episode, an error mark and numbers for the metrics;
- :class:`ToolArgumentError` is how a tool refuses its arguments (the message names the field).

Around the contract (each in its own module): a :class:`~tools.toolset.ToolSet` holds the tools
of an agent, their :class:`~tools.limits.ToolLimits` and their
:class:`~tools.metrics.ToolMetrics`; a :class:`~tools.episode.ToolEpisode`
(``async with toolset.episode() as ep``) runs the calls of one episode and never raises (an
unknown tool, bad arguments, an exception in the tool and a timeout all come back as a
``ToolResult`` with ``error=True`` whose content starts with ``error:``); the registry
(:func:`~tools.registry.get_tool`) finds tools by name.

Example::

    @tool
    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: The first addend.
            b: The second addend.
        \"\"\"
        return a + b

    add(2, 3)                       # 5: still the function
    add.schema()["function"]        # {"name": "add", "description": "Add two integers.", ...}

    tools = ToolSet([add, get_tool("calculator")], timeout_s=5.0)
    async with tools.episode() as ep:
        result = await ep.call("add", '{"a": 2, "b": "3"}')
    assert result.content == "5"
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, overload

from pydantic import BaseModel, Field

from tools.call import ABANDON_GRACE_S, run_in_tool_thread
from tools.limits import TruncateSide, truncate
from tools.schema import arguments_model, clean_schema, parse_docstring

__all__ = [
    "ABANDON_GRACE_S",
    "BoundTool",
    "FunctionTool",
    "Tool",
    "ToolArgumentError",
    "ToolResult",
    "TruncateSide",
    "tool",
    "truncate",
]
# ABANDON_GRACE_S (tools.call), truncate and TruncateSide (tools.limits) stay importable from
# here for code written when this module held the ToolSet too.


class ToolResult(BaseModel):
    """What one tool call returns to the agent (a tool may also return a plain ``str``).

    Example::

        ToolResult(content="you won", reward=1.0, stop=True)
    """

    content: str
    """What the model reads (the tool message)."""
    reward: float | None = None
    """An optional step reward."""
    stop: bool = False
    """Ask the agent to end the episode (``StopReason.TOOL_STOP``)."""
    error: bool = False
    """The call failed; the content then starts with ``error:``."""
    timed_out: bool = False
    """The ToolSet cut the call off at its timeout (``error`` is then set too)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Numbers the tool wants averaged into ``tools/<name>/<key>``."""


class ToolArgumentError(ValueError):
    """Raised by :meth:`Tool.validate_arguments`; the message says which field is wrong."""


class Tool(ABC):
    """A tool the model can call.

    Subclasses set ``name``, ``description`` and either ``parameters`` (a JSON schema of the
    arguments object) or ``arguments_model`` (a pydantic model; the schema is derived from it
    and arguments are validated against it before ``execute``). Stateful tools override
    ``create`` (returns the per-episode state) and ``release`` (frees it); ``execute`` receives
    that state and the validated arguments.

    Example (a stateful tool)::

        class Counter(Tool):
            name = "count"
            description = "Count this episode's calls of this tool."

            async def create(self):              # once per episode, on the first call
                return {"n": 0}

            async def execute(self, state, arguments):
                state["n"] += 1
                return str(state["n"])
    """

    name: str = ""
    """The name the model calls the tool by (unique in a ToolSet)."""
    description: str = ""
    """What the tool does, for the model."""
    parameters: dict[str, Any] = {}  # noqa: RUF012 (class-level default, replaced per tool)
    """JSON schema of the arguments object (or leave empty and set ``arguments_model``)."""
    arguments_model: ClassVar[type[BaseModel] | None] = None
    """A pydantic model of the arguments: the schema and the validation come from it."""
    timeout_s: float | None = None
    """This tool's own call timeout (``None`` = the ToolSet's ``timeout_s``)."""
    max_output_chars: int | None = None
    """This tool's own output limit (``None`` = the ToolSet's ``max_output_chars``)."""

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
        params = list(inspect.signature(fn).parameters)
        self.is_method = bool(params) and params[0] == "self"
        """A method (``self`` first): bound to its object per episode (:meth:`bind`)."""
        self._model = arguments_model(
            fn, arg_docs, model_name=f"{self.name}_arguments", method=self.is_method
        )
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
            out = await run_in_tool_thread(self.fn, **arguments)
        return _to_result(out)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def bind(self, obj: Any) -> BoundTool:
        """This method tool bound to ``obj`` (the object whose state its calls read and change)."""
        if not self.is_method:
            raise TypeError(f"tool {self.name!r} is a function, not a method; it binds to nothing")
        return BoundTool(self, obj)

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        # ``@tool`` on a method: ``instance.probe`` is the tool bound to that instance (and
        # still callable as the method: ``instance.probe(3)``).
        if obj is None or not self.is_method:
            return self
        return self.bind(obj)

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


class BoundTool(Tool):
    """A ``@tool`` method bound to one object: ``env.probe`` for an environment ``env``.

    It shares the method's schema and validation; a call runs ``method(obj, **arguments)``
    (a sync method in the tool thread pool, like any sync ``@tool``). Calling it directly calls
    the method, so ``env.probe(3)`` still works in tests.
    """

    def __init__(self, method: FunctionTool, obj: Any) -> None:
        self.method = method
        self.obj = obj
        self.name = method.name
        self.description = method.description
        self.parameters = method.parameters
        self.timeout_s = method.timeout_s
        self.max_output_chars = method.max_output_chars

    def validate_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Checked and coerced by the method's model (its type hints)."""
        return self.method.validate_arguments(arguments)

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult | str:
        """Call the method on the bound object."""
        if self.method.is_async:
            out = await self.method.fn(self.obj, **arguments)
        else:
            out = await run_in_tool_thread(functools.partial(self.method.fn, self.obj), **arguments)
        return _to_result(out)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.method.fn(self.obj, *args, **kwargs)


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
