"""agentrl training: resolve a config, build a run, train it (the actor, critic, step, loop).

The package's public entry is the names below, what the layers above (``agentrl.service``,
``agentrl.distributed``) may use; they import ``from agentrl.training import X`` and nothing
from the modules inside (``tests/unit/test_layers.py`` holds it). Each name is imported on
first use, so ``import agentrl.training`` (and every CLI that starts with it) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.training.actor import load_causal_lm
    from agentrl.training.build import Serving, build_serving, server_api_key, worker_config
    from agentrl.training.errors import RunFailed
    from agentrl.training.ranks import follow, launcher_scope
    from agentrl.training.resolve import (
        ResolutionError,
        Resolved,
        build_rewards,
        build_tasks,
        build_toolset,
        default_agent,
        model_dir,
        resolve_experiment,
    )
    from agentrl.training.run_log import LOG_LEVEL_ENV, add_log_level_argument
    from agentrl.training.trainer import Trainer

_PUBLIC = {
    "load_causal_lm": "actor",
    "Serving": "build",
    "build_serving": "build",
    "server_api_key": "build",
    "worker_config": "build",
    "RunFailed": "errors",
    "follow": "ranks",
    "launcher_scope": "ranks",
    "ResolutionError": "resolve",
    "Resolved": "resolve",
    "build_rewards": "resolve",
    "build_tasks": "resolve",
    "build_toolset": "resolve",
    "default_agent": "resolve",
    "model_dir": "resolve",
    "resolve_experiment": "resolve",
    "LOG_LEVEL_ENV": "run_log",
    "add_log_level_argument": "run_log",
    "Trainer": "trainer",
}

__all__ = [
    "LOG_LEVEL_ENV",
    "ResolutionError",
    "Resolved",
    "RunFailed",
    "Serving",
    "Trainer",
    "add_log_level_argument",
    "build_rewards",
    "build_serving",
    "build_tasks",
    "build_toolset",
    "default_agent",
    "follow",
    "launcher_scope",
    "load_causal_lm",
    "model_dir",
    "resolve_experiment",
    "server_api_key",
    "worker_config",
]


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module on first use (PEP 562)."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl.training' has no attribute {name!r}")
    # Not cached here: a test that patches ``agentrl.training.resolve.build_tasks`` is seen.
    return getattr(importlib.import_module(f"agentrl.training.{module}"), name)
