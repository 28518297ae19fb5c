"""Where each role's Ray actors go: ``distributed.placement`` and ``distributed.resources``
become the actors' Ray ``.options()``; mistakes name the key and the fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentrl.distributed.ray_backend import _role_options, spread_nodes, trainer_bundles
from tests.fakes import experiment


def test_spread_places_servers_and_workers_across_nodes_only() -> None:
    cfg = experiment("distributed.placement=spread")
    # without a node list (none known): Ray's best-effort SPREAD
    assert _role_options(cfg, "server") == {"scheduling_strategy": "SPREAD"}
    assert _role_options(cfg, "worker") == {"scheduling_strategy": "SPREAD"}
    assert _role_options(cfg, "reward") == {} and _role_options(cfg, "trainer") == {}
    assert _role_options(experiment(), "server") == {}  # default: Ray's own scheduling
    assert _role_options(experiment(), "server", 1, ["a", "b"]) == {}


def test_spread_deals_the_nodes_out_in_turn_as_soft_affinities() -> None:
    cfg = experiment("distributed.placement=spread")
    a, b = "a" * 56, "b" * 56  # Ray's node ids: 28 bytes in hex
    placed = [_role_options(cfg, "worker", i, [a, b])["scheduling_strategy"] for i in range(3)]
    assert [s.node_id for s in placed] == [a, b, a]
    assert all(s.soft for s in placed)  # a restart after its node died goes anywhere
    # a request that is not empty: Ray ignores a soft affinity of a 0-CPU actor half the time
    assert _role_options(cfg, "worker", 0, [a])["num_cpus"] == 0.01


def _node(node_id: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 1.0, **resources}}


def test_spread_nodes_are_the_alive_ones_that_fit_the_role_the_drivers_first() -> None:
    alive = [_node("c"), _node("a", alive=False), _node("b", serving=1.0, GPU=1.0), _node("d")]
    alive.append({"NodeID": "e", "Alive": True, "Resources": {"GPU": 1.0}})  # no CPU: no fit
    cfg = experiment("distributed.placement=spread")
    assert spread_nodes(cfg, "worker", alive, here="d") == ["d", "b", "c"]
    pinned = experiment(
        "distributed.placement=spread", "distributed.resources={server: {serving: 1}}"
    )
    assert spread_nodes(pinned, "server", alive, here="d") == ["b"]
    assert spread_nodes(pinned, "worker", alive, here="d") == ["d", "b", "c"]
    gpus = experiment("distributed.placement=spread", "distributed.num_gpus_per_server=2")
    assert spread_nodes(gpus, "server", alive, here="d") == []  # none fits: Ray's SPREAD


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
