"""A run resolves its config once, at its entry point, and hands the ``Resolved`` down.

``agentrl train`` resolves (every mistake fails before a server starts,
``test_mistakes.py``); the trainer it starts, ``agentrl eval``'s evaluation and the Ray trainer
actor (``tests/unit/distributed/test_ray_backend.py``) take that resolution instead of reading
the task files and importing the user's code a second time. A ``Resolved`` crosses processes
(Ray pickles it with the trainer actor's arguments), so it round-trips through pickle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentrl.cli import main
from agentrl.config import load_config
from agentrl.training.errors import RunFailed
from agentrl.training.resolve import Resolved, ensure_resolved, resolve_experiment
from tests.fakes import count_resolutions

UNITS = Path(__file__).resolve().parents[3] / "examples" / "units" / "config.yaml"
STOP = "stopped before any server: this test counts resolutions"


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[Resolved | None]:
    """The ``resolved`` each run hands its builder; the builder then stops the run (RunFailed)
    before anything starts."""
    import agentrl.training.trainer as trainer

    seen: list[Resolved | None] = []

    @contextlib.asynccontextmanager
    async def build_run(cfg: Any, *, resolved: Resolved | None = None, **_: Any) -> AsyncIterator:
        seen.append(resolved)
        raise RunFailed(STOP)
        yield

    @contextlib.asynccontextmanager
    async def build_serving(cfg: Any, **_: Any) -> AsyncIterator:
        raise RunFailed(STOP)
        yield

    monkeypatch.setattr(trainer, "build_run", build_run)
    monkeypatch.setattr(trainer, "build_serving", build_serving)
    return seen


def test_agentrl_train_resolves_once_and_the_trainer_builds_with_it(
    built: list[Resolved | None],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    made = count_resolutions(monkeypatch)
    rc = main(["train", str(UNITS), f"trainer.output_dir={tmp_path}", "--quiet"])
    assert rc == 1 and STOP in capsys.readouterr().err  # it reached the builder
    assert len(made) == 1, f"the config was resolved {len(made)} times"
    assert built == made and built[0] is made[0]  # the CLI's own resolution, not a copy


def test_the_start_up_log_times_the_resolution_where_it_ran(
    built: list[Resolved | None], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Handed a resolution, the trainer logs the time it took in the caller, not ~0 s."""
    import logging

    from agentrl.training import Trainer

    cfg = load_config(UNITS, [f"trainer.output_dir={tmp_path}"])
    resolved = dataclasses.replace(resolve_experiment(cfg), seconds=12.34)
    caplog.set_level(logging.INFO, logger="agentrl.run")
    with pytest.raises(RunFailed, match="counts resolutions"):
        Trainer(cfg, resolved=resolved).run_sync()
    assert "start-up: config resolved in 12.3 s" in caplog.messages, caplog.messages


def test_the_sdk_trainer_still_resolves_a_plain_config_once(
    built: list[Resolved | None], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from agentrl.training import Trainer

    made = count_resolutions(monkeypatch)
    cfg = load_config(UNITS, [f"trainer.output_dir={tmp_path}"])
    with pytest.raises(RunFailed, match="counts resolutions"):
        Trainer(cfg).run_sync()
    assert len(made) == 1 and built[0] is made[0]


def test_agentrl_eval_resolves_once(
    built: list[Resolved | None], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from agentrl.inference.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    made = count_resolutions(monkeypatch)
    with pytest.raises(RunFailed, match="counts resolutions"):
        main(["eval", str(UNITS), f"trainer.output_dir={tmp_path}", "--checkpoint", str(model)])
    assert len(made) == 1


def test_a_resolution_pickles_and_means_the_same_after(tmp_path: Path) -> None:
    cfg = load_config(UNITS, [f"trainer.output_dir={tmp_path}"])
    resolved = resolve_experiment(cfg)
    back = pickle.loads(pickle.dumps(resolved))
    assert back == resolved
    assert back.plan.describe() == resolved.plan.describe()
    assert (back.plan.needs_critic, back.plan.needs_reference, back.plan.needs_old_log_probs) == (
        resolved.plan.needs_critic,
        resolved.plan.needs_reference,
        resolved.plan.needs_old_log_probs,
    )
    assert [t.id for t in back.train_tasks] == [t.id for t in resolved.train_tasks]
    assert back.val_tasks == resolved.val_tasks and back.agents == ["units_agent"]
    # what a process that receives it does: no second resolution, the user's code imported
    assert ensure_resolved(cfg, back) is back
