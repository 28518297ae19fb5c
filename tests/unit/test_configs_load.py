"""Every YAML file in configs/ loads under its schema (dispatched by its top-level `kind:`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.config import ExperimentConfig, SFTConfig, load_any_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FILES = sorted(CONFIGS.glob("*.yaml")) + sorted(CONFIGS.glob("*.yml"))


def test_configs_directory_has_the_shipped_recipes() -> None:
    names = {p.name for p in FILES}
    assert {"quickstart.yaml", "gsm8k_grpo.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_config_file_loads(path: Path, tmp_path: Path) -> None:
    cfg = load_any_config(path)
    assert isinstance(cfg, ExperimentConfig | SFTConfig)
    # the resolved config is a fixed point: dumping and loading it again changes nothing
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(cfg.to_yaml())
    assert load_any_config(resolved) == cfg
    assert cfg.flatten()
    if isinstance(cfg, ExperimentConfig):
        # the correction section (preset + explicit fields) is a valid CorrectionConfig
        cfg.algorithm.correction.to_correction_config()


def test_quickstart_is_the_cpu_async_grpo_recipe() -> None:
    cfg = load_any_config(CONFIGS / "quickstart.yaml")
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.inference.backend == "embedded" and cfg.inference.num_servers == 2
    assert cfg.algorithm.advantage.name == "grpo"
    assert cfg.trainer.max_staleness == 2
    assert cfg.algorithm.correction.preset == "bypass_ppo_clip"  # the ablation's best stale preset
    assert cfg.data.generator == "calculator" and "calculator" in cfg.tools.enabled
    assert cfg.trainer.device == "cpu" and cfg.distributed.backend == "local"


def test_gsm8k_is_a_gpu_vllm_recipe() -> None:
    cfg = load_any_config(CONFIGS / "gsm8k_grpo.yaml")
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.inference.backend == "vllm"
    assert cfg.trainer.device == "cuda" and cfg.model.dtype == "bfloat16"
    assert cfg.reward.sources["gsm8k"] == "numeric_match"


CHECKPOINT = "checkpoints/calculator-sft"


def test_quickstart_uses_the_warm_start_system_prompt() -> None:
    """RL must see the system prompt the shipped warm start was trained with."""
    from agentrl.config import load_config
    from agentrl.rollout.calculator_task import CALCULATOR_SYSTEM_PROMPT

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
    assert cfg.agent.system_prompt == CALCULATOR_SYSTEM_PROMPT
    # The turn budget fits the longest calculator call (3-digit operands) in the shipped
    # warm start's tokens, <|im_end|> included, with room to spare.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[2] / CHECKPOINT))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "999 * 999"}}\n'
    call_tokens = len(tok.encode(call + "</tool_call><|im_end|>", add_special_tokens=False))
    assert cfg.inference.max_tokens_per_turn >= 1.5 * call_tokens, call_tokens


def test_the_distillation_example_loads_and_its_pure_distillation_estimator_gives_zeros() -> None:
    import torch

    from agentrl.training.algorithm import build_algorithm

    example = CONFIGS.parent / "examples" / "distill" / "config.yaml"
    cfg = load_any_config(example)
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.teacher.enabled and cfg.teacher.mode == "advantage"
    plan = build_algorithm(cfg.algorithm, base_dir=cfg.base_dir)
    adv, returns = plan.advantage(torch.ones(2, 3), torch.ones(2, 3))
    assert not adv.any() and not returns.any()  # the teacher's term is the only signal
