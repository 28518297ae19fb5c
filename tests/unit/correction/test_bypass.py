"""Bypass-mode losses: hand-computed values, gradients at extreme ratios, padding isolation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from correction import LOSS_AGG_MODES, bypass_ppo_clip_loss, bypass_reinforce_loss, is_weights

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
ROLLOUT = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.5, 0.5]]))
ADV = torch.tensor([[1.0, -1.0, 7.0], [2.0, 7.0, 7.0]])


def test_ppo_clip_hand_computed() -> None:
    # ratios r = π_θ / π_rollout = 1.5, 0.5 | 1.1
    log_prob = torch.log(torch.tensor([[0.75, 0.25, 0.5], [0.44, 0.5, 0.5]])).requires_grad_(True)
    loss, m = bypass_ppo_clip_loss(log_prob, ROLLOUT, ADV, MASK, 0.2, 0.2)
    # token losses: max(−A r, −A clip(r)) = max(−1.5, −1.2) = −1.2 ; max(0.5, 0.8) = 0.8 ;
    # max(−2.2, −2.2) = −2.2
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2) / 3, rel=1e-5)
    assert m["pg_clipfrac"] == pytest.approx(2 / 3)
    assert m["ppo_kl"] == pytest.approx(
        -(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3, rel=1e-5
    )
    loss.backward()
    assert log_prob.grad is not None
    # clipped tokens have zero gradient; the unclipped one has d(−A r)/d log π = −A r
    torch.testing.assert_close(
        log_prob.grad,
        torch.tensor([[0.0, 0.0, 0.0], [-2.0 * 1.1 / 3, 0.0, 0.0]]),
        rtol=1e-5,
        atol=1e-6,
    )


def test_reinforce_hand_computed_with_weights() -> None:
    log_prob = torch.log(torch.tensor([[0.75, 0.25, 0.5], [0.44, 0.5, 0.5]])).requires_grad_(True)
    weights = torch.tensor([[2.0, 0.5, 9.0], [1.0, 9.0, 9.0]], requires_grad=True)
    loss, m = bypass_reinforce_loss(log_prob, ROLLOUT, ADV, MASK, weights, "token-mean")
    lp = log_prob.detach()
    expected = -(1.0 * lp[0, 0] * 2.0 + (-1.0) * lp[0, 1] * 0.5 + 2.0 * lp[1, 0] * 1.0) / 3
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert m["is_weight_mean"] == pytest.approx((2.0 + 0.5 + 1.0) / 3)
    loss.backward()
    assert weights.grad is None  # stop-gradient on w
    assert log_prob.grad is not None
    torch.testing.assert_close(
        log_prob.grad, torch.tensor([[-2.0 / 3, 0.5 / 3, 0.0], [-2.0 / 3, 0.0, 0.0]])
    )


def test_reinforce_without_weights_is_plain_policy_gradient() -> None:
    log_prob = torch.log(torch.tensor([[0.75, 0.25, 0.5], [0.44, 0.5, 0.5]]))
    loss, m = bypass_reinforce_loss(log_prob, ROLLOUT, ADV, MASK, None, "seq-mean-token-sum")
    expected = (-(log_prob[0, 0] - log_prob[0, 1]) - 2.0 * log_prob[1, 0]) / 2
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert m["is_weight_mean"] == 1.0


@pytest.mark.parametrize("shift", [50.0, -50.0])
@pytest.mark.parametrize("which", ["ppo", "reinforce"])
def test_gradients_stay_finite_for_extreme_log_ratios(shift: float, which: str) -> None:
    rollout = torch.full((2, 4), -3.0)
    log_prob = (rollout + shift).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0, -2.0], [0.5, 0.5, -0.5, -0.5]])
    mask = torch.ones(2, 4)
    if which == "ppo":
        loss, m = bypass_ppo_clip_loss(log_prob, rollout, adv, mask)
    else:
        w, _ = is_weights(log_prob.detach() - rollout, mask, "token", threshold=2.0)
        loss, m = bypass_reinforce_loss(log_prob, rollout, adv, mask, w)
    loss.backward()
    assert math.isfinite(loss.item())
    assert log_prob.grad is not None and torch.isfinite(log_prob.grad).all()
    assert all(math.isfinite(v) for v in m.values())


def test_nan_in_padding_does_not_reach_loss_or_gradient() -> None:
    log_prob = torch.log(torch.tensor([[0.75, 0.25, 0.5], [0.44, 0.5, 0.5]]))
    log_prob[0, 2] = math.nan
    log_prob[1, 1:] = -math.inf
    log_prob.requires_grad_(True)
    adv = ADV.clone()
    adv[1, 2] = math.nan
    loss, _ = bypass_ppo_clip_loss(log_prob, ROLLOUT, adv, MASK)
    loss.backward()
    assert math.isfinite(loss.item())
    assert log_prob.grad is not None and torch.isfinite(log_prob.grad).all()


def test_nonfinite_on_a_response_token_is_an_error() -> None:
    log_prob = ROLLOUT.clone()
    log_prob[1, 0] = -math.inf
    with pytest.raises(
        ValueError, match=r"log_prob has a non-finite value \(-inf\) at \[b, t\] = \[1, 0\]"
    ):
        bypass_ppo_clip_loss(log_prob, ROLLOUT, ADV, MASK)
    adv = ADV.clone()
    adv[0, 1] = math.nan
    with pytest.raises(ValueError, match=r"advantages .*\[0, 1\]"):
        bypass_reinforce_loss(ROLLOUT, ROLLOUT, adv, MASK)


@settings(max_examples=40, deadline=None)
@given(
    log_ratios=st.lists(st.floats(-50.0, 50.0, allow_nan=False, width=32), min_size=8, max_size=8),
    advantages=st.lists(st.floats(-5.0, 5.0, allow_nan=False, width=32), min_size=8, max_size=8),
    mode=st.sampled_from(LOSS_AGG_MODES),
)
def test_property_gradients_finite_for_log_ratios_up_to_50(
    log_ratios: list[float], advantages: list[float], mode: str
) -> None:
    rollout = torch.full((2, 4), -2.0)
    log_prob = (rollout + torch.tensor(log_ratios).view(2, 4)).requires_grad_(True)
    adv = torch.tensor(advantages).view(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    w, _ = is_weights(log_prob.detach() - rollout, mask, "sequence", threshold=2.0)
    for loss, _ in (
        bypass_ppo_clip_loss(log_prob, rollout, adv, mask, loss_agg_mode=mode),
        bypass_reinforce_loss(log_prob, rollout, adv, mask, w, loss_agg_mode=mode),
    ):
        (grad,) = torch.autograd.grad(loss, log_prob)
        assert math.isfinite(loss.item())
        assert torch.isfinite(grad).all()
        assert (grad[mask == 0] == 0).all()
