"""IS weights: every level against hand-computed values and the reference, plus properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from correction import ISLevel, is_weights

from . import reference
from .conftest import make_batch

LR = torch.tensor([[math.log(0.5), math.log(3.0), 0.0], [math.log(1.5), 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def test_token_level_hand_computed() -> None:
    w, m = is_weights(LR, MASK, "token", threshold=2.0)
    expected = torch.tensor([[0.5, 2.0, 1.0], [1.5, 0.0, 0.0]])
    torch.testing.assert_close(w, expected)
    assert m["is_weight_mean"] == pytest.approx((0.5 + 2 + 1 + 1.5) / 4)
    assert m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_weight_min"] == pytest.approx(0.5)
    assert m["is_frac_truncated"] == pytest.approx(1 / 4)
    values = torch.tensor([0.5, 2.0, 1.0, 1.5], dtype=torch.float64)
    assert m["is_weight_std"] == pytest.approx(values.std(unbiased=False).item(), rel=1e-6)
    ess = values.sum().item() ** 2 / (4 * (values**2).sum().item())
    assert m["is_ess"] == pytest.approx(ess, rel=1e-6)


def test_sequence_level_hand_computed() -> None:
    # row 0: exp(log 0.5 + log 3 + 0) = 1.5; row 1: 1.5 -> both under C = 2
    w, m = is_weights(LR, MASK, "sequence", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [1.5, 0.0, 0.0]]))
    assert m["is_weight_mean"] == pytest.approx(1.5)
    assert m["is_frac_truncated"] == 0.0
    # truncation at C = 1.2 applies to the whole sequence
    w, m = is_weights(LR, MASK, ISLevel.SEQUENCE, threshold=1.2)
    torch.testing.assert_close(w, torch.tensor([[1.2, 1.2, 1.2], [1.2, 0.0, 0.0]]))
    assert m["is_frac_truncated"] == 1.0


def test_geometric_level_hand_computed() -> None:
    w, _ = is_weights(LR, MASK, "geometric", threshold=2.0)
    g0 = 1.5 ** (1 / 3)  # geometric mean of (0.5, 3, 1)
    torch.testing.assert_close(w, torch.tensor([[g0, g0, g0], [1.5, 0.0, 0.0]]))


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.usefixtures("block_size")
def test_matches_reference(level: str, normalize: bool) -> None:
    train, rollout, mask = make_batch(batch=6, length=9, scale=0.5)
    lr = train - rollout
    w, _ = is_weights(lr, mask, level, threshold=1.3, batch_normalize=normalize)
    torch.testing.assert_close(w, reference.is_weights(lr, mask, level, 1.3, normalize))


def test_batch_normalize_factor_is_reported() -> None:
    w, m = is_weights(LR, MASK, "token", threshold=2.0, batch_normalize=True)
    assert m["is_batch_norm_factor"] == pytest.approx(5.0 / 4)
    assert (w.sum() / MASK.sum()).item() == pytest.approx(1.0)


def test_weights_are_detached_even_for_grad_inputs() -> None:
    lr = (LR.clone()).requires_grad_(True)
    w, _ = is_weights(lr, MASK, "token")
    assert not w.requires_grad


def test_bool_and_int_masks_are_accepted() -> None:
    ref, _ = is_weights(LR, MASK, "token")
    for mask in (MASK.bool(), MASK.long()):
        w, _ = is_weights(LR, mask, "token")
        torch.testing.assert_close(w, ref)


def test_bf16_input_is_computed_in_float32() -> None:
    w, _ = is_weights(LR.to(torch.bfloat16), MASK, "token")
    assert w.dtype == torch.float32


def test_invalid_level_and_threshold_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"level='tokens'.*token"):
        is_weights(LR, MASK, "tokens")
    with pytest.raises(ValueError, match="threshold must be a finite number > 0"):
        is_weights(LR, MASK, "token", threshold=0.0)


_float = st.floats(min_value=-50.0, max_value=50.0, allow_nan=False, width=32)


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    values = draw(st.lists(_float, min_size=b * t, max_size=b * t))
    bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    return torch.tensor(values).view(b, t), torch.tensor(bits, dtype=torch.float32).view(b, t)


@settings(max_examples=60, deadline=None)
@given(
    data=batches(),
    level=st.sampled_from(["token", "sequence", "geometric"]),
    c=st.floats(0.1, 10.0),
)
def test_property_weights_bounded_by_threshold_and_zero_on_padding(
    data: tuple[torch.Tensor, torch.Tensor], level: str, c: float
) -> None:
    lr, mask = data
    w, m = is_weights(lr, mask, level, threshold=c)
    assert torch.isfinite(w).all()
    assert (w <= c * (1 + 1e-6)).all()
    assert (w[mask == 0] == 0).all()
    assert (w[mask > 0] > 0).all()
    assert all(math.isfinite(v) for v in m.values())


@settings(max_examples=60, deadline=None)
@given(data=batches(), level=st.sampled_from(["token", "sequence", "geometric"]))
def test_property_batch_normalized_weights_have_mean_one(
    data: tuple[torch.Tensor, torch.Tensor], level: str
) -> None:
    lr, mask = data
    if mask.sum() == 0:
        return
    w, _ = is_weights(lr, mask, level, threshold=5.0, batch_normalize=True)
    if level == "token":
        mean = w.sum() / mask.sum()
    else:  # mean over sequences with at least one valid token of their (shared) weight
        valid = mask.sum(-1) > 0
        seq_w = w.sum(-1)[valid] / mask.sum(-1)[valid]
        mean = seq_w.mean()
    assert mean.item() == pytest.approx(1.0, rel=1e-5)
