"""The Hugging Face KV cache argument across transformers versions.

Why it exists: transformers 5.25 renamed the KV cache of a model's ``forward`` and of its output
from ``past_key_values`` to ``cache`` and deprecated the old name (removed in 5.40), while
``pyproject.toml`` allows 4.51 on. Every place that passes a cache in (the embedded engine's
forward and probe, the shared prompts of the trainer, the supervised trainer's shared prefix)
names it through :func:`cache_kwargs` and reads it back through :func:`output_cache`.

Guarantees: the name is the one the model class's own ``forward`` declares (looked up once per
class, through a peft wrapper; a wrapper that declares neither gets the name of this version's
stock models); an output's cache is found under either name.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["base_model", "cache_kwargs", "output_cache"]


@functools.cache
def _cache_argument(model_class: type) -> str:
    """The name under which ``model_class`` takes a KV cache: the one its ``forward`` (or
    ``__call__``) declares, else the one a stock transformers model of this version takes
    (``cache`` from 5.25 on, ``past_key_values`` before)."""
    call = getattr(model_class, "forward", None) or model_class.__call__
    params = inspect.signature(call).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    from transformers import LlamaForCausalLM

    return _cache_argument(LlamaForCausalLM)


def base_model(model: Any) -> Any:
    """The transformers model under a peft wrapper (itself otherwise)."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(...)``, under the name its transformers version takes."""
    return {_cache_argument(type(base_model(model))): cache}


def output_cache(out: Any) -> Any:
    """The KV cache of a model output (``cache``, or ``past_key_values`` before 5.25)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
