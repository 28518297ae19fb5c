"""The trainer's bypass path end to end: stale rollouts from a real embedded server, PPO clipped
against π_rollout, every weight push verified, the off-policy diagnostics logged every step.

Why this test exists: the unit tests drive the bypass step with a scripted fake policy; only a
run against a real server shows that the rollout log-probs the server returns are what the loss
anchors on, and that a real policy lag shows up in ``rollout_corr/``. The lag is forced with
``checkpoint.push_every=2`` (the servers get new weights every other step), so the batch of step
2 was sampled entirely by version 0 while the trainer is at version 1.

What "the loss anchors on π_rollout" means here, measurably: the PPO loss logs ``actor/ppo_kl``
= masked mean of log π_anchor − log π_θ over its first pass, and the correction logs
``rollout_corr/kl`` = masked mean of log π_rollout − log π_θ from the same pass (bypass mode has
no π_old). With one micro-batch per step the two are the same number; in decoupled mode
``ppo_kl`` would be 0 (π_old = π_θ before the first step) while ``kl`` is not.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.training.trainer import Trainer
from agentrl.weightsync.engine import PushReport

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "checkpoints" / "calculator-sft"
STEPS = 4
PUSH_EVERY = 2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


class PushRecordingTrainer(Trainer):
    """A Trainer that keeps every PushReport (``Trainer._push`` is the documented hook)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pushes: list[PushReport] = []

    async def _push(self, version: int) -> PushReport:
        report = await super()._push(version)
        self.pushes.append(report)
        return report


def test_bypass_ppo_clip_trains_on_stale_rollouts_with_verified_pushes(
    tmp_path: Path, report_metric
) -> None:
    cfg = load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            f"model.path={CHECKPOINT}",
            f"trainer.output_dir={tmp_path}",
            f"trainer.total_steps={STEPS}",
            "trainer.max_staleness=2",
            f"checkpoint.push_every={PUSH_EVERY}",
            "algorithm.correction.preset=bypass_ppo_clip",
            "inference.num_servers=1",
            # An entropy bonus moves the policy at step 1 even if every GRPO group has uniform
            # rewards (zero advantages), so step 2's lag is never zero by chance.
            "algorithm.entropy_coeff=0.01",
            "trainer.micro_batch_max_tokens=1000000",  # one micro-batch: ppo_kl is one mean
            "trainer.val_before_train=false",
            "trainer.val_at_end=false",
            "tracking.enabled=false",
            f"checkpoint.shared_dir={tmp_path / 'weights'}",
        ],
    )
    trainer = PushRecordingTrainer(cfg, progress=False)
    result = trainer.run_sync()
    assert result.steps == STEPS and result.version == STEPS

    # The run really is bypass: no π_old pass, and the ratio loss takes no IS weight.
    plan = trainer.run_obj.resolved.plan  # type: ignore[union-attr]
    assert plan.correction.bypass and not plan.needs_old_log_probs
    assert not plan.loss.takes_is_weights

    # Every push (the start-up one, then every PUSH_EVERY steps) reached the server and its
    # probe log-probs matched the trainer's within the tolerance.
    assert [r.version for r in trainer.pushes] == [0, *range(PUSH_EVERY, STEPS + 1, PUSH_EVERY)]
    for report in trainer.pushes:
        assert report.ok, report.describe()
        assert len(report.servers) == cfg.inference.num_servers
        diff = report.max_abs_diff
        assert diff is not None and diff <= cfg.checkpoint.verify_tolerance, report.describe()

    h = {k: [v for _, v in series] for k, series in result.history.items()}
    for key in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token",
                "rollout_corr/chi2_seq", "rollout_corr/ppl_ratio", "actor/ppo_kl",
                "actor/pg_clipfrac"):  # fmt: skip
        assert len(h.get(key, [])) == STEPS, f"{key} not logged every step: {h.get(key)}"
        assert all(math.isfinite(v) for v in h[key]), f"{key}: {h[key]}"
    assert not any(k.startswith("rollout_corr/is_weight") for k in h), "bypass PPO-clip has no IS"

    # The lag is real: step 1 trains on version-0 samples at version 0, step 2 on version-0
    # samples at version 1 (no push after step 1).
    assert h["async/staleness_max"][0] == 0.0
    assert h["async/staleness_mean"][1] == 1.0
    kl, k3, ppo_kl = h["rollout_corr/kl"], h["rollout_corr/k3_kl"], h["actor/ppo_kl"]
    report_metric("k3_kl_step1_on_policy", k3[0])
    report_metric("k3_kl_step2_one_version_stale", k3[1])
    report_metric("pg_clipfrac_step2", h["actor/pg_clipfrac"][1])
    report_metric(
        "max_abs_ppo_kl_minus_rollout_kl", max(abs(a - b) for a, b in zip(ppo_kl, kl, strict=True))
    )
    report_metric("max_push_verify_abs_diff", max(r.max_abs_diff or 0.0 for r in trainer.pushes))
    assert k3[0] < 1e-6, f"on-policy step 1 should match the server to float precision: {k3}"
    assert k3[1] > 100 * max(k3[0], 1e-9), f"step 2 is one version stale: k3_kl per step {k3}"
    # The PPO ratio is π_θ / π_rollout: its KL is the measured off-policy KL, every step.
    for step, (a, b) in enumerate(zip(ppo_kl, kl, strict=True), start=1):
        assert abs(a - b) <= 1e-5 + 1e-3 * abs(b), f"step {step}: ppo_kl {a} vs rollout kl {b}"
