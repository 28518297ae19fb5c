"""Critic: value positions and masking, the clipped value loss, gradient accumulation, learning
toward the returns, and an exact state round-trip (on the tiny model, CPU, float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentrl.algos import compute_advantage, value_loss
from agentrl.batch import BatchSchemaError, trajectories_to_batch
from agentrl.training.critic import Critic
from agentrl.training.metrics import value_metrics
from agentrl.types import Trajectory
from tests.fakes import MODEL_ARGS, critic_config, random_trajectories

PAD = 256


_trajectories = random_trajectories


def _critic(model_dir: Path, head_seed: int | None = 0, **cfg) -> Critic:
    critic = Critic(model_dir, critic_config(**cfg), **MODEL_ARGS)
    if head_seed is not None:
        # A non-zero head, so values vary and gradients reach the backbone from the first step.
        gen = torch.Generator().manual_seed(head_seed)
        with torch.no_grad():
            w = critic.value_head.weight
            w.copy_(torch.randn(w.shape, generator=gen) * 0.3)
            critic.value_head.bias.fill_(0.1)
    return critic


def _gae_batch(critic: Critic, trajs: list[Trajectory], gamma: float = 1.0, lam: float = 0.95):
    """The trainer's data path: values, then GAE advantages/returns from the outcome rewards."""
    batch = trajectories_to_batch(trajs, pad_token_id=PAD)
    batch["values"] = critic.compute_values(batch)
    adv, returns = compute_advantage(
        "gae",
        batch["token_level_scores"],
        batch["response_mask"].float(),
        values=batch["values"],
        gamma=gamma,
        lam=lam,
    )
    batch["advantages"] = adv
    batch["returns"] = returns
    return batch


def test_fresh_critic_predicts_zero(tiny_model_dir: Path) -> None:
    critic = Critic(tiny_model_dir, critic_config(), **MODEL_ARGS)
    batch = trajectories_to_batch(_trajectories(3), pad_token_id=PAD)
    assert torch.all(critic.compute_values(batch) == 0)


@pytest.mark.parametrize("budget", [16, 10_000])
def test_values_sit_at_the_positions_that_predict_each_response_token(
    tiny_model_dir: Path, budget: int
) -> None:
    from transformers import AutoModelForCausalLM

    critic = _critic(tiny_model_dir, micro_batch_max_tokens=budget)
    trajs = _trajectories(5)
    batch = trajectories_to_batch(trajs, pad_token_id=PAD)
    values = critic.compute_values(batch)
    assert values.shape == batch["responses"].shape and values.dtype == torch.float32
    # Reference: the causal LM's own final hidden state on the unpadded sequence.
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    for row, traj in enumerate(trajs):
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            hidden = lm(ids, output_hidden_states=True).hidden_states[-1][0]
            ref = critic.value_head(hidden).squeeze(-1)
        p, r = len(traj.prompt_ids), len(traj.response_ids)
        mask = torch.tensor(traj.loss_mask, dtype=torch.float32)
        # value of response token t = V(state before t) = the head at position p - 1 + t
        torch.testing.assert_close(
            values[row, :r], ref[p - 1 : p - 1 + r] * mask, atol=1e-5, rtol=0
        )
        assert torch.all(values[row, r:] == 0)  # right padding
        assert torch.all(values[row, :r][mask == 0] == 0)  # tool/user tokens
        assert values[row, :r][mask == 1].abs().min() > 0  # sampled tokens carry a value


def test_update_loss_is_the_clipped_value_loss(tiny_model_dir: Path) -> None:
    critic = _critic(tiny_model_dir, cliprange_value=0.05, lr=1e-4)
    trajs = _trajectories(4, seed=3)
    batch = trajectories_to_batch(trajs, pad_token_id=PAD)
    mask = batch["response_mask"].float()
    v_now = critic.compute_values(batch)
    # Old values offset from the current ones: tokens where |V - V_old| > 0.05 are clipped.
    gen = torch.Generator().manual_seed(0)
    old = (v_now + 0.1 * torch.randn(v_now.shape, generator=gen)) * mask
    returns = torch.randn(v_now.shape, generator=gen) * mask
    batch["values"] = old
    batch["returns"] = returns
    # By hand: ½ · token-mean of max((V − R)², (V_old + clip(V − V_old, ±ε) − R)²).
    v_clip = old + (v_now - old).clamp(-0.05, 0.05)
    per_token = 0.5 * torch.maximum((v_now - returns) ** 2, (v_clip - returns) ** 2)
    by_hand = (per_token * mask).sum() / mask.sum()
    clipfrac = (
        ((v_clip - returns) ** 2 > (v_now - returns) ** 2).float() * mask
    ).sum() / mask.sum()
    expected, expected_metrics = value_loss(v_now, returns, old, mask, cliprange_value=0.05)
    torch.testing.assert_close(expected, by_hand, atol=1e-6, rtol=1e-6)
    metrics = critic.update(batch)
    assert metrics["critic/vf_loss"] == pytest.approx(float(by_hand), rel=1e-5, abs=1e-7)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(float(clipfrac), abs=1e-6)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(expected_metrics["vf_clipfrac"])
    assert 0 < metrics["critic/vf_clipfrac"] < 1
    vpred_mean = float((v_now * mask).sum() / mask.sum())
    assert metrics["critic/vpred_mean"] == pytest.approx(vpred_mean, abs=1e-5)
    assert metrics["critic/grad_norm"] > 0
    assert metrics["critic/lr"] == pytest.approx(1e-4)


