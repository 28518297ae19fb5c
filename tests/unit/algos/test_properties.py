"""Properties of the algorithms that must hold for every input (hypothesis).

Structure (sizes, groups, micro-batch splits) is drawn by hypothesis; tensor values come from a
drawn seed so examples stay cheap to generate.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.algos import (
    AGG_MODES,
    agg_loss,
    compute_advantage,
    kl_penalty,
    loss_normalizers,
    policy_loss,
)

SETTINGS = settings(max_examples=40, deadline=None)
GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline")
LOSSES = (
    "vanilla",
    "gspo",
    "cispo",
    "reinforce",
    "dppo_tv",
    "dppo_kl",
    "sapo",
    "geo_mean",
    "dro",
    "clip_cov",
    "kl_cov",
)
KL_BASES = ("k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl")


def _batch(
    seed: int, b: int, t: int, empty_rows: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outcome rewards [b, t] with scores in hundredths, right-padded mask [b, t])."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0 if empty_rows else 1, t + 1, (b,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()
    scores = torch.randint(-300, 301, (b,), generator=g).float() / 100
    rewards = torch.zeros(b, t)
    last = (lengths - 1).clamp(min=0)
    rewards[torch.arange(b), last] = scores
    return rewards, mask


groups = st.lists(st.integers(0, 4), min_size=1, max_size=16)


@SETTINGS
@given(index=groups, seed=st.integers(0, 2**31), t=st.integers(1, 5), norm=st.booleans())
def test_grpo_rloo_gpg_advantages_have_zero_mean_within_each_group(
    index: list[int], seed: int, t: int, norm: bool
) -> None:
    rewards, mask = _batch(seed, len(index), t)
    ids = torch.tensor(index)
    runs = [
        compute_advantage("grpo", rewards, mask, index=index, norm_adv_by_std_in_grpo=norm)[0],
        compute_advantage("rloo", rewards, mask, index=index)[0],
        compute_advantage("gpg", rewards, mask, index=index)[0],
    ]
    for adv in runs:
        per_seq = adv[:, 0]  # every row has >= 1 sampled token, all of its tokens share the value
        for gid in set(index):
            assert abs(per_seq[ids == gid].mean().item()) < 1e-4


@SETTINGS
@given(index=groups, seed=st.integers(0, 2**31), t=st.integers(1, 5))
def test_a_group_of_one_gets_zero_advantage(index: list[int], seed: int, t: int) -> None:
    index = [*index, 99]  # at least one singleton
    rewards, mask = _batch(seed, len(index), t)
    singletons = torch.tensor([index.count(i) == 1 for i in index])
    for name in GROUP_ESTIMATORS:
        adv, _ = compute_advantage(name, rewards, mask, index=index)
        assert torch.equal(adv[singletons], torch.zeros_like(adv[singletons])), name
        assert torch.isfinite(adv).all(), name


@SETTINGS
@given(
    seed=st.integers(0, 2**31),
    b=st.integers(1, 6),
    t=st.integers(1, 6),
    pad_cols=st.integers(1, 5),
    pad_rows=st.integers(0, 3),
)
def test_token_mean_is_invariant_to_extra_padding(
    seed: int, b: int, t: int, pad_cols: int, pad_rows: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    _, mask = _batch(seed, b, t)
    old = -torch.rand(b, t, generator=g) * 3
    new = old + torch.randn(b, t, generator=g) * 0.5
    adv = torch.randn(b, t, generator=g)

    def pad(x: torch.Tensor, fill: float) -> torch.Tensor:
        x = torch.cat([x, torch.full((b, pad_cols), fill)], dim=1)
        return torch.cat([x, torch.full((pad_rows, t + pad_cols), fill)], dim=0)

    # junk values under the padding must not matter
    loss = torch.randn(b, t, generator=g)
    # float32 sums in another order: equal to rounding (|loss| ~ 2, a few ulps of the sum)
    assert torch.allclose(
        agg_loss(loss, mask, "token-mean"),
        agg_loss(pad(loss, 7.0), pad(mask, 0.0), "token-mean"),
        atol=1e-6,
    )
    for name in LOSSES:
        torch.manual_seed(seed)  # clip_cov draws the tokens it cuts: same draw for both calls
        base, _ = policy_loss(name, old, new, adv, mask)
        torch.manual_seed(seed)
        padded, _ = policy_loss(
            name, pad(old, -1.0), pad(new, -30.0), pad(adv, 5.0), pad(mask, 0.0)
        )
        assert torch.allclose(base, padded, atol=1e-6), name


@SETTINGS
@given(seed=st.integers(0, 2**31), base=st.sampled_from(KL_BASES), scale=st.floats(0.1, 30.0))
def test_straight_through_kl_has_the_gradient_of_k2(seed: int, base: str, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    ref = -torch.rand(3, 4, generator=g) * 5
    lp = (ref + torch.randn(3, 4, generator=g) * scale).requires_grad_(True)
    lp2 = lp.detach().clone().requires_grad_(True)
    st_kl = kl_penalty(lp, ref, base + "+")
    kl_penalty(lp2, ref, "k2").sum().backward()
    st_kl.sum().backward()
    assert lp.grad is not None and lp2.grad is not None
    torch.testing.assert_close(lp.grad, lp2.grad)
    torch.testing.assert_close(st_kl.detach(), kl_penalty(lp.detach(), ref, base))


@SETTINGS
@given(
    signs=st.lists(st.sampled_from([-50.0, 50.0, 0.0]), min_size=1, max_size=8),
    adv_seed=st.integers(0, 2**31),
    mode=st.sampled_from(AGG_MODES),
)
def test_gradients_stay_finite_for_log_ratios_of_50(
    signs: list[float], adv_seed: int, mode: str
) -> None:
    g = torch.Generator().manual_seed(adv_seed)
    t = len(signs)
    old = torch.full((2, t), -60.0)
    old[1] = -1.0
    adv = torch.randn(2, t, generator=g) * 10
    mask = torch.ones(2, t)
    for name in LOSSES:
        new = (old + torch.tensor(signs)).requires_grad_(True)
        loss, metrics = policy_loss(name, old, new, adv, mask, loss_agg_mode=mode)
        loss.backward()
        assert new.grad is not None
        assert torch.isfinite(loss), name
        assert torch.isfinite(new.grad).all(), name
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), name
    for base in KL_BASES:
        for est in (base, base + "+"):
            lp = (old + torch.tensor(signs)).requires_grad_(True)
            kl_penalty(lp, old, est).sum().backward()
            assert lp.grad is not None and torch.isfinite(lp.grad).all(), est


@SETTINGS
@given(
    seed=st.integers(0, 2**31),
    b=st.integers(2, 8),
    t=st.integers(1, 6),
    cuts=st.lists(st.integers(1, 7), max_size=3),
    mode=st.sampled_from(AGG_MODES),
)
def test_micro_batches_with_global_counts_equal_the_full_batch(
    seed: int, b: int, t: int, cuts: list[int], mode: str
) -> None:
    g = torch.Generator().manual_seed(seed)
    _, mask = _batch(seed, b, t, empty_rows=True)
    old = -torch.rand(b, t, generator=g) * 3
    new = (old + torch.randn(b, t, generator=g) * 0.3).requires_grad_(True)
    adv = torch.randn(b, t, generator=g)
    raw = torch.randn(b, t, generator=g, requires_grad=True)

    full_agg = agg_loss(raw, mask, mode, loss_scale_factor=t)
    full_pg, _ = policy_loss(
        "vanilla", old, new, adv, mask, loss_agg_mode=mode, loss_scale_factor=t
    )
    (full_agg + full_pg).backward()
    assert raw.grad is not None and new.grad is not None
    want_raw, want_new = raw.grad.clone(), new.grad.clone()
    raw.grad, new.grad = None, None

    tokens, seqs = loss_normalizers(mask)
    bounds = sorted({0, b, *(c for c in cuts if c < b)})
    total = torch.zeros(())
    for lo, hi in itertools.pairwise(bounds):
        # each micro-batch is padded only to its own longest row, as a trainer would
        width = max(int(mask[lo:hi].sum(-1).max().item()), 1)
        sl = (slice(lo, hi), slice(0, width))
        kw = {"global_tokens": tokens, "global_seqs": seqs, "loss_scale_factor": t}
        micro = agg_loss(raw[sl], mask[sl], mode, **kw)
        micro_pg, _ = policy_loss(
            "vanilla", old[sl], new[sl], adv[sl], mask[sl], loss_agg_mode=mode, **kw
        )
        (micro + micro_pg).backward()
        total = total + (micro + micro_pg).detach()
    torch.testing.assert_close(total, (full_agg + full_pg).detach(), rtol=1e-5, atol=1e-5)
    assert raw.grad is not None and new.grad is not None
    torch.testing.assert_close(raw.grad, want_raw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new.grad, want_new, rtol=1e-5, atol=1e-6)
