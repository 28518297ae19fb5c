"""Policy losses against hand-computed values and gradients on one tiny row."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.algos import POLICY_LOSSES, policy_loss, register_policy_loss

RATIOS = [1.5, 0.9, 0.5, 5.0]
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
MASK = torch.ones(1, 4)


def _logprobs(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new) with new - old = log(ratio); new requires grad."""
    old = torch.full((1, len(ratios)), -1.0)
    new = (old + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    return old, new


def test_vanilla_ppo_clip_and_dual_clip() -> None:
    old, new = _logprobs(RATIOS)
    loss, metrics = policy_loss("vanilla", old, new, ADV, MASK)
    # per token: clip(1.5)->-1.2 | -0.9 | A<0, r=.5: max(.5, .8)=.8 | A<0, r=5: min(max(5, 1.2), 3)=3
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 0.8 + 3.0) / 4)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.25)
    assert metrics["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in RATIOS) / 4, rel=1e-5)
    loss.backward()
    # only the unclipped token has a gradient: d(-A r)/dlogp = -A r = -0.9, over 4 tokens
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -0.9 / 4, 0.0, 0.0]]))


def test_vanilla_asymmetric_clip_higher() -> None:
    old, new = _logprobs([1.5])
    loss, _ = policy_loss(
        "vanilla",
        old,
        new,
        torch.ones(1, 1),
        torch.ones(1, 1),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    assert loss.item() == pytest.approx(-1.28)
    loss, _ = policy_loss("vanilla", old, new, torch.ones(1, 1), torch.ones(1, 1), clip_ratio=0.6)
    assert loss.item() == pytest.approx(-1.5)


def test_vanilla_rollout_is_weights_multiply_per_token_and_carry_no_grad() -> None:
    old, new = _logprobs(RATIOS)
    w = torch.tensor([[2.0, 1.0, 1.0, 1.0]], requires_grad=True)
    loss, _ = policy_loss("vanilla", old, new, ADV, MASK, rollout_is_weights=w)
    assert loss.item() == pytest.approx((-2.4 - 0.9 + 0.8 + 3.0) / 4)
    loss.backward()
    assert w.grad is None


def test_ppo_clip_is_vanillas_alias_and_bypass_is_not_a_loss() -> None:
    """Bypass is a correction mode (the loss anchors on π_rollout, no IS weight is passed to a
    ratio loss: ``agentrl.training.algorithm``), not a second PPO-clip implementation."""
    old, new = _logprobs(RATIOS)
    a, _ = policy_loss("vanilla", old, new, ADV, MASK)
    b, _ = policy_loss("ppo_clip", old, new, ADV, MASK)
    assert a.item() == b.item()
    with pytest.raises(ValueError, match="unknown policy loss 'bypass'"):
        policy_loss("bypass", old, new, ADV, MASK)


def test_dual_clip_bound_must_exceed_one() -> None:
    old, new = _logprobs(RATIOS)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss("vanilla", old, new, ADV, MASK, clip_ratio_c=0.5)


def test_gspo_uses_sequence_ratio_with_sequence_gradient() -> None:
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    new = torch.tensor([[-0.9, -0.7, -5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # last token is padding
    adv = torch.ones(1, 3)
    loss, metrics = policy_loss(
        "gspo", old, new, adv, mask, loss_agg_mode="seq-mean-token-mean", clip_ratio=0.5
    )
    s = math.exp((0.1 + 0.3) / 2)  # geometric mean ratio of the 2 valid tokens
    assert loss.item() == pytest.approx(-s, rel=1e-5)
    assert metrics["pg_clipfrac"] == 0.0
    loss.backward()
    # GSPO gradient: d(-A s)/dlogp_t = -A s / |y| for each valid token, 0 on padding
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([[-s / 2, -s / 2, 0.0]]))


def test_gspo_default_clip_is_the_papers_tiny_range() -> None:
    old = torch.tensor([[-1.0, -1.0]])
    new = torch.tensor([[-0.9, -0.7]], requires_grad=True)
    loss, metrics = policy_loss("gspo", old, new, torch.ones(1, 2), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-(1 + 4e-4), rel=1e-6)
    assert metrics["pg_clipfrac"] == 1.0


def test_cispo_clips_the_detached_weight_not_the_update() -> None:
    old, new = _logprobs([1.5, 0.5])
    adv = torch.tensor([[1.0, -1.0]])
    loss, metrics = policy_loss("cispo", old, new, adv, torch.ones(1, 2))
    w = [1.28, 0.5]  # default eps_high 0.28, no lower bound
    lp = new.detach()[0].tolist()
    assert loss.item() == pytest.approx((-1.0 * w[0] * lp[0] + 1.0 * w[1] * lp[1]) / 2, rel=1e-5)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    # every token keeps a gradient: -A * w / N
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([[-1.28 / 2, 0.5 / 2]]))


def test_reinforce_is_weighted_log_likelihood() -> None:
    old, new = _logprobs([2.0, 1.0])
    adv = torch.tensor([[1.0, -2.0]])
    w = torch.tensor([[0.5, 1.0]])
    loss, metrics = policy_loss("reinforce", old, new, adv, torch.ones(1, 2), rollout_is_weights=w)
    lp = new.detach()[0].tolist()
    assert loss.item() == pytest.approx((-0.5 * lp[0] + 2.0 * lp[1]) / 2, rel=1e-5)
    assert metrics["ppo_kl"] == pytest.approx(-math.log(2.0) / 2, rel=1e-5)
    loss.backward()
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([[-0.25, 1.0]]))
    gpg, _ = policy_loss("gpg", old, new, adv, torch.ones(1, 2), rollout_is_weights=w)
    assert gpg.item() == pytest.approx(loss.item())


def test_every_loss_reports_the_same_metric_keys() -> None:
    old, new = _logprobs(RATIOS)
    for name in ("vanilla", "gspo", "cispo", "reinforce"):
        _, metrics = policy_loss(name, old, new, ADV, MASK)
        assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}, name
        assert all(isinstance(v, float) for v in metrics.values())


