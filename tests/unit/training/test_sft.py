"""Supervised warm start: assistant-only masks from the chat template, and the loss goes down."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentrl.rollout.calculator_task import calculator_tool_schemas
from agentrl.training.sft import SFTSettings, load_conversations, tokenize_conversation, train_sft

TOOLS = calculator_tool_schemas()


def _conversation(a: int, b: int) -> list[dict]:
    return [
        {"role": "user", "content": f"What is {a} * {b}?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}},
                }
            ],
        },
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"The answer is {a * b}."},
    ]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_mask_covers_exactly_the_assistant_turns(tokenizer) -> None:
    ex = tokenize_conversation(tokenizer, _conversation(12, 34), TOOLS)
    assert len(ex.input_ids) == len(ex.loss_mask)
    spans: list[list[int]] = []
    for tok, m in zip(ex.input_ids, ex.loss_mask, strict=True):
        if m and (not spans or spans[-1][-1] is None):
            spans.append([tok])
        elif m:
            spans[-1].append(tok)
        elif spans and spans[-1][-1] is not None:
            spans[-1].append(None)  # close the span
    texts = [tokenizer.decode([t for t in s if t is not None]) for s in spans]
    assert texts == [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call><|im_end|>',
        "The answer is 408.<|im_end|>",
    ]


def test_load_conversations_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "x"}]}\n{"messages": 3}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: column 'messages'"):
        load_conversations(p)
    with pytest.raises(FileNotFoundError, match=r"data\.train_files"):
        load_conversations(tmp_path / "missing.jsonl")


def test_sft_loss_decreases(tiny_model_dir: Path, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    convs = [{"messages": _conversation(a, a + 1), "tools": TOOLS} for a in (3, 5, 7, 9)]
    seen: list[float] = []
    train_sft(
        model,
        tokenizer,
        convs,
        SFTSettings(steps=40, batch_size=4, lr=3e-3, warmup_steps=5, log_every=5),
        on_log=lambda step, m: seen.append(m["sft/loss"]),
    )
    assert len(seen) == 8
    assert seen[-1] < 0.5 * seen[0], seen


def test_share_prefix_batches_each_tools_group_separately(tokenizer, tiny_model_dir, monkeypatch):
    """Conversations with and without the tools block never share a batch under share_prefix,
    and both groups are drawn."""
    from transformers import AutoModelForCausalLM

    import agentrl.training.sft as sft

    seen: list[set[bool]] = []
    collate = sft._collate

    def recording_collate(examples, pad_id):
        seen.append({"# Tools" in tokenizer.decode(e.input_ids[:200]) for e in examples})
        return collate(examples, pad_id)

    monkeypatch.setattr(sft, "_collate", recording_collate)
    convs = [
        {"messages": _conversation(i, i + 1), "tools": TOOLS if i % 2 else None}
        for i in range(10, 22)
    ]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    train_sft(model, tokenizer, convs, SFTSettings(steps=8, batch_size=3, share_prefix=True))
    assert all(len(kinds) == 1 for kinds in seen), seen
    assert {next(iter(k)) for k in seen} == {True, False}


def test_micro_batches_cover_every_row_once_within_the_token_budget() -> None:
    from agentrl.training.sft import micro_batches

    lengths = [213, 95, 210, 54, 99, 220, 60, 97]
    chunks = micro_batches(lengths, max_tokens=600)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    for c in chunks:
        assert len(c) * max(lengths[i] for i in c) <= 600
    # Long and short rows are not padded together when the budget allows both splits.
    assert all(len({lengths[i] > 150 for i in c}) == 1 for c in micro_batches(lengths, 4096))
    assert micro_batches([1200, 5], max_tokens=100) == [[0], [1]]  # a long row goes alone


def test_micro_batched_gradient_equals_the_one_batch_gradient(tiny_model_dir: Path, tokenizer):
    """Splitting a step's rows by length changes the speed, not the token-mean loss."""
    from transformers import AutoModelForCausalLM

    from agentrl.training.sft import _batch_loss, _collate, _train_batch

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    picked = [
        tokenize_conversation(tokenizer, _conversation(a, a + 1), TOOLS if a % 2 else None)
        for a in (3, 14, 159, 2653)
    ]
    settings = SFTSettings(batch_size=len(picked), micro_batch_max_tokens=200)
    loss, _ = _train_batch(model, picked, 0, torch.device("cpu"), settings)
    split = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    whole = _batch_loss(model, _collate(picked, 0), 0)
    whole.backward()
    assert loss == pytest.approx(whole.item(), rel=1e-5)
    for g_split, p in zip(split, model.parameters(), strict=True):
        assert p.grad is not None
        assert torch.allclose(g_split, p.grad, atol=1e-6, rtol=1e-4)
