"""``agentrl sft`` end to end, the shipped recipe, and the committed warm-start checkpoint."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from agentrl.cli import main
from agentrl.config import SFTTrainerConfig, load_sft_config
from agentrl.training.sft import SFTExample, _batch_loss, _collate, _shared_prefix_len
from agentrl.training.sft_cli import MANIFEST, sha256_weights

ROOT = Path(__file__).resolve().parents[3]
STAGE1 = ROOT / "configs" / "sft_calculator_tool.yaml"
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
    """Stage 1 of the recipe (tiny model, merges learned from its data), then stage 2 from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def sft(recipe: Path, out: Path, *overrides: str) -> None:
        tiny = ["data.batch_size=2", "data.generator_kwargs.n=4", "tracking.enabled=false"]
        unused = f"trainer.output_dir={tmp_path / 'unused'}"
        assert main(["sft", str(recipe), *tiny, unused, *overrides, "--output-dir", str(out)]) == 0

    out = tmp_path / "sft-out"
    sft(STAGE1, out, "trainer.total_steps=2", "tracking.log_every=1")
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
    # The learned merges: words of the tools prompt are single tokens, digits stay single.
    assert len(tok) > 300 and model.config.vocab_size == len(tok)
    pieces = [tok.decode([i]) for i in tok.encode(" calculator 417", add_special_tokens=False)]
    assert pieces == [" calculator", " ", "4", "1", "7"]

    # Stage 2 starts from stage 1's output and keeps its manifest as provenance.
    final = tmp_path / "sft-final"
    sft(RECIPE, final, f"model.path={out}", "trainer.total_steps=1")
    final_manifest = json.loads((final / MANIFEST).read_text())
    assert final_manifest["init_manifest"] == manifest
    assert len(AutoTokenizer.from_pretrained(str(final))) == len(tok)


def test_cli_rejects_unsupported_train_on(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train_on"):
        main(["sft", str(RECIPE), "data.train_on=all", "tracking.enabled=false",
              "--output-dir", str(tmp_path)])  # fmt: skip


def test_recipe_loads() -> None:
    first, second = load_sft_config(STAGE1), load_sft_config(RECIPE)
    assert first.kind == second.kind == "sft"
    assert first.model.path is None and first.model.tiny.bpe_merges > 0
    assert first.data.generator == second.data.generator == "calculator"
    # Stage 1 always uses the tool; stage 2 starts from it and mixes in wrong guesses.
    assert first.data.generator_kwargs["tool_fraction"] == 1.0
    assert second.model.path == first.trainer.output_dir
    assert 0.0 < second.data.generator_kwargs["tool_fraction"] < 0.5
    assert first.data.generator_kwargs["seed"] != second.data.generator_kwargs["seed"]


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
    for made_by, recipe_file in ((manifest, RECIPE), (manifest["init_manifest"], STAGE1)):
        made = {k: v for k, v in made_by["config"].items() if k != "tracking"}
        # Keys the SFT trainer never read (trainer.val_every / save_every) were removed from
        # the schema after this checkpoint was made; they did not change the weights.
        made["trainer"] = {
            k: v for k, v in made["trainer"].items() if k in SFTTrainerConfig.model_fields
        }
        recipe = load_sft_config(recipe_file).model_dump(mode="json")
        recipe.pop("tracking")
        assert made == recipe, recipe_file.name
        assert made_by["steps"] == load_sft_config(recipe_file).trainer.total_steps


@pytest.mark.skipif(not (CHECKPOINT / MANIFEST).exists(), reason="checkpoint not committed")
def test_committed_checkpoint_writes_well_formed_calculator_calls() -> None:
    """Held-out tasks through the real tool loop: forced to open a call, the checkpoint writes a
    well-formed ``calculator`` call with the user's expression and answers the tool's result;
    left alone it mostly guesses. A random model never writes the JSON."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(CHECKPOINT))
    model = AutoModelForCausalLM.from_pretrained(str(CHECKPOINT)).eval()
    torch.set_num_threads(2)
    evaluate = _eval_module().evaluate_warmstart
    # Held-out tasks: the SFT data used seed 1234.
    forced = evaluate(
        CHECKPOINT,
        n=16,
        seed=777,
        temperature=0.0,
        force_tool_call=True,
        model=model,
        tokenizer=tok,
    )
    # When it calls the tool it copies the expression and the result (RL has something to find).
    assert forced["well_formed_rate"] == 1.0, forced
    assert forced["expression_correct_rate"] >= 0.75, forced
    assert forced["accuracy"] >= 0.5, forced
    # Unforced, it mostly guesses: greedy never opens a call, sampling sometimes does (an
    # imperfect start that GRPO improves by calling the tool more often).
    greedy = evaluate(CHECKPOINT, n=16, seed=777, temperature=0.0, model=model, tokenizer=tok)
    assert greedy["tool_call_rate"] <= 0.25 and greedy["accuracy"] <= 0.25, greedy
    sampled = evaluate(CHECKPOINT, n=32, seed=777, temperature=1.0, model=model, tokenizer=tok)
    assert 0.0 < sampled["tool_call_rate"] < 0.6, sampled
