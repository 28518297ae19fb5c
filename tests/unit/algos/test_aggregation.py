"""agg_loss (shared with ``correction``): the four modes by hand, global normalizers, empty batches."""

from __future__ import annotations

import pytest
import torch

import correction
from agentrl.algos import AGG_MODES, agg_loss, loss_normalizers

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 3: no tokens


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 10 / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / (2 * 3)),
    ],
)
def test_modes_by_hand(mode: str, expected: float) -> None:
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_norm_length_is_the_constant_divisor() -> None:
    out = agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=5)
    assert out.item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=0)


def test_global_counts_replace_local_ones() -> None:
    assert agg_loss(LOSS, MASK, "token-mean", global_tokens=10).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", global_seqs=5).item() == pytest.approx(2.0)
    assert loss_normalizers(MASK) == (4, 2)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_empty_mask_gives_zero_with_graph(mode: str) -> None:
    loss_mat = torch.ones(2, 3, requires_grad=True)
    out = agg_loss(loss_mat, torch.zeros(2, 3), mode)
    assert out.item() == 0.0
    out.backward()
    assert loss_mat.grad is not None and torch.equal(loss_mat.grad, torch.zeros(2, 3))


def test_is_the_correction_package_function() -> None:
    # One implementation for the trainer and correction's bypass losses.
    assert agg_loss is correction.agg_loss


def test_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-mean") as err:
        agg_loss(LOSS, MASK, "seq-mean")
    assert "token-mean" in str(err.value)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")
