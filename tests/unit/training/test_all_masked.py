"""A step whose every sequence is masked changes nothing, and the run says when most is masked."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import correction
from agentrl.batch import trajectories_to_batch
from agentrl.training.actor import Actor
from agentrl.training.masking import MaskingWatch
from tests.fakes import MODEL_ARGS, actor_config, experiment, random_trajectories

PAD = 256


def _batch(actor: Actor, seed: int) -> Any:
    trajs = random_trajectories(4, seed=seed)
    batch = trajectories_to_batch(trajs, pad_token_id=PAD)
    batch["old_log_probs"] = actor.compute_log_probs(batch)
    rewards = torch.tensor([t.reward for t in trajs])
    batch["advantages"] = (rewards - rewards.mean())[:, None] * batch["response_mask"].float()
    return batch


def _snapshot(actor: Any) -> dict[str, Any]:
    """Weights, AdamW moments and step counts, learning rates, schedule (an Actor or a Critic)."""
    opt = actor.optimizer.state_dict()
    state = actor.state_dict()
    weights = {**state["model"], **{f"head.{k}": v for k, v in state.get("value_head", {}).items()}}
    return {
        "model": {k: v.clone() for k, v in weights.items()},
        "moments": {(i, k): v.clone() for i, st in opt["state"].items() for k, v in st.items()},
        "groups": [dict(g) for g in opt["param_groups"]],
        "scheduler": dict(actor.scheduler.state_dict()),
        "global_step": actor.global_step,
    }


def _identical(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("mini_batch_size", [None, 2])
def test_an_all_masked_step_leaves_weights_optimizer_and_schedule_bit_identical(
    tiny_model_dir: Path, mini_batch_size: int | None
) -> None:
    """AdamW's momentum must not move the weights, and the warmup must not advance the LR."""
    cfg = actor_config(lr=1e-2, warmup_steps=5, mini_batch_size=mini_batch_size)
    actor = Actor(tiny_model_dir, cfg, **MODEL_ARGS)
    first = actor.update(_batch(actor, seed=3))  # a real step: Adam has moments now
    assert first["actor/skipped_all_masked"] == 0.0
    before = _snapshot(actor)
    masked = _batch(actor, seed=4)
    masked["response_mask"] = torch.zeros_like(masked["response_mask"])
    metrics = actor.update(masked)
    assert metrics["actor/skipped_all_masked"] == 1.0
    assert _identical(before, _snapshot(actor))
    # the next real step continues the schedule where it stopped (warmup step 2 of 5)
    actor.update(_batch(actor, seed=5))
    assert actor.scheduler.get_last_lr()[0] == pytest.approx(1e-2 * 3 / 5)


def test_a_partly_masked_step_still_learns(tiny_model_dir: Path) -> None:
    actor = Actor(tiny_model_dir, actor_config(lr=1e-2), **MODEL_ARGS)
    batch = _batch(actor, seed=6)
    batch["response_mask"][1:] = 0
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    metrics = actor.update(batch)
    assert metrics["actor/skipped_all_masked"] == 0.0
    assert any(not torch.equal(before[k], v) for k, v in actor.model.state_dict().items())


def test_loglinear_with_alpha_zero_is_the_step_anchored_on_the_rollout(
    tiny_model_dir: Path,
) -> None:
    """α = 0 (tokens at most one version old): π_old = π_rollout and the IS weight is 1, so the
    update equals one given old_log_probs = rollout, in any update shape (here 2 mini-batches)."""
    anchor = correction.preset("decoupled_loglinear")
    weights = []
    for use_anchor in (True, False):
        torch.manual_seed(0)
        actor = Actor(tiny_model_dir, actor_config(lr=1e-2, mini_batch_size=2), **MODEL_ARGS)
        batch = _batch(actor, seed=7)
        gen = torch.Generator().manual_seed(1)
        noise = 0.2 * torch.randn(batch["old_log_probs"].shape, generator=gen)
        batch["rollout_log_probs"] = (batch["old_log_probs"] + noise) * batch["response_mask"]
        if use_anchor:
            del batch["old_log_probs"]
            batch["prox_alpha"] = torch.zeros_like(batch["rollout_log_probs"])
            actor.update_with_log_probs(batch, anchor=anchor)
        else:
            batch["old_log_probs"] = batch["rollout_log_probs"].clone()
            batch["rollout_is_weights"] = batch["response_mask"].float()
            actor.update(batch)
        weights.append(torch.cat([p.detach().flatten() for p in actor.model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], atol=1e-6, rtol=0)


def _watch(preset: str, **kwargs: Any) -> MaskingWatch:
    section = experiment(f"algorithm.correction.preset={preset}").algorithm.correction
    return MaskingWatch(section, **kwargs)


def test_the_warning_fires_once_per_n_steps_naming_the_preset_and_the_knob(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = _watch("decoupled_geo_rs", every=5)
    heavy = {
        "rollout_corr/masked_frac_token": 0.8,
        "rollout_corr/masked_frac_seq": 0.9,
        "rollout_corr/rs_masked_frac_token": 0.8,
        "rollout_corr/k3_kl": 0.05,
        "actor/skipped_all_masked": 0.0,
    }
    light = {**heavy, "rollout_corr/masked_frac_token": 0.1, "rollout_corr/masked_frac_seq": 0.2}
    with caplog.at_level(logging.WARNING, logger="agentrl.training.masking"):
        watch.on_step(1, 1, light, [])
        for step in range(2, 13):
            watch.on_step(step, step, heavy, [])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 3  # steps 2, 7 and 12: not every step
    assert warned[0].startswith("step 2: the off-policy correction (preset 'decoupled_geo_rs'")
    assert "masked 80% of the response tokens and 90% of the sequences" in warned[0]
    assert "loosen algorithm.correction.rs_rules (now seq_mean_k1 in [0.999, 1.001])" in warned[0]
    assert "5 steps since the last warning masked more than 50%" in warned[1]


def test_the_warning_names_the_mechanism_that_masked_most(caplog: pytest.LogCaptureFixture) -> None:
    watch = _watch("decoupled_token_is_opsm")
    metrics = {
        "rollout_corr/masked_frac_token": 0.3,
        "rollout_corr/masked_frac_seq": 0.6,
        "rollout_corr/opsm_masked_frac_token": 0.3,
        "actor/skipped_all_masked": 1.0,
    }
    with caplog.at_level(logging.WARNING, logger="agentrl.training.masking"):
        watch.on_step(1, 1, metrics, [])
    (message,) = [r.getMessage() for r in caplog.records]
    assert "raise algorithm.correction.opsm_threshold (now 0.05)" in message
    assert "this step's update was skipped" in message


def test_the_critic_skips_an_all_masked_step_too(tiny_model_dir: Path) -> None:
    from agentrl.training.critic import Critic
    from tests.fakes import critic_config
    from tests.unit.training.test_critic import _gae_batch

    critic = Critic(tiny_model_dir, critic_config(lr=1e-2, warmup_steps=5), **MODEL_ARGS)
    with torch.no_grad():
        critic.value_head.bias.fill_(0.5)  # values off the returns: a real first step
    critic.update(_gae_batch(critic, random_trajectories(4, seed=8)))
    before = _snapshot(critic)
    masked = _gae_batch(critic, random_trajectories(4, seed=9))
    masked["response_mask"] = torch.zeros_like(masked["response_mask"])
    assert critic.update(masked)["critic/skipped_all_masked"] == 1.0
    assert _identical(before, _snapshot(critic))
