"""Trainer ranks without a process group: thread shares, the follower's environment, the proxy's
dispatch, the checkpoint's shard files and its world-size check, the Ray bundles.

The ranks themselves (a real follower subprocess, gloo, FSDP2) are exercised in
``tests/integration/test_ranks.py``.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from agentrl.threads import ProcessThreads
from agentrl.training.ranks import COLLECTIVE_METHODS, RankedModel, RankSpec, rank_threads
from agentrl.training.state import STATE_FILE, RunState, model_file
from tests.fakes import experiment


def test_rank_threads_split_the_trainer_share() -> None:
    shares = rank_threads(ProcessThreads("trainer", 3), 2)
    assert [(s.role, s.threads, s.cpus) for s in shares] == [("rank0", 2, None), ("rank1", 1, None)]
    # never fewer than one thread, even when the trainer has fewer threads than ranks
    assert [s.threads for s in rank_threads(ProcessThreads("trainer", 1), 3)] == [1, 1, 1]
    pinned = rank_threads(ProcessThreads("trainer", 4, cpus=(4, 5, 6, 7)), 2)
    assert [s.cpus for s in pinned] == [(4, 5), (6, 7)]
    # too few pinned CPUs for one each: every rank keeps the trainer's CPUs
    crowded = rank_threads(ProcessThreads("trainer", 1, cpus=(3,)), 2)
    assert [s.cpus for s in crowded] == [(3,), (3,)]
    assert shares[1].env()["OMP_NUM_THREADS"] == "1"


def test_rank_spec_round_trips_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = RankSpec(rank=2, world_size=3, master_addr="10.0.0.5", master_port=29511, device="cpu")
    for key, value in spec.env().items():
        monkeypatch.setenv(key, value)
    assert RankSpec.from_env() == spec
    assert spec.env()["LOCAL_RANK"] == "2"
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(RuntimeError, match=r"MASTER_PORT.*not set"):
        RankSpec.from_env()


class _Model:
    temperature = 0.7

    def compute_log_probs(self, batch: Any) -> str:
        return f"local {batch}"

    def helper(self) -> str:
        return "not a collective"


class _RecordingRanks:
    """Records what RankedModel asks of the ranks (the real ones need a process group)."""

    world_size = 2

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def call(self, model: Any, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((role, method, args, kwargs))
        return getattr(model, method)(*args, **kwargs)

    def every_rank(self, model: Any, role: str, fn: Any, args: tuple[Any, ...]) -> Any:
        self.calls.append((role, fn.__name__, args))
        return fn(model, 0, self.world_size, *args)


def _rank_and_world(model: Any, rank: int, world: int, tag: str) -> str:
    return f"{tag} {rank}/{world}"


def test_ranked_model_announces_collectives_and_passes_the_rest_through() -> None:
    ranks = _RecordingRanks()
    proxy = RankedModel("reference", _Model(), ranks)  # type: ignore[arg-type]  # recording ranks
    assert proxy.compute_log_probs("b") == "local b"
    assert ranks.calls == [("reference", "compute_log_probs", ("b",), {})]
    assert proxy.temperature == 0.7 and proxy.helper() == "not a collective"
    assert len(ranks.calls) == 1  # attributes and other methods are local
    assert proxy.on_every_rank(_rank_and_world, "save") == "save 0/2"
    assert ranks.calls[-1] == ("reference", "_rank_and_world", ("save",))
    assert proxy.world_size == 2
    with pytest.raises(AttributeError):
        _ = proxy.no_such_attribute
    # every method the loop, the step and the checkpoint call on a model is a collective
    assert {"update_with_log_probs", "state_dict_for_push", "score_tokens"} <= COLLECTIVE_METHODS


def test_shard_files_and_the_world_size_check(tmp_path: Path) -> None:
    assert model_file(tmp_path, "actor", 0, 1) == tmp_path / "actor.pt"
    assert model_file(tmp_path, "critic", 3, 4) == tmp_path / "critic.rank3.pt"
    (tmp_path / STATE_FILE).write_text(
        json.dumps(
            {
                "step": 3,
                "version": 3,
                "dataset": {},
                "buffer": {},
                "pending_tasks": [],
                "world_size": 2,
            }
        )
    )
    assert RunState.load(tmp_path).world_size == 2  # type: ignore[union-attr]  # saved above
    with pytest.raises(
        ValueError,
        match=r"saved by 2 trainer rank.*trainer\.world_size=1.*resume with trainer\.world_size=2",
    ):
        RunState.load(tmp_path, world_size=1)
    with pytest.raises(ValueError, match=r"trainer\.world_size=2"):
        RunState.load_weights(tmp_path, actor=_Model(), critic=None)  # a plain model: 1 rank


def test_ray_trainer_bundles_and_rank_actor_pickle() -> None:
    from agentrl.distributed.ray_backend import TrainerActor, TrainerRankActor, trainer_bundles

    assert trainer_bundles(experiment("trainer.world_size=2")) is None  # no GPUs: no group
    assert trainer_bundles(experiment("distributed.num_trainer_gpus=1")) is None  # one rank
    gpus = experiment("trainer.world_size=3", "distributed.num_trainer_gpus=0.5")
    assert trainer_bundles(gpus) == [{"GPU": 0.5}] * 3
    actor = pickle.loads(pickle.dumps(TrainerRankActor({"OMP_NUM_THREADS": "1"})))
    assert actor.env == {"OMP_NUM_THREADS": "1"}
    trainer = pickle.loads(pickle.dumps(TrainerActor(gpus, placement_group=None)))
    assert trainer.cfg.trainer.world_size == 3 and trainer.rank_info() == []


def test_local_cuda_ranks_need_a_gpu_each(tmp_path: Path) -> None:
    import torch

    from agentrl.training.ranks import start_ranks

    gpus = torch.cuda.device_count()
    cfg = experiment(
        f"trainer.world_size={gpus + 1}", "trainer.device=cuda", f"trainer.output_dir={tmp_path}"
    )
    registered: list[Any] = []
    with pytest.raises(ValueError, match=rf"trainer\.world_size={gpus + 1}.*has {gpus}"):
        start_ranks(cfg, tmp_path, threads=ProcessThreads("trainer", 1), register=registered.append)
    assert registered == []  # nothing was started
