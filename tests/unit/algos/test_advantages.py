"""Advantage estimators against hand-computed values on tiny batches."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from agentrl.algos import ADVANTAGE_ESTIMATORS, compute_advantage, register_advantage


def _rows(*values: float, t: int = 2) -> torch.Tensor:
    """Outcome rewards: each score on the last token of a [B, t] matrix."""
    r = torch.zeros(len(values), t)
    r[:, -1] = torch.tensor(values)
    return r


def test_grpo_normalizes_by_group_std_and_zeroes_singletons() -> None:
    rewards = _rows(1.0, 0.0, 5.0)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv, ret = compute_advantage("grpo", rewards, mask, index=["a", "a", "b"])
    a = 0.5 / (statistics.stdev([1.0, 0.0]) + 1e-6)  # 0.7071
    expected = torch.tensor([[a, a], [-a, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


def test_dr_grpo_only_subtracts_group_mean() -> None:
    rewards = _rows(1.0, 0.0, 0.0, 0.0)
    mask = torch.ones(4, 2)
    adv, _ = compute_advantage(
        "grpo", rewards, mask, index=[0, 0, 0, 0], norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    alias, _ = compute_advantage("grpo", rewards, mask, index=[0, 0, 0, 0], norm_adv_by_std=False)
    torch.testing.assert_close(alias, adv)


def test_grpo_equal_scores_give_zero_not_nan() -> None:
    adv, _ = compute_advantage("grpo", _rows(1.0, 1.0), torch.ones(2, 2), index=["x", "x"])
    assert torch.equal(adv, torch.zeros(2, 2))


def test_rloo_uses_leave_one_out_mean() -> None:
    adv, _ = compute_advantage(
        "rloo", _rows(1.0, 0.0, 2.0, 7.0), torch.ones(4, 2), index=[1, 1, 1, 2]
    )
    # 1 - mean(0, 2) = 0; 0 - mean(1, 2) = -1.5; 2 - mean(1, 0) = 1.5; singleton -> 0
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, -1.5, 1.5, 0.0]))


def test_opo_uses_length_weighted_baseline() -> None:
    rewards = _rows(1.0, 0.0, 1.0, t=4)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    adv, _ = compute_advantage("opo", rewards, mask, index=["g", "g", "g"])
    b = (2 * 1.0 + 4 * 0.0 + 1 * 1.0) / 7  # 3/7
    expected = torch.tensor([1 - b, -b, 1 - b]).unsqueeze(-1) * mask
    torch.testing.assert_close(adv, expected)


def test_gpg_scales_by_batch_over_nonzero_count() -> None:
    adv, _ = compute_advantage(
        "gpg", _rows(1.0, 0.0, 0.0, 0.0), torch.ones(4, 2), index=[0, 0, 1, 1]
    )
    # alpha = B / #nonzero = 4 / 1; group 0 mean 0.5
    torch.testing.assert_close(adv[:, 1], torch.tensor([2.0, -2.0, 0.0, 0.0]))


def test_remax_subtracts_greedy_baseline_from_reward_to_go() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_advantage("remax", rewards, mask, reward_baselines=torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]]))


def test_remax_without_baselines_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage("remax", _rows(1.0), torch.ones(1, 2))


def test_reinforce_plus_plus_discounts_then_whitens() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0]]))
    g = [0.25, 0.5, 1.0]
    mu, sd = statistics.mean(g), statistics.stdev(g)
    torch.testing.assert_close(
        adv, torch.tensor([[(x - mu) / sd for x in g]]), rtol=1e-4, atol=1e-5
    )


def test_reinforce_plus_plus_passes_return_through_tool_tokens() -> None:
    # Multi-turn: the middle token is a tool token (mask 0); the last-turn reward must reach
    # the first turn, discounted once per *sampled* token.
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    _, ret = compute_advantage("reinforce_plus_plus", rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.0, 1.0]]))


def test_reinforce_plus_plus_baseline_whitens_over_real_groups() -> None:
    rewards = _rows(1.0, 0.0, 3.0)
    mask = torch.ones(3, 2)
    adv, _ = compute_advantage("reinforce_plus_plus_baseline", rewards, mask, index=["a", "a", "b"])
    # centered tokens +-0.5 (x2 each); unbiased std over 4 tokens = sqrt(1/3)
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(
        adv, torch.tensor([[a, a], [-a, -a], [0.0, 0.0]]), rtol=1e-4, atol=1e-5
    )


def test_gae_hand_computed() -> None:
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.8]])
    adv, ret = compute_advantage(
        "gae", rewards, torch.ones(1, 2), values=values, gamma=0.9, lam=0.8, whiten=False
    )
    # t=1: delta = 1 - 0.8 = 0.2; t=0: delta = 0.9*0.8 - 0.5 = 0.22, A = 0.22 + 0.72*0.2
    torch.testing.assert_close(adv, torch.tensor([[0.364, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.864, 1.0]]))


def test_gae_skips_tool_tokens() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.8]])  # the tool token's value must be ignored
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, _ = compute_advantage("gae", rewards, mask, values=values, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.2]]))


def test_gae_whitens_over_valid_tokens() -> None:
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv, _ = compute_advantage("gae", torch.randn(2, 4), mask, values=torch.randn(2, 4))
    valid = adv[mask.bool()]
    assert abs(valid.mean().item()) < 1e-5
    assert abs(valid.std().item() - 1.0) < 1e-3
    assert torch.equal(adv[~mask.bool()], torch.zeros(3))


def test_gae_without_values_asks_for_a_critic() -> None:
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", torch.zeros(1, 2), torch.ones(1, 2))


def test_group_estimators_need_index() -> None:
    for name in ("grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match="index"):
            compute_advantage(name, _rows(1.0), torch.ones(1, 2))


def test_index_length_is_checked() -> None:
    with pytest.raises(ValueError, match="group ids"):
        compute_advantage("grpo", _rows(1.0, 0.0), torch.ones(2, 2), index=["a"])


def test_index_accepts_tensor_ids() -> None:
    adv, _ = compute_advantage(
        "grpo", _rows(1.0, 0.0), torch.ones(2, 2), index=torch.tensor([3, 3])
    )
    assert adv[0, 0] > 0 > adv[1, 0]


def test_unknown_estimator_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="grpo") as err:
        compute_advantage("gpro", _rows(1.0), torch.ones(1, 2))
    for name in (
        "gae",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
        "gpg",
    ):
        assert name in str(err.value)


def test_unknown_option_is_named() -> None:
    with pytest.raises(ValueError, match="gamma") as err:
        compute_advantage("grpo", _rows(1.0), torch.ones(1, 2), index=[0], gamma=0.9)
    assert "norm_adv_by_std_in_grpo" in str(err.value)


def test_half_precision_inputs_give_float32() -> None:
    adv, ret = compute_advantage(
        "grpo", _rows(1.0, 0.0).bfloat16(), torch.ones(2, 2, dtype=torch.bfloat16), index=[0, 0]
    )
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32


def test_register_user_estimator_and_refuse_duplicates() -> None:
    name = "test_sign_estimator"

    @register_advantage(name)
    def sign(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, scale: float = 1.0):
        adv = scale * torch.sign(token_level_rewards.sum(-1, keepdim=True)) * response_mask
        return adv, adv

    adv, _ = compute_advantage(name, _rows(2.0, -1.0), torch.ones(2, 2), scale=3.0)
    torch.testing.assert_close(adv[:, 0], torch.tensor([3.0, -3.0]))
    assert name in ADVANTAGE_ESTIMATORS.names()

    with pytest.raises(ValueError, match="already registered"):

        @register_advantage(name)
        def other(token_level_rewards: torch.Tensor, response_mask: torch.Tensor):
            return token_level_rewards, token_level_rewards


def test_index_accepts_numpy_object_arrays() -> None:
    import numpy as np

    uid = np.array(["p0", "p0", "p1", "p1"], dtype=object)  # verl's non-tensor uid column
    adv, _ = compute_advantage("grpo", _rows(1.0, 0.0, 0.0, 1.0), torch.ones(4, 2), index=uid)
    assert adv[0, 0] > 0 > adv[1, 0] and adv[2, 0] < 0 < adv[3, 0]