def test_global_tokens_and_agg_mode_are_forwarded() -> None:
    old, new = _logprobs(RATIOS)
    local, _ = policy_loss("vanilla", old, new, ADV, MASK)
    scaled, _ = policy_loss("vanilla", old, new, ADV, MASK, global_tokens=8)
    assert scaled.item() == pytest.approx(local.item() / 2)
    summed, _ = policy_loss("vanilla", old, new, ADV, MASK, loss_agg_mode="seq-mean-token-sum")
    assert summed.item() == pytest.approx(local.item() * 4)


def test_padding_is_ignored() -> None:
    old, new = _logprobs(RATIOS)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    loss, metrics = policy_loss("vanilla", old, new, ADV, mask)
    assert loss.item() == pytest.approx((-1.2 - 0.9) / 2)
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_bf16_inputs_compute_in_float32() -> None:
    old, new = _logprobs(RATIOS)
    loss, _ = policy_loss(
        "vanilla", old.bfloat16(), new.bfloat16(), ADV.bfloat16(), MASK.bfloat16()
    )
    assert loss.dtype == torch.float32


def test_unknown_loss_and_option_errors_name_the_fix() -> None:
    old, new = _logprobs(RATIOS)
    with pytest.raises(ValueError, match="vanilla") as err:
        policy_loss("ppo", old, new, ADV, MASK)
    for name in ("gspo", "cispo", "reinforce"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="clip_ratio_hi"):
        policy_loss("vanilla", old, new, ADV, MASK, clip_ratio_hi=0.3)
    with pytest.raises(ValueError, match="shape"):
        policy_loss("vanilla", old, new, ADV[:, :2], MASK)


def test_register_user_policy_loss() -> None:
    @register_policy_loss("test_linear_loss")
    def linear(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean"):
        loss = -(advantages * log_prob * response_mask).sum()
        return loss, {"n": float(response_mask.sum())}

    old, new = _logprobs(RATIOS)
    loss, metrics = policy_loss("test_linear_loss", old, new, ADV, MASK)
    assert metrics == {"n": 4.0}
    assert "test_linear_loss" in POLICY_LOSSES.names()
    assert loss.item() == pytest.approx(-(ADV * new.detach()).sum().item())


def test_value_loss_clips_the_critic_update() -> None:
    from agentrl.algos import value_loss

    values = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0]])
    vpreds = torch.tensor([[2.0, 0.4]], requires_grad=True)
    loss, metrics = value_loss(vpreds, returns, values, torch.ones(1, 2), cliprange_value=0.5)
    # token 0: clip 2 -> 0.5: max((2-1)^2, (0.5-1)^2) = 1; token 1: max(0.36, 0.36) = 0.36
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.36) / 2)
    assert metrics["vf_clipfrac"] == 0.0
    loss.backward()
    assert vpreds.grad is not None
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.5 * 2 * 1.0 / 2, 0.5 * 2 * -0.6 / 2]]))
    # V=-0.2 from old 1.0 clips to 0.5; against R=-2 the clipped error (2.5²) is the larger one
    vpreds2 = torch.tensor([[-0.2]], requires_grad=True)
    _, m2 = value_loss(vpreds2, torch.tensor([[-2.0]]), torch.tensor([[1.0]]), torch.ones(1, 1))
    assert m2["vf_clipfrac"] == 1.0


