"""Reward functions by name: the built-ins, the user's ``@register_reward``, and path specs.

Why it exists: configs name reward functions by string (``reward.sources``, ``reward.default``,
the terms of a mix), and every name must resolve the same way, before any server starts, with
an error that names the key and the choices. :data:`REWARDS` is one
:class:`agentrl.registry.Registry`, so a name is one of:

- a built-in (:data:`BUILTIN_REWARDS`, :mod:`agentrl.rollout.rewards.rules`);
- a name registered with ``@register_reward("name")`` in a module the config ``imports:``;
- ``module:function`` or ``path/file.py:function`` (resolved against the config's folder).

Example::

    @register_reward("length_penalty")
    def length_penalty(traj: Trajectory, task: Task) -> float:
        return -0.001 * len(traj.response_ids)

    resolve_reward_fn("length_penalty")            # the function above
    resolve_reward_fn("my_pkg.rewards:my_judge")   # any importable module:function
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from agentrl.registry import Registry, RegistryError
from agentrl.rollout.rewards.base import RewardConfigError, RewardFn
from agentrl.rollout.rewards.rules import calculator_reward, exact_match, numeric_match, tool_format

__all__ = ["BUILTIN_REWARDS", "REWARDS", "check_arity", "register_reward", "resolve_reward_fn"]


def _check_reward(obj: Any) -> None:
    if not callable(obj):
        raise TypeError(f"a reward function must be callable, got {type(obj).__name__}")


REWARDS: Registry[RewardFn] = Registry(
    "reward function",
    config_key="reward.sources",
    check=_check_reward,
    how_to_register="decorate a function `(traj, task) -> float | dict` with "
    "@register_reward('name') in a module listed under `imports:`, or give "
    "'module:function' / 'path/file.py:function'",
)
"""Reward functions by name (built-ins below; add yours with :func:`register_reward`)."""
REWARDS.add("exact_match", exact_match)
REWARDS.add("numeric_match", numeric_match)
REWARDS.add("calculator", calculator_reward)
REWARDS.add("tool_format", tool_format)
REWARDS.add_lazy("reasoning_gym", "agentrl.rollout.reasoning_gym:reasoning_gym_reward")
REWARDS.add_lazy("verifiers", "agentrl.rollout.verifiers_env:verifiers_reward")
BUILTIN_REWARDS = (
    "exact_match",
    "numeric_match",
    "calculator",
    "tool_format",
    "reasoning_gym",
    "verifiers",
)
"""Names of the built-in reward functions."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available by ``name`` in reward configs."""
    return REWARDS.register(name)


def resolve_reward_fn(
    spec: str | RewardFn, *, key: str = "reward.sources", base_dir: Any = None
) -> RewardFn:
    """A registered name, a ``module:function`` / ``path/file.py:function`` spec, or a callable."""
    if not isinstance(spec, str) and not callable(spec):
        raise RewardConfigError(
            f"{key}: reward function {spec!r}: give a built-in name, a 'module:function' path or "
            "a callable"
        )
    if isinstance(spec, str) and not spec:
        raise RewardConfigError(f"{key}: empty reward function name")
    try:
        fn = REWARDS.get(spec, key=key, base_dir=base_dir)
    except RegistryError as exc:
        raise RewardConfigError(str(exc)) from None
    check_arity(fn, key=key)
    return fn


def check_arity(fn: Any, *, key: str) -> None:
    """Raise :class:`RewardConfigError` unless ``fn`` can be called as ``fn(traj, task)``: a
    wrong signature is found when the config resolves, not at the first scored episode."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        sig.bind(None, None)
    except TypeError:
        name = getattr(fn, "__qualname__", None) or repr(fn)
        raise RewardConfigError(
            f"{key}: reward function {name!r} has the signature {sig}; a reward is called as "
            "fn(traj, task): declare `def {0}(traj, task) -> float | dict` (extra parameters "
            "need defaults)".format(getattr(fn, "__name__", "reward"))
        ) from None
