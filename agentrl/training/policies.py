"""The models a run trains and scores with: the actor, and the reference and critic its algorithm needs.

Why it exists: rank 0 (:mod:`agentrl.training.build`) and every follower rank
(:mod:`agentrl.training.ranks`) build the same models from the same config; one function here
serves both, so neither imports the other for it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from agentrl.config import ExperimentConfig

__all__ = ["load_policies"]

logger = logging.getLogger(__name__)


def load_policies(cfg: ExperimentConfig, path: Path, plan: Any, *, dist: Any = None) -> Any:
    """The actor, and the reference and critic the algorithm plan needs; with ``dist`` (a
    :class:`~agentrl.training.fsdp.DistContext`) this rank's FSDP2 shards of each (every rank
    builds the same models: :mod:`agentrl.training.ranks`)."""
    from agentrl.training.actor import Actor, ActorConfig, FrozenPolicy
    from agentrl.training.critic import Critic, CriticConfig
    from agentrl.training.step import Policies

    t, m = cfg.trainer, cfg.model
    if dist is not None and t.cpu_offload:
        dist = dataclasses.replace(dist, cpu_offload=True)
    common = {
        "device": t.device,
        "dtype": m.dtype,
        "trust_remote_code": m.trust_remote_code,
        "dist": dist,
    }
    actor = Actor(path, ActorConfig.from_config(cfg, plan), **common)
    reference = (
        FrozenPolicy(
            path,
            temperature=actor.temperature,
            micro_batch_max_tokens=t.micro_batch_max_tokens,
            share_prompts=t.share_prompts,
            **common,
        )
        if plan.needs_reference
        else None
    )
    critic = Critic(path, CriticConfig.from_config(cfg), **common) if plan.needs_critic else None
    if critic is None and t.critic_warmup_steps and (dist is None or dist.is_main):
        logger.warning(
            "trainer.critic_warmup_steps=%d is ignored: algorithm.advantage %r has no critic "
            "(use gae)",
            t.critic_warmup_steps,
            plan.advantage.name,
        )
    return Policies(actor=actor, reference=reference, critic=critic)
