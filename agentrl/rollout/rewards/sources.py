"""Which reward scores each data source: the config's names, resolved once, before anything runs.

Why it exists: ``reward.sources`` / ``reward.default`` name rewards by string, and a mistake
must stop the run before any server starts, with the key in the message. A data source is
scored by one of three kinds of reward:

- a **function** (a built-in or registered name, ``module:function``, or a callable;
  :mod:`agentrl.rollout.rewards.registry`), run by the executor;
- a **model reward** (a ``reward.models`` name: a reward model or an LLM judge,
  :mod:`agentrl.rollout.model_rewards`), whose async ``score`` runs on the event loop whatever
  the executor, once :meth:`RewardSources.connect_models` has given it its servers;
- a **mix** (``{"terms": {name: weight} | [names], "combine": "module:function" | None}``), a
  :class:`~agentrl.rollout.model_rewards.CombinedReward` of rewards of the first two kinds.

Guarantees: every name is resolved at construction (unknown names list the choices; a model
directory is checked; with the ``process`` executor every function that would travel to a worker
is checked to pickle), so :meth:`RewardSources.reward_fn_for` fails only for a data source
nobody configured, naming the configured ones.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any, cast

from agentrl.registry import RegistryError, import_spec
from agentrl.rollout.model_rewards import CombinedReward, ModelReward, build_model_reward
from agentrl.rollout.rewards.base import RewardConfigError, RewardFn
from agentrl.rollout.rewards.registry import REWARDS, resolve_reward_fn

__all__ = [
    "RewardSources",
    "check_picklable",
    "function_terms",
    "is_combined",
    "is_model_call",
    "reward_name",
]


def is_model_call(fn: Any) -> bool:
    """``fn`` is a model reward's ``score`` (runs on the event loop, whatever the executor)."""
    return isinstance(getattr(fn, "__self__", None), ModelReward)


def is_combined(fn: Any) -> bool:
    """``fn`` is a mix of rewards (its terms run concurrently)."""
    return isinstance(fn, CombinedReward)


def function_terms(fn: Any) -> list[Any]:
    """The user functions a reward runs through the executor (what a process pool receives)."""
    if fn is None or is_model_call(fn):
        return []
    if is_combined(fn):
        terms = [t for _, term, _ in fn.terms for t in function_terms(term)]
        return terms + ([fn.combine] if fn.combine is not None else [])
    return [fn]


def reward_name(fn: Any) -> str:
    """How messages name a reward: the function's name, ``reward.models.<name>``, or the mix."""
    if is_model_call(fn):
        return f"reward.models.{fn.__self__.name}"
    return getattr(fn, "__qualname__", None) or repr(fn)


def check_picklable(source: str, fn: RewardFn) -> None:
    """Raise :class:`RewardConfigError` if ``fn`` cannot travel to a worker process."""
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise RewardConfigError(
            f"reward function for data_source {source!r} ({getattr(fn, '__qualname__', fn)!r}) "
            f"cannot be sent to a process pool: {exc}. Define it at module level in an "
            "importable module (no lambdas or closures), or use executor='async'/'thread'"
        ) from exc


def _build_models(
    models: Mapping[str, Any] | None, *, timeout_s: float, base_dir: Any
) -> dict[str, ModelReward]:
    """The model rewards of ``reward.models`` (not connected yet); config errors named."""
    built: dict[str, ModelReward] = {}
    for name, spec in (models or {}).items():
        if name in REWARDS:
            raise RewardConfigError(
                f"reward.models.{name}: the name is taken by the reward function "
                f"{name!r}; give the model reward another name"
            )
        try:
            built[name] = build_model_reward(name, spec, timeout_s=timeout_s, base_dir=base_dir)
        except (ValueError, OSError) as exc:
            raise RewardConfigError(str(exc)) from exc
    return built


