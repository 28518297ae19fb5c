"""Where each role's Ray actors go: ``distributed.placement`` and ``distributed.resources``
become the actors' Ray ``.options()``; mistakes name the key and the fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentrl.distributed.ray_backend import _role_options, trainer_bundles
from tests.fakes import experiment


def test_spread_places_servers_and_workers_across_nodes_only() -> None:
    cfg = experiment("distributed.placement=spread")
    assert _role_options(cfg, "server") == {"scheduling_strategy": "SPREAD"}
    assert _role_options(cfg, "worker") == {"scheduling_strategy": "SPREAD"}
    assert _role_options(cfg, "reward") == {} and _role_options(cfg, "trainer") == {}
    assert _role_options(experiment(), "server") == {}  # default: Ray's own scheduling


def test_custom_resources_go_to_their_role_and_into_the_trainer_bundles() -> None:
    cfg = experiment(
        "distributed.resources={server: {serving: 1}, trainer: {training: 0.5}}",
        "trainer.world_size=2",
        "distributed.num_trainer_gpus=1",
    )
    assert _role_options(cfg, "server") == {"resources": {"serving": 1.0}}
    assert _role_options(cfg, "worker") == {}
    assert trainer_bundles(cfg) == [{"GPU": 1.0, "training": 0.5}] * 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("distributed.resources={server: {GPU: 1}}", "num_gpus_per_server"),
        ("distributed.resources={worker: {fast: 0}}", r"worker\.fast=0.0; request an amount"),
        ("distributed.resources={judge: {fast: 1}}", "judge"),
        ("distributed.placement=scatter", "spread"),
    ],
)
def test_placement_mistakes_name_the_key_and_the_fix(override: str, message: str) -> None:
    with pytest.raises((ValidationError, ValueError), match=message):
        experiment(override)


def test_a_lost_trainer_actor_ends_the_run_saying_how_to_go_on() -> None:
    from agentrl.distributed.ray_backend import _trainer_lost
    from agentrl.training.loop import RunFailed

    died = RuntimeError(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: TrainerActor\n"
        "The actor died because its node has died. Node Id: 2e52\n"
    )
    err = _trainer_lost(died)
    assert isinstance(err, RunFailed)
    assert "died because its node has died" in str(err) and "--resume" in str(err)
    assert "distributed.resources.trainer" in str(err)
