"""The run's algorithm plan: typed variants, knob validation, needs_* properties, KL terms."""

from __future__ import annotations

import pytest
import torch

from agentrl.algos import compute_advantage, kl_penalty
from agentrl.config import load_config
from agentrl.registry import RegistryError
from agentrl.training.algorithm import build_algorithm


def plan_of(*overrides: str):
    return build_algorithm(load_config(None, list(overrides)).algorithm)


def test_each_estimator_gets_exactly_its_own_knobs() -> None:
    grpo = plan_of("algorithm.advantage={name: grpo, norm_adv_by_std_in_grpo: false}")
    assert grpo.advantage.options == {"norm_adv_by_std_in_grpo": False}
    gae = plan_of("algorithm.advantage={name: gae, gamma: 0.95, lam: 0.9}")
    assert gae.advantage.options == {"gamma": 0.95, "lam": 0.9}
    assert plan_of("algorithm.advantage=rloo").advantage.options == {}


def test_the_variant_says_what_the_run_needs() -> None:
    assert plan_of("algorithm.advantage=gae").needs_critic
    assert not plan_of("algorithm.advantage=grpo").needs_critic
    assert plan_of("algorithm.advantage=grpo").advantage.needs_index
    assert plan_of("algorithm.advantage=remax").advantage.needs_greedy_baseline
    assert plan_of("algorithm.use_kl_loss=true").needs_reference
    assert plan_of("algorithm.use_kl_in_reward=true").needs_reference
    assert not plan_of().needs_reference
    assert plan_of().needs_old_log_probs  # decoupled by default
    bypass = plan_of("algorithm.correction.preset=bypass_ppo_clip")
    assert not bypass.needs_old_log_probs and not bypass.loss.takes_is_weights


def test_unknown_names_and_knobs_name_the_key_and_the_closest_match() -> None:
    with pytest.raises(
        RegistryError,
        match=r"algorithm\.advantage\.name: unknown advantage estimator 'grp'.*did you mean 'grpo'",
    ):
        plan_of("algorithm.advantage=grp")
    with pytest.raises(
        RegistryError,
        match=r"algorithm\.loss\.clip_ratio_hgh: unknown knob.*did you mean 'clip_ratio_high'",
    ):
        plan_of("algorithm.loss={name: vanilla, clip_ratio_hgh: 0.3}")
    with pytest.raises(RegistryError, match=r"algorithm\.advantage\.gamma: .*got 'high'"):
        plan_of("algorithm.advantage={name: gae, gamma: high}")
    # a knob another variant has is not silently accepted by this one
    with pytest.raises(
        RegistryError,
        match=r"algorithm\.advantage\.lam: unknown knob of advantage estimator 'grpo'",
    ):
        plan_of("algorithm.advantage={name: grpo, lam: 0.9}")


def test_a_custom_variant_by_import_path() -> None:
    plan = plan_of("algorithm.advantage={name: 'agentrl.algos.advantages:rloo_advantage'}")
    assert plan.advantage.name.endswith("rloo_advantage") and plan.advantage.needs_index


def test_the_advantage_variant_computes_what_the_registry_function_does() -> None:
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0], [0.0, 1.0]])
    mask = torch.ones_like(rewards)
    uids = ["a", "a", "b", "b"]
    plan = plan_of("algorithm.advantage={name: grpo, norm_adv_by_std_in_grpo: false}")
    got, _ = plan.advantage(rewards, mask, index=uids)
    want, _ = compute_advantage("grpo", rewards, mask, index=uids, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(got, want)


def test_bypass_reinforce_is_the_loss_choice_and_conflicts_are_refused() -> None:
    plan = plan_of("algorithm.correction.preset=bypass_pg_is")
    assert plan.loss.name == "reinforce" and plan.loss.takes_is_weights
    with pytest.raises(RegistryError, match=r"conflicts with algorithm.correction"):
        plan_of("algorithm.correction.preset=bypass_pg_is", "algorithm.loss=gspo")


def test_kl_in_reward_subtracts_exactly_beta_times_kl() -> None:
    plan = plan_of(
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=k1",
        "algorithm.kl_ctrl.kl_coef=0.25",
    )
    assert plan.kl_in_reward is not None
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.tensor([[-1.0, -0.5, -0.2], [-0.3, -0.9, -0.1]])
    ref = torch.tensor([[-1.2, -0.4, -0.2], [-0.3, -1.5, -0.6]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards, m = plan.kl_in_reward.apply(scores, old, ref, mask)
    expected = scores - 0.25 * kl_penalty(old, ref, "k1") * mask
    torch.testing.assert_close(rewards, expected)
    assert m["actor/reward_kl_penalty_coeff"] == 0.25


def test_the_adaptive_controller_moves_beta_toward_the_target() -> None:
    plan = plan_of(
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl={type: adaptive, kl_coef: 0.1, target_kl: 0.01, horizon: 10}",
    )
    ctrl = plan.kl_in_reward.controller
    old = torch.zeros(4, 3)
    far = torch.full((4, 3), -1.0)  # KL 1.0 per token >> target: β grows
    plan.kl_in_reward.apply(torch.zeros(4, 3), old, far, torch.ones(4, 3))
    assert ctrl.value > 0.1
    grown = ctrl.value
    plan.kl_in_reward.apply(torch.zeros(4, 3), old, old, torch.ones(4, 3))  # KL 0: β shrinks
    assert ctrl.value < grown
