"""The quickstart learns: a short run of ``configs/quickstart.yaml`` from the shipped warm start
(``checkpoints/calculator-sft``) in which the mean reward rises while every step's weight push is
verified on every server, against two embedded servers and against a real vLLM server.

Why these tests exist: the other trainer tests check the mechanics (versions, staleness, resume)
on a random model, where reward is always 0. Only a policy that sometimes succeeds shows that
the pieces compose into learning: rewards reach the advantages with the right sign, the update
moves the policy the right way, and the servers really sample from the pushed weights.

The run is the quickstart's recipe (async GRPO, ``max_staleness: 2``, bypass PPO-clip) with a
higher learning rate and fewer steps, so that the rise is large against the sampling noise of
``STEPS`` batches of 8 tasks x 4 samples.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from agentrl.config import ExperimentConfig, load_config
from agentrl.training.trainer import Trainer, TrainResult

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "checkpoints" / "calculator-sft"
STEPS = 10
RISE = 0.06
"""Minimum rise of the mean reward: the steps after the first ``WARMUP`` vs those first ones
(rewards are 0 or 1; 224 and 96 samples). Without learning, at the warm start's success rate of
~5%, that difference has a standard deviation of ~0.027, so 0.06 is > 2.2 sigma, and a policy
that does not learn fails both attempts (``ATTEMPTS``) with probability > 0.97.

Why this measure and two attempts: a 10-step async run either takes off (CI runs peaked at
rewards of 0.6-0.7) or learns weakly (two CI runs on vLLM, one under a parallel test: 0.03 ->
0.34 -> 0.0, and 0.06 -> 0.22 -> 0.09). The weak runs still rose by 0.085 on this measure, but
the earlier ones (second half vs first, best 3 steps vs first 2) failed them: they asked about
the run's shape, not whether it learned. Only the rise is retried; every attempt must verify
every push."""

WARMUP = 3
ATTEMPTS = 2

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]


def _cfg(out: Path, *overrides: str) -> ExperimentConfig:
    return load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            f"model.path={CHECKPOINT}",
            f"trainer.output_dir={out}",
            f"trainer.total_steps={STEPS}",
            "trainer.lr=1e-3",
            "data.generator_val_size=32",
            "tracking.enabled=false",
            f"checkpoint.shared_dir={out / 'weights'}",
            *overrides,
        ],
    )


def _series(result: TrainResult, key: str) -> list[float]:
    assert key in result.history, f"{key} never logged; logged: {sorted(result.history)}"
    return [v for _, v in result.history[key]]


def _rise(rewards: list[float]) -> float:
    """The mean reward after the first ``WARMUP`` steps minus theirs (``RISE``)."""
    return statistics.mean(rewards[WARMUP:]) - statistics.mean(rewards[:WARMUP])


def _assert_verified_pushes(result: TrainResult, num_servers: int) -> None:
    assert result.steps == STEPS and result.version == STEPS
    # Every step's push reached and was verified on every server, within tolerance.
    assert _series(result, "weight_sync/verified_servers") == [float(num_servers)] * STEPS
    assert _series(result, "weight_sync/failed_servers") == [0.0] * STEPS
    assert all(d <= 1e-3 for d in _series(result, "weight_sync/verify_max_abs_diff"))
    assert max(_series(result, "async/staleness_max")) <= 2


def _not_learned(result: TrainResult) -> str | None:
    """Why the run did not learn, or None: the reward rose by ``RISE`` and the held-out
    accuracy of the last weights beats the first's."""
    rewards = _series(result, "reward/mean")
    before, after = result.val_before["val/accuracy"], result.val_after["val/accuracy"]
    if _rise(rewards) < RISE:
        return f"mean reward per step {rewards}: rose {_rise(rewards):.3f}, not {RISE}"
    if after <= before:
        return f"held-out accuracy {before} -> {after}"
    return None


def _learns(tmp_path: Path, num_servers: int, report: Any, prefix: str, *overrides: str) -> None:
    """Up to ``ATTEMPTS`` runs (fresh output dirs) until one learns; each verifies every push."""
    why: list[str] = []
    for attempt in range(ATTEMPTS):
        result = Trainer(_cfg(tmp_path / f"attempt{attempt}", *overrides)).run_sync()
        _assert_verified_pushes(result, num_servers)
        rewards = _series(result, "reward/mean")
        report(f"{prefix}reward_rise_after_warmup", _rise(rewards))
        report(f"{prefix}val_accuracy_after", result.val_after["val/accuracy"])
        report(f"{prefix}wall_time_s", result.wall_time_s)
        report(f"{prefix}attempts", attempt + 1)
        failed = _not_learned(result)
        if failed is None:
            return
        why.append(failed)
    raise AssertionError(f"no attempt of {ATTEMPTS} learned: " + "; ".join(why))


def test_quickstart_recipe_learns_on_embedded_servers(tmp_path: Path, report_metric) -> None:
    _learns(tmp_path, 2, report_metric, "")


@pytest.mark.vllm
def test_quickstart_recipe_learns_on_a_vllm_server(tmp_path: Path, report_metric) -> None:
    from tests.integration.conftest import vllm_python_or_fail

    python = vllm_python_or_fail()
    overrides = (
        "inference.backend=vllm",
        "inference.num_servers=1",
        f"inference.vllm_python={python}",
    )
    _learns(tmp_path, 1, report_metric, "vllm_", *overrides)
