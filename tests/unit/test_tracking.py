"""Run names (issue 22): every run gets its own name, whatever the seed, or the user's."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from agentrl.tracking import MlflowTracker, fresh_run_name


def test_run_names_do_not_follow_the_seeded_global_rng() -> None:
    names = set()
    for _ in range(5):
        random.seed(0)  # what seed_everything does before the tracker starts
        names.add(fresh_run_name())
    assert len(names) > 1
    assert all(re.fullmatch(r"[a-z]+-[a-z]+-\d{1,3}", n) for n in names), names


@pytest.mark.integration  # a real MLflow SQLite store (about 30 s to create on a busy machine)
def test_mlflow_runs_are_named_by_the_config_or_freshly(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    got = []
    for run_name in (None, None, "my-baseline"):
        random.seed(0)
        tracker = MlflowTracker(tracking_uri=uri, experiment="names", run_name=run_name)
        got.append(tracker._run.info.run_name)
        tracker.finish()
    assert got[0] != got[1] and got[2] == "my-baseline"