def test_update_needs_values_and_returns(tiny_model_dir: Path) -> None:
    critic = _critic(tiny_model_dir)
    batch = trajectories_to_batch(_trajectories(2), pad_token_id=PAD)
    with pytest.raises(BatchSchemaError, match=r"Critic.update: the batch has no 'values'"):
        critic.update(batch)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_matches_full_batch(tiny_model_dir: Path, mode: str) -> None:
    trajs = _trajectories(6, seed=1)
    grads, metrics = [], []
    for budget in (12, 100_000):
        critic = _critic(
            tiny_model_dir, micro_batch_max_tokens=budget, loss_agg_mode=mode, grad_clip=1e9
        )
        batch = _gae_batch(critic, trajs)
        assert len(critic._micro_batches(batch)[0]) == (6 if budget == 12 else 1)
        metrics.append(critic.update(batch))
        grads.append(
            torch.cat([p.grad.flatten() for p in critic.parameters() if p.grad is not None])
        )
    backbone_params = sum(p.numel() for p in critic.backbone.parameters())
    assert grads[0][:backbone_params].abs().sum() > 0  # the backbone learns too
    # float32 sums in a different order: compare at the scale of the gradient itself
    scale = float(grads[1].abs().max())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5 * scale, rtol=1e-4)
    # the loss metrics do not depend on the packing either (vf_clipfrac is left out: with
    # V == V_old up to rounding, its strict comparison counts rounding ties)
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean", "critic/lr"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-7), key


def test_updates_move_values_toward_the_returns(tiny_model_dir: Path) -> None:
    critic = _critic(tiny_model_dir, head_seed=None, lr=3e-3)  # zero-initialised head
    trajs = _trajectories(4, seed=2)
    batch = _gae_batch(critic, trajs)
    returns = batch["returns"]
    mask = batch["response_mask"].float()

    def mse() -> float:
        v = critic.compute_values(batch)
        return float((((v - returns) ** 2) * mask).sum() / mask.sum())

    before = mse()
    assert before > 0.1  # V ≡ 0 while half the episodes return 1
    losses = []
    for _ in range(8):
        batch["values"] = critic.compute_values(batch)  # as the trainer does every step
        losses.append(critic.update(batch)["critic/vf_loss"])
    after = mse()
    assert after < 0.5 * before, (before, after, losses)
    assert losses[-1] < losses[0]
    assert critic.global_step == 8


def test_state_round_trip_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    trajs = _trajectories(4, seed=4)
    first = _critic(tiny_model_dir, lr=1e-3, warmup_steps=3)
    first.update(_gae_batch(first, trajs))
    torch.save(first.state_dict(), tmp_path / "critic.pt")
    second = _critic(tiny_model_dir, head_seed=7, lr=1e-3, warmup_steps=3)
    second.load_state_dict(torch.load(tmp_path / "critic.pt", weights_only=False))
    assert second.global_step == 1
    assert second.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    batch = trajectories_to_batch(trajs, pad_token_id=PAD)
    torch.testing.assert_close(second.compute_values(batch), first.compute_values(batch))
    # The next update (Adam moments + LR warmup restored) is the same on both.
    m1 = first.update(_gae_batch(first, trajs))
    m2 = second.update(_gae_batch(second, trajs))
    assert m1 == m2
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


def test_value_metrics_explained_variance() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    returns = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    perfect = value_metrics(returns.clone(), returns, mask)
    assert perfect["critic/vf_explained_var"] == pytest.approx(1.0)
    assert perfect["critic/returns_mean"] == pytest.approx(3.0)  # the 9.0 is masked
    # A constant critic explains nothing; values on masked tokens are ignored.
    constant = value_metrics(torch.full_like(returns, 7.0), returns, mask)
    assert constant["critic/vf_explained_var"] == pytest.approx(0.0, abs=1e-6)
    assert constant["critic/values_mean"] == pytest.approx(7.0)
    # Var(R − V) / Var(R): residuals [1, 0, -1, 1, 0] against returns 1..5 (both Bessel).
    values = returns - torch.tensor([[1.0, 0.0, 0.0], [-1.0, 1.0, 0.0]])
    got = value_metrics(values, returns, mask)["critic/vf_explained_var"]
    residual = torch.tensor([1.0, 0.0, -1.0, 1.0, 0.0])
    assert got == pytest.approx(1 - residual.var().item() / 2.5, abs=1e-6)
    flat = value_metrics(returns * 0, torch.ones_like(returns), mask)
    assert flat["critic/vf_explained_var"] == 0.0  # Var(R) = 0: defined as 0, not nan
