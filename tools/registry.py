"""The tool registry: tools by name, for configs (``tools.enabled``) and :func:`get_tool`.

Why it exists: a config names its tools (``tools.enabled: [calculator, python]``); this module
turns such a name into a tool. Built-ins are registered lazily (``module:attr`` strings
imported on first use), so ``import tools`` never imports the sandbox or the search index.

What it guarantees (through :class:`agentrl.registry.Registry`): a name resolves to a
registered tool, a built-in, or a ``module:attr`` / ``path/file.py:attr`` spec; an unknown name
raises an error naming the config key, the value, the registered names and the closest match;
registering a different tool under a taken name raises ``ValueError``.

Example::

    register_tool(my_tool)                       # a @tool function or a Tool subclass
    get_tool("python", wall_time_s=2)            # a built-in, built with options
    get_tool("my_project.tools:lookup")          # imported by spec
"""

from __future__ import annotations

from typing import Any

from agentrl.registry import Registry
from tools.base import Tool

__all__ = ["TOOLS", "get_tool", "register_tool", "registered_tools"]


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
