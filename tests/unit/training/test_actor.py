"""Actor: log-probs by the servers' convention, micro-batching invariance, and the update."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from agentrl.batch import BatchSchemaError, trajectories_to_batch
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


def test_update_checks_the_batch_it_receives(tiny_model_dir: Path) -> None:
    actor = Actor(tiny_model_dir, actor_config(), **MODEL_ARGS)
    batch = _prepared_batch(actor, _trajectories(2, seed=4))
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    with pytest.raises(BatchSchemaError, match=r"Actor.update: the batch has no 'advantages'"):
        actor.update(batch.exclude("advantages"))
    batch["advantages"] = batch["advantages"].double()
    with pytest.raises(BatchSchemaError, match=r"'advantages' has dtype torch.float64"):
        actor.update(batch)
    after = actor.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # refused before any step


@pytest.mark.parametrize(
    ("preset", "budget"), [("decoupled_token_is", 16), ("decoupled_seq_is", 10**5)]
)
async def test_pi_old_from_the_update_equals_a_separate_pass(
    tiny_model_dir: Path, preset: str, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One optimizer step per batch: π_old is the update's own first forward, and the step is
    the one a separate π_old pass gives (weights, IS weights, diagnostics), one pass cheaper."""
    from agentrl.training.algorithm import build_algorithm
    from agentrl.training.step import Policies, train_step
    from tests.fakes import experiment

    plan = build_algorithm(experiment(f"algorithm.correction.preset={preset}").algorithm)
    trajs = _trajectories(6, seed=4)
    # π_rollout = the model's own log-probs + noise, so that the IS weights vary around 1
    policy = FrozenPolicy(
        tiny_model_dir, temperature=1.0, micro_batch_max_tokens=4096, **MODEL_ARGS
    )
    own = policy.compute_log_probs(trajectories_to_batch(trajs, pad_token_id=PAD))
    gen = torch.Generator().manual_seed(0)
    for row, t in enumerate(trajs):
        noise = 0.3 * torch.randn(len(t.response_ids), generator=gen)
        lp = (own[row, : len(t.response_ids)] + noise).tolist()
        t.rollout_logprobs = [v if m else 0.0 for v, m in zip(lp, t.loss_mask, strict=True)]
    runs = []
    for fuse in (True, False):
        cfg = actor_config(lr=1e-3, micro_batch_max_tokens=budget)
        actor = Actor(tiny_model_dir, cfg, **MODEL_ARGS)
        if not fuse:
            monkeypatch.setattr(actor, "fuses_old_log_probs", lambda n: False)
        out = await train_step(trajs, Policies(actor), plan, pad_token_id=PAD)
        weights = torch.cat([p.detach().flatten() for p in actor.model.parameters()])
        runs.append((out, weights))
    (fused, w_fused), (separate, w_separate) = runs
    assert fused.metrics["actor/old_log_prob_fused"] == 1.0
    assert "timing_s/old_log_prob" not in fused.metrics
    assert "actor/old_log_prob_fused" not in separate.metrics
    torch.testing.assert_close(w_fused, w_separate, atol=1e-7, rtol=0)
    for key in ("old_log_probs", "rollout_is_weights", "advantages", "response_mask"):
        torch.testing.assert_close(fused.batch[key], separate.batch[key], atol=1e-6, rtol=0)
    w = separate.batch["rollout_is_weights"][separate.batch["response_mask"].bool()]
    assert float(w.min()) < 0.9 and float(w.max()) > 1.1  # the weights did work
    for key, value in separate.metrics.items():
        if key.startswith(("actor/", "rollout_corr/")) and key != "actor/lr":
            assert fused.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_pi_old_needs_its_own_pass_when_something_uses_it_before_the_update(
    tiny_model_dir: Path,
) -> None:
    from agentrl.training.algorithm import build_algorithm
    from agentrl.training.step import fuses_old_log_probs
    from tests.fakes import experiment

    def plan(*overrides: str):
        return build_algorithm(experiment(*overrides).algorithm)

    one_step = Actor(tiny_model_dir, actor_config(), **MODEL_ARGS)
    token_is = plan("algorithm.correction.preset=decoupled_token_is")
    assert fuses_old_log_probs(token_is, one_step, 8)
    # RS changes the mask the advantages and the loss normalizer see; KL in the reward and
    # bypass use π_old/π_rollout before the update; several steps move the weights.
    for other in (
        plan("algorithm.correction.preset=decoupled_seq_is_rs"),
        plan("algorithm.correction.preset=decoupled_token_is", "algorithm.use_kl_in_reward=true"),
        plan("algorithm.correction.preset=bypass_ppo_clip"),
    ):
        assert not fuses_old_log_probs(other, one_step, 8)
    epochs = Actor(tiny_model_dir, actor_config(ppo_epochs=2), **MODEL_ARGS)
    minis = Actor(tiny_model_dir, actor_config(mini_batch_size=4), **MODEL_ARGS)
    assert not fuses_old_log_probs(token_is, epochs, 8)
    assert not fuses_old_log_probs(token_is, minis, 8)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_grad_noise_is_logged_from_the_micro_batches_when_asked(
    tiny_model_dir: Path, mode: str
) -> None:
    """``trainer.log_grad_noise``: the actor logs ``grad_noise/*`` from its micro-batches (the
    estimator itself is checked against hand values in test_metrics.py), and nothing without."""
    trajs = _trajectories(6, seed=3)
    cfg = actor_config(micro_batch_max_tokens=12, loss_agg_mode=mode, grad_noise=True)
    actor = Actor(tiny_model_dir, cfg, **MODEL_ARGS)
    metrics = actor.update(_prepared_batch(actor, trajs))
    keys = {"grad_noise/trace_cov", "grad_noise/grad_sq_norm", "grad_noise/micro_grad_norm/mean"}
    assert keys <= set(metrics), sorted(metrics)
    assert metrics["grad_noise/micro_grad_norm/mean"] > 0
    signal, trace = metrics["grad_noise/grad_sq_norm"], metrics["grad_noise/trace_cov"]
    assert math.isfinite(signal) and math.isfinite(trace)
    off = Actor(tiny_model_dir, actor_config(micro_batch_max_tokens=12), **MODEL_ARGS)
    assert not any(k.startswith("grad_noise/") for k in off.update(_prepared_batch(off, trajs)))


def test_grad_noise_with_sharded_gradients_is_refused_before_anything_starts() -> None:
    from agentrl.training.resolve import resolve_experiment
    from tests.fakes import experiment

    cfg = experiment("trainer.log_grad_noise=true", "trainer.world_size=2")
    with pytest.raises(Exception, match=r"trainer\.log_grad_noise=true with trainer\.world_size=2"):
        resolve_experiment(cfg)
