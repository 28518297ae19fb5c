"""``distributed.backend: ray`` on a real local Ray cluster: 2 training steps with the servers,
the agent-loop worker, the reward worker and the trainer as actors.

The fixture starts its own head node (``ray start --head --block`` on 127.0.0.1, a free port, its
own temp dir, 2 CPUs) in a new process group and ends exactly that group at the end (not
``ray stop``, which would stop every Ray cluster of the machine's user). Ray missing is a
failure here, not a skip.
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import time
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.distributed.actors import AgentLoopWorkerActor, InferenceServerActor, RewardWorkerActor
from agentrl.distributed.ray_backend import TrainerActor, run_with_ray
from agentrl.rollout.manager import WorkerConfig
from agentrl.serving import ServerSpec

pytestmark = [pytest.mark.integration, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(model_dir: Path, out: Path, *overrides: str):
    return load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            f"model.path={model_dir}",
            f"trainer.output_dir={out}",
            "trainer.total_steps=2",
            "data.batch_size=2",
            "data.n_samples=2",
            "data.generator_val_size=2",
            "trainer.mini_batch_size=2",
            "inference.num_servers=1",
            "inference.max_tokens_per_turn=16",
            "agent.max_turns=2",
            "agent.max_response_tokens=48",
            "rollout.max_concurrency=4",
            "tracking.enabled=false",
            f"checkpoint.shared_dir={out / 'weights'}",
            "distributed.backend=ray",
            *overrides,
        ],
    )


def _children(pid: int) -> set[int]:
    """All descendants of ``pid`` (from /proc)."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _local_children(pid: int) -> set[int]:
    """Descendants of ``pid`` outside the Ray head's process tree.

    The fixture's ``ray start --head`` is a child of this test process, so every process the
    cluster spawns (raylet, actor workers) descends from it too, for as long as it lives. Those
    are Ray's, not ours: what must not happen is work running here or in a subprocess we
    started ourselves.
    """
    mine = _children(pid)
    for child in list(mine):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"start" in argv and b"--head" in argv and any(a.endswith(b"ray") for a in argv):
            mine -= {child} | _children(child)
    return mine


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_actor_state_pickles(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(tiny_model_dir, tmp_path)
    objs = [
        InferenceServerActor(
            ServerSpec(backend="embedded", model=tiny_model_dir, seed=3),
            index=1,
            log_dir=str(tmp_path),
        ),
        RewardWorkerActor(cfg.reward),
        AgentLoopWorkerActor(cfg, ["http://127.0.0.1:1"], str(tiny_model_dir), WorkerConfig()),
        TrainerActor(cfg, stop_after_step=1),
    ]
    for obj in objs:
        clone = pickle.loads(pickle.dumps(obj))
        assert type(clone) is type(obj)
    server = pickle.loads(pickle.dumps(objs[0]))
    assert (server.index, server.spec.seed, server.url()) == (1, 3, "")
    worker = pickle.loads(pickle.dumps(objs[2]))
    assert worker.server_urls == ["http://127.0.0.1:1"] and worker.counts() == {}
    assert pickle.loads(pickle.dumps(objs[3])).cfg == cfg
    with pytest.raises(ValueError, match=r"inference\.backend"):
        ServerSpec(backend="external", model=tiny_model_dir)  # type: ignore[arg-type]


@pytest.mark.timeout(400)
def test_train_two_steps_on_ray(ray_cluster: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    # With a distillation teacher (the model itself: the wiring is what is tested here; the
    # term's value is tested in test_distill.py): the reward actor must be told its servers.
    cfg = _cfg(
        tiny_model_dir,
        tmp_path / "run",
        f"distributed.ray_address={ray_cluster}",
        f"teacher.path={tiny_model_dir}",
    )
    info: dict = {}
    result = run_with_ray(cfg, placement_info=info)
    assert result.steps == 2 and result.version == 2
    assert (Path(result.output_dir) / "final_model").is_dir()
    # The server ran in the server actor: not a child of this test process; stopped at the end.
    mine = _local_children(os.getpid())
    (server,) = info["servers"]
    assert server["server_pid"] not in mine and server["actor_pid"] not in mine
    assert server["url"].startswith("http://127.0.0.1:")
    assert not _alive(server["server_pid"])
    # Episodes ran in the worker actor and were scored by the reward actor (4 per step, at least).
    (worker,) = info["workers"]
    assert worker["actor_pid"] != os.getpid() and worker["actor_pid"] not in mine
    assert worker["episodes"] >= 4
    assert info["reward"]["scored"] >= 4
    assert info["trainer"]["actor_pid"] not in (os.getpid(), worker["actor_pid"])
    rkl = [v for _, v in result.history["teacher/reverse_kl_mean"]]
    assert len(rkl) == 2 and all(math.isfinite(x) for x in rkl)


def _wait_dead(pid: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.mark.timeout(300)
def test_failing_trainer_still_stops_everything(
    ray_cluster: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A config mistake fails in the driver, before any actor or server starts.
    missing = tmp_path / "no-such-tasks.jsonl"
    bad = _cfg(
        tiny_model_dir,
        tmp_path / "bad",
        f"distributed.ray_address={ray_cluster}",
        f"data.train_files=[{missing}]",
    )
    info: dict = {}
    with pytest.raises(Exception, match="no-such-tasks"):
        run_with_ray(bad, placement_info=info)
    assert "servers" not in info
    # A failure inside the trainer actor, after the servers started (no CUDA here).
    cfg = _cfg(
        tiny_model_dir,
        tmp_path / "run",
        f"distributed.ray_address={ray_cluster}",
        "trainer.device=cuda",
    )
    with pytest.raises(Exception, match=r"(?i)cuda"):
        run_with_ray(cfg, placement_info=info)
    (server,) = info["servers"]
    assert _wait_dead(server["server_pid"], 30), "the server outlived a failed run"
    assert _wait_dead(server["actor_pid"], 30), "the server actor outlived a failed run"


@pytest.mark.timeout(300)
def test_killed_server_actor_does_not_orphan_its_server(
    ray_cluster: str, tiny_model_dir: Path
) -> None:
    import ray

    ray.init(address=ray_cluster, log_to_driver=False)
    try:
        spec = ServerSpec(backend="embedded", model=tiny_model_dir, device="cpu")
        actor = ray.remote(InferenceServerActor).options(num_cpus=0).remote(spec)
        url = ray.get(actor.start.remote(), timeout=240)
        assert url.startswith("http://127.0.0.1:") and ray.get(actor.healthy.remote(), timeout=30)
        pid = ray.get(actor.info.remote(), timeout=30)["server_pid"]
        ray.kill(actor)  # no shutdown(): the reaper must stop the server
        assert _wait_dead(pid, 60), "a killed server actor left its server running"
    finally:
        ray.shutdown()


def test_train_cli_dispatches_to_ray(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import argparse

    from agentrl.distributed import ray_backend
    from agentrl.training import train_cli
    from agentrl.training.trainer import TrainResult

    calls: list = []

    def fake_run_with_ray(cfg, *, resolved=None, resume: bool = False) -> TrainResult:
        assert resolved is not None  # the command's own resolution, handed down (issue 20)
        calls.append((cfg.distributed.backend, resume))
        return TrainResult(steps=7, version=7, output_dir=cfg.trainer.output_dir)

    monkeypatch.setattr(ray_backend, "run_with_ray", fake_run_with_ray)
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            str(ROOT / "configs" / "quickstart.yaml"),
            f"trainer.output_dir={tmp_path}",
            "distributed.backend=ray",
            "--resume",
            "--quiet",
        ]
    )
    assert train_cli.run(args) == 0
    assert calls == [("ray", True)]
    assert '"steps": 7' in capsys.readouterr().out
