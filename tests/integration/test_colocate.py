"""Colocated mode end to end (issue 26): ``agentrl train`` with ``distributed.colocate`` on an
embedded server it launches. Every step the server sleeps before the update and wakes after it
(by the push at level 2; without a push at level 1), and the push is verified before the wake."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.training.trainer import Trainer
from tests.integration.test_metric_keys import CONDITIONAL

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def test_colocated_training_sleeps_and_wakes_the_server_every_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"trainer.output_dir={tmp_path / 'out'}",
            f"trainer.total_steps={STEPS}",
            "trainer.max_staleness=1",
            "trainer.val_before_train=false",
            "trainer.val_at_end=false",
            "trainer.save_every=0",
            "checkpoint.push_every=2",  # step 1 pushes nothing: it sleeps at level 1
            "data.batch_size=2",
            "data.n_samples=2",
            "trainer.mini_batch_size=2",
            "inference.num_servers=1",
            "inference.max_tokens_per_turn=16",
            "agent.max_turns=2",
            "agent.max_response_tokens=48",
            "tracking.enabled=false",
            "distributed.colocate=true",
        ],
    )
    result = Trainer(cfg, progress=False).run_sync()
    h = result.history
    assert result.steps == STEPS
    steps = list(range(1, STEPS + 1))
    assert h["colocate/slept_servers"] == [(s, 1.0) for s in steps]
    assert h["colocate/woken_servers"] == [(s, 1.0) for s in steps]
    # level 2 where the step pushes full weights (step 2, the last), else level 1
    assert h["colocate/sleep_level"] == [(1, 1.0), (2, 2.0)]
    # step 1 (level 1) frees the staging buffer the start-up push arrived in (the size of the
    # weights file); step 2 (level 2) the weights themselves
    freed = dict(h["colocate/freed_bytes"])
    weights = h["weight_sync/bytes"][-1][1]
    assert weights > freed[2] > 0.99 * weights and freed[1] == weights
    # the push that woke the server verified it first
    assert [s for s, _ in h["weight_sync/verify_max_abs_diff"]] == [2]
    assert all(v == 1.0 for _, v in h["weight_sync/verified_while_paused"])
    assert all(v == 0.0 for _, v in h["weight_sync/failed_servers"])
    # every colocate/ key docs/tracking.md names (test_metric_keys.py lists them as this test's)
    documented = [k for k in CONDITIONAL if k.startswith("colocate/")]
    assert len(documented) == 8 and all(len(h[k]) == STEPS for k in documented), sorted(h)
