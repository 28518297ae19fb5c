"""RS: every option against hand-computed values and the reference, AND-combination, rule errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from correction import RejectionRule, RSOption, rejection_mask

from . import reference
from .conftest import make_batch

# Row 0: ratios 0.4, 1.0, 2.5 (k1 = −log ρ). Row 1: ratio 1.1 then padding. Row 2: all padding.
LR = torch.tensor([[math.log(0.4), 0.0, math.log(2.5)], [math.log(1.1), 9.0, 9.0], [5.0, 5.0, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_token_k1_icepop_hand_computed() -> None:
    mask, m = rejection_mask(LR, MASK, [RejectionRule("token_k1", 2.0)])
    torch.testing.assert_close(mask, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0] * 3]))
    assert m["rs_masked_frac_token/token_k1"] == pytest.approx(2 / 4)
    assert m["rs_masked_frac_seq/token_k1"] == pytest.approx(1 / 2)
    assert m["rs_masked_frac_token"] == pytest.approx(2 / 4)
    assert m["rs_masked_frac_seq"] == pytest.approx(1 / 2)


def test_k1_bounds_are_in_ratio_space_of_rollout_over_train() -> None:
    # keep iff L <= π_rollout/π_train = exp(−ℓ) <= U. Row 0: exp(−ℓ) = 2.5, 1, 0.4.
    mask, _ = rejection_mask(LR, MASK, RejectionRule("token_k1", upper=3.0, lower=0.9))
    torch.testing.assert_close(mask[0], torch.tensor([1.0, 1.0, 0.0]))
    assert mask[1, 0] == 1.0  # exp(−log 1.1) = 0.909 >= 0.9
    mask, _ = rejection_mask(LR, MASK, RejectionRule("token_k1", upper=3.0, lower=0.95))
    assert mask[1, 0] == 0.0  # 0.909 < 0.95


def test_token_k2_and_k3_hand_computed() -> None:
    # k2 = ½ℓ²: row 0 -> 0.42, 0, 0.42; row 1 -> 0.0045
    mask, _ = rejection_mask(LR, MASK, RejectionRule(RSOption.TOKEN_K2, 0.1))
    torch.testing.assert_close(mask[:2], torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    # k3 = ρ − 1 − ℓ: row 0 -> 0.316, 0, 0.584
    mask, _ = rejection_mask(LR, MASK, RejectionRule("token_k3", 0.4))
    torch.testing.assert_close(mask[0], torch.tensor([1.0, 1.0, 0.0]))


def test_sequence_options_hand_computed() -> None:
    # seq_sum_k1 of row 0: −(log 0.4 + log 2.5) = 0 -> ratio 1, kept by [0.5, 2]
    mask, m = rejection_mask(LR, MASK, RejectionRule("seq_sum_k1", 2.0))
    torch.testing.assert_close(mask, MASK)
    assert m["rs_masked_frac_seq/seq_sum_k1"] == 0.0
    # seq_max_k2 of row 0 is ½ log(2.5)² = 0.42 > 0.1: the whole row goes
    mask, m = rejection_mask(LR, MASK, RejectionRule("seq_max_k2", 0.1))
    torch.testing.assert_close(mask, torch.tensor([[0.0] * 3, [1.0, 0.0, 0.0], [0.0] * 3]))
    assert m["rs_masked_frac_token/seq_max_k2"] == pytest.approx(3 / 4)
    assert m["rs_masked_frac_seq/seq_max_k2"] == pytest.approx(1 / 2)
    # seq_mean_k3 of row 0: (0.316 + 0 + 0.584) / 3 = 0.3 <= 0.35 kept, > 0.25 dropped
    assert rejection_mask(LR, MASK, RejectionRule("seq_mean_k3", 0.35))[0][0].sum() == 3
    assert rejection_mask(LR, MASK, RejectionRule("seq_mean_k3", 0.25))[0][0].sum() == 0


@pytest.mark.parametrize("option", [o.value for o in RSOption])
@pytest.mark.usefixtures("block_size")
def test_every_option_matches_reference(option: str) -> None:
    train, rollout, mask = make_batch(batch=7, length=6, scale=0.4, seed=3)
    lr = train - rollout
    upper = 1.3 if option.endswith("k1") else 0.08
    got, _ = rejection_mask(lr, mask, [RejectionRule(option, upper)])
    expected = reference.rs_keep(lr, mask, option, upper, None)
    torch.testing.assert_close(got, expected)
    assert got.dtype == mask.dtype


def test_geometric_rs_preset_bounds() -> None:
    lr = torch.tensor([[0.0005, -0.0005], [0.002, 0.002]])
    rule = RejectionRule("seq_mean_k1", upper=1.001, lower=0.999)
    mask, _ = rejection_mask(lr, torch.ones(2, 2), rule)
    torch.testing.assert_close(mask, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_no_rules_keeps_the_mask() -> None:
    mask, m = rejection_mask(LR, MASK, [])
    torch.testing.assert_close(mask, MASK)
    assert m == {"rs_masked_frac_token": 0.0, "rs_masked_frac_seq": 0.0}


def test_rule_errors_name_the_field_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"did you mean 'seq_mean_k3'.*valid options"):
        RejectionRule("seq_mean_k4", 1.0)
    with pytest.raises(ValueError, match="upper"):
        RejectionRule("token_k2", -1.0)
    with pytest.raises(ValueError, match="lower is only for k1"):
        RejectionRule("token_k3", 1.0, lower=0.5)
    with pytest.raises(ValueError, match="needs U >= 1"):
        RejectionRule("token_k1", 0.5)
    with pytest.raises(ValueError, match="0 < lower <= upper"):
        RejectionRule("token_k1", 2.0, lower=3.0)
    with pytest.raises(ValueError, match="two rules for token_k1"):
        rejection_mask(LR, MASK, [RejectionRule("token_k1", 2.0), RejectionRule("token_k1", 3.0)])


def test_single_k1_number_means_reciprocal_interval() -> None:
    assert RejectionRule("token_k1", 4.0) == RejectionRule(RSOption.TOKEN_K1, 4.0, 0.25)
    rule = RejectionRule("seq_sum_k1", 2.0)
    assert RejectionRule.from_dict(rule.to_dict()) == rule


_small = st.floats(min_value=-3.0, max_value=3.0, allow_nan=False, width=32)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(_small, min_size=12, max_size=12),
    bits=st.lists(st.booleans(), min_size=12, max_size=12),
    picks=st.lists(st.sampled_from(list(RSOption)), min_size=2, max_size=4, unique=True),
    upper=st.floats(1.05, 3.0),
)
def test_property_rules_and_combine(
    values: list[float], bits: list[bool], picks: list[RSOption], upper: float
) -> None:
    lr = torch.tensor(values).view(3, 4)
    mask = torch.tensor(bits, dtype=torch.float32).view(3, 4)
    rules = [RejectionRule(o, upper if o.is_k1 else upper - 1.0) for o in picks]
    combined, _ = rejection_mask(lr, mask, rules)
    expected = mask.clone()
    for rule in rules:
        alone, _ = rejection_mask(lr, mask, [rule])
        expected = expected * alone
    torch.testing.assert_close(combined, expected)
    assert (combined <= mask).all()
