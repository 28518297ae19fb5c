"""Actor: log-probs by the servers' convention, micro-batching invariance, and the update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentrl.batch import trajectories_to_batch
from agentrl.training.actor import Actor, FrozenPolicy
from agentrl.types import Trajectory
from tests.fakes import MODEL_ARGS, actor_config, random_trajectories

PAD = 256


_trajectories = random_trajectories


def _reference_logprobs(model_dir: Path, traj: Trajectory, temperature: float) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    p = len(traj.prompt_ids)
    return [logp[p - 1 + t, tok].item() for t, tok in enumerate(traj.response_ids)]


@pytest.mark.parametrize("budget", [16, 10_000])
def test_log_probs_match_unpadded_forward(tiny_model_dir: Path, budget: int) -> None:
    trajs = _trajectories(5)
    batch = trajectories_to_batch(trajs, pad_token_id=PAD)
    policy = FrozenPolicy(
        tiny_model_dir, temperature=0.7, micro_batch_max_tokens=budget, **MODEL_ARGS
    )
    logp = policy.compute_log_probs(batch)
    assert logp.shape == batch["responses"].shape
    for row, traj in enumerate(trajs):
        ref = _reference_logprobs(tiny_model_dir, traj, 0.7)
        got = logp[row, : len(ref)]
        mask = torch.tensor(traj.loss_mask, dtype=torch.float32)
        torch.testing.assert_close(got, torch.tensor(ref) * mask, atol=1e-5, rtol=0)
        assert torch.all(logp[row, len(ref) :] == 0)


def _prepared_batch(actor: Actor, trajs: list[Trajectory]):
    batch = trajectories_to_batch(trajs, pad_token_id=PAD)
    batch["old_log_probs"] = actor.compute_log_probs(batch)
    rewards = torch.tensor([t.reward for t in trajs])
    adv = (rewards - rewards.mean())[:, None] * batch["response_mask"].float()
    batch["advantages"] = adv
    return batch


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_matches_full_batch(tiny_model_dir: Path, mode: str) -> None:
    trajs = _trajectories(6, seed=1)
    grads, metrics = [], []
    for budget in (12, 100_000):
        cfg = actor_config(
            lr=1e-3, micro_batch_max_tokens=budget, loss_agg_mode=mode, grad_clip=1e9
        )
        actor = Actor(tiny_model_dir, cfg, **MODEL_ARGS)
        batch = _prepared_batch(actor, trajs)
        # π_old off the model's own, so that the ratio diagnostics are not all 0 or 1
        gen = torch.Generator().manual_seed(0)
        noise = 0.2 * torch.randn(batch["old_log_probs"].shape, generator=gen)
        batch["old_log_probs"] = (batch["old_log_probs"] + noise) * batch["response_mask"]
        metrics.append(actor.update(batch))
        grads.append(
            torch.cat([p.grad.flatten() for p in actor.model.parameters() if p.grad is not None])
        )
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    # the loss and its diagnostics (token-weighted) do not depend on the packing either
    assert metrics[0].keys() == metrics[1].keys()
    assert metrics[0]["actor/ppo_kl"] != 0.0 and metrics[0]["actor/pg_clipfrac"] > 0.0
    for key, value in metrics[1].items():
        assert metrics[0][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_update_raises_logprob_of_positive_advantage_tokens(tiny_model_dir: Path) -> None:
    trajs = _trajectories(4, seed=2)
    actor = Actor(tiny_model_dir, actor_config(lr=3e-3, ppo_epochs=4), **MODEL_ARGS)
    batch = _prepared_batch(actor, trajs)
    before = batch["old_log_probs"].clone()
    metrics = actor.update(batch)
    after = actor.compute_log_probs(batch)
    mask = batch["response_mask"].float()
    adv = batch["advantages"]
    gain = ((after - before) * torch.sign(adv) * mask).sum() / mask.sum()
    assert gain > 0, gain
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "actor/ppo_kl"):
        assert key in metrics, sorted(metrics)
    pushed = actor.state_dict_for_push()
    assert set(pushed) == set(actor.model.state_dict())
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in pushed.values())


def test_a_fully_masked_batch_leaves_the_weights_alone(tiny_model_dir: Path) -> None:
    """With every token rejected the gradient is 0; AdamW's momentum must not move the weights
    anyway (it did: a collapsed geometric-RS run drifted with 100 % of sequences masked)."""
    trajs = _trajectories(4, seed=3)
    actor = Actor(tiny_model_dir, actor_config(lr=1e-2), **MODEL_ARGS)
    batch = _prepared_batch(actor, trajs)
    actor.update(batch)  # one real step: Adam has momentum now
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    masked = batch.clone()
    masked["response_mask"] = torch.zeros_like(masked["response_mask"])
    metrics = actor.update(masked)
    assert metrics["actor/skipped_empty_minibatch"] == 1.0
    after = actor.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
