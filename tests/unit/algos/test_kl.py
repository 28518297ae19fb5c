"""KL estimators, the straight-through variants, KL controllers and the reward penalty."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimator_names,
    kl_penalty,
)

LP = torch.tensor([[0.0, -1.0]])
REF = torch.tensor([[-1.0, 0.0]])  # delta = log p - log ref = [1, -1]


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("k1", "kl"), [1.0, -1.0]),
        (("k2", "mse"), [0.5, 0.5]),
        (("k3", "low_var_kl"), [math.exp(-1) - 1 + 1, math.exp(1) - 1 - 1]),
        (("abs",), [1.0, 1.0]),
    ],
)
def test_estimator_values(names: tuple[str, ...], expected: list[float]) -> None:
    for name in names:
        torch.testing.assert_close(kl_penalty(LP, REF, name), torch.tensor([expected]))


def test_k3_is_clamped_to_ten_both_ways() -> None:
    lp = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[50.0, -50.0]])
    assert torch.equal(kl_penalty(lp, ref, "k3"), torch.tensor([[10.0, 10.0]]))


@pytest.mark.parametrize("base", ["k1", "k3", "low_var_kl", "abs", "mse"])
def test_plus_variant_has_value_of_named_and_gradient_of_k2(base: str) -> None:
    lp = torch.tensor([[0.0, -1.0, -0.3]], requires_grad=True)
    ref = torch.tensor([[-1.0, 0.0, -0.3]])
    st = kl_penalty(lp, ref, base + "+")
    torch.testing.assert_close(st.detach(), kl_penalty(lp.detach(), ref, base))
    st.sum().backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, (lp - ref).detach())  # d(½δ²)/dlogp = δ


def test_unknown_estimator_lists_all_names() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'") as err:
        kl_penalty(LP, REF, "k4")
    for name in ("k1", "k2", "k3", "low_var_kl", "mse", "abs", "k3+", "low_var_kl+"):
        assert name in str(err.value)
    assert set(kl_estimator_names()) >= {"k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "k3+"}


def test_fixed_controller_never_moves() -> None:
    c = FixedKLController(0.1)
    c.update(current_kl=100.0, n_steps=64)
    assert c.value == 0.1
    with pytest.raises(ValueError, match=">= 0"):
        FixedKLController(-1.0)


def test_adaptive_controller_follows_the_ppo_rule() -> None:
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=100)
    c.update(current_kl=12.0, n_steps=10)  # error clipped to +0.2 -> x1.02
    assert c.value == pytest.approx(0.102)
    c.update(current_kl=3.0, n_steps=10)  # error -0.5 clipped to -0.2 -> x0.98
    assert c.value == pytest.approx(0.102 * 0.98)
    c.update(current_kl=6.6, n_steps=50)  # error +0.1 -> x1.05
    assert c.value == pytest.approx(0.102 * 0.98 * 1.05)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 6.0, 0)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 10)


def test_apply_kl_penalty_subtracts_beta_kl_and_updates_controller() -> None:
    scores = torch.tensor([[0.0, 1.0, 0.0]])
    lp = torch.tensor([[-1.0, -1.0, -3.0]])
    ref = torch.tensor([[-2.0, -1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.5, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, lp, ref, mask, ctrl, "k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.5, 0.75, 0.0]]))
    assert metrics["reward_kl_penalty"] == pytest.approx(0.75)
    assert metrics["reward_kl_penalty_coeff"] == 0.5  # beta used, read before the update
    assert ctrl.value == pytest.approx(0.5 * (1 + 0.2 * 1 / 10))
