"""One name registry for everything a config can name: agents, tools, tool-call parsers, rewards,
advantage estimators and policy losses.

Why it exists: the same three questions come up for every family — what is registered under a
name, what happens when two things claim the name, and what a user sees when the name is wrong —
and they must have one answer, not six. Here:

- ``registry.register(name, obj)`` (or the decorator form) adds an entry. Registering the *same*
  object again is a no-op, and so is a re-definition with the same ``module.qualname`` (a module
  imported twice, e.g. by path and by name): the newer object wins. A *different* object under a
  taken name raises :class:`DuplicateNameError` naming both.
- ``registry.get(spec)`` accepts a registered name, ``package.module:attr`` or
  ``path/to/file.py:attr`` (relative paths are resolved against ``base_dir``, the config file's
  folder); an unknown name raises :class:`UnknownNameError` naming the config key, the value,
  the registered names and the closest match.
- Built-ins may be *lazy* (``module:attr`` strings imported on first use), so importing a package
  never imports every built-in's dependencies.

This module imports the standard library and :mod:`agentrl.user_code` (stdlib only, which
loads path specs and defines :class:`RegistryError`) only: ``tools`` (stdlib + pydantic) and
``agentrl.algos`` (torch only) use it without pulling in the runtime.

Example::

    AGENTS = Registry("agent", config_key="agent.default")
    AGENTS.register("tool_agent", ToolAgent)
    AGENTS.get("tool_agnt")   # UnknownNameError: agent.default: unknown agent 'tool_agnt'; ...
    AGENTS.get("my_project.agents:Units")   # imported and returned
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from agentrl.user_code import RegistryError, import_path, imported_by_path

__all__ = [
    "DuplicateNameError",
    "Registry",
    "RegistryError",
    "UnknownNameError",
    "closest",
    "import_spec",
]

T = TypeVar("T")


class UnknownNameError(RegistryError, KeyError):
    """No entry under that name (a ``KeyError`` too, for callers that catch that)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateNameError(RegistryError):
    """A different object is already registered under the name."""


def closest(word: str, candidates: list[str]) -> str | None:
    """The closest candidate to ``word`` (difflib ratio >= 0.6), or None."""
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def _identity(obj: Any) -> tuple[str, str] | None:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module is None or qualname is None:
        cls = type(obj)
        # Instances (e.g. a FunctionTool) are identified by what they wrap, when they say so.
        wrapped = getattr(obj, "__wrapped__", None) or getattr(obj, "fn", None)
        if wrapped is not None and wrapped is not obj:
            return _identity(wrapped)
        return (cls.__module__, cls.__qualname__ + f"@{id(obj)}")
    return (module, qualname)


def _same_definition(a: Any, b: Any) -> bool:
    if a is b:
        return True
    ia, ib = _identity(a), _identity(b)
    if ia is None or ib is None or ia[1] != ib[1]:
        return False
    # The same qualname from the same module, or from the same file imported under two names.
    return ia[0] == ib[0] or _module_file(ia[0]) == _module_file(ib[0]) is not None


def _module_file(name: str) -> str | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return str(Path(path).resolve()) if path else None


