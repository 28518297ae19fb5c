"""logprobs_from_logits (the trainer's logprob convention) and entropy_from_logits."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.algos import entropy_from_logits, logprobs_from_logits


def test_logprobs_match_log_softmax_after_temperature() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    for temp in (1.0, 0.7, 1.3):
        expected = (
            torch.log_softmax(logits / temp, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        )
        torch.testing.assert_close(logprobs_from_logits(logits, labels, temperature=temp), expected)


def test_logprobs_hand_value() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probs 1/4, 3/4
    out = logprobs_from_logits(logits, torch.tensor([[1]]))
    assert out.item() == pytest.approx(math.log(0.75))


def test_logprobs_chunked_and_bf16_agree_with_float32() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 7, 13)
    labels = torch.randint(0, 13, (3, 7))
    full = logprobs_from_logits(logits, labels)
    torch.testing.assert_close(logprobs_from_logits(logits, labels, chunk_size=4), full)
    half = logprobs_from_logits(logits.bfloat16(), labels)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, atol=0.05, rtol=0.05)


def test_logprobs_have_gradients() -> None:
    logits = torch.randn(1, 3, 5, requires_grad=True)
    logprobs_from_logits(logits, torch.tensor([[0, 1, 2]]), chunk_size=2).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_logprobs_reject_bad_inputs() -> None:
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(
            torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), temperature=0.0
        )
    with pytest.raises(ValueError, match="vocab"):
        logprobs_from_logits(torch.zeros(1, 2, 2), torch.zeros(1, 3, dtype=torch.long))


def test_entropy_hand_values_and_stability() -> None:
    uniform = torch.zeros(2, 3, 4)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(4.0)))
    peaked = torch.tensor([[1e4, 0.0, -1e4]])
    ent = entropy_from_logits(peaked)
    assert torch.isfinite(ent).all() and ent.abs().item() < 1e-6
    two = torch.tensor([0.0, math.log(3.0)])  # p = 1/4, 3/4
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(two).item() == pytest.approx(expected, rel=1e-6)


def test_entropy_chunked_and_bf16_agree() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 6, 17)
    full = entropy_from_logits(logits)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=5), full)
    half = entropy_from_logits(logits.bfloat16())
    assert half.dtype == torch.float32 and half.shape == (4, 6)
    torch.testing.assert_close(half, full, atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)
