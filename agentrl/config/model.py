"""The ``model`` sections: the policy of an RL run (with LoRA) and the model an SFT run tunes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agentrl.config.section import Section

__all__ = [
    "LoraSection",
    "ModelConfig",
    "PolicyModelConfig",
    "SFTModelConfig",
    "TinyModelConfig",
]


class LoraSection(Section):
    """LoRA adapters on the policy (peft): train and push only the adapter."""

    rank: int = Field(default=0, ge=0)
    """Adapter rank r; 0 = full fine-tuning (no LoRA)."""
    alpha: float = Field(default=16.0, gt=0)
    """Scaling numerator: the update is (alpha / r) · B A (alpha / sqrt(r) with `use_rslora`)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Names of the linear layers that get adapters (Qwen2/Llama names)."""
    use_rslora: bool = False
    """Rank-stabilized scaling alpha / sqrt(r)."""


class ModelConfig(Section):
    """The policy model."""

    path: str | None = None
    """HF model directory (or hub id); None = the tiny random test model (`agentrl tiny-model`)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Training/inference dtype; auto = float32 on CPU, bfloat16 on GPU."""
    trust_remote_code: bool = False
    """Allow model code from the model directory (needed by some HF architectures)."""


class PolicyModelConfig(ModelConfig):
    """The policy model of an RL run (its weights train; the servers get each version)."""

    lora: LoraSection = Field(default_factory=LoraSection)
    """LoRA adapters (rank 0 = off); the servers get adapter-only pushes."""


class TinyModelConfig(Section):
    """Shape of the tiny model built when `model.path` is null (`agentrl tiny-model`)."""

    num_layers: int = Field(default=2, ge=1)
    """Decoder layers."""
    hidden_size: int = Field(default=128, ge=32)
    """Model width (hidden_size / num_heads >= 32 for vLLM's CPU attention)."""
    num_heads: int = Field(default=4, ge=1)
    """Attention heads."""
    num_kv_heads: int = Field(default=2, ge=1)
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = Field(default=256, ge=1)
    """MLP width."""
    seed: int = 0
    """Weight-init seed (the built model is deterministic for it)."""
    bpe_merges: int = Field(default=0, ge=0)
    """BPE merges learned from the SFT conversations (digits never merge); 0 = one token per byte."""
    bpe_max_token_bytes: int = Field(default=16, ge=2)
    """Longest token, in bytes, that a learned merge may make."""
    bpe_corpus_size: int = Field(default=1000, ge=1)
    """How many of the SFT conversations (the first ones) the merges are learned from."""


class SFTModelConfig(ModelConfig):
    """The model to fine-tune: an HF directory, or the tiny model built from `tiny`."""

    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Shape of the tiny model used when `path` is null."""
