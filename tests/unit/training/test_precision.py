"""Mixed precision on CPU (bf16 autocast works there too): float32 master weights, float32
logits, and the log-prob agreement between the embedded server and the trainer in bf16.

The stated tolerance (docs/design.md, "Mixed precision"): in bf16 the trainer's log-probs of
the server's sampled tokens agree with the server's own to within 0.1 nats per token (max) and
0.03 nats (mean); in float32 to within 1e-4. What differs is bf16 rounding of the hidden states
(KV-cached decoding vs one full forward, autocast's float32 norms vs bf16 weights), not the
convention: the float32 run would catch a convention error, the bf16 bound catches a trainer
that lost the float32 log-softmax or computes in a different dtype than the server.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from agentrl.batch import trajectories_to_batch
from agentrl.inference.engine.inference_engine import InferenceEngine
from agentrl.training.actor import Actor
from agentrl.types import SamplingParams, StopReason, Trajectory
from tests.fakes import actor_config

PAD = 256


def _sampled(model_dir: Path, dtype: torch.dtype) -> list[Trajectory]:
    """Four episodes sampled by an embedded engine in ``dtype``, with its log-probs."""
    engine = InferenceEngine(model_dir, dtype=dtype, max_batch_size=4, seed=0)
    prompts = [[1 + i, 2, 3, 4, 5 + 7 * i] for i in range(4)]

    async def run():  # type: ignore[no-untyped-def]
        sampling = [SamplingParams(max_tokens=40, temperature=1.0, seed=i) for i in range(4)]
        return await asyncio.gather(
            *(engine.generate(p, s) for p, s in zip(prompts, sampling, strict=True))
        )

    try:
        outs = asyncio.run(run())
    finally:
        engine.close()
    return [
        Trajectory(
            prompt_ids=prompt,
            response_ids=list(out.token_ids),
            loss_mask=[1] * len(out.token_ids),
            rollout_logprobs=[float(x) for x in out.logprobs],
            policy_version=[0] * len(out.token_ids),
            uid=f"g{i // 2}",
            index=i % 2,
            reward=float(i % 2),
            stop_reason=StopReason.EOS,
        )
        for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True))
    ]


def _disagreement(model_dir: Path, dtype: str, engine_dtype: torch.dtype) -> torch.Tensor:
    """|trainer log-prob − server log-prob| of every sampled token."""
    batch = trajectories_to_batch(_sampled(model_dir, engine_dtype), pad_token_id=PAD)
    actor = Actor(model_dir, actor_config(), device="cpu", dtype=dtype, trust_remote_code=False)
    mask = batch["response_mask"].bool()
    diff = (actor.compute_log_probs(batch) - batch["rollout_log_probs"]).abs()
    return diff[mask]


def test_bf16_trainer_agrees_with_the_bf16_server(tiny_model_dir: Path) -> None:
    diff = _disagreement(tiny_model_dir, "bfloat16", torch.bfloat16)
    assert diff.numel() > 100
    assert float(diff.max()) <= 0.1 and float(diff.mean()) <= 0.03, (diff.max(), diff.mean())


def test_float32_trainer_agrees_with_the_float32_server(tiny_model_dir: Path) -> None:
    diff = _disagreement(tiny_model_dir, "float32", torch.float32)
    assert float(diff.max()) <= 1e-4, diff.max()


def test_bf16_actor_keeps_float32_master_weights(tiny_model_dir: Path) -> None:
    """A step far below bf16's resolution still moves the weights; the push is bf16."""
    actor = Actor(
        tiny_model_dir,
        actor_config(lr=1e-6, grad_clip=1e9),
        device="cpu",
        dtype="bfloat16",
        trust_remote_code=False,
    )
    assert actor.autocast is torch.bfloat16
    assert all(p.dtype == torch.float32 for p in actor.model.parameters())
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    trajs = _sampled(tiny_model_dir, torch.bfloat16)
    batch = trajectories_to_batch(trajs, pad_token_id=PAD)
    batch["old_log_probs"] = actor.compute_log_probs(batch)
    rewards = torch.tensor([t.reward for t in trajs])
    batch["advantages"] = (rewards - rewards.mean())[:, None] * batch["response_mask"].float()
    actor.update(batch)
    weight = "model.layers.0.mlp.down_proj.weight"
    after = dict(actor.model.named_parameters())[weight].detach()
    moved = after != before[weight]
    assert moved.float().mean() > 0.5  # AdamW's ~1e-6 step landed in float32
    # ... and a bf16 weight would have rounded nearly all of it away
    lost = after.to(torch.bfloat16) == before[weight].to(torch.bfloat16)
    assert lost[moved].float().mean() > 0.9
    pushed = actor.state_dict_for_push()
    assert all(t.dtype == torch.bfloat16 for t in pushed.values() if t.is_floating_point())
