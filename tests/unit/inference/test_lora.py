"""LoRA payload checks and the merge (``agentrl.inference.lora``), against peft's own merge, and
the engine's adapter loads on the tiny model (base kept, nothing accumulates, bad adapters change
nothing)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from agentrl.inference.lora import LoraAdapter, LoraMerger, LoraSpec, check_adapter
from agentrl.inference.weights import WeightLoadError

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _peft(model_dir: Path, seed: int, targets=TARGETS, **kwargs):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, **kwargs)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _merged_reference(model) -> dict[str, torch.Tensor]:
    """peft's own merge of the adapter into the base weights."""
    import copy

    return {k: v.clone() for k, v in copy.deepcopy(model).merge_and_unload().state_dict().items()}


@pytest.fixture(scope="module")
def base_params(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("rslora", [False, True])
def test_the_merge_equals_peft_merge_and_unload(tiny_model_dir, base_params, rslora) -> None:
    model = _peft(tiny_model_dir, 1, use_rslora=rslora)
    adapter = LoraAdapter.from_peft(model)
    assert adapter.spec.use_rslora is rslora and adapter.spec.target_modules == tuple(
        sorted(TARGETS)
    )
    assert all(k.startswith("base_model.model.") for k in adapter.state)
    params = {k: v.clone() for k, v in base_params.items()}
    merger = LoraMerger(params)
    merger.apply(check_adapter(adapter.state, adapter.spec, params), adapter.spec)
    want = _merged_reference(model)
    for k, v in params.items():
        assert torch.allclose(v, want[k], atol=1e-6), k
    assert merger.info() == {"r": 4, "lora_alpha": 8, "modules": 2 * 3}
    scale = 8 / (math.sqrt(4) if rslora else 4)
    assert adapter.spec.scaling == pytest.approx(scale)


def test_a_second_adapter_is_merged_onto_the_base_not_the_first(tiny_model_dir, base_params):
    first, second = _peft(tiny_model_dir, 1), _peft(tiny_model_dir, 2, targets=["o_proj"])
    params = {k: v.clone() for k, v in base_params.items()}
    merger = LoraMerger(params)
    for model in (first, second):
        a = LoraAdapter.from_peft(model)
        merger.apply(check_adapter(a.state, a.spec, params), a.spec)
    want = _merged_reference(second)  # only the second adapter, on the untouched base
    for k, v in params.items():
        assert torch.allclose(v, want[k], atol=1e-6), k
    assert set(merger.base) == {k for k in params if ".o_proj." in k}  # q/v/down restored
    merger.forget()
    assert merger.spec is None and not merger.base


def _tiny_adapter() -> tuple[dict[str, torch.Tensor], LoraSpec, dict[str, torch.Tensor]]:
    params = {"m.q_proj.weight": torch.zeros(6, 5), "m.emb.weight": torch.zeros(3, 5)}
    params["m.head.weight"] = params["m.emb.weight"]  # tied
    state = {
        "base_model.model.m.q_proj.lora_A.weight": torch.ones(2, 5),
        "base_model.model.m.q_proj.lora_B.weight": torch.ones(6, 2),
    }
    return state, LoraSpec(r=2, lora_alpha=2, target_modules=("q_proj", "head")), params


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda s: s.update(
                {"base_model.model.m.q_proj.lora_embedding_A": s.pop(next(iter(s)))}
            ),
            "is not a LoRA matrix",
        ),
        (lambda s: s.pop("base_model.model.m.q_proj.lora_B.weight"), "has no lora_B.weight"),
        (
            lambda s: s.update({"base_model.model.m.q_proj.lora_A.weight": torch.ones(2, 4)}),
            r"do not fit weight \(6, 5\) at r=2",
        ),
        (
            lambda s: s.update({"base_model.model.m.q_proj.lora_A.weight": torch.ones(3, 5)}),
            "at r=2",
        ),
        (
            lambda s: s.update(
                {"base_model.model.m.q_proj.lora_B.weight": torch.full((6, 2), math.nan)}
            ),
            "non-finite",
        ),
        (
            lambda s: s.update(
                {
                    "base_model.model.m.k_proj.lora_A.weight": torch.ones(2, 5),
                    "base_model.model.m.k_proj.lora_B.weight": torch.ones(6, 2),
                }
            ),
            "not in target_modules",
        ),
        (
            lambda s: s.update(
                {
                    "base_model.model.m.head.lora_A.weight": torch.ones(2, 5),
                    "base_model.model.m.head.lora_B.weight": torch.ones(3, 2),
                }
            ),
            "is tied to another parameter",
        ),
        (lambda s: s.clear(), "has no tensors"),
    ],
)
def test_a_bad_adapter_is_refused_by_name(edit, match) -> None:
    state, spec, params = _tiny_adapter()
    check_adapter(state, spec, params)  # the unedited one is fine
    edit(state)
    with pytest.raises(WeightLoadError, match=match):
        check_adapter(state, spec, params)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"r": 0, "lora_alpha": 1, "target_modules": ["q"]}, "r=0"),
        ({"r": 2, "lora_alpha": math.inf, "target_modules": ["q"]}, "lora_alpha=inf"),
        ({"r": 2, "lora_alpha": 1, "target_modules": []}, "target_modules"),
        ({"r": 2, "lora_alpha": 1, "target_modules": ".*proj"}, "pattern"),
        ({"r": 2, "lora_alpha": 1, "target_modules": ["q"], "use_dora": True}, "use_dora"),
        (
            {"r": 2, "lora_alpha": 1, "target_modules": ["q"], "rank_pattern": {"q": 4}},
            "rank_pattern",
        ),
        ({"peft_type": "IA3", "r": 2}, "only LORA"),
        ({"lora_alpha": 1, "target_modules": ["q"]}, "missing 'r'"),
    ],
)
def test_a_bad_spec_is_refused_by_name(cfg, match) -> None:
    with pytest.raises(WeightLoadError, match=match):
        LoraSpec.from_dict(cfg)


