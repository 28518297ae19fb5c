"""``train_step`` with scripted fake models: every path of the step, in seconds, no servers.

The fake actor's log-probs are the rollout's plus a known per-token shift, so every expected
tensor (IS weights, KL terms, advantages) is computed by hand from the inputs.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from agentrl.algos import compute_advantage, kl_penalty
from agentrl.training.algorithm import build_algorithm
from agentrl.training.step import Policies, train_step, trajectory_metrics
from tests.fakes import experiment, random_trajectories

SHIFT = 0.3  # π_train = π_rollout + SHIFT on sampled tokens: exp(SHIFT) = 1.35 < the IS cap 2


class FakeActor:
    """Log-probs = rollout + SHIFT (sampled tokens); records what the update was given."""

    temperature = 1.0

    def __init__(self, shift: float = SHIFT) -> None:
        self.shift = shift
        self.forward_calls = 0
        self.updated: TensorDict | None = None

    def compute_log_probs(self, batch: TensorDict) -> torch.Tensor:
        self.forward_calls += 1
        mask = batch["response_mask"].float()
        return (batch["rollout_log_probs"] + self.shift) * mask

    def update_with_log_probs(self, batch: TensorDict) -> tuple[dict[str, float], torch.Tensor]:
        self.updated = batch.clone()
        return {"actor/pg_loss": 0.5}, self.compute_log_probs(batch)

    def compute_log_probs_and_sum_pi_squared(
        self, batch: TensorDict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.compute_log_probs(batch), torch.full_like(batch["rollout_log_probs"], 0.25)


class FakeReference(FakeActor):
    def __init__(self) -> None:
        super().__init__(shift=-0.2)


class FakeCritic:
    def __init__(self) -> None:
        self.updates = 0

    def compute_values(self, batch: TensorDict) -> torch.Tensor:
        return torch.full(batch["responses"].shape, 0.25) * batch["response_mask"].float()

    def update(self, batch: TensorDict) -> dict[str, float]:
        self.updates += 1
        return {"critic/vf_loss": 0.1}


def plan_of(*overrides: str) -> Any:
    return build_algorithm(experiment(*overrides).algorithm)


async def run(plan: Any, policies: Policies, **kwargs: Any) -> Any:
    return await train_step(random_trajectories(6), policies, plan, pad_token_id=0, **kwargs)


async def test_decoupled_token_is_recomputes_pi_old_and_weights_the_loss() -> None:
    actor = FakeActor()
    out = await run(plan_of("algorithm.correction.preset=decoupled_token_is"), Policies(actor))
    assert actor.forward_calls == 2  # π_old before the update, the first pass inside it
    b = actor.updated
    mask = b["response_mask"].float()
    torch.testing.assert_close(b["old_log_probs"], (b["rollout_log_probs"] + SHIFT) * mask)
    torch.testing.assert_close(
        b["rollout_is_weights"], torch.full_like(mask, math.exp(SHIFT)) * mask
    )
    assert out.metrics["rollout_corr/kl"] == pytest.approx(-SHIFT, abs=1e-6)


async def test_bypass_anchors_on_the_rollout_and_adds_no_is_weight() -> None:
    actor = FakeActor()
    out = await run(plan_of("algorithm.correction.preset=bypass_ppo_clip"), Policies(actor))
    assert actor.forward_calls == 1  # only the update's own pass: no π_old forward
    b = actor.updated
    torch.testing.assert_close(b["old_log_probs"], b["rollout_log_probs"])
    assert "rollout_is_weights" not in b
    # the diagnostics come from the update's first pass (π_θ = rollout + SHIFT)
    assert out.metrics["rollout_corr/kl"] == pytest.approx(-SHIFT, abs=1e-6)


async def test_geometric_rs_masks_only_the_response_mask() -> None:
    actor = FakeActor()
    plan = plan_of(
        "algorithm.correction.preset=decoupled_geo_rs",
    )
    out = await run(plan, Policies(actor))
    # a geometric shift of 0.3 is far outside [0.999, 1.001]: every sequence is rejected
    assert float(actor.updated["response_mask"].sum()) == 0.0
    assert out.metrics["rollout_corr/rs_masked_frac_seq"] == pytest.approx(1.0)


async def test_kl_loss_brings_the_reference_log_probs() -> None:
    actor, ref = FakeActor(), FakeReference()
    await run(plan_of("algorithm.use_kl_loss=true"), Policies(actor, reference=ref))
    b = actor.updated
    torch.testing.assert_close(
        b["ref_log_prob"], (b["rollout_log_probs"] - 0.2) * b["response_mask"]
    )
    torch.testing.assert_close(b["token_level_rewards"], b["token_level_scores"])


async def test_kl_in_reward_changes_the_rewards_by_exactly_beta_kl() -> None:
    actor, ref = FakeActor(), FakeReference()
    plan = plan_of("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.5")
    out = await run(plan, Policies(actor, reference=ref))
    b = actor.updated
    mask = b["response_mask"].float()
    kl = kl_penalty(b["old_log_probs"], b["ref_log_prob"], "k1") * mask
    torch.testing.assert_close(b["token_level_rewards"], b["token_level_scores"] - 0.5 * kl)
    assert out.metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert out.metrics["actor/reward_kl_penalty"] == pytest.approx(0.5, abs=1e-6)  # k1 = 0.5


async def test_grpo_advantages_by_group() -> None:
    actor = FakeActor()
    await run(plan_of("algorithm.advantage=grpo"), Policies(actor))
    b = actor.updated
    uids = [f"g{i // 2}" for i in range(6)]
    want, _ = compute_advantage(
        "grpo", b["token_level_rewards"], b["response_mask"].float(), index=uids
    )
    torch.testing.assert_close(b["advantages"], want)


async def test_critic_values_feed_gae_and_a_frozen_actor_is_not_updated() -> None:
    actor, critic = FakeActor(), FakeCritic()
    plan = plan_of("algorithm.advantage={name: gae, lam: 0.95}")
    out = await run(plan, Policies(actor, critic=critic), train_actor=False)
    assert critic.updates == 1 and actor.updated is None
    assert out.metrics["actor/frozen"] == 1.0
    assert float(out.batch["values"].max()) == 0.25
    assert "rollout_corr/kl" in out.metrics  # diagnostics from one forward of the frozen policy


async def test_remax_subtracts_the_greedy_baseline() -> None:
    actor = FakeActor()
    baselines = torch.full((6,), 0.5)
    await run(plan_of("algorithm.advantage=remax"), Policies(actor), reward_baselines=baselines)
    b = actor.updated
    want, _ = compute_advantage(
        "remax", b["token_level_rewards"], b["response_mask"].float(), reward_baselines=baselines
    )
    torch.testing.assert_close(b["advantages"], want)


def test_trajectory_metrics_count_episode_metrics_and_errors() -> None:
    trajs = random_trajectories(4)
    trajs[0] = trajs[0].model_copy(update={"metrics": {"tool_calls_malformed": 2.0}})
    m = trajectory_metrics(trajs, version=0)
    assert m["rollout/tool_calls_malformed"] == 2.0
    assert m["reward/mean"] == 0.5 and m["rollout/error_episodes"] == 0.0


def test_the_greedy_sample_is_the_baseline_not_a_training_row() -> None:
    """ReMax: each group holds n sampled episodes + one greedy one (index n); the feed trains on
    the sampled ones and hands the greedy reward as every row's baseline."""
    from agentrl.training.loop import RolloutFeed

    feed = RolloutFeed.__new__(RolloutFeed)  # only split() is exercised: no manager, no loop
    feed.greedy, feed.group = True, 3
    trajs = random_trajectories(6)
    groups = [
        [
            t.model_copy(update={"uid": f"g{g}", "index": i, "reward": float(g + i)})
            for i, t in enumerate(trajs[3 * g : 3 * g + 3])
        ]
        for g in range(2)
    ]
    rows, baselines = feed.split(groups)
    assert [(t.uid, t.index) for t in rows] == [("g0", 0), ("g0", 1), ("g1", 0), ("g1", 1)]
    assert baselines is not None and baselines.tolist() == [2.0, 2.0, 3.0, 3.0]


