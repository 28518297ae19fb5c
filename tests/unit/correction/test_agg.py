"""agg_loss: the four modes against hand-computed values, padding, empty batches, accumulation."""

import pytest
import torch

from correction import LOSS_AGG_MODES, agg_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),  # the all-padding row is not a sequence
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 / 3 + 4 / 3) / 2),
    ],
)
def test_modes_match_hand_computed(mode: str, expected: float) -> None:
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_padding_values_do_not_leak_even_if_nan() -> None:
    poisoned = LOSS.clone()
    poisoned[MASK == 0] = float("nan")
    for mode in LOSS_AGG_MODES:
        assert agg_loss(poisoned, MASK, mode).item() == pytest.approx(
            agg_loss(LOSS, MASK, mode).item()
        )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_mask_gives_zero_loss_with_zero_grad(mode: str) -> None:
    loss_mat = torch.randn(2, 4, requires_grad=True)
    loss = agg_loss(loss_mat, torch.zeros(2, 4), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert loss_mat.grad is not None and torch.equal(loss_mat.grad, torch.zeros(2, 4))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_accumulation_with_global_counts_equals_full_batch(mode: str) -> None:
    torch.manual_seed(0)
    loss_mat = torch.randn(4, 5, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    full = agg_loss(loss_mat, mask, mode, loss_scale_factor=5)
    n_tok = mask.sum()
    n_seq = (mask.sum(-1) > 0).sum()
    parts = [
        agg_loss(loss_mat[i : i + 2], mask[i : i + 2], mode, n_tok, n_seq, loss_scale_factor=5)
        for i in (0, 2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-6)


def test_unknown_mode_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, MASK, "token_mean")


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        agg_loss(LOSS, MASK[:, :2])
