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


# --- gdpo: decoupled per-reward normalization -------------------------------------------------


def _whiten(tokens: list[float]) -> list[float]:
    """What masked_whiten does, by hand: (x − mean) / sqrt(unbiased var + 1e-8)."""
    mu, var = statistics.fmean(tokens), statistics.variance(tokens)
    return [(x - mu) / math.sqrt(var + 1e-8) for x in tokens]


GDPO_INFO = [
    {"acc": 1.0, "fmt": 0.5},
    {"acc": 0.0, "fmt": 1.0},
    {"acc": 1, "fmt": True},
    {"acc": 1, "fmt": 0.0},
    {"acc": 0.0, "fmt": 7.0},
]


def test_gdpo_normalizes_each_reward_in_its_group_then_whitens_the_batch() -> None:
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv, ret = compute_advantage(
        "gdpo",
        torch.zeros(5, 2),  # the components replace the score
        mask,
        index=["a", "a", "b", "b", "solo"],
        reward_info=GDPO_INFO,
        gdpo_reward_keys=("acc", "fmt"),
    )
    half = 1 / (statistics.stdev([1.0, 0.0]) + 1e-6)  # (1 - 0.5) / std of {1, 0}
    quarter = 0.25 / (statistics.stdev([0.5, 1.0]) + 1e-6)
    # group a: acc says row 0, fmt says row 1, equally strongly: they cancel (GRPO on the sum
    # 1.5 vs 1.0 would favour row 0); group b: acc ties (0), fmt favours row 2.
    per_row = [0.5 * half - quarter, -0.5 * half + quarter, 0.5 * half, -0.5 * half]
    tokens = [per_row[0]] * 2 + [per_row[1]] * 2 + [per_row[2]] * 2 + [per_row[3]]
    w = _whiten(tokens)
    expected = torch.tensor([[w[0], w[1]], [w[2], w[3]], [w[4], w[5]], [w[6], 0.0], [0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    # rows 0 and 1 tie (their components cancel); row 2 beats row 3
    assert adv[0, 0].item() == pytest.approx(adv[1, 0].item(), abs=1e-4)
    assert adv[2, 0] > adv[0, 0] > adv[3, 0]


def test_gdpo_is_invariant_to_rescaling_one_reward_unlike_grpo_on_the_sum() -> None:
    mask = torch.ones(4, 1)
    index = [0, 0, 0, 0]
    info = [{"acc": a, "len": n} for a, n in [(1, 0.2), (0, 0.1), (1, 0.9), (0, 0.8)]]
    loud = [{"acc": i["acc"], "len": 100 * i["len"]} for i in info]
    keys = ("acc", "len")
    quiet_adv, _ = compute_advantage(
        "gdpo", torch.zeros(4, 1), mask, index=index, reward_info=info, gdpo_reward_keys=keys
    )
    loud_adv, _ = compute_advantage(
        "gdpo", torch.zeros(4, 1), mask, index=index, reward_info=loud, gdpo_reward_keys=keys
    )
    torch.testing.assert_close(quiet_adv, loud_adv, rtol=1e-4, atol=1e-4)
    # GRPO on the summed reward lets the loud component decide the ranking
    loud_sum = torch.tensor([[i["acc"] + i["len"]] for i in loud], dtype=torch.float32)
    grpo, _ = compute_advantage("grpo", loud_sum, mask, index=index)
    assert grpo[3, 0] > 0 > quiet_adv[3, 0]  # row 3 failed acc; only its length is high


def test_gdpo_weights_components_and_without_keys_is_grpo_then_whitening() -> None:
    mask = torch.ones(4, 1)
    weighted, _ = compute_advantage(
        "gdpo",
        torch.zeros(4, 1),
        mask,
        index=["a", "a", "b", "b"],
        reward_info=GDPO_INFO[:4],
        gdpo_reward_keys=("acc", "fmt"),
        gdpo_reward_weights=(2.0, 0.0),
        norm_adv_by_std_in_grpo=False,
    )
    # fmt weighs nothing; acc centred per group without std: 2·(±0.5) in a, 0 in b
    torch.testing.assert_close(weighted[:, 0], torch.tensor(_whiten([1.0, -1.0, 0.0, 0.0])))
    rewards = torch.tensor([[1.0], [0.0], [2.0], [5.0]])
    plain, _ = compute_advantage("gdpo", rewards, mask, index=["a", "a", "b", "b"])
    a = 0.5 / (statistics.stdev([1.0, 0.0]) + 1e-6)
    b = 1.5 / (statistics.stdev([2.0, 5.0]) + 1e-6)
    torch.testing.assert_close(plain[:, 0], torch.tensor(_whiten([a, -a, -b, b])))


def test_gdpo_errors_name_the_key_the_row_and_the_fix() -> None:
    args = (torch.zeros(2, 1), torch.ones(2, 1))
    keys = {"index": [0, 0], "gdpo_reward_keys": ("acc",)}
    with pytest.raises(ValueError, match=r"needs `reward_info`.*needs_reward_info"):
        compute_advantage("gdpo", *args, **keys)
    with pytest.raises(ValueError, match=r"row 1 has no reward_info\['acc'\].*\['fmt'\]"):
        compute_advantage("gdpo", *args, reward_info=[{"acc": 1}, {"fmt": 0}], **keys)
    with pytest.raises(ValueError, match=r"reward_info\['acc'\] of row 0 must be a finite number"):
        compute_advantage("gdpo", *args, reward_info=[{"acc": "yes"}, {"acc": 0}], **keys)
    with pytest.raises(ValueError, match=r"finite number, got nan"):
        compute_advantage("gdpo", *args, reward_info=[{"acc": math.nan}, {"acc": 0}], **keys)
    with pytest.raises(ValueError, match=r"gdpo_reward_weights has 2 entries but there are 1"):
        compute_advantage(
            "gdpo", *args, reward_info=[{"acc": 1}] * 2, gdpo_reward_weights=(1.0, 2.0), **keys
        )
    with pytest.raises(ValueError, match=r"reward_info has 1 rows but the batch has 2"):
        compute_advantage("gdpo", *args, reward_info=[{"acc": 1}], **keys)


# --- optimal token baseline -------------------------------------------------------------------


def _otb_batch() -> dict[str, torch.Tensor]:
    """Group "g" of three responses of lengths 3, 2, 1 (scores 1, 0, 2) and a singleton."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = torch.zeros(4, 3)
    rewards[0, 2], rewards[2, 0], rewards[3, 2] = 1.0, 2.0, 4.0
    # per-token energy 1 - 2π + Σπ²: row 0 → 0.5, row 1 → 0.02, row 2 → 0.8, row 3 → 0.5
    pi = torch.tensor([[0.5] * 3, [0.9] * 3, [0.2] * 3, [0.5] * 3])
    sum_sq = torch.tensor([[0.5] * 3, [0.82] * 3, [0.2] * 3, [0.5] * 3])
    return {"rewards": rewards, "mask": mask, "old": torch.log(pi), "sum_sq": sum_sq}


def _otb(batch: dict[str, torch.Tensor], name: str = "optimal_token_baseline", **kw):
    return compute_advantage(
        name,
        batch["rewards"],
        batch["mask"],
        index=["g", "g", "g", "solo"],
        old_log_probs=batch["old"],
        sum_pi_squared=batch["sum_sq"],
        **kw,
    )


def test_optimal_token_baseline_hand_computed() -> None:
    adv, ret = _otb(_otb_batch())
    # W (cumulative energy): row 0 [0.5, 1.0, 1.5], row 1 [0.02, 0.04], row 2 [0.8]
    # G (reward-to-go):      row 0 [1, 1, 1],      row 1 [0, 0],       row 2 [2]
    b0 = (1 * 0.5 + 0 * 0.02 + 2 * 0.8) / (0.5 + 0.02 + 0.8 + 1e-8)  # 2.1 / 1.32
    b1 = (1 * 1.0 + 0 * 0.04) / (1.0 + 0.04 + 1e-8)
    # position 2 is reached by row 0 alone: baseline 0 there (zero tail), A = G
    expected = torch.tensor(
        [[1 - b0, 1 - b1, 1.0], [-b0, -b1, 0.0], [2 - b0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret[:3], torch.tensor([[1.0] * 3, [0.0, 0.0, 0.0], [2.0, 0, 0]]))
    no_tail, _ = _otb(_otb_batch(), handle_zero_tail=False)
    assert abs(no_tail[0, 2].item()) < 1e-6  # its own return as the baseline: no signal left
    torch.testing.assert_close(no_tail[:, :2], expected[:, :2])


def test_optimal_token_baseline_squares_the_is_weights_in_the_energy() -> None:
    batch = _otb_batch()
    weights = torch.ones(4, 3)
    weights[2] = 2.0  # row 2's energy counts 4x
    adv, _ = _otb(batch, rollout_is_weights=weights)
    b0 = (1 * 0.5 + 2 * 0.8 * 4) / (0.5 + 0.02 + 0.8 * 4 + 1e-8)
    torch.testing.assert_close(adv[:3, 0], torch.tensor([1 - b0, -b0, 2 - b0]))


def test_optimal_token_baseline_multi_turn_aligns_sampled_tokens() -> None:
    flat = _otb_batch()
    single, _ = _otb(flat)
    # row 0 gets a 3-token tool turn after its first token; the other rows only get padding, so
    # columns no longer line up: the k-th *sampled* tokens must still share their baseline
    junk = {"rewards": 0.0, "mask": 0.0, "old": -0.01, "sum_sq": 0.99}
    turn = {}
    for key, t in flat.items():
        pad = torch.full((4, 3), junk[key])
        rows = [torch.cat([t[0, :1], pad[0], t[0, 1:]])]
        rows += [torch.cat([t[i], pad[i]]) for i in range(1, 4)]
        turn[key] = torch.stack(rows)
    adv, _ = _otb(turn, name="tir_optimal_token_baseline")
    sampled = turn["mask"] > 0
    torch.testing.assert_close(adv[sampled], single[flat["mask"] > 0])
    assert torch.equal(adv[~sampled], torch.zeros_like(adv[~sampled]))


def test_optimal_token_baseline_stays_finite_on_extreme_inputs() -> None:
    batch = _otb_batch()
    batch["rewards"] = batch["rewards"] * 1e6
    batch["old"] = torch.full((4, 3), -1e4)  # π = 0: energy 1 + Σπ²
    adv, _ = _otb(batch)
    assert torch.isfinite(adv).all()
    batch["old"] = torch.zeros(4, 3)  # π = 1 and Σπ² = 1: no energy anywhere
    batch["sum_sq"] = torch.ones(4, 3)
    adv, ret = _otb(batch)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv[:3], ret[:3])  # zero weights: baseline 0, A = G


def test_optimal_token_baseline_asks_for_its_policy_statistics() -> None:
    batch = _otb_batch()
    with pytest.raises(ValueError, match=r"needs sum_pi_squared \[B, T\].*logsumexp"):
        compute_advantage(
            "optimal_token_baseline",
            batch["rewards"],
            batch["mask"],
            index=[0, 0, 0, 1],
            old_log_probs=batch["old"],
        )
    with pytest.raises(ValueError, match=r"sum_pi_squared \(4, 2\) must match"):
        compute_advantage(
            "optimal_token_baseline",
            batch["rewards"],
            batch["mask"],
            index=[0, 0, 0, 1],
            old_log_probs=batch["old"],
            sum_pi_squared=batch["sum_sq"][:, :2],
        )
