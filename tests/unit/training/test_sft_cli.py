"""``agentrl sft`` end to end, the shipped recipe, and the committed warm-start checkpoint."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from agentrl.cli import main
from agentrl.config import load_sft_config
from agentrl.training.sft import SFTExample, _batch_loss, _collate, _shared_prefix_len
from agentrl.training.sft_cli import MANIFEST, sha256_weights

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "configs" / "sft_calculator.yaml"
CHECKPOINT = ROOT / "checkpoints" / "calculator-sft"


def _eval_module():
    spec = importlib.util.spec_from_file_location(
        "sft_warmstart_eval", ROOT / "benchmarks" / "sft_warmstart_eval.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_trains_and_writes_a_loadable_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "sft-out"
    rc = main(
        [
            "sft",
            str(RECIPE),
            "trainer.total_steps=2",
            "data.batch_size=2",
            "data.generator_kwargs.n=4",
            "tracking.enabled=false",
            "tracking.log_every=1",
            f"trainer.output_dir={tmp_path / 'unused'}",
            "--output-dir",
            str(out),
        ]
    )
    assert rc == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["steps"] == 2
    assert manifest["num_conversations"] == 4
    assert manifest["config"]["trainer"]["total_steps"] == 2
    assert manifest["final_loss"] > 0
    assert manifest["weights_sha256"] == sha256_weights(out)
    assert set(manifest["weights_sha256"]) == {"model.safetensors"}
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    assert sum(p.numel() for p in model.parameters()) == manifest["num_params"]
    assert load_sft_config(out / "sft_config.yaml").trainer.total_steps == 2


def test_cli_rejects_unsupported_train_on(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train_on"):
        main(["sft", str(RECIPE), "data.train_on=all", "tracking.enabled=false",
              "--output-dir", str(tmp_path)])  # fmt: skip


def test_recipe_loads() -> None:
    cfg = load_sft_config(RECIPE)
    assert cfg.kind == "sft"
    assert cfg.model.path is None
    assert cfg.data.generator == "calculator"
    assert 0.0 < cfg.data.generator_kwargs["tool_fraction"] < 1.0


def test_shared_prefix_forward_matches_full_forward(tiny_model_dir: Path) -> None:
    """The prefix-cached loss equals the plain loss (same function, only gradients differ)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    prefix = list(range(40, 70))
    examples = [
        SFTExample([*prefix, 80, 81, 82, 83], [0] * 30 + [0, 1, 1, 1]),
        SFTExample([*prefix, 90, 91], [0] * 30 + [0, 1]),
        SFTExample([*prefix, 95, 96, 97], [0] * 30 + [0, 0, 1]),
    ]
    n = _shared_prefix_len(examples)
    assert n == 30
    batch = _collate(examples, pad_id=256)
    with torch.no_grad():
        full = _batch_loss(model, batch, 0)
        shared = _batch_loss(model, batch, n)
    assert torch.allclose(full, shared, atol=1e-5), (full, shared)


def test_shared_prefix_stops_before_a_loss_target() -> None:
    # Row 2's first loss token sits at position 3: the prefix must end at 2 so that position
    # 3 is predicted by trainable logits.
    a = SFTExample([1, 2, 3, 4, 5], [0, 0, 0, 1, 1])
    b = SFTExample([1, 2, 3, 4, 6], [0, 0, 0, 1, 1])
    assert _shared_prefix_len([a, b]) == 2


@pytest.mark.skipif(not (CHECKPOINT / MANIFEST).exists(), reason="checkpoint not committed")
def test_committed_checkpoint_matches_manifest_and_recipe() -> None:
    manifest = json.loads((CHECKPOINT / MANIFEST).read_text())
    assert sha256_weights(CHECKPOINT) == manifest["weights_sha256"]
    assert (CHECKPOINT / "model.safetensors").stat().st_size < 8 * 2**20
    # The checkpoint is what the committed recipe makes (same resolved config; where the metrics
    # went does not change the weights).
    made = {k: v for k, v in manifest["config"].items() if k != "tracking"}
    recipe = load_sft_config(RECIPE).model_dump(mode="json")
    recipe.pop("tracking")
    assert made == recipe
    assert manifest["steps"] == load_sft_config(RECIPE).trainer.total_steps


@pytest.mark.skipif(not (CHECKPOINT / MANIFEST).exists(), reason="checkpoint not committed")
def test_committed_checkpoint_writes_well_formed_calculator_calls() -> None:
    """When it calls the tool (greedy after the ``<tool_call>`` opener), the call parses, names
    ``calculator`` and carries an ``expression``, on held-out tasks, and the tool loop runs
    to a ``\\boxed{}`` answer, for some held-out tasks. A random model never writes the JSON."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(CHECKPOINT))
    model = AutoModelForCausalLM.from_pretrained(str(CHECKPOINT)).eval()
    torch.set_num_threads(2)
    evaluate = _eval_module().evaluate_warmstart
    # Held-out tasks: the SFT data used seed 1234.
    forced = evaluate(
        CHECKPOINT, n=8, seed=777, temperature=0.0, force_tool_call=True, model=model, tokenizer=tok
    )
    assert forced["well_formed_rate"] is not None and forced["well_formed_rate"] > 0, forced
    assert forced["boxed_rate"] is not None and forced["boxed_rate"] > 0, forced
    # Unforced and sampled, it both calls the tool and answers at once (an imperfect start).
    sampled = evaluate(CHECKPOINT, n=16, seed=777, temperature=1.0, model=model, tokenizer=tok)
    assert 0.0 < sampled["tool_call_rate"] < 1.0, sampled
