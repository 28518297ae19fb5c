"""FSDP2 helpers that need no process group: layer discovery, precision defaults, tied names.

The data-parallel math itself (two real gloo ranks against one process) is in
``tests/integration/test_fsdp.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentrl.training.fsdp import (
    DistContext,
    _tied_duplicates,
    decoder_layers,
    default_mixed_precision,
)


def _load(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def test_decoder_layers_are_the_hf_layer_list(tiny_model_dir: Path) -> None:
    model = _load(tiny_model_dir)
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    assert all(a is b for a, b in zip(layers, model.model.layers, strict=True))


def test_decoder_layers_error_names_the_model_class() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"Sequential.*_no_split_modules"):
        decoder_layers(model)


def test_mixed_precision_defaults() -> None:
    cuda = default_mixed_precision("cuda")
    assert cuda.param_dtype == torch.bfloat16 and cuda.reduce_dtype == torch.float32
    cpu = default_mixed_precision("cpu")
    assert cpu.param_dtype is None and cpu.reduce_dtype is None


def test_tied_lm_head_is_pushed_once(tmp_path: Path) -> None:
    from agentrl.inference.tiny_model import build_tiny_model

    tied = _load(build_tiny_model(tmp_path / "tied", seed=0, tie_embeddings=True))
    assert _tied_duplicates(tied) == {"lm_head.weight"}
    untied = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert _tied_duplicates(untied) == set()


def test_dist_context_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_distributed"):
        DistContext.current("cpu")
