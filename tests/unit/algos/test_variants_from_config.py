"""Every estimator and loss added in agentrl.algos is reachable from a config with no other file
touched: ``algorithm.advantage/loss: {name, knobs}`` -> ``build_algorithm`` -> a callable variant."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.config import load_config
from agentrl.registry import RegistryError
from agentrl.training.algorithm import AlgorithmPlan, build_algorithm


def plan_of(*overrides: str) -> AlgorithmPlan:
    return build_algorithm(load_config(None, list(overrides)).algorithm)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    old = -torch.rand(4, 3, generator=g) * 2 - 0.1
    return {
        "mask": mask,
        "old": old,
        "new": (old + torch.randn(4, 3, generator=g) * 0.3).requires_grad_(True),
        "adv": torch.randn(4, 3, generator=g) * mask,
    }


@pytest.mark.parametrize(
    ("spec", "options"),
    [
        ("{name: dppo_tv}", {}),
        ("{name: dppo_kl, clip_ratio_high: 0.1, clip_ratio_c: 10.0}", {"clip_ratio_high": 0.1}),
        ("{name: sapo, tau_pos: 2.0}", {"tau_pos": 2.0}),
        ("{name: geo_mean, clip_ratio: 0.3}", {"clip_ratio": 0.3}),
        ("{name: dro, dro_beta: 0.5}", {"dro_beta": 0.5}),
        ("{name: clip_cov, clip_cov_ratio: 0.5}", {"clip_cov_ratio": 0.5}),
        ("{name: kl_cov, kl_cov_ratio: 0.5, ppo_kl_coef: 1.0}", {"ppo_kl_coef": 1.0}),
    ],
)
def test_each_new_loss_builds_from_config_and_trains(spec: str, options: dict[str, float]) -> None:
    plan = plan_of(f"algorithm.loss={spec}", "algorithm.loss_agg_mode=seq-mean-token-mean")
    assert options.items() <= dict(plan.loss.options).items()
    b = _batch()
    loss, metrics = plan.loss(
        b["old"], b["new"], b["adv"], b["mask"], loss_agg_mode=plan.loss_agg_mode
    )
    loss.backward()
    assert math.isfinite(loss.item()) and {"pg_clipfrac", "ppo_kl"} <= set(metrics)
    assert b["new"].grad is not None and b["new"].grad.abs().sum() > 0
    assert torch.equal(b["new"].grad[1, 2], torch.tensor(0.0))  # masked token


def test_gdpo_builds_from_config_with_its_reward_keys() -> None:
    plan = plan_of(
        "algorithm.advantage={name: gdpo, gdpo_reward_keys: [acc, fmt], "
        "gdpo_reward_weights: [1.0, 0.5]}"
    )
    assert plan.advantage.needs_index and plan.advantage.flag("needs_reward_info")
    assert plan.advantage.options == {
        "gdpo_reward_keys": ("acc", "fmt"),
        "gdpo_reward_weights": (1.0, 0.5),
    }
    rewards = torch.zeros(4, 2)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 2.0, 5.0])
    # through the variant's call as the train step makes it today (no reward_info yet): the
    # estimator says what it needs instead of silently normalizing the score
    with pytest.raises(ValueError, match="needs `reward_info`"):
        plan.advantage(rewards, torch.ones(4, 2), index=["a", "a", "b", "b"])
    scored = plan_of("algorithm.advantage={name: gdpo}")
    adv, _ = scored.advantage(rewards, torch.ones(4, 2), index=["a", "a", "b", "b"])
    assert adv[0, 0] > 0 > adv[1, 0] and adv[2, 0] < 0 < adv[3, 0]
    with pytest.raises(RegistryError, match=r"algorithm\.advantage\.gdpo_reward_keys"):
        plan_of("algorithm.advantage={name: gdpo, gdpo_reward_keys: 3}")


def test_optimal_token_baseline_builds_from_config_and_names_its_inputs() -> None:
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        plan = plan_of(f"algorithm.advantage={{name: {name}, handle_zero_tail: false}}")
        assert plan.advantage.needs_index and plan.advantage.flag("needs_sum_pi_squared")
        assert plan.advantage.options == {"handle_zero_tail": False}
        b = _batch()
        rewards = torch.zeros(4, 3)
        rewards[:, -1] = torch.tensor([1.0, 0.0, 2.0, 5.0])
        index = ["a", "a", "b", "b"]
        with pytest.raises(ValueError, match="needs old_log_probs and sum_pi_squared"):
            plan.advantage(rewards, b["mask"], index=index)
        # the same function with the inputs the run must pass (see register_advantage)
        adv, _ = plan.advantage.fn(
            rewards,
            b["mask"],
            index=index,
            old_log_probs=b["old"],
            sum_pi_squared=torch.full((4, 3), 0.3),
            **plan.advantage.options,
        )
        assert torch.isfinite(adv).all() and adv[1, 2] == 0.0