def test_the_spec_round_trips_through_json_and_peft_config() -> None:
    spec = LoraSpec(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), use_rslora=True)
    assert LoraSpec.from_json(spec.to_json()) == spec
    assert LoraSpec.from_dict(spec.adapter_config()) == spec
    with pytest.raises(WeightLoadError, match="not valid JSON"):
        LoraSpec.from_json("{")


def test_the_engine_merges_adapters_and_a_full_load_makes_a_new_base(tiny_model_dir) -> None:
    from agentrl.inference.engine import InferenceEngine

    engine = InferenceEngine(tiny_model_dir, max_batch_size=2)
    try:
        base = {k: v.clone() for k, v in engine.model.state_dict().items()}
        model = _peft(tiny_model_dir, 3)
        adapter = LoraAdapter.from_peft(model)
        assert engine.load_lora(adapter.state, adapter.spec, 5) == 5
        want = _merged_reference(model)
        for k, v in engine.model.state_dict().items():
            assert torch.allclose(v, want[k], atol=1e-6), k
        assert engine.weight_info()["lora"] == {"r": 4, "lora_alpha": 8, "modules": 6}
        checksum = engine.weight_info(checksum=True)["checksum"]

        bad = dict(adapter.state)
        key = next(k for k in bad if k.endswith("lora_A.weight"))
        bad[key] = torch.full_like(bad[key], math.nan)
        with pytest.raises(WeightLoadError, match="non-finite"):
            engine.load_lora(bad, adapter.spec, 6)
        assert engine.weight_version == 5
        assert engine.weight_info(checksum=True)["checksum"] == checksum

        assert engine.load_state_dict(base, 7) == 7  # full weights: the new base
        assert "lora" not in engine.weight_info() and not engine.lora.base
    finally:
        engine.close()
