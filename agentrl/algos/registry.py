"""Registries of the RL math (estimators, losses, KL estimators) and their variant metadata.

The registry class is :class:`agentrl.registry.Registry` (one duplicate-name policy and one
unknown-name message for every family a config can name). This module adds what the math needs
on top:

- :func:`describe` / :func:`flags`: what a registered function requires of the run
  (``needs_critic``, ``needs_index``, ``needs_greedy_baseline``), set by the ``register_*``
  decorators and read by the run's algorithm plan, so the trainer never branches on a name;
- :func:`option_signature`: the function's own knobs (keyword parameters with defaults, minus
  the ones the framework passes), from which the typed config variant is built;
- :func:`check_kwargs`: a clear error for an option the function does not take.

Imports the standard library and ``agentrl.registry`` only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from agentrl.registry import Registry

__all__ = ["Registry", "check_kwargs", "describe", "flags", "option_signature"]

_FLAGS = "__agentrl_flags__"


def describe(fn: Any, **new_flags: bool) -> Any:
    """Attach requirement flags to a registered function (returns it unchanged)."""
    current = dict(getattr(fn, _FLAGS, {}))
    current.update(new_flags)
    setattr(fn, _FLAGS, current)
    return fn


def flags(fn: Any) -> dict[str, bool]:
    """The requirement flags of ``fn`` (empty when none were attached)."""
    return dict(getattr(fn, _FLAGS, {}))


def option_signature(
    fn: Callable[..., Any], reserved: tuple[str, ...]
) -> dict[str, inspect.Parameter]:
    """The knobs of ``fn``: keyword parameters with a default, except the ``reserved`` ones."""
    params = inspect.signature(fn).parameters
    return {
        name: p
        for name, p in params.items()
        if p.default is not p.empty
        and name not in reserved
        and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def check_kwargs(
    kind: str, name: str, fn: Callable[..., object], kwargs: dict[str, object]
) -> None:
    """Raise ``ValueError`` naming any keyword in ``kwargs`` that ``fn`` does not accept.

    Turns Python's ``unexpected keyword argument`` into a message that says which
    estimator/loss rejected the option and which options it does take.
    """
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    keyword_kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    accepted = {n for n, p in params.items() if p.kind in keyword_kinds}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        # Options are the parameters with defaults; the required ones are the tensors.
        options = sorted(
            n for n, p in params.items() if p.kind in keyword_kinds and p.default is not p.empty
        )
        raise ValueError(
            f"{kind} {name!r} does not take option(s) {', '.join(unknown)}; "
            f"its options are: {', '.join(options)}"
        )
