"""The engine's lean forward: the same logits and KV as the model's own call, on the layouts it
claims (Llama, Qwen2, Qwen3), and the model's own call for everything else."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from agentrl.inference.engine.forward import (
    HFForward,
    LeanForward,
    _allowed,
    make_forward,
)


def _tiny(kind: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        kind,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _ragged_prefill(n_rows: int = 3, width: int = 9):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (n_rows, width), generator=gen)
    mask = torch.ones(n_rows, width, dtype=torch.long)
    for i in range(n_rows):
        mask[i, : 2 * i] = 0  # left padding of 0, 2, 4 columns
    return ids, (mask.cumsum(-1) - 1).clamp(min=0), mask


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_lean_equals_the_models_own_call_on_prefill_and_decode(kind: str) -> None:
    model = _tiny(kind)
    fwd = make_forward(model)
    assert isinstance(fwd, LeanForward)
    hf = HFForward(model)
    ids, pos, mask = _ragged_prefill()
    (a, kv_a), (b, kv_b) = fwd(ids, pos, mask, None), hf(ids, pos, mask, None)
    assert torch.allclose(a, b, atol=1e-5)
    real = mask.bool()[:, None, :, None]
    for (ka, va), (kb, vb) in zip(kv_a, kv_b, strict=True):
        assert torch.allclose(ka * real, kb * real, atol=1e-5)
        assert torch.allclose(va * real, vb * real, atol=1e-5)
    for step in range(3):  # decode steps on top of each one's own cache
        tok = a.argmax(-1, keepdim=True)
        pos = pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        (a, kv_a), (b, kv_b) = fwd(tok, pos, mask, kv_a), hf(tok, pos, mask, kv_b)
        assert torch.allclose(a, b, atol=1e-5), step


def test_lean_handles_a_cache_with_holes_as_the_models_own_call(tiny_model_dir: Path) -> None:
    """The prefix-cache prefill: cached prefixes of different lengths, a gap, then suffixes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    lean, hf = make_forward(model), HFForward(model)
    assert isinstance(lean, LeanForward)
    seqs = [list(range(5, 30)), list(range(40, 52))]
    cached = [16, 4]
    past_w, suf_w = max(cached), max(len(s) - c for s, c in zip(seqs, cached, strict=True))
    full = [
        hf(torch.tensor([s[:c]]), torch.arange(c)[None], torch.ones(1, c, dtype=torch.long), None)[
            1
        ]
        for s, c in zip(seqs, cached, strict=True)
    ]
    past = []
    for layer in range(len(full[0])):
        k = torch.zeros(2, 2, past_w, full[0][layer][0].shape[-1])
        v = torch.zeros_like(k)
        for i, c in enumerate(cached):
            k[i, :, past_w - c :] = full[i][layer][0][0]
            v[i, :, past_w - c :] = full[i][layer][1][0]
        past.append((k, v))
    ids = torch.zeros(2, suf_w, dtype=torch.long)
    pos = torch.zeros(2, suf_w, dtype=torch.long)
    mask = torch.zeros(2, past_w + suf_w, dtype=torch.long)
    for i, (s, c) in enumerate(zip(seqs, cached, strict=True)):
        n = len(s) - c
        ids[i, suf_w - n :] = torch.tensor(s[c:])
        pos[i, suf_w - n :] = torch.arange(c, len(s))
        mask[i, past_w - c : past_w] = 1
        mask[i, past_w + suf_w - n :] = 1
    a, _ = lean(ids, pos, mask, past)
    b, _ = hf(ids, pos, mask, past)
    assert torch.isfinite(a).all()
    assert torch.allclose(a, b, atol=1e-5)
    for i, s in enumerate(seqs):  # and both equal each sequence run alone from scratch
        alone, _ = hf(
            torch.tensor([s]),
            torch.arange(len(s))[None],
            torch.ones(1, len(s), dtype=torch.long),
            None,
        )
        assert torch.allclose(a[i], alone[0], atol=1e-4)


def test_padded_queries_attend_to_themselves_so_nothing_is_nan() -> None:
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    allowed = _allowed(mask, 4, fresh=True)
    assert allowed is not None and allowed.shape == (2, 1, 4, 4)
    assert allowed[0, 0, 0].tolist() == [True, False, False, False]  # a padded query: itself
    assert allowed[0, 0, 3].tolist() == [False, False, True, True]
    assert (allowed[1, 0] == torch.ones(4, 4).tril().bool()).all()
    step = _allowed(torch.tensor([[0, 1, 0, 1]]), 1, fresh=False)
    assert step is not None and step[0, 0, 0].tolist() == [False, True, False, True]
    # no padding: plain causal attention (None), unless new columns follow a cache
    full = torch.ones(2, 4, dtype=torch.long)
    assert _allowed(full, 4, fresh=True) is None and _allowed(full, 1, fresh=False) is None
    after_cache = _allowed(full, 2, fresh=False)
    assert after_cache is not None and after_cache[0, 0, 0].tolist() == [True, True, True, False]


def test_anything_else_gets_the_models_own_call(monkeypatch, caplog) -> None:
    model = _tiny("qwen2")

    class Wrapper:  # a stand-in that takes the model's keywords (as tests poison models)
        config = model.config

        def __call__(self, **kw):
            return model(**kw)

    assert isinstance(make_forward(Wrapper()), HFForward)
    sliding = _tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert isinstance(make_forward(sliding), HFForward)
    monkeypatch.setenv("AGENTRL_LEAN_FORWARD", "0")
    assert isinstance(make_forward(model), HFForward)
    monkeypatch.delenv("AGENTRL_LEAN_FORWARD")

    real = LeanForward.__call__

    def off_by_a_bit(self, ids, positions, mask, past):
        logits, kv = real(self, ids, positions, mask, past)
        return logits + 0.01, kv

    monkeypatch.setattr(LeanForward, "__call__", off_by_a_bit)
    with caplog.at_level(logging.WARNING, logger="agentrl.inference.engine.forward"):
        assert isinstance(make_forward(model), HFForward)
    assert "disagrees" in caplog.text
