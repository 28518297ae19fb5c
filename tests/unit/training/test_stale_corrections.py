"""``train_step`` with the newer off-policy variants (OPSM, M2PO, staleness RS, loglinear π_old),
on the scripted fake actor of ``test_step``: what each masks, what it needs, what it logs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import correction
from agentrl.training.step import Policies, train_step
from tests.fakes import random_trajectories
from tests.unit.training.test_step import FakeActor, plan_of


class AnchoringFakeActor(FakeActor):
    """The fake actor, also taking the in-update π_old (``anchor=``) the real one takes."""

    def __init__(self, shift: float) -> None:
        super().__init__(shift)
        self.anchor: Any = None

    def update_with_log_probs(
        self, batch: TensorDict, *, anchor: Any = None
    ) -> tuple[dict[str, float], torch.Tensor]:
        self.anchor = anchor
        return super().update_with_log_probs(batch)


def _trajs(stale_rows: dict[int, int] | None = None) -> list[Any]:
    """Six trajectories sampled at version 0, except ``{row: version}``."""
    trajs = random_trajectories(6)
    for row, v in (stale_rows or {}).items():
        t = trajs[row]
        t.policy_version = [v if m else -1 for m in t.loss_mask]
    return trajs


async def _step(preset: str, actor: FakeActor, *extra: str, **kwargs: Any) -> Any:
    plan = plan_of(f"algorithm.correction.preset={preset}", *extra)
    trajs = kwargs.pop("trajs", None) or _trajs()
    return await train_step(trajs, Policies(actor), plan, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("preset", ["decoupled_token_is_opsm", "bypass_ppo_clip_opsm"])
async def test_opsm_drops_only_divergent_negative_advantage_rows(preset: str) -> None:
    actor = FakeActor(shift=-0.3)  # mean k1 = +0.3 > δ = 0.05 on every row
    out = await _step(preset, actor)
    b = actor.updated
    assert b is not None
    negative = b["advantages"].sum(dim=1) < 0  # computed on the mask before OPSM
    kept = b["response_mask"].sum(dim=1) > 0
    assert bool(negative.any()) and torch.equal(kept, ~negative)
    if "rollout_is_weights" in b:
        assert bool((b["rollout_is_weights"][~kept] == 0).all())
    assert actor.forward_calls == 2  # π_train before the update (also in bypass), then the update
    m = out.metrics
    assert m["rollout_corr/opsm_masked_frac_seq"] == pytest.approx(float(negative.float().mean()))
    assert m["rollout_corr/masked_frac_seq"] == m["rollout_corr/opsm_masked_frac_seq"]
    assert m["rollout_corr/opsm_seq_kl_mean"] == pytest.approx(0.3, abs=1e-6)


async def test_opsm_keeps_everything_when_the_policy_has_not_drifted_away() -> None:
    out = await _step("decoupled_token_is_opsm", FakeActor(shift=0.3))  # k1 = -0.3 < δ
    assert out.metrics["rollout_corr/masked_frac_token"] == 0.0


async def test_staleness_rs_needs_the_version_and_drops_the_outlier_for_its_age() -> None:
    with pytest.raises(ValueError, match="stale_rs_multiplier needs the trainer's version"):
        await _step("decoupled_token_is_stale_rs", FakeActor(shift=0.3))
    # rows 0-3 are 3 versions old, rows 4-5 one version old; every row drifted by 0.3: the
    # drift per version is 0.1 (lower median), so the one-version-old rows are 3x over it
    actor = FakeActor(shift=0.3)
    out = await _step("decoupled_token_is_stale_rs", actor, version=3, trajs=_trajs({4: 2, 5: 2}))
    b = actor.updated
    assert b is not None
    assert (b["response_mask"].sum(dim=1) > 0).tolist() == [True] * 4 + [False] * 2
    m = out.metrics
    assert m["rollout_corr/stale_rs_drift_per_version"] == pytest.approx(0.1, abs=1e-6)
    assert m["rollout_corr/masked_frac_seq"] == pytest.approx(2 / 6)


async def test_m2po_masks_the_largest_squared_ratios_down_to_its_bound() -> None:
    actor = FakeActor(shift=0.3)  # ℓ² = 0.09 on every token
    out = await _step("decoupled_m2po", actor)
    assert out.metrics["rollout_corr/m2po_m2"] == pytest.approx(0.09, abs=1e-6)
    assert actor.updated is not None and float(actor.updated["response_mask"].sum()) == 1.0
    loose = await _step(
        "decoupled_m2po", FakeActor(shift=0.3), "algorithm.correction.m2po_threshold=0.1"
    )
    assert loose.metrics["rollout_corr/masked_frac_token"] == 0.0


async def test_loglinear_forms_pi_old_inside_the_update_without_a_forward_pass() -> None:
    with pytest.raises(ValueError, match="proximal=loglinear needs the trainer's version"):
        await _step("decoupled_loglinear", AnchoringFakeActor(shift=0.3))
    actor = AnchoringFakeActor(shift=0.3)
    out = await _step("decoupled_loglinear", actor, version=3)
    assert actor.forward_calls == 1  # only the update's own pass
    assert actor.anchor is not None and actor.anchor.proximal is correction.ProximalMethod.LOGLINEAR
    b = actor.updated
    assert b is not None
    mask = b["response_mask"].float()
    torch.testing.assert_close(b["prox_alpha"], torch.full_like(mask, 2 / 3) * mask)
    # after the update the batch holds the approximated π_old of the first pass
    torch.testing.assert_close(
        out.batch["old_log_probs"], (b["rollout_log_probs"] + 0.3 * 2 / 3) * mask
    )
    m = out.metrics
    assert m["rollout_corr/prox_alpha_mean"] == pytest.approx(2 / 3)
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(math.exp(0.2), rel=1e-5)
    assert m["rollout_corr/kl"] == pytest.approx(-0.3, abs=1e-6)  # π_θ vs π_rollout


async def test_every_step_reports_what_all_masks_removed() -> None:
    out = await _step("decoupled_geo_rs", FakeActor(shift=0.3))
    assert out.metrics["rollout_corr/masked_frac_seq"] == 1.0
    assert out.metrics["rollout_corr/masked_frac_token"] == 1.0
    out = await _step("decoupled_token_is", FakeActor(shift=0.3))
    assert out.metrics["rollout_corr/masked_frac_token"] == 0.0