def import_spec(spec: str, *, base_dir: str | Path | None = None, key: str = "") -> Any:
    """Import ``package.module:attr`` or ``path/to/file.py:attr`` and return the attribute.

    Paths are resolved against ``base_dir`` (the config file's folder) and loaded through
    :func:`agentrl.user_code.import_path` (a user package named like ours, e.g. ``tools``,
    still loads). Errors name ``key`` and say what to fix.
    """
    where = f"{key}: " if key else ""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise RegistryError(
            f"{where}{spec!r} is not of the form 'package.module:attr' or 'path/file.py:attr'"
        )
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = import_path(target, base_dir=base_dir, key=key)
    else:
        module = _import_module(target, spec, where)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            guess = closest(part, names)
            hint = f"; did you mean {guess!r}?" if guess else ""
            raise RegistryError(f"{where}{target!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, part)
    return obj


def _import_module(target: str, spec: str, where: str) -> Any:
    """Module ``target`` of ``spec``: installed, or a file imported by path under ``imports:``
    (``imports: [plugin.py]`` then ``plugin:fn``: the file's stem names it)."""
    try:
        return importlib.import_module(target)
    except ImportError as exc:
        module = imported_by_path(target)
        if module is not None:
            return module
        raise RegistryError(
            f"{where}cannot import module {target!r} of {spec!r} ({exc}); install it, list "
            "its file under `imports:`, or give a path relative to the config file "
            "('path/file.py:attr')"
        ) from exc


class Registry(Generic[T]):
    """Objects (classes, functions, instances) registered by name for one family.

    Args:
        kind: the family in messages ("agent", "tool", "reward function", ...).
        config_key: the config key that usually names an entry (for messages).
        check: called on every registered or imported object; raises ``TypeError`` if the
            object is not of the family (e.g. "an AgentLoop subclass").
        how_to_register: one line telling the user how to add an entry.
    """

    def __init__(
        self,
        kind: str,
        *,
        config_key: str = "",
        check: Callable[[Any], None] | None = None,
        how_to_register: str = "",
    ) -> None:
        self.kind = kind
        self.config_key = config_key
        self._check = check
        self.how_to_register = how_to_register
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = {}

    # ---- adding ------------------------------------------------------------------------------
    def add(self, name: str, obj: T, *aliases: str) -> T:
        """Register ``obj`` under ``name`` (and ``aliases``) by the duplicate policy above."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"a {self.kind} needs a non-empty string name, got {name!r}")
        if self._check is not None:
            self._check(obj)
        for key in (name, *aliases):
            taken = self._entries.get(key)
            if taken is not None and not _same_definition(taken, obj):
                raise DuplicateNameError(
                    f"{self.kind} {key!r} is already registered to {_describe(taken)}; "
                    f"cannot register {_describe(obj)} under the same name: pick another name"
                )
            if key in self._lazy and taken is None:
                raise DuplicateNameError(
                    f"{self.kind} {key!r} is a built-in ({self._lazy[key]}); pick another name"
                )
            self._entries[key] = obj
        return obj

    def register(self, name: str | None = None, *aliases: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`; ``name`` defaults to the object's ``name`` or ``__name__``."""

        def decorator(obj: T) -> T:
            """Register ``obj`` under its name (see :meth:`add`); returns it unchanged."""
            key = name or getattr(obj, "name", None) or getattr(obj, "__name__", None)
            if not isinstance(key, str) or not key:
                raise RegistryError(f"give the {self.kind} a name: register('my_name')")
            return self.add(key, obj, *aliases)

        return decorator

    def add_lazy(self, name: str, target: str) -> None:
        """A built-in imported on first use from ``package.module:attr``."""
        self._lazy[name] = target

    # ---- looking up --------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every registered name (built-ins and aliases included), sorted."""
        return sorted({*self._entries, *self._lazy})

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(
        self, spec: str | T, *, key: str | None = None, base_dir: str | Path | None = None
    ) -> T:
        """The object for a registered name or an import spec (see the module docstring).

        A non-string ``spec`` (already an object) is checked and returned. ``key`` names the
        config key in error messages (default: this registry's ``config_key``).
        """
        where = self.config_key if key is None else key
        if not isinstance(spec, str):
            if self._check is not None:
                self._check(spec)
            return spec
        if spec in self._entries:
            return self._entries[spec]
        if spec in self._lazy:
            obj = import_spec(self._lazy[spec], key=where)
            self._entries.setdefault(spec, obj)
            return self._entries[spec]
        if ":" in spec:
            obj = import_spec(spec, base_dir=base_dir, key=where)
            if self._check is not None:
                try:
                    self._check(obj)
                except TypeError as exc:
                    raise RegistryError(f"{where}: {spec!r}: {exc}") from None
            return obj
        raise UnknownNameError(self.unknown_message(spec, key=where))

    def unknown_message(self, spec: str, *, key: str | None = None) -> str:
        """``key: unknown kind 'x'; registered: a, b; did you mean 'a'? <how to register>``."""
        where = self.config_key if key is None else key
        names = self.names()
        guess = closest(spec, names)
        parts = [
            f"{where + ': ' if where else ''}unknown {self.kind} {spec!r}",
            f"registered: {', '.join(names) or '(none)'}",
        ]
        if guess:
            parts.append(f"did you mean {guess!r}?")
        tail = self.how_to_register or (
            "register one, list the module that registers it under `imports:`, or give "
            "'module:attr' / 'path/file.py:attr'"
        )
        return "; ".join(parts) + f" ({tail})"


def _describe(obj: Any) -> str:
    ident = _identity(obj)
    return f"{ident[0]}.{ident[1]}" if ident else repr(obj)
