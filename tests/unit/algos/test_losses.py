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


def test_bypass_is_ppo_clip_and_refuses_is_weights() -> None:
    old, new = _logprobs(RATIOS)
    a, _ = policy_loss("vanilla", old, new, ADV, MASK)
    b, _ = policy_loss("bypass", old, new, ADV, MASK)
    assert a.item() == pytest.approx(b.item())
    with pytest.raises(ValueError, match="twice"):
        policy_loss("bypass", old, new, ADV, MASK, rollout_is_weights=torch.ones(1, 4))


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
    for name in ("vanilla", "gspo", "cispo", "bypass", "reinforce"):
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
    for name in ("gspo", "cispo", "bypass", "reinforce"):
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


def test_bypass_and_reinforce_agree_with_correction_bypass_losses() -> None:
    # correction/ owns the bypass-mode helpers; our registered losses must give the same numbers
    # (ours adds the dual clip, so switch it off for the comparison).
    import correction

    old, new = _logprobs(RATIOS)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    ours, om = policy_loss("bypass", old, new, ADV, mask, clip_ratio=0.2, clip_ratio_c=1e9)
    theirs, tm = correction.bypass_ppo_clip_loss(new, old, ADV, mask, 0.2, 0.2)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    assert om["pg_clipfrac"] == pytest.approx(tm["pg_clipfrac"])
    assert om["ppo_kl"] == pytest.approx(tm["ppo_kl"], rel=1e-6)

    w = torch.tensor([[0.5, 1.0, 2.0, 9.0]])
    ours, _ = policy_loss("reinforce", old, new, ADV, mask, rollout_is_weights=w)
    theirs, _ = correction.bypass_reinforce_loss(new, old, ADV, mask, weights=w)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