def test_bypass_mode_losses_agree_with_correction_bypass_helpers() -> None:
    # correction/ keeps standalone bypass-mode helpers; the trainer's bypass path (vanilla anchored
    # on the rollout logprobs, reinforce with IS weights) must give the same numbers (vanilla
    # adds the dual clip, so switch it off for the comparison).
    import correction

    old, new = _logprobs(RATIOS)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    ours, om = policy_loss("vanilla", old, new, ADV, mask, clip_ratio=0.2, clip_ratio_c=1e9)
    theirs, tm = correction.bypass_ppo_clip_loss(new, old, ADV, mask, 0.2, 0.2)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    assert om["pg_clipfrac"] == pytest.approx(tm["pg_clipfrac"])
    assert om["ppo_kl"] == pytest.approx(tm["ppo_kl"], rel=1e-6)

    w = torch.tensor([[0.5, 1.0, 2.0, 9.0]])
    ours, _ = policy_loss("reinforce", old, new, ADV, mask, rollout_is_weights=w)
    theirs, _ = correction.bypass_reinforce_loss(new, old, ADV, mask, weights=w)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


# --- trust-region variants: dppo_tv, dppo_kl, sapo, geo_mean, dro, clip_cov, kl_cov -----------

NEW_LOSSES = ("dppo_tv", "dppo_kl", "sapo", "geo_mean", "dro", "clip_cov", "kl_cov")
P_OLD = math.exp(-2.0)  # π_old of every token in the DPPO examples


