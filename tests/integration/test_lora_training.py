"""LoRA through ``agentrl train``: only the adapter trains and only the adapter is pushed, every
push verified on every server (the embedded server merges it onto the base it keeps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.training.trainer import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_lora_run_pushes_only_the_adapter_verified(tiny_model_dir: Path, tmp_path: Path) -> None:
    full_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    cfg = load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            f"model.path={tiny_model_dir}",
            "model.lora={rank: 4, alpha: 8}",
            f"trainer.output_dir={tmp_path}",
            "trainer.total_steps=2",
            "trainer.lr=1e-2",
            "data.batch_size=2",
            "data.n_samples=2",
            "trainer.mini_batch_size=2",
            "data.generator_val_size=2",
            "inference.num_servers=2",
            "inference.max_tokens_per_turn=16",
            "agent.max_turns=2",
            "agent.max_response_tokens=64",
            "tracking.enabled=false",
        ],
    )
    trainer = Trainer(cfg)
    result = trainer.run_sync()
    h = result.history
    assert result.steps == 2
    assert [v for _, v in h["weight_sync/lora"]] == [1.0, 1.0]
    pushed = [v for _, v in h["weight_sync/bytes"]]
    assert all(b < full_bytes / 5 for b in pushed), (pushed, full_bytes)
    assert [v for _, v in h["weight_sync/verified_servers"]] == [2.0, 2.0]
    assert all(d <= 1e-3 for _, d in h["weight_sync/verify_max_abs_diff"])
    model = trainer.actor.model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    assert 0 < trainable < total / 10  # only the adapters train
    assert h["model/trainable_params"][0][1] == trainable and h["model/params"][0][1] == total
    # the final model is the merged one (loads as a plain HF model), the adapter beside it
    assert (tmp_path / "final_model" / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "final_model" / "model.safetensors").exists()
