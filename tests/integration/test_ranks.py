"""``trainer.world_size``: trainer ranks driven by the run (CPU, gloo, the tiny model).

- Equality: the policies built by the run's own path (``build.start_policies``) with 2 ranks
  (this process is rank 0, one follower subprocess) and with 1 rank run ``train_step`` on the
  same fixed batches (GAE with a KL loss, so the actor, the reference and the critic are all
  sharded): the same metrics, batch tensors and updated weights within float32 tolerance.
- ``agentrl train`` with ``trainer.world_size=2``, locally (the CLI in a subprocess) and on a real
  local Ray cluster: every push verified, no rank left running afterwards.
- Resume with 2 ranks: one shard file per rank, the resumed weights bit-equal to the saved ones,
  and resuming with another world size is an error that says what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.config import load_config
from agentrl.training.algorithm import build_algorithm
from agentrl.training.build import start_policies
from agentrl.training.step import train_step
from agentrl.training.trainer import Trainer
from tests.fakes import random_trajectories

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
PAD = 256
STEPS = 2


def even_token_reward(traj: Any, task: Any) -> float:
    """A varied reward the random tiny model earns (share of even sampled token ids), so that
    advantages, and therefore the updates, are not zero (the calculator reward is)."""
    sampled = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    return sum(t % 2 == 0 for t in sampled) / max(1, len(sampled))


GAE_KL = (
    "algorithm.advantage={name: gae, lam: 0.95}",
    "algorithm.use_kl_loss=true",
    "algorithm.kl_loss_coef=0.1",
    "trainer.critic_lr=1e-3",
)


def _cfg(model_dir: Path, out: Path, *overrides: str) -> Any:
    return load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            f"model.path={model_dir}",
            f"trainer.output_dir={out}",
            f"trainer.total_steps={STEPS}",
            "data.batch_size=2",
            "data.n_samples=2",
            "data.generator_val_size=2",
            "trainer.mini_batch_size=2",
            "trainer.val_before_train=false",
            "trainer.val_at_end=false",
            "inference.num_servers=1",
            "inference.max_tokens_per_turn=16",
            "agent.max_turns=2",
            "agent.max_response_tokens=48",
            "rollout.max_concurrency=4",
            "tracking.enabled=false",
            f"checkpoint.shared_dir={out / 'weights'}",
            "reward.sources.calculator=tests.integration.test_ranks:even_token_reward",
            # the fakes' rollout logprobs are random: in bypass mode (the quickstart's preset) the
            # ratios to them sit at the clip bounds, and the float32 noise floor (one rank against
            # itself, repacked) rose from 2.2e-6 to 8e-5, above this test's 2e-5 bound
            "algorithm.correction.preset=decoupled_token_is",
            *overrides,
        ],
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def _wait_dead(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """The pids still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [p for p in pids if _alive(p)]


def _ranks_of(rank0_pid: int) -> list[int]:
    """Live processes started as follower ranks of ``rank0_pid`` (from their environment)."""
    found = []
    marker = f"AGENTRL_RANK0_PID={rank0_pid}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return [p for p in found if _alive(p)]


# ---- 2 ranks == 1 rank on the same batches ---------------------------------------------------
async def _train(cfg: Any, model_dir: Path) -> dict[str, Any]:
    """Two train_steps on fixed batches through the run's model builder; what the test compares."""
    plan = build_algorithm(cfg.algorithm)
    out: dict[str, Any] = {"steps": []}
    async with contextlib.AsyncExitStack() as stack:
        policies = await asyncio.to_thread(start_policies, cfg, model_dir, plan, stack)
        for seed in (0, 1):
            trajs = random_trajectories(8, seed=seed)
            out["steps"].append(await train_step(trajs, policies, plan, pad_token_id=PAD))
        out["actor"] = policies.actor.state_dict_for_push()
        out["critic"] = policies.critic.full_state_dict()
        ranks = getattr(policies.actor, "ranks", None)
        out["launcher"] = ranks.launcher if ranks is not None else None
    return out


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = float((a.float() - b.float()).abs().max())
    return diff, diff / max(float(b.abs().max()), 1e-12)