def _low_prob_logprobs(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new) at π_old = e^-2 (so π_θ = ratio · π_old stays a probability)."""
    old = torch.full((1, len(ratios)), -2.0)
    new = (old + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    return old, new


def test_dppo_tv_masks_tokens_whose_probability_moved_too_far() -> None:
    old, new = _low_prob_logprobs(RATIOS)
    loss, metrics = policy_loss("dppo_tv", old, new, ADV, MASK, clip_ratio=0.05)
    # π_θ − π_old = (ρ − 1)·e^-2 = [+0.068, −0.014, −0.068, +0.541]: token 0 (A > 0) went up by
    # more than δ = 0.05 and token 2 (A < 0) went down by more: both masked; tokens 1 and 3 keep
    # ℓ = −A · min(ρ, 20) · log π_θ
    kept = [-1.0 * 0.9 * math.log(0.9 * P_OLD), 1.0 * 5.0 * math.log(5.0 * P_OLD)]
    assert loss.item() == pytest.approx(sum(kept) / 4, rel=1e-5)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["pg_clipfrac_lower"] == 0.0
    loss.backward()
    assert new.grad is not None  # gradient −A·ρ per kept token (PPO's unclipped gradient)
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -0.9 / 4, 0.0, 5.0 / 4]]))
    # a wide region keeps every token; C = 3 truncates the IS weight of the ρ = 5 token
    new.grad = None
    loss, metrics = policy_loss("dppo_tv", old, new, ADV, MASK, clip_ratio=0.6, clip_ratio_c=3.0)
    loss.backward()
    assert metrics["pg_clipfrac"] == 0.0 and metrics["pg_clipfrac_lower"] == 0.25
    torch.testing.assert_close(new.grad, torch.tensor([[-1.5, -0.9, 0.5, 3.0]]) / 4)


def _binary_kl(p_old: float, p: float) -> float:
    return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))


def test_dppo_kl_masks_by_the_binary_kl_in_the_pushed_direction() -> None:
    old, new = _low_prob_logprobs(RATIOS)
    kl_up, kl_down = _binary_kl(P_OLD, 1.5 * P_OLD), _binary_kl(P_OLD, 0.5 * P_OLD)
    assert kl_up < 0.02 < kl_down  # 0.0156 and 0.0287
    loss, metrics = policy_loss("dppo_kl", old, new, ADV, MASK, clip_ratio=0.02)
    # token 2 (A < 0, π down, KL 0.029 > δ) is masked; token 1 moves against its advantage's
    # push and token 3 with it, so neither is constrained
    kept = [-1.5 * math.log(1.5 * P_OLD), -0.9 * math.log(0.9 * P_OLD), 5 * math.log(5 * P_OLD)]
    assert loss.item() == pytest.approx(sum(kept) / 4, rel=1e-5)
    assert metrics["pg_clipfrac"] == pytest.approx(0.25)
    loss.backward()
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([[-1.5, -0.9, 0.0, 5.0]]) / 4)


def test_sapo_gates_the_ratio_smoothly() -> None:
    old, new = _logprobs(RATIOS)
    loss, metrics = policy_loss("sapo", old, new, ADV, MASK, tau_pos=1.0, tau_neg=2.0)
    sig = [1 / (1 + math.exp(-tau * (r - 1))) for r, tau in zip(RATIOS, [1, 1, 2, 2], strict=True)]
    gates = [s * 4 / tau for s, tau in zip(sig, [1, 1, 2, 2], strict=True)]
    assert loss.item() == pytest.approx((-gates[0] - gates[1] + gates[2] + gates[3]) / 4)
    assert metrics["pg_clipfrac"] == 0.0
    loss.backward()
    # dℓ/dlog π = −A · 4σ(1 − σ) · ρ
    want = [
        -a * 4 * s * (1 - s) * r / 4 for a, s, r in zip([1, 1, -1, -1], sig, RATIOS, strict=True)
    ]
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([want]))
    # on-policy it is the plain policy gradient: gradient −A, value −A·2/τ
    lp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss("sapo", lp.detach(), lp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    loss.backward()
    assert loss.item() == pytest.approx((-2.0 + 2 / 1.05) / 2, rel=1e-5)
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, 0.5]]))


def test_geo_mean_uses_the_geometric_mean_of_clipped_token_ratios() -> None:
    old = torch.full((2, 2), -1.0)
    new = (old + torch.log(torch.tensor([[1.5, 0.9], [0.5, 5.0]]))).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, metrics = policy_loss(
        "geo_mean", old, new, adv, torch.ones(2, 2), loss_agg_mode="seq-mean-token-mean"
    )
    # seq 0 (A > 0): log ρ = [0.405 → clipped to 0.4, −0.105]; seq 1 (A < 0): [−0.693 → −0.4, 1.609]
    rho0 = math.exp((0.4 + math.log(0.9)) / 2)
    rho1 = math.exp((-0.4 + math.log(5.0)) / 2)
    assert loss.item() == pytest.approx((-rho0 + rho1) / 2, rel=1e-5)
    assert metrics["pg_clipfrac"] == 0.25 and metrics["pg_clipfrac_lower"] == 0.25
    loss.backward()
    # only unclipped tokens carry gradient: −Ā·ρ_i / n_i, then / 2 sequences
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -rho0 / 4], [0.0, rho1 / 4]]))


def test_geo_mean_takes_the_geometric_mean_of_the_is_weights() -> None:
    old, new = _logprobs([1.0, 1.0])
    w = torch.tensor([[4.0, 1.0]])
    loss, _ = policy_loss(
        "geo_mean", old, new, torch.ones(1, 2), torch.ones(1, 2), rollout_is_weights=w
    )
    assert loss.item() == pytest.approx(-2.0, rel=1e-5)  # −A · ρ · sqrt(4 · 1)


def test_dro_is_a_policy_gradient_with_a_quadratic_pull_back() -> None:
    old, new = _logprobs(RATIOS)
    loss, metrics = policy_loss("dro", old, new, ADV, MASK, dro_beta=0.5)
    terms = [
        -(a * (-1 + math.log(r)) - 0.25 * math.log(r) ** 2)
        for a, r in zip([1, 1, -1, -1], RATIOS, strict=True)
    ]
    assert loss.item() == pytest.approx(sum(terms) / 4, rel=1e-5)
    assert metrics["pg_clipfrac"] == 0.0
    loss.backward()
    want = [-(a - 0.5 * math.log(r)) / 4 for a, r in zip([1, 1, -1, -1], RATIOS, strict=True)]
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([want]))
    # at log ρ = A/β the pull-back cancels the advantage: no gradient
    lp = torch.tensor([[2.0]], requires_grad=True)
    loss, _ = policy_loss(
        "dro", torch.zeros(1, 1), lp, torch.ones(1, 1), torch.ones(1, 1), dro_beta=0.5
    )
    loss.backward()
    assert lp.grad is not None and lp.grad.abs().item() < 1e-6
    with pytest.raises(ValueError, match="dro_beta must be > 0"):
        policy_loss("dro", old, new, ADV, MASK, dro_beta=0.0)


# log π of four tokens, covariance terms (A − 0)(log π − (−2)) = [3, 0.5, 0, 4.5] with these A
COV_LP = [-0.5, -1.5, -2.5, -3.5]
COV_ADV = torch.tensor([[2.0, 1.0, 0.0, -3.0]])


def test_clip_cov_cuts_the_gradient_of_high_covariance_unclipped_tokens() -> None:
    new = torch.tensor([COV_LP], requires_grad=True)
    old = new.detach().clone()
    old[0, 3] -= math.log(0.5)  # token 3: ρ = 0.5 with A < 0, so PPO's clip already holds it
    loss, metrics = policy_loss("clip_cov", old, new, COV_ADV, MASK, clip_cov_ratio=0.25)
    # candidates in (1, 5) not ratio-clipped: token 0 only (token 3 is clipped); ⌊0.25·4⌋ = 1 cut
    assert loss.item() == pytest.approx((0.0 - 1.0 + 0.0 + 3.0 * 0.8) / 4)
    assert metrics["pg_clipfrac"] == 0.25 and metrics["cov_fraction"] == 0.25
    loss.backward()
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -0.25, 0.0, 0.0]]))
    # with no candidate inside the bounds it is PPO's clip loss (no dual clip)
    loss, metrics = policy_loss(
        "clip_cov", old, new, COV_ADV, MASK, clip_cov_lb=10.0, clip_cov_ub=20.0
    )
    assert loss.item() == pytest.approx((-2.0 - 1.0 + 0.0 + 2.4) / 4)
    assert metrics["cov_fraction"] == 0.0


def test_kl_cov_penalizes_the_log_ratio_of_the_top_covariance_tokens() -> None:
    new = torch.tensor([COV_LP], requires_grad=True)
    old = new.detach().clone()
    old[0, 3] -= 0.2  # token 3 (the largest covariance, 4.5) has log ρ = 0.2
    loss, metrics = policy_loss("kl_cov", old, new, COV_ADV, MASK, kl_cov_ratio=0.25)
    rho = math.exp(0.2)
    assert loss.item() == pytest.approx((-2.0 - 1.0 + 0.0 + 3.0 * rho + 0.1 * 0.2) / 4, rel=1e-5)
    assert metrics["cov_fraction"] == 0.25 and metrics["pg_clipfrac"] == 0.0
    loss.backward()
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([[-2.0, -1.0, 0.0, 3.0 * rho + 0.1]]) / 4)


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_new_losses_push_on_policy_tokens_along_their_advantage(name: str) -> None:
    # two one-token rows, on-policy: the gradient must raise log π where A > 0, lower it where A < 0
    lp = torch.full((2, 1), -1.0, requires_grad=True)
    loss, metrics = policy_loss(
        name, lp.detach(), lp, torch.tensor([[1.0], [-1.0]]), torch.ones(2, 1)
    )
    loss.backward()
    assert lp.grad is not None
    assert lp.grad[0, 0] < 0 < lp.grad[1, 0], name
    assert {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} <= set(metrics), name
    assert all(isinstance(v, float) for v in metrics.values()), name


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_new_losses_ignore_masked_tokens_and_give_them_no_gradient(name: str) -> None:
    old, new = _low_prob_logprobs(RATIOS)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    torch.manual_seed(0)  # clip_cov draws its tokens at random
    base, _ = policy_loss(name, old[:, :2], new[:, :2], ADV[:, :2], mask[:, :2])
    junk_new = torch.cat([new[:, :2].detach(), torch.tensor([[30.0, -80.0]])], dim=1)
    junk_new.requires_grad_(True)
    junk_adv = torch.cat([ADV[:, :2], torch.tensor([[1e6, -1e6]])], dim=1)
    torch.manual_seed(0)
    loss, metrics = policy_loss(name, old, junk_new, junk_adv, mask)
    assert loss.item() == pytest.approx(base.item(), rel=1e-5, abs=1e-7), name
    loss.backward()
    assert junk_new.grad is not None
    assert torch.equal(junk_new.grad[:, 2:], torch.zeros(1, 2)), name
    assert all(math.isfinite(v) for v in metrics.values()), name


def test_new_loss_knobs_are_checked() -> None:
    old, new = _logprobs(RATIOS)
    with pytest.raises(
        ValueError, match=r"clip_ratio_c \(the truncated-IS bound C of DPPO\) must be > 0"
    ):
        policy_loss("dppo_tv", old, new, ADV, MASK, clip_ratio_c=0.0)
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0"):
        policy_loss("sapo", old, new, ADV, MASK, tau_neg=-1.0)
    with pytest.raises(ValueError, match="clip_cov_ratio must be > 0"):
        policy_loss("clip_cov", old, new, ADV, MASK, clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="kl_cov_ratio must be > 0"):
        policy_loss("kl_cov", old, new, ADV, MASK, kl_cov_ratio=0.0)
    with pytest.raises(ValueError, match="tau_pos"):
        policy_loss("geo_mean", old, new, ADV, MASK, tau_pos=1.0)  # another loss's knob
