"""Off-policy diagnostics against the loop reference and hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from correction import DIAGNOSTIC_NAMES, offpolicy_metrics

from . import reference
from .conftest import make_batch


@pytest.mark.usefixtures("block_size")
def test_matches_reference_float64() -> None:
    train, rollout, mask = make_batch(batch=6, length=8, scale=0.3, seed=1)
    got = offpolicy_metrics(train, rollout, mask)
    expected = reference.diagnostics(train, rollout, mask)
    assert set(got) == set(DIAGNOSTIC_NAMES)
    for name in DIAGNOSTIC_NAMES:
        assert got[name] == pytest.approx(expected[name], rel=1e-9, abs=1e-12), name


def test_matches_reference_float32_within_rounding() -> None:
    train, rollout, mask = make_batch(batch=6, length=8, scale=0.3, seed=2)
    got = offpolicy_metrics(train.float(), rollout.float(), mask.float())
    expected = reference.diagnostics(train, rollout, mask)
    for name in DIAGNOSTIC_NAMES:
        assert got[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name


def test_hand_computed_single_sequence() -> None:
    # One sequence, two tokens: train = log(0.5), log(0.25); rollout = log(0.25), log(0.25)
    train = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    rollout = torch.tensor([[math.log(0.25), math.log(0.25)]], dtype=torch.float64)
    m = offpolicy_metrics(train, rollout, torch.ones(1, 2))
    lr = [math.log(2.0), 0.0]
    assert m["kl"] == pytest.approx(-math.log(2.0) / 2)
    assert m["k3_kl"] == pytest.approx((2 - 1 - math.log(2.0)) / 2)
    assert m["training_ppl"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.25)) / 2))
    assert m["rollout_ppl"] == pytest.approx(4.0)
    assert m["log_ppl_diff"] == pytest.approx(-sum(lr) / 2)
    assert m["log_ppl_abs_diff"] == pytest.approx(sum(lr) / 2)
    assert m["ppl_ratio"] == pytest.approx(m["training_ppl"] / m["rollout_ppl"])
    assert m["chi2_token"] == pytest.approx((4 + 1) / 2 - 1)
    assert m["chi2_seq"] == pytest.approx(4 - 1)


def test_on_policy_is_exactly_zero_divergence() -> None:
    _, rollout, mask = make_batch(seed=4)
    m = offpolicy_metrics(rollout.clone(), rollout, mask)
    for name in ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq"):
        assert m[name] == 0.0, name
    assert m["ppl_ratio"] == 1.0


def test_no_valid_token_gives_zeros() -> None:
    m = offpolicy_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert m == dict.fromkeys(DIAGNOSTIC_NAMES, 0.0)


def test_errors_name_the_bad_input() -> None:
    train, rollout, mask = make_batch(seed=5)
    bad = rollout.clone()
    bad[1, 0] = -math.inf
    with pytest.raises(ValueError, match=r"rollout_log_probs .*\[b, t\] = \[1, 0\]"):
        offpolicy_metrics(train, bad, mask)
    bad = train.clone()
    bad[3, 0] = math.nan
    with pytest.raises(ValueError, match=r"train_log_probs .*\[b, t\] = \[3, 0\]"):
        offpolicy_metrics(bad, rollout, mask)