class RewardSources:
    """The reward of every data source, resolved from ``sources`` / ``default`` / ``models``.

    Args:
        sources: ``data_source -> reward`` (a name, ``module:function``, callable, a
            ``reward.models`` name, or a mix).
        default: the reward of data sources not in ``sources``; None = a data source named
            like a built-in uses it, any other is an error.
        models: ``reward.models`` entries (config objects or dicts), by name.
        timeout_s: the per-call deadline the model rewards' HTTP clients are sized to.
        base_dir: the folder path specs resolve against (the config file's).
        check_pickle: every function must pickle (the ``process`` executor).
    """

    def __init__(
        self,
        sources: Mapping[str, Any] | None,
        default: Any,
        *,
        models: Mapping[str, Any] | None = None,
        timeout_s: float,
        base_dir: Any = None,
        check_pickle: bool = False,
    ) -> None:
        self.models = _build_models(models, timeout_s=timeout_s, base_dir=base_dir)
        """Model rewards by name (``reward.models``)."""
        self._base_dir = base_dir
        self._check_pickle = check_pickle
        self._model_servers: tuple[dict[str, list[str]], str | None] = ({}, None)
        self._fns: dict[str, RewardFn] = {
            source: self._resolve(spec, key=f"reward.sources.{source}")
            for source, spec in dict(sources or {}).items()
        }
        self._default = (
            self._resolve(default, key="reward.default") if default is not None else None
        )
        if check_pickle:
            for name, fn in [*self._fns.items(), ("<default>", self._default)]:
                for term in function_terms(fn):
                    check_picklable(name, term)

    def reward_fn_for(self, data_source: str) -> RewardFn:
        """The reward function that scores tasks of ``data_source``."""
        if data_source in self._fns:
            return self._fns[data_source]
        if self._default is not None:
            return self._default
        if data_source in REWARDS:
            fn = REWARDS.get(data_source)
            if self._check_pickle:
                check_picklable(data_source, fn)
            self._fns[data_source] = fn
            return fn
        raise RewardConfigError(
            f"no reward function for data_source {data_source!r}; configured: "
            f"{sorted(self._fns) or 'none'}; add it to reward sources or set a default "
            f"(registered: {', '.join(REWARDS.names())})"
        )

    def connect_models(self, urls: Mapping[str, Sequence[str]], api_key: str | None = None) -> None:
        """Give each model reward its servers (``{name: base URLs}``, from the builder) and the
        key they want (an entry's own ``api_key`` wins)."""
        missing = sorted(set(self.models) - set(urls))
        if missing:
            raise RewardConfigError(f"no servers for reward.models {missing}")
        for name, model in self.models.items():
            model.connect(urls[name], api_key)
        self._model_servers = ({n: list(u) for n, u in urls.items()}, api_key)

    def model_servers(self) -> tuple[dict[str, list[str]], str | None]:
        """``({name: urls}, api_key)`` as given to :meth:`connect_models`."""
        return self._model_servers

    def _resolve(self, spec: Any, *, key: str) -> RewardFn:
        """The reward of one ``sources``/``default`` value: a ``models`` name (its async
        ``score``), a mix of terms (:class:`~agentrl.rollout.model_rewards.CombinedReward`), or
        anything :func:`resolve_reward_fn` takes."""
        if isinstance(spec, str) and spec in self.models:
            return self.models[spec].score
        terms = spec.get("terms") if isinstance(spec, Mapping) else getattr(spec, "terms", None)
        if terms is not None:
            return self._combined(spec, terms, key=key)
        try:
            return resolve_reward_fn(cast(Any, spec), key=key, base_dir=self._base_dir)
        except RewardConfigError as exc:
            if not self.models or not isinstance(spec, str) or ":" in spec:
                raise
            raise RewardConfigError(
                f"{exc}; or a reward.models name: {sorted(self.models)}"
            ) from None

    def _combined(self, spec: Any, terms: Any, *, key: str) -> RewardFn:
        """A :class:`~agentrl.rollout.model_rewards.CombinedReward` of ``terms`` (``{name:
        weight}`` or ``[names]``) and the optional ``combine`` function of ``spec``."""
        weights = dict(terms) if isinstance(terms, Mapping) else dict.fromkeys(terms, 1.0)
        if not weights:
            raise RewardConfigError(f"{key}.terms is empty; name at least one reward")
        parts = []
        for name, weight in weights.items():
            if not isinstance(name, str) or isinstance(weight, bool):
                raise RewardConfigError(f"{key}.terms: {name!r}: {weight!r} is not name: weight")
            parts.append((name, self._resolve(name, key=f"{key}.terms.{name}"), float(weight)))
        combine = spec.get("combine") if isinstance(spec, Mapping) else spec.combine
        if isinstance(combine, str):
            try:
                combine = import_spec(combine, base_dir=self._base_dir, key=f"{key}.combine")
            except RegistryError as exc:
                raise RewardConfigError(str(exc)) from None
        if combine is not None and not callable(combine):
            raise RewardConfigError(f"{key}.combine: {combine!r} is not a function")
        return cast(RewardFn, CombinedReward(tuple(parts), combine))
