"""What the rollout service serves with: servers, pool, CheckpointEngine, tokenizer, rewards.

The service and the trainer build these from a config the same way (DESIGN section 10: "it
builds its servers, pool, engine and manager through the same builder as the trainer"):
:func:`agentrl.training.build.build_serving`, re-exported here. This module adds what only the
service needs: per-job sampling overrides on a manager's workers (:func:`with_sampling`).

Shutdown order (leaving the builder's context): close the pool and control clients -> close the
reward manager -> stop the servers the builder started (external servers are left running).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agentrl.rollout.manager import AgentLoopManager, AgentLoopWorker
from agentrl.training import Serving, build_serving

__all__ = ["Serving", "build_serving", "with_sampling"]


def with_sampling(manager: AgentLoopManager, **overrides: Any) -> AgentLoopManager:
    """Apply sampling overrides (``temperature``, ``top_p``, ``top_k``, ``max_tokens``) to
    every in-process worker of ``manager``; ``None`` values keep the worker's setting."""
    update = {k: v for k, v in overrides.items() if v is not None}
    if not update:
        return manager
    for worker in manager.workers:
        if not isinstance(worker, AgentLoopWorker):
            raise TypeError(f"with_sampling: {worker!r} is not an in-process AgentLoopWorker")
        cfg = worker.config
        worker.config = dataclasses.replace(cfg, sampling=cfg.sampling.model_copy(update=update))
    return manager
