"""Shared prompts (``trainer.share_prompts``): each distinct prompt of a micro-batch runs once and
its rows' responses on its KV cache; log-probs, gradients and the update equal the plain forward's
(Qwen2 and Llama layouts, LoRA, left-padded prompts of different lengths, rows without a partner,
budgets that split a group), and anything that cannot share runs every row whole, saying why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from agentrl.batch import prompt_groups, split_by_prompt_groups, trajectories_to_batch
from agentrl.training import actor as actor_module
from agentrl.training.actor import Actor, FrozenPolicy
from agentrl.training.shared_prompts import sharing_blocker
from tests.fakes import MODEL_ARGS, actor_config, experiment, grouped_trajectories

PAD = 256


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (no tokenizer: the actor needs none)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny_llama")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def _model_dir(kind: str, tiny_model_dir: Path, llama_dir: Path) -> Path:
    return tiny_model_dir if kind == "qwen2" else llama_dir


def test_prompt_groups_compare_tokens_and_padding() -> None:
    prompts = torch.tensor([[0, 5, 6], [0, 5, 6], [5, 5, 6], [1, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]])
    groups = prompt_groups(prompts, mask)
    assert groups is not None
    # rows 0, 1 and 3 are the same left-padded prompt (padding ids do not matter); row 2 is longer
    assert groups[0] == groups[1] == groups[3] != groups[2]
    assert prompt_groups(prompts[1:3], mask[1:3]) is None  # all distinct: nothing to share


@pytest.mark.parametrize("budget", [24, 60, 100_000])
def test_split_keeps_a_prompts_rows_together_within_budget(budget: int) -> None:
    batch = trajectories_to_batch(grouped_trajectories(), pad_token_id=PAD)
    micro, rows = split_by_prompt_groups(batch, budget)
    assert sorted(r for ix in rows for r in ix) == list(range(batch.batch_size[0]))
    p_width = batch["prompts"].shape[1]
    groups = prompt_groups(batch["prompts"], batch["attention_mask"][:, :p_width]).tolist()
    for mb, ix in zip(micro, rows, strict=True):
        p = mb["prompts"].shape[1]
        distinct = len({groups[i] for i in ix})
        cost = distinct * p + len(ix) * mb["responses"].shape[1]
        assert cost <= budget or len(ix) == 1
    if budget == 100_000:  # everything fits: one micro-batch
        assert len(micro) == 1
    if budget == 60:  # each group fits alone, so none is cut
        where = {}
        for m, ix in enumerate(rows):
            for i in ix:
                where.setdefault(groups[i], set()).add(m)
        assert all(len(ms) == 1 for ms in where.values())


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("budget", [24, 100_000])
def test_log_probs_equal_the_plain_forward(
    tiny_model_dir: Path, llama_dir: Path, kind: str, budget: int
) -> None:
    batch = trajectories_to_batch(grouped_trajectories(), pad_token_id=PAD)
    out = []
    for share in (True, False):
        policy = FrozenPolicy(
            _model_dir(kind, tiny_model_dir, llama_dir),
            temperature=0.7,
            micro_batch_max_tokens=budget,
            share_prompts=share,
            **MODEL_ARGS,
        )
        assert policy.share_prompts is share
        out.append(policy.compute_log_probs_and_sum_pi_squared(batch))
        assert policy.share_prompts is share  # the first shared micro-batch passed its check
    torch.testing.assert_close(out[0][0], out[1][0], atol=2e-5, rtol=0)
    torch.testing.assert_close(out[0][1], out[1][1], atol=2e-5, rtol=0)


def _update(model_dir: Path, share: bool, **fields) -> tuple[dict[str, float], torch.Tensor]:
    cfg = actor_config(lr=1e-3, grad_clip=1e9, share_prompts=share, **fields)
    torch.manual_seed(0)  # LoRA's A matrices are random
    actor = Actor(model_dir, cfg, **MODEL_ARGS)
    trajs = grouped_trajectories(seed=3)
    batch = trajectories_to_batch(trajs, pad_token_id=PAD)
    gen = torch.Generator().manual_seed(0)
    noise = 0.2 * torch.randn(batch["responses"].shape, generator=gen)
    batch["old_log_probs"] = (actor.compute_log_probs(batch) + noise) * batch["response_mask"]
    rewards = torch.tensor([float(i % 2) for i in range(len(trajs))])
    batch["advantages"] = (rewards - rewards.mean())[:, None] * batch["response_mask"].float()
    metrics = actor.update(batch)
    grads = [p.grad.flatten() for p in actor.model.parameters() if p.grad is not None]
    return metrics, torch.cat(grads)


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("qwen2", {}),
        ("llama", {}),
        ("qwen2", {"micro_batch_max_tokens": 24}),
        ("qwen2", {"lora": experiment("model.lora.rank=4").model.lora}),
    ],
    ids=["qwen2", "llama", "qwen2-small-budget", "qwen2-lora"],
)
def test_update_equals_the_plain_forward(
    tiny_model_dir: Path, llama_dir: Path, kind: str, fields: dict
) -> None:
    model_dir = _model_dir(kind, tiny_model_dir, llama_dir)
    (shared_m, shared_g), (plain_m, plain_g) = (
        _update(model_dir, True, **fields),
        _update(model_dir, False, **fields),
    )
    assert plain_g.abs().sum() > 0
    torch.testing.assert_close(shared_g, plain_g, atol=1e-6, rtol=1e-4)
    reused = shared_m["actor/prompt_tokens_reused"]
    if "micro_batch_max_tokens" in fields:  # groups cut into chunks re-run their prompt
        assert 0 < reused < 29 / 53
    else:  # 53 prompt tokens, of which the distinct prompts are 4 + 9 + 6 + 5 = 24
        assert reused == pytest.approx(29 / 53)
    assert plain_m["actor/prompt_tokens_reused"] == 0.0
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm"):
        assert shared_m[key] == pytest.approx(plain_m[key], rel=1e-4, abs=1e-6), key


def test_a_disagreeing_shared_forward_turns_sharing_off(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = actor_module.shared_prompt_logits

    def skewed(*args, **kwargs):
        return real(*args, **kwargs) + 0.5 * torch.randn(1)

    batch = trajectories_to_batch(grouped_trajectories(), pad_token_id=PAD)
    plain = FrozenPolicy(
        tiny_model_dir, temperature=1.0, micro_batch_max_tokens=4096, **MODEL_ARGS
    ).compute_log_probs(batch)
    monkeypatch.setattr(actor_module, "shared_prompt_logits", skewed)
    policy = FrozenPolicy(
        tiny_model_dir,
        temperature=1.0,
        micro_batch_max_tokens=4096,
        share_prompts=True,
        **MODEL_ARGS,
    )
    with caplog.at_level(logging.WARNING, logger="agentrl.training.actor"):
        got = policy.compute_log_probs(batch)
    assert policy.share_prompts is False
    assert "trainer.share_prompts: turned off (logits differ by" in caplog.text
    torch.testing.assert_close(got, plain, atol=1e-6, rtol=0)


def test_windowed_or_flash_models_run_every_row_whole() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    windowed = AutoConfig.for_model(
        "qwen2",
        vocab_size=97,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        intermediate_size=64,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=0,
    )
    model = AutoModelForCausalLM.from_config(windowed)
    assert "sliding-window" in sharing_blocker(model)
    model.config._attn_implementation = "flash_attention_2"
    assert "attention" in sharing_blocker(model)


def test_the_config_knob_reaches_the_actor_and_the_reference() -> None:
    from agentrl.training.actor import ActorConfig
    from agentrl.training.algorithm import build_algorithm

    on, off = experiment(), experiment("trainer.share_prompts=false")
    assert on.trainer.share_prompts is True
    assert ActorConfig.from_config(off, build_algorithm(off.algorithm)).share_prompts is False
    assert ActorConfig.from_config(on, build_algorithm(on.algorithm)).share_prompts is True
