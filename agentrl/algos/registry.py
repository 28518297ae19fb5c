"""A tiny name -> function registry shared by estimators, losses and KL estimators.

It exists so that every lookup by name fails the same helpful way: an unknown name raises
``ValueError`` that lists every valid name, and registering a second, different function
under a taken name is refused instead of silently replacing the first.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    """Functions registered by name; ``kind`` names the family in error messages.

    Example::

        LOSSES: Registry[Callable[..., float]] = Registry("policy loss")

        @LOSSES.register("mine")
        def my_loss(...): ...

        LOSSES.get("mine")  # -> my_loss; LOSSES.get("typo") raises, listing "mine"
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator: register the function under ``name`` (and any ``aliases``)."""

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                taken = self._fns.get(key)
                if taken is not None and taken is not fn:
                    raise ValueError(
                        f"{self.kind} {key!r} is already registered to "
                        f"{getattr(taken, '__qualname__', taken)!s}; pick another name"
                    )
                self._fns[key] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as ``name``; unknown names raise ``ValueError`` listing valid ones."""
        fn = self._fns.get(name)
        if fn is None:
            raise ValueError(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}"
            )
        return fn

    def names(self) -> list[str]:
        """Every registered name (aliases included), sorted."""
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


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
