"""Load the user's own code named by a config: ``imports:`` and ``path/file.py:attr`` specs.

Why it exists: a user project is a folder with its own agent, tools, reward and data next to its
config, and ``agentrl train its/config.yaml`` must load that code from any working directory,
without PYTHONPATH, in the driver and in every Ray actor and subprocess that builds user
objects. Its package names may even be ours (a user package called ``tools``).

How: a file or package given by path is imported as part of a *project namespace*, a small
package ``agentrl_user_<hash of the project root>`` whose ``__path__`` is the project root (the
folder above the file's top-most package). So ``my_project/tools/convert.py`` becomes the module
``agentrl_user_1a2b3c4d5e.tools.convert``: it never collides with agentrl's ``tools``, relative
imports inside the user's package work, and the name is the same in every process. The
namespace package lives in a cache folder that is put on ``sys.path`` and on ``PYTHONPATH`` (for
child processes: spawned reward pools, servers, local Ray workers), so objects pickled by
reference (reward functions, tools) import again on arrival.

Guarantees:

- every error names the config key, the value and the fix (the path that was looked for);
- importing the same file twice returns the same module;
- ``import_user_modules(cfg.imports, base_dir)`` is idempotent and cheap after the first call.

Example::

    import_user_modules(["tools/convert.py", "my_installed_pkg.agents"], base_dir="examples/units")
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

__all__ = [
    "RegistryError",
    "import_path",
    "import_user_modules",
    "imported_by_path",
    "is_path_spec",
    "resolve_user_path",
]

OUR_PACKAGES = ("agentrl", "agents", "tools", "correction")
"""Top-level package names of agentrl itself (a user module name starting with one is ours)."""


class RegistryError(ValueError):
    """A name or path in a config or a call does not resolve; the message says which key and the fix.

    Defined here, the lowest module that raises it (a path that does not exist or does not
    import); :mod:`agentrl.registry`, which builds on this module, re-exports it and raises it
    for unknown and duplicate names.
    """


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "agentrl" / "user_namespaces"


def is_path_spec(text: str) -> bool:
    """True when ``text`` names a file or folder rather than a module (``.py``, or a slash)."""
    return text.endswith(".py") or "/" in text or "\\" in text


def resolve_user_path(text: str, base_dir: str | Path | None, *, key: str = "") -> Path:
    """``text`` as an absolute path: relative to ``base_dir`` (the config's folder) first, then
    to the working directory. Raises ``RegistryError`` naming ``key`` and both candidates."""
    p = Path(text).expanduser()
    if p.is_absolute():
        if p.exists():
            return p
        candidates = [p]
    else:
        candidates = [Path(base_dir) / p] if base_dir is not None else []
        candidates.append(Path.cwd() / p)
        for c in candidates:
            if c.exists():
                return c.resolve()
    looked = " or ".join(str(c) for c in candidates)
    where = f"{key}: " if key else ""
    raise RegistryError(
        f"{where}{text!r} does not exist (looked for {looked}); paths in a config are relative "
        "to the config file's folder"
    )


def _namespace_for(root: Path) -> str:
    """The project namespace package for ``root`` (created in the cache, put on the path)."""
    digest = hashlib.sha1(str(root).encode()).hexdigest()[:10]
    name = f"agentrl_user_{digest}"
    cache = _cache_dir()
    pkg = cache / name
    init = pkg / "__init__.py"
    text = (
        f'"""agentrl project namespace for {root} (generated; see agentrl.user_code)."""\n'
        f"__path__ = [{str(root)!r}]\n"
    )
    if not init.exists() or init.read_text() != text:
        pkg.mkdir(parents=True, exist_ok=True)
        tmp = init.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(init)
    if str(cache) not in sys.path:
        sys.path.append(str(cache))
        importlib.invalidate_caches()
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(cache) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([*parts, str(cache)])
    return name


def _top_package(path: Path) -> tuple[Path, list[str]]:
    """(project root, dotted parts of ``path`` below it): climb while folders are packages."""
    if path.is_dir():
        parts: list[str] = []
        folder = path
    else:
        parts = [] if path.name == "__init__.py" else [path.stem]
        folder = path.parent
    while (folder / "__init__.py").exists():
        parts.insert(0, folder.name)
        folder = folder.parent
    return folder, parts


def import_path(text: str, *, base_dir: str | Path | None = None, key: str = "") -> ModuleType:
    """Import a ``.py`` file or a package folder by path, inside its project namespace."""
    path = resolve_user_path(text, base_dir, key=key)
    if path.is_dir() and not (path / "__init__.py").exists():
        raise RegistryError(
            f"{key + ': ' if key else ''}{text!r} is a folder without __init__.py; name a .py "
            "file or a package folder"
        )
    if path.is_file() and path.suffix != ".py":
        raise RegistryError(f"{key + ': ' if key else ''}{text!r} is not a .py file")
    root, parts = _top_package(path)
    if not parts:
        raise RegistryError(f"{key + ': ' if key else ''}{text!r}: nothing to import")
    name = ".".join([_namespace_for(root), *parts])
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        hint = ""
        missing = getattr(exc, "name", None) or ""
        if missing.split(".")[0] in OUR_PACKAGES and parts[0] == missing.split(".")[0]:
            hint = (
                f" (your package is named {parts[0]!r} like agentrl's own; inside it, use "
                "relative imports: `from .units import x`)"
            )
        raise RegistryError(
            f"{key + ': ' if key else ''}importing {text!r} failed: {type(exc).__name__}: {exc}{hint}"
        ) from exc
    _BY_SHORT_NAME[".".join(parts)] = module
    return module


_BY_SHORT_NAME: dict[str, ModuleType] = {}
"""Files and packages imported by path, by their name inside the project (``plugin`` for
``plugin.py``, ``pkg.mod`` for ``pkg/mod.py``)."""


def imported_by_path(name: str) -> ModuleType | None:
    """The module imported by path (``imports: [plugin.py]``) whose name inside its project is
    ``name`` (``plugin``), so a later ``plugin:fn`` resolves to it; None if there is none."""
    return _BY_SHORT_NAME.get(name)


def import_user_modules(
    specs: Iterable[str], base_dir: str | Path | None, *, key: str = "imports"
) -> list[ModuleType]:
    """Import every entry of a config's ``imports:`` list (module names or paths), in order."""
    modules: list[ModuleType] = []
    for i, spec in enumerate(specs):
        where = f"{key}[{i}]"
        if not isinstance(spec, str) or not spec.strip():
            raise RegistryError(f"{where}: give a module name or a path, got {spec!r}")
        spec = spec.strip()
        candidate = Path(base_dir) / spec if base_dir is not None else Path(spec)
        if is_path_spec(spec) or candidate.is_dir():
            modules.append(import_path(spec, base_dir=base_dir, key=where))
            continue
        try:
            modules.append(importlib.import_module(spec))
        except ImportError as exc:
            top = spec.split(".")[0]
            hint = (
                f"; {top!r} is agentrl's own package: give your file's path instead "
                f"(e.g. '{spec.replace('.', '/')}.py')"
                if top in OUR_PACKAGES
                else "; install it, or give a path relative to the config file"
            )
            raise RegistryError(f"{where}: cannot import module {spec!r} ({exc}){hint}") from exc
    return modules