def test_two_ranks_train_like_one(tiny_model_dir: Path, tmp_path: Path, report_metric) -> None:
    import torch.distributed as dist

    overrides = (
        *GAE_KL,
        "trainer.micro_batch_max_tokens=40",  # several micro-batches, uneven over the ranks
        "trainer.lr=1e-3",
    )
    one = asyncio.run(_train(_cfg(tiny_model_dir, tmp_path / "w1", *overrides), tiny_model_dir))
    cfg2 = _cfg(tiny_model_dir, tmp_path / "w2", *overrides, "trainer.world_size=2")
    two = asyncio.run(_train(cfg2, tiny_model_dir))
    # the float32 noise floor: one rank against itself with another micro-batch packing (Adam's
    # normalized steps amplify summation-order noise in near-zero gradient entries)
    repack = _cfg(
        tiny_model_dir, tmp_path / "w1b", *overrides, "trainer.micro_batch_max_tokens=10000"
    )
    floor = asyncio.run(_train(repack, tiny_model_dir))

    # the follower stopped cleanly when the exit stack closed; rank 0 left its process group
    launcher = two["launcher"]
    assert [p.returncode for p in launcher.procs.values()] == [0]
    assert "stopped after" in (tmp_path / "w2" / "logs" / "rank1.log").read_text()
    assert not dist.is_initialized()

    worst_metric = 0.0
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert a.metrics.keys() == b.metrics.keys()
        for key, x in a.metrics.items():
            # timings differ; vf_clipfrac counts tokens whose clipped and unclipped value losses
            # tie up to rounding (|V − V_old| far inside the clip range), so 1e-8 noise flips it
            if key.startswith("timing_s/") or key == "critic/vf_clipfrac":
                continue
            assert b.metrics[key] == pytest.approx(x, rel=1e-5, abs=1e-6), key
            worst_metric = max(worst_metric, abs(b.metrics[key] - x) / max(abs(x), 1e-6))
        for key in ("old_log_probs", "ref_log_prob", "values", "advantages", "returns"):
            diff, _ = _max_rel(b.batch[key], a.batch[key])
            assert diff <= 1e-5, (key, diff)
    assert one["steps"][0].metrics["actor/pg_loss"] != 0.0

    for model in ("actor", "critic"):
        w1, w2 = one[model], two[model]
        assert w1.keys() == w2.keys() and all(w1[k].shape == w2[k].shape for k in w1)
        diffs = [_max_rel(w2[k], w1[k]) for k in w1]
        worst_abs, worst_rel = max(d[0] for d in diffs), max(d[1] for d in diffs)
        noise = max(_max_rel(floor[model][k], w1[k])[0] for k in w1)
        assert worst_abs <= 2e-5, (model, worst_abs, noise)
        report_metric(f"{model}/max_abs_weight_diff", worst_abs)
        report_metric(f"{model}/max_rel_weight_diff_per_tensor", worst_rel)
        report_metric(f"{model}/max_abs_weight_diff_1rank_repacked", noise)
    # the updates moved the weights far more than the tolerance
    from safetensors.torch import load_file

    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    moved = max(float((one["actor"][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3
    report_metric("actor/max_abs_update", moved)
    report_metric("max_rel_metric_diff", worst_metric)


# ---- failures: a follower dies, rank 0 dies -----------------------------------------------------
async def _kill_follower_mid_update(cfg: Any, model_dir: Path) -> list[str]:
    """Start 2 ranks, SIGKILL the follower during an actor update; the errors rank 0 raises."""
    from agentrl.batch import trajectories_to_batch

    plan = build_algorithm(cfg.algorithm)
    errors: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        policies = await asyncio.to_thread(start_policies, cfg, model_dir, plan, stack)
        (proc,) = policies.actor.ranks.launcher.procs.values()
        batch = trajectories_to_batch(random_trajectories(16, seed=3), pad_token_id=PAD)
        batch["old_log_probs"] = batch["rollout_log_probs"]
        batch["advantages"] = torch.ones_like(batch["rollout_log_probs"])
        killer = asyncio.get_running_loop().call_later(0.3, proc.kill)
        for _ in range(2):  # the first call sees the death; the next one is refused
            try:
                await asyncio.to_thread(policies.actor.update_with_log_probs, batch)
            except RuntimeError as exc:
                errors.append(str(exc))
        killer.cancel()
    return errors


def test_a_dead_follower_fails_the_run_naming_its_rank(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch.distributed as dist

    # many micro-batches, so that the update is still running when the follower is killed
    cfg = _cfg(
        tiny_model_dir, tmp_path, "trainer.world_size=2", "trainer.micro_batch_max_tokens=16"
    )
    cfg.trainer.ppo_epochs = 16
    errors = asyncio.run(_kill_follower_mid_update(cfg, tiny_model_dir))
    assert len(errors) == 2, errors
    assert re.search(
        r"trainer rank failed during actor\.update_with_log_probs: rank 1 exited "
        r"with status -9; log .*rank1\.log",
        errors[0],
    ), errors[0]
    assert "out of step" in errors[1]
    assert not dist.is_initialized()  # the exit stack stopped the ranks and left the group


FOLLOWER_OF_A_DYING_RANK0 = """
import contextlib, os, signal, sys
from pathlib import Path
from agentrl.training.algorithm import build_algorithm
from agentrl.training.build import start_policies
from tests.integration.test_ranks import _cfg

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
cfg = _cfg(model_dir, out, "trainer.world_size=2")
policies = start_policies(cfg, model_dir, build_algorithm(cfg.algorithm), contextlib.AsyncExitStack())
print(policies.actor.ranks.launcher.info()[0]["pid"], flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no exit stack, no stop: rank 0 just dies
"""


def test_followers_exit_when_rank0_dies(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", FOLLOWER_OF_A_DYING_RANK0, str(tiny_model_dir), str(tmp_path)],
        capture_output=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -9, proc.stderr.decode()[-3000:]
    pid = int(proc.stdout.decode().split()[0])
    assert _wait_dead([pid], 30) == [], "a follower outlived its rank 0"


# ---- agentrl train with 2 ranks ----------------------------------------------------------------
def test_agentrl_train_with_two_ranks(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    overrides = [
        f"model.path={tiny_model_dir}",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={STEPS}",
        "trainer.world_size=2",
        "data.batch_size=2",
        "data.n_samples=2",
        "data.generator_val_size=2",
        "trainer.mini_batch_size=2",
        "inference.num_servers=1",
        "inference.max_tokens_per_turn=16",
        "agent.max_turns=2",
        "agent.max_response_tokens=48",
        "tracking.enabled=false",
        f"checkpoint.shared_dir={out / 'weights'}",
    ]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentrl",
            "train",
            str(ROOT / "configs" / "quickstart.yaml"),
            *overrides,
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        stdout, stderr = proc.communicate(timeout=500)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr.decode()[-4000:]
    summary = json.loads(stdout)
    assert (summary["steps"], summary["version"]) == (STEPS, STEPS)
    # every step's push verified on the server (the initial one is verified too, not logged)
    assert summary["weight_pushes"]["verified"] == STEPS
    assert summary["weight_pushes"]["failed_servers"] == 0
    assert summary["weight_pushes"]["max_abs_diff"] <= 1e-3
    # gathered and saved by rank 0: a complete Hugging Face checkpoint of the trained weights
    from safetensors.torch import load_file

    final = load_file(str(out / "final_model" / "model.safetensors"))
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert {k: v.shape for k, v in final.items()} == {k: v.shape for k, v in initial.items()}
    log = (out / "logs" / "rank1.log").read_text()
    (pid,) = [int(p) for p in re.findall(r"trainer rank 1 of 2: pid (\d+)", log)]
    assert "stopped after" in log, log[-2000:]
    assert not _alive(pid), "the follower rank outlived `agentrl train`"
    assert _ranks_of(proc.pid) == []


@pytest.mark.ray
def test_two_ranks_on_ray(ray_cluster: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    from agentrl.distributed.ray_backend import run_with_ray

    cfg = _cfg(
        tiny_model_dir,
        tmp_path / "run",
        "distributed.backend=ray",
        f"distributed.ray_address={ray_cluster}",
        "trainer.world_size=2",
    )
    info: dict[str, Any] = {}
    result = run_with_ray(cfg, placement_info=info)
    assert (result.steps, result.version) == (STEPS, STEPS)
    diffs = result.history["weight_sync/verify_max_abs_diff"]
    assert [s for s, _ in diffs] == list(range(1, STEPS + 1))  # every step's push verified
    assert all(d <= 1e-3 for _, d in diffs)
    (rank1,) = info["trainer_ranks"]
    assert rank1["rank"] == 1 and rank1["pid"] not in (None, os.getpid())
    assert rank1["pid"] != info["trainer"]["actor_pid"]  # its own actor process
    assert _wait_dead([rank1["pid"]]) == [], "the follower rank actor outlived the run"


# ---- resume with 2 ranks -------------------------------------------------------------------------
class RecordingTrainer(Trainer):
    """Keeps the actor's and the critic's gathered weights at every push."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pushed: dict[int, dict[str, torch.Tensor]] = {}
        self.critic_at_push: dict[int, dict[str, torch.Tensor]] = {}

    async def _push(self, version: int) -> Any:
        self.pushed[version] = self.actor.state_dict_for_push()
        self.critic_at_push[version] = self.critic.full_state_dict()
        return await super()._push(version)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def own_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An embedded server of this module's own: the resume test pushes trained weights to it
    (the session's shared server must keep the tiny model's weights for the tests after)."""
    from agentrl.inference.server import launch_embedded_server

    tmp = tmp_path_factory.mktemp("ranks-server")
    handle = launch_embedded_server(
        tiny_model_dir, log_path=tmp / "server.log", startup_timeout_s=300
    )
    try:
        yield handle
    finally:
        handle.stop()


def test_resume_with_two_ranks(own_server: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    urls = [own_server.base_url]
    cfg = _cfg(tiny_model_dir, tmp_path, *GAE_KL, "trainer.world_size=2", "trainer.save_every=1")
    first = RecordingTrainer(cfg, server_urls=urls, stop_after_step=1)
    r1 = first.run_sync()
    ckpt = tmp_path / "checkpoint"
    names = sorted(p.name for p in ckpt.glob("*.pt"))
    assert names == [
        "actor.rank0.pt",
        "actor.rank1.pt",
        "critic.rank0.pt",
        "critic.rank1.pt",
        "rng.pt",
    ]
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2

    # another world size: a clear error, before any model call
    one_rank = _cfg(tiny_model_dir, tmp_path, *GAE_KL, "trainer.world_size=1")
    with pytest.raises(ValueError, match=r"trainer\.world_size=2"):
        Trainer(one_rank, server_urls=urls, resume=True).run_sync()

    second = RecordingTrainer(cfg, server_urls=urls, resume=True)
    r2 = second.run_sync()
    assert (r1.steps, r2.steps, r2.version) == (1, STEPS, STEPS)
    # second's first push (version 1, right after loading) carries first's weights of version 1
    assert _same(second.pushed[1], first.pushed[1])
    assert _same(second.critic_at_push[1], first.critic_at_push[1])
    assert not _same(first.pushed[1], first.pushed[0])  # step 1 did train
    assert not _same(second.pushed[2], second.pushed[1])  # and so did step 2, after resume
    assert second.actor.global_step == STEPS and second.critic.global_step == STEPS