async def test_the_optimal_token_baseline_gets_sum_pi_squared_from_the_pi_old_pass() -> None:
    from agentrl.algos import compute_advantage

    actor = FakeActor()
    await run(plan_of("algorithm.advantage=optimal_token_baseline"), Policies(actor))
    assert actor.forward_calls == 2  # one forward gave π_old and Σπ² together, + the update's
    b = actor.updated
    assert float(b["sum_pi_squared"].max()) == 0.25
    want, _ = compute_advantage(
        "optimal_token_baseline",
        b["token_level_rewards"],
        b["response_mask"].float(),
        index=[f"g{i // 2}" for i in range(6)],
        old_log_probs=b["train_log_probs"],
        sum_pi_squared=b["sum_pi_squared"],
        rollout_is_weights=b.get("rollout_is_weights"),
    )
    torch.testing.assert_close(b["advantages"], want)


async def test_gdpo_reads_reward_components_from_reward_info() -> None:
    actor = FakeActor()
    trajs = random_trajectories(4)
    trajs = [
        t.model_copy(update={"reward_info": {"fmt": float(i % 2), "acc": float(i // 2)}})
        for i, t in enumerate(trajs)
    ]
    plan = plan_of("algorithm.advantage={name: gdpo, gdpo_reward_keys: [fmt, acc]}")
    out = await train_step(trajs, Policies(actor), plan, pad_token_id=0)
    assert out.batch["advantages"].abs().sum() > 0


async def test_mask_truncated_drops_the_loss_of_length_cut_rows_but_keeps_their_score() -> None:
    from agentrl.types import StopReason

    trajs = random_trajectories(4)
    trajs[1] = trajs[1].model_copy(update={"stop_reason": StopReason.LENGTH})
    for overrides, masked in (((), False), (("algorithm.mask_truncated=true",), True)):
        actor = FakeActor()
        plan = plan_of("algorithm.advantage=grpo", *overrides)
        out = await train_step(trajs, Policies(actor), plan, pad_token_id=0)
        b = actor.updated
        assert b is not None
        assert bool(b["response_mask"][1].any()) is not masked
        for row in (0, 2, 3):
            assert b["response_mask"][row].sum() == sum(trajs[row].loss_mask)
        # group g0 = rows 0 (reward 0) and 1 (reward 1, cut): row 0's advantage still sees row 1
        assert float(b["advantages"][0][0]) < 0
        assert out.metrics.get("actor/masked_truncated_frac") == (0.25 if masked else None)


def test_token_version_metrics_age_each_sampled_token() -> None:
    from agentrl.training.step import token_version_metrics

    a, b = random_trajectories(2)
    mask = [1, 1, 0, 1]
    a = a.model_copy(
        update={
            "response_ids": [5] * 4,
            "loss_mask": mask,
            "rollout_logprobs": [-1.0, -1.0, 0.0, -1.0],
            "policy_version": [2, 3, -1, 3],
        }
    )
    b = b.model_copy(
        update={
            "response_ids": [5] * 2,
            "loss_mask": [1, 1],
            "rollout_logprobs": [-1.0, -1.0],
            "policy_version": [4, 4],
        }
    )
    m = token_version_metrics([a, b], version=4)
    # ages 2, 1, 1 (a) and 0, 0 (b): mean 4/5; only a spans two versions
    assert m == {
        "async/token_staleness_mean": pytest.approx(0.8),
        "async/mixed_version_episodes": 1.0,
    }


async def test_teacher_advantage_mode_subtracts_coef_times_the_reverse_kl_per_token() -> None:
    import dataclasses

    trajs = random_trajectories(6)
    taught = [
        t.model_copy(
            update={
                "teacher_logprobs": [
                    lp - 0.5 * m for lp, m in zip(t.rollout_logprobs, t.loss_mask, strict=True)
                ]
            }
        )
        for t in trajs
    ]  # the teacher is 0.5 nats less sure of every sampled token: reverse KL 0.5 each
    base = plan_of("algorithm.correction.preset=bypass_ppo_clip")
    plain = await train_step(trajs, Policies(FakeActor()), base, pad_token_id=0)
    plan = dataclasses.replace(base, teacher_coef=0.2)
    out = await train_step(taught, Policies(FakeActor()), plan, pad_token_id=0)
    mask = out.batch["response_mask"].float()
    expected = plain.batch["advantages"] - 0.2 * 0.5 * mask
    torch.testing.assert_close(out.batch["advantages"], expected)
    assert out.metrics["teacher/reverse_kl_mean"] == pytest.approx(0.5)
    # mode reward (no coef in the plan): the advantages are the estimator's, the metric is logged
    logged = await train_step(taught, Policies(FakeActor()), base, pad_token_id=0)
    torch.testing.assert_close(logged.batch["advantages"], plain.batch["advantages"])
    assert logged.metrics["teacher/reverse_kl_mean"] == pytest.approx(0.5)
