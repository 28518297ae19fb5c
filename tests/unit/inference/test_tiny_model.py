"""The tiny-model builder: lossless tokenizer, prefix-stable chat template, determinism."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.inference.tiny_model import (
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
    learn_bpe_merges,
    tiny_tokenizer,
)

_TOK = build_tiny_tokenizer()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'},
            },
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "3 + 2"}},
            },
        ],
    },
    {"role": "tool", "content": "5", "tool_call_id": "call_0"},
    {"role": "tool", "content": "5", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Thanks ünïcødé 🎉"},
]


def _digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_decode_encode_roundtrip_any_unicode(text: str) -> None:
    ids = _TOK.encode(text, add_special_tokens=False)
    assert _TOK.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.text(), st.text())
def test_encoding_is_concatenative(a: str, b: str) -> None:
    # Byte-level with no merges: token deltas of later turns can be appended safely.
    joined = _TOK.encode(a + b, add_special_tokens=False)
    split = _TOK.encode(a, add_special_tokens=False) + _TOK.encode(b, add_special_tokens=False)
    if not any(t in a + b for t in SPECIAL_TOKENS):
        assert joined == split


def test_special_tokens_are_single_ids_and_eos_is_im_end() -> None:
    for i, t in enumerate(SPECIAL_TOKENS):
        assert _TOK.encode(t, add_special_tokens=False) == [256 + i]
    assert _TOK.eos_token == "<|im_end|>"
    assert _TOK.pad_token == "<|endoftext|>"
    # Tool tags survive skip_special_tokens (the chat server parses them from text).
    ids = _TOK.encode("<tool_call>x</tool_call><|im_end|>", add_special_tokens=False)
    assert _TOK.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"


def test_chat_template_renders_roles_tools_and_tool_calls() -> None:
    text = _TOK.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text
    assert (
        '<|im_start|>assistant\nLet me compute.\n<tool_call>\n{"name": "calculator", '
        '"arguments": {"expression": "2 + 3"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "calculator", "arguments": {"expression": "3 + 2"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert "<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nThanks ünïcødé 🎉<|im_end|>\n<|im_start|>assistant\n")
    # No hidden default system prompt without tools or a system message.
    plain = _TOK.apply_chat_template(CONVERSATION[1:2], tokenize=False)
    assert plain == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_is_prefix_stable(tools: list | None) -> None:
    full_text = _TOK.apply_chat_template(CONVERSATION, tools=tools, tokenize=False)
    full_ids = _TOK.encode(full_text, add_special_tokens=False)
    for k in range(1, len(CONVERSATION)):
        prefix = _TOK.apply_chat_template(CONVERSATION[:k], tools=tools, tokenize=False)
        assert full_text.startswith(prefix), k
        prefix_ids = _TOK.encode(prefix, add_special_tokens=False)
        assert full_ids[: len(prefix_ids)] == prefix_ids, k
        # The generation prompt is what the next assistant turn is appended to.
        if CONVERSATION[k]["role"] == "assistant":
            gen = _TOK.apply_chat_template(
                CONVERSATION[:k], tools=tools, tokenize=False, add_generation_prompt=True
            )
            assert full_text.startswith(gen), k


def test_builder_is_deterministic_and_loads(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    again = build_tiny_model(tmp_path / "again", seed=0)
    assert _digest(again) == _digest(tiny_model_dir)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert _digest(other)["model.safetensors"] != _digest(tiny_model_dir)["model.safetensors"]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = tiny_tokenizer(tiny_model_dir)
    cfg = model.config
    assert cfg.model_type == "qwen2" and not cfg.tie_word_embeddings
    assert cfg.hidden_size // cfg.num_attention_heads >= 32
    assert cfg.vocab_size == len(tok)
    assert (
        model.generation_config.eos_token_id
        == tok.eos_token_id
        == tok.convert_tokens_to_ids("<|im_end|>")
    )
    ids = torch.tensor([tok.encode("hello", add_special_tokens=False)])
    logits = model(ids).logits
    assert logits.shape == (1, 5, cfg.vocab_size) and torch.isfinite(logits).all()


def test_tied_embeddings_option(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = build_tiny_model(tmp_path / "tied", tie_embeddings=True, num_layers=1, seed=3)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_builder_rejects_small_head_dim(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_model(tmp_path / "bad", hidden_size=64, num_heads=4)


def test_cli_builds_a_model(tmp_path: Path) -> None:
    out = tmp_path / "cli-model"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl", "tiny-model", str(out), "--layers", "1", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"model_dir": str(out)}
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1


# ---- learned BPE merges (the quickstart's tokenizer) -------------------------------------------
def _calculator_corpus() -> list[str]:
    rows = [[*CONVERSATION[:2], {"role": "assistant", "content": "\\boxed{5}"}]] * 3
    texts = [_TOK.apply_chat_template(r, tools=TOOLS, tokenize=False) for r in rows]
    return [
        *texts,
        _TOK.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False),
        _TOK.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True),
    ]


_MERGES = learn_bpe_merges(_calculator_corpus(), 300, max_token_bytes=12)
_BPE = build_tiny_tokenizer(_MERGES)


def test_merges_are_deterministic_capped_and_never_touch_digits_or_span_newlines() -> None:
    assert learn_bpe_merges(_calculator_corpus(), 300, max_token_bytes=12) == _MERGES
    assert 50 < len(_MERGES) <= 300
    # A prefix of the merge list is what a smaller budget learns (greedy, one at a time).
    assert learn_bpe_merges(_calculator_corpus(), 20, max_token_bytes=12) == _MERGES[:20]
    for a, b in _MERGES:
        token = a + b
        assert len(token) <= 12
        assert not any(c.isdigit() for c in token), token
        # "\n" is "Ċ" in the ByteLevel alphabet: a token may end in line breaks, never go on
        # past one into the next line's text.
        if "Ċ" in token:
            assert set(token[token.index("Ċ") :]) <= {"Ċ", "č"}, token
    vocab = _BPE.get_vocab()
    assert len(_BPE) == 256 + len(SPECIAL_TOKENS) + len({a + b for a, b in _MERGES})
    assert all(vocab[t] == 256 + i for i, t in enumerate(SPECIAL_TOKENS))


def test_merges_shorten_the_prompt_and_numbers_stay_one_token_per_digit() -> None:
    text = _TOK.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    ids = _BPE.encode(text, add_special_tokens=False)
    assert len(ids) < len(_TOK.encode(text, add_special_tokens=False)) / 3
    assert _BPE.decode(ids) == text
    ids = _BPE.encode("What is 4821 * 37?", add_special_tokens=False)
    pieces = [_BPE.decode([i]) for i in ids]
    assert pieces[pieces.index("4") : pieces.index("4") + 4] == ["4", "8", "2", "1"]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_merged_tokenizer_is_lossless_on_any_unicode(text: str) -> None:
    assert _BPE.decode(_BPE.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_merged_tokenizer_keeps_the_template_prefix_stable(tools: list | None) -> None:
    # Turn boundaries end in a newline or a special token, and no merge spans either, so the
    # agent loop's and SFT's token deltas line up with the whole conversation's tokens.
    full = _BPE.encode(
        _BPE.apply_chat_template(CONVERSATION, tools=tools, tokenize=False),
        add_special_tokens=False,
    )
    for k in range(1, len(CONVERSATION)):
        gen = _BPE.apply_chat_template(
            CONVERSATION[:k], tools=tools, tokenize=False, add_generation_prompt=True
        )
        prefix = _BPE.encode(gen, add_special_tokens=False)
        if CONVERSATION[k]["role"] == "assistant":
            assert full[: len(prefix)] == prefix, k


def test_builder_with_merges_sizes_the_vocab_and_vllm_shapes(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = build_tiny_model(tmp_path / "bpe", num_layers=1, merges=_MERGES)
    tok = tiny_tokenizer(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(tok) == len(_BPE)
    text = _TOK.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert tok.encode(text, add_special_tokens=False) == _BPE.encode(text, add_special_tokens=False)
    assert _digest(build_tiny_model(tmp_path / "again", num_layers=1, merges=_MERGES)) == _digest(
        out
    )
    # AutoTokenizer swaps in Qwen2Tokenizer's own pre-tokenizer; it must be the one we built.
    loaded = json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"]
    assert loaded == json.loads(_BPE.backend_tokenizer.to_str())["pre_tokenizer"]


def test_merge_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="num_merges"):
        learn_bpe_merges([], -1)
    with pytest.raises(ValueError, match="max_token_bytes"):
        learn_bpe_merges([], 1, max_token_bytes=1)
    with pytest.raises(ValueError, match="no earlier merge"):
        build_tiny_tokenizer([("ab", "c")])
