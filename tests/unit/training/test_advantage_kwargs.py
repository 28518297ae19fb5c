"""Which algorithm settings reach the advantage estimator (the trainer's only mapping of them)."""

from __future__ import annotations

import torch

from agentrl.algos import compute_advantage
from agentrl.config import AlgorithmConfig
from agentrl.training.trainer import advantage_kwargs


def test_each_estimator_gets_its_own_settings() -> None:
    grpo = AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=False)
    assert advantage_kwargs(grpo, critic=False) == {"norm_adv_by_std_in_grpo": False}
    rpp = AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=0.9)
    assert advantage_kwargs(rpp, critic=False) == {"gamma": 0.9}
    gae = AlgorithmConfig(adv_estimator="gae", gamma=0.95, lam=0.9)
    assert advantage_kwargs(gae, critic=True) == {"gamma": 0.95, "lam": 0.9}
    assert advantage_kwargs(AlgorithmConfig(adv_estimator="rloo"), critic=False) == {}


def test_reinforce_plus_plus_discount_reaches_the_returns() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones_like(rewards)
    cfg = AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=0.5)
    _, returns = compute_advantage(
        cfg.adv_estimator, rewards, mask, **advantage_kwargs(cfg, critic=False)
    )
    assert torch.allclose(returns, torch.tensor([[0.25, 0.5, 1.0]]))
