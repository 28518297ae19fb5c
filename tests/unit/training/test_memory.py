"""Activation checkpointing: the same numbers as without it, with fewer saved activations.

Each test counts the decoder layers' attention forwards, so a checkpointing that silently did
nothing (e.g. Hugging Face's own switch, which is off in eval mode) fails: with it on, every
layer runs once more in backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.batch import trajectories_to_batch
from agentrl.training.actor import Actor
from agentrl.training.critic import Critic
from agentrl.training.fsdp import decoder_layers
from agentrl.training.memory import checkpoint_decoder_layers
from tests.fakes import (
    MODEL_ARGS,
    actor_config,
    critic_config,
    experiment,
    grouped_trajectories,
    random_trajectories,
)

PAD = 256


def _count_attention_calls(model: torch.nn.Module) -> list[int]:
    """A counter of the attention forwards of every decoder layer."""
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    for layer in decoder_layers(model):
        attention: Any = layer.self_attn
        attention.register_forward_hook(hook)
    return calls


def _actor_batch(actor: Actor, grouped: bool = False):
    trajs = grouped_trajectories(seed=3) if grouped else random_trajectories(6, seed=3)
    batch = trajectories_to_batch(trajs, pad_token_id=PAD)
    logp = actor.compute_log_probs(batch)
    gen = torch.Generator().manual_seed(0)
    batch["old_log_probs"] = (logp + 0.2 * torch.randn(logp.shape, generator=gen)) * batch[
        "response_mask"
    ]
    rewards = torch.tensor([t.reward for t in trajs])
    batch["advantages"] = (rewards - rewards.mean())[:, None] * batch["response_mask"].float()
    return batch


@pytest.mark.parametrize(
    ("lora", "shared"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["full", "lora", "full-shared-prompts", "lora-shared-prompts"],
)
def test_actor_checkpointing_gives_the_same_update(
    tiny_model_dir: Path, lora: bool, shared: bool
) -> None:
    """With shared prompts (rows that repeat a prompt run on its KV cache) each layer's
    recompute must start from the cache as its forward found it."""
    lora_section = experiment("model.lora.rank=4").model.lora if lora else None
    results = []
    for on in (False, True):
        cfg = actor_config(
            lr=1e-3,
            micro_batch_max_tokens=40,
            grad_clip=1e9,
            entropy_coeff=0.01,
            gradient_checkpointing=on,
            lora=lora_section,
            share_prompts=shared,
        )
        torch.manual_seed(0)  # the same LoRA A initialisation in both runs
        actor = Actor(tiny_model_dir, cfg, **MODEL_ARGS)
        assert actor.share_prompts is shared
        batch = _actor_batch(actor, grouped=shared)
        calls = _count_attention_calls(actor.model)
        metrics, first = actor.update_with_log_probs(batch)
        grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
        results.append((metrics, first, grads, calls[0]))
    (m0, f0, g0, c0), (m1, f1, g1, c1) = results
    assert c1 == 2 * c0 > 0  # every layer recomputed once in backward
    assert g0.keys() == g1.keys() and g0
    if lora:
        assert all("lora_" in name for name in g0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(f1, f0, atol=1e-6, rtol=0)
    for key, value in m0.items():
        assert m1[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert (m1["actor/prompt_tokens_reused"] > 0) is shared


def test_critic_checkpointing_gives_the_same_update(tiny_model_dir: Path) -> None:
    trajs = random_trajectories(5, seed=4)
    results = []
    for on in (False, True):
        critic = Critic(
            tiny_model_dir,
            critic_config(micro_batch_max_tokens=40, grad_clip=1e9, gradient_checkpointing=on),
            **MODEL_ARGS,
        )
        with torch.no_grad():  # a head that is not zero, so the backbone gets a gradient
            critic.value_head.weight.fill_(0.05)
        batch = trajectories_to_batch(trajs, pad_token_id=PAD)
        batch["values"] = critic.compute_values(batch)
        batch["returns"] = batch["token_level_scores"].cumsum(dim=1).flip(1) * 0.5
        calls = _count_attention_calls(critic.backbone)
        metrics = critic.update(batch)
        grads = [p.grad.clone() for p in critic.parameters() if p.grad is not None]
        results.append((metrics, grads, calls[0]))
    (m0, g0, c0), (m1, g1, c1) = results
    assert c1 == 2 * c0 > 0
    assert len(g0) == len(g1) and float(g0[0].abs().sum()) > 0
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    assert m1["critic/vf_loss"] == pytest.approx(m0["critic/vf_loss"], rel=1e-6)


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward pass."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    return total[0]


def test_checkpointing_keeps_fewer_activations(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.eval()  # as the trainer keeps it: Hugging Face's own switch would do nothing here
    plain = _saved_bytes(model, ids)
    assert checkpoint_decoder_layers(model) == model.config.num_hidden_layers
    assert checkpoint_decoder_layers(model) == model.config.num_hidden_layers  # idempotent
    # the outer pass keeps only each layer's inputs (the recompute's saves are freed per layer)
    checkpointed = _saved_bytes(model, ids)
    assert checkpointed < 0.6 * plain, (checkpointed, plain)


def test_gradient_checkpointing_is_a_config_key() -> None:
    cfg = experiment("trainer.gradient_checkpointing=true", "trainer.cpu_offload=true")
    assert cfg.trainer.gradient_checkpointing and cfg.trainer.cpu_offload
    assert actor_config("trainer.gradient_checkpointing=true").gradient_checkpointing
    assert critic_config("trainer.gradient_checkpointing=true").gradient_checkpointing
