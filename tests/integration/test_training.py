"""The trainer end to end on real embedded servers: verified pushes, bounded staleness, resume,
a failed push, and the MLflow run.

Every run uses the tiny model, two embedded inference servers shared by the module, 2 tasks × 2
samples per step and short turns, so each run takes seconds on two CPU cores. Runs are cached
per module (several tests assert different things about the same run).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentrl.config import ExperimentConfig, load_config
from agentrl.inference.client import PolicyClient
from agentrl.training.trainer import Trainer, TrainResult
from agentrl.weightsync.engine import HttpStreamTransport, StagedWeights, WeightPushError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
FAMILIES = ("reward/", "actor/", "rollout_corr/", "async/", "timing_s/", "perf/", "rollout/")


def _cfg(model_dir: Path, out: Path, *overrides: str) -> ExperimentConfig:
    base = [
        f"model.path={model_dir}",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={STEPS}",
        "data.batch_size=2",
        "data.n_samples=2",
        "data.generator_val_size=2",
        "trainer.mini_batch_size=2",
        "inference.max_tokens_per_turn=16",
        "agent.max_turns=2",
        "agent.max_response_tokens=64",
        "rollout.max_concurrency=8",
        "tracking.enabled=false",
        "tracking.num_sample_trajectories=2",
        f"checkpoint.shared_dir={out / 'weights'}",
    ]
    return load_config(ROOT / "configs" / "quickstart.yaml", [*base, *overrides])


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    from agentrl.inference.server import launch_embedded_server

    tmp = tmp_path_factory.mktemp("train-servers")
    handles = []
    try:
        for i in range(2):
            handles.append(
                launch_embedded_server(
                    tiny_model_dir,
                    log_path=tmp / f"server-{i}.log",
                    extra_args=["--seed", str(i)],
                    startup_timeout_s=300,
                )
            )
        yield [h.base_url for h in handles]
    finally:
        for h in handles:
            h.stop()


async def _server_state(urls: list[str]) -> list[tuple[int, bool]]:
    out = []
    for url in urls:
        async with PolicyClient(url, timeout_s=30) as client:
            out.append(((await client.weight_info())["weight_version"], await client.is_paused()))
    return out


_RUNS: dict[tuple[int, int], tuple[TrainResult, list[tuple[int, bool]]]] = {}


@pytest.fixture(scope="module")
def staleness_run(
    servers: list[str], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
):
    """``run(η, warmup=0)``: one cached 4-step run at max_staleness η (ramped up over ``warmup``
    steps) and the servers' state right after."""

    def run(eta: int, warmup: int = 0) -> tuple[TrainResult, list[tuple[int, bool]]]:
        if (eta, warmup) not in _RUNS:
            out = tmp_path_factory.mktemp(f"eta{eta}-warmup{warmup}")
            cfg = _cfg(
                tiny_model_dir,
                out,
                f"trainer.max_staleness={eta}",
                f"trainer.staleness_warmup_steps={warmup}",
            )
            result = Trainer(cfg, server_urls=servers).run_sync()
            _RUNS[eta, warmup] = (result, asyncio.run(_server_state(servers)))
        return _RUNS[eta, warmup]

    return run


def _values(result: TrainResult, key: str) -> list[tuple[int, float]]:
    assert key in result.history, f"{key} never logged; logged: {sorted(result.history)}"
    return result.history[key]


def test_every_step_pushes_verified_weights_to_every_server(staleness_run) -> None:
    result, state = staleness_run(1)
    assert result.steps == STEPS and result.version == STEPS
    diffs = _values(result, "weight_sync/verify_max_abs_diff")
    assert [s for s, _ in diffs] == list(range(1, STEPS + 1))
    # the checkpoint engine verified on every server; tolerance from the config (default 1e-3)
    assert all(d <= 1e-3 for _, d in diffs), diffs
    assert all(f == 0.0 for _, f in _values(result, "weight_sync/failed_servers"))
    assert [v for _, v in _values(result, "weight_sync/verified_servers")] == [2.0] * STEPS
    assert state == [(STEPS, False), (STEPS, False)]
    versions = [v for _, v in _values(result, "trainer/version")]
    assert versions == [float(v) for v in range(1, STEPS + 1)]


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_staleness_never_exceeds_the_bound(staleness_run, eta: int) -> None:
    result, _ = staleness_run(eta)
    assert result.steps == STEPS
    history = _values(result, "async/staleness_max")
    assert len(history) == STEPS
    assert all(v <= eta for _, v in history), history
    if eta == 0:
        assert all(v == 0 for _, v in history)
    for family in FAMILIES:
        assert any(k.startswith(family) for k in result.history), family


def test_a_staleness_warmup_ramps_the_bound_and_the_samples_follow_it(staleness_run) -> None:
    """η = 2 ramped over 3 steps: the bound at version v is min(2, ⌊2v/3⌋) (logged after step
    v), and step s, which trains at version s - 1, gets nothing staler than the bound there."""
    result, _ = staleness_run(2, warmup=3)
    assert result.steps == STEPS == 3
    bounds = [v for _, v in _values(result, "async/staleness_bound")]
    assert bounds == [0.0, 1.0, 2.0]
    stale = [v for _, v in _values(result, "async/staleness_max")]
    assert all(v <= b for v, b in zip(stale, [0.0, *bounds[:-1]], strict=True)), stale


# ---- resume ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resumed_run(
    servers: list[str],
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """Stop after step 2 (checkpoint saved), then ``resume=True`` to step 4; MLflow enabled."""
    out = tmp_path_factory.mktemp("resume")
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        cfg = _cfg(
            tiny_model_dir,
            out,
            "trainer.max_staleness=1",
            "trainer.save_every=2",
            "tracking.enabled=true",
            "tracking.experiment=resume-test",
        )
        first = Trainer(cfg, server_urls=servers, stop_after_step=2)
        r1 = first.run_sync()
        state1 = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
        second = Trainer(cfg, server_urls=servers, resume=True)
        r2 = second.run_sync()
        state2 = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
        servers_after = asyncio.run(_server_state(servers))
    finally:
        mp.undo()
    return {
        "out": out,
        "first": first,
        "second": second,
        "r1": r1,
        "r2": r2,
        "state1": state1,
        "state2": state2,
        "servers": servers_after,
    }


def test_resume_continues_exactly(resumed_run: dict[str, Any]) -> None:
    import mlflow

    r1, r2 = resumed_run["r1"], resumed_run["r2"]
    s1, s2 = resumed_run["state1"], resumed_run["state2"]
    first, second = resumed_run["first"], resumed_run["second"]
    assert (r1.steps, r1.version) == (2, 2)
    assert (s1["step"], s1["version"]) == (2, 2)
    assert (r2.steps, r2.version) == (STEPS, STEPS)
    assert resumed_run["servers"] == [(STEPS, False), (STEPS, False)]
    # one MLflow run, continued
    assert s1["mlflow_run_id"] and s1["mlflow_run_id"] == s2["mlflow_run_id"]
    client = mlflow.MlflowClient(
        tracking_uri=f"sqlite:///{resumed_run['out'] / 'mlruns' / 'mlflow.db'}"
    )
    exp = client.get_experiment_by_name("resume-test")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [s1["mlflow_run_id"]]
    run_id = s1["mlflow_run_id"]
    for key in ("trainer/version", "reward/mean", "async/staleness_max"):
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        assert steps == list(range(1, STEPS + 1)), (key, steps)
    versions = sorted(
        (m.step, m.value) for m in client.get_metric_history(run_id, "trainer/version")
    )
    assert [v for _, v in versions] == [float(v) for v in range(1, STEPS + 1)]
    # staleness accounting continued: consumed trajectories add up, none above the bound
    assert s2["consumed_trajectories"] == STEPS * 2 * 2
    assert s1["consumed_trajectories"] == 2 * 2 * 2
    # no admitted task lost, none trained twice
    pending = [t["id"] for t in s1["pending_tasks"]]
    settled1 = set(first.trained_task_ids) | set(first.dropped_task_ids)
    # tasks pulled after the checkpoint lie past the saved data position: read again on resume
    dispatched1 = first.dispatched_task_ids[: first.dispatched_at_save]
    assert pending, "with max_staleness 1 rollouts run ahead: some tasks must be pending"
    assert set(dispatched1) == settled1 | set(pending)
    assert not settled1 & set(pending)
    assert second.dispatched_task_ids[: len(pending)] == pending  # re-dispatched first
    fresh2 = second.dispatched_task_ids[len(pending) :]
    assert not set(fresh2) & set(dispatched1)  # the data position continued
    assert not set(first.trained_task_ids) & set(second.trained_task_ids)
    assert len(first.trained_task_ids) == 4 and len(second.trained_task_ids) == 2


def test_mlflow_run_has_params_metrics_and_artifacts(resumed_run: dict[str, Any]) -> None:
    import mlflow

    out: Path = resumed_run["out"]
    run_id = resumed_run["state2"]["mlflow_run_id"]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlruns' / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["trainer.max_staleness"] == "1"
    assert params["data.batch_size"] == "2"
    metrics = run.data.metrics
    for family in (*FAMILIES, "critic/", "val/", "weight_sync/"):
        assert any(k.startswith(family) for k in metrics), (family, sorted(metrics))

    def listing(path: str | None = None) -> list[str]:
        found: list[str] = []
        for f in client.list_artifacts(run_id, path):
            found.extend(listing(f.path) if f.is_dir else [f.path])
        return found

    files = listing()
    assert "config.yaml" in files
    assert any(f.startswith("trajectories/") and f.endswith(".json") for f in files)
    for plot in ("reward", "staleness", "kl"):
        assert f"plots/{plot}.png" in files, files
    assert "final_model/config.json" in files
    assert any(f.startswith("final_model/") and f.endswith(".safetensors") for f in files)
    rows = json.loads(
        Path(
            client.download_artifacts(run_id, next(f for f in files if "trajectories/" in f))
        ).read_text()
    )
    assert rows and {"uid", "reward", "messages"} <= set(rows[0])
    # ... and the same sample episodes as traces of the run: a span per model turn and reward.
    traces = client.search_traces(locations=[run.info.experiment_id], run_id=run_id)
    assert traces, "no episode traces in the run"
    for trace in traces:
        names = [s.name for s in trace.data.spans]
        assert names[0] == "episode" and "model turn 1" in names and "reward" in names, names
        turn = next(s for s in trace.data.spans if s.name == "model turn 1")
        assert turn.attributes["tokens"] > 0 and turn.attributes["weight_version"] >= 0


# ---- a failed push ---------------------------------------------------------------------------
class CorruptingTransport(HttpStreamTransport):
    """Sends garbage safetensors bytes to one server from version ``from_version`` on: that
    server's real weight loader rejects them (a real rejection, not a scripted error)."""

    def __init__(self, bad_url: str, from_version: int) -> None:
        self.bad_url = bad_url
        self.from_version = from_version
        self.bad_attempts = 0

    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        if client.base_url == self.bad_url and staged.version >= self.from_version:
            self.bad_attempts += 1
            assert staged.data is not None
            staged = StagedWeights(
                version=staged.version,
                num_bytes=staged.num_bytes,
                data=staged.data[:16] + b"\x00garbage\x00" + staged.data[64:],
            )
        await super().load(client, staged)


def test_failed_push_resumes_servers_and_stops_with_weight_push_error(
    servers: list[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg(
        tiny_model_dir,
        tmp_path,
        "trainer.max_staleness=1",
        "checkpoint.transport=http",
        "checkpoint.push_retries=2",
    )
    transport = CorruptingTransport(servers[1], from_version=1)
    trainer = Trainer(cfg, server_urls=servers, transport=transport)
    with pytest.raises(WeightPushError) as info:
        trainer.run_sync()
    report = info.value.report
    assert not report.ok
    assert transport.bad_attempts == 3  # 1 + checkpoint.push_retries
    assert servers[1] in str(info.value)
    assert trainer.step == 1  # the step trained; its push failed and training stopped
    state = asyncio.run(_server_state(servers))
    assert [paused for _, paused in state] == [False, False]  # nobody left paused
    assert state[1][0] == 0  # the rejecting server still serves the last good version


# ---- GAE: the critic, critic warmup (frozen actor) and its resume ------------------------------
def even_token_reward(traj: Any, task: Any) -> float:
    """A dense, varied reward the random tiny model earns (share of even sampled token ids), so
    GAE returns, critic targets and advantages are non-zero (the calculator reward is 0)."""
    sampled = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    return sum(t % 2 == 0 for t in sampled) / max(1, len(sampled))


GAE = (
    "algorithm.advantage={name: gae, lam: 0.95}",
    "trainer.critic_warmup_steps=1",
    "trainer.critic_lr=1e-3",
    "trainer.max_staleness=1",
    "reward.sources.calculator=tests.integration.test_training:even_token_reward",
)
CRITIC_KEYS = (
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/values_mean",
    "critic/returns_mean",
    "critic/vf_explained_var",
    "critic/grad_norm",
    "critic/lr",
)


class RecordingTrainer(Trainer):
    """Keeps a copy of the actor's pushed weights and of the critic's state at every push."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pushed: dict[int, dict[str, Any]] = {}
        self.critic_at_push: dict[int, dict[str, Any]] = {}

    async def _push(self, version: int):
        self.pushed[version] = {k: v.clone() for k, v in self.actor.state_dict_for_push().items()}
        if self.critic is not None:
            state = self.critic.state_dict()
            self.critic_at_push[version] = {
                "model": {k: v.clone() for k, v in state["model"].items()},
                "value_head": {k: v.clone() for k, v in state["value_head"].items()},
                "optimizer_steps": [float(s["step"]) for s in state["optimizer"]["state"].values()],
                "global_step": state["global_step"],
            }
        return await super()._push(version)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


@pytest.fixture(scope="module")
def gae_run(
    servers: list[str], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RecordingTrainer, TrainResult]:
    out = tmp_path_factory.mktemp("gae")
    trainer = RecordingTrainer(_cfg(tiny_model_dir, out, *GAE), server_urls=servers)
    return trainer, trainer.run_sync()


def test_gae_critic_warmup_freezes_the_actor_then_trains_it(gae_run) -> None:
    trainer, result = gae_run
    assert result.steps == STEPS and result.version == STEPS
    assert sorted(trainer.pushed) == list(range(STEPS + 1))  # initial push + one per step
    # step 1 (critic warmup): the actor is frozen; the push carries the same weights, new version
    assert _same(trainer.pushed[1], trainer.pushed[0])
    assert [v for _, v in _values(result, "actor/frozen")] == [1.0, 0.0, 0.0]
    # steps 2 and 3 train the actor
    assert not _same(trainer.pushed[2], trainer.pushed[1])
    assert not _same(trainer.pushed[3], trainer.pushed[2])
    assert [s for s, _ in _values(result, "actor/pg_loss")] == [2, 3]
    assert trainer.actor.global_step == STEPS - 1  # its LR schedule did not move while frozen
    # the critic trains (and is logged) every step
    assert trainer.critic is not None and trainer.critic.global_step == STEPS
    for key in CRITIC_KEYS:
        assert [s for s, _ in _values(result, key)] == list(range(1, STEPS + 1)), key
    head = [trainer.critic_at_push[v]["value_head"]["weight"] for v in range(STEPS + 1)]
    assert all(not bool((head[v] == head[v + 1]).all()) for v in range(STEPS))
    assert all(v > 0 for _, v in _values(result, "critic/returns_mean"))
    assert _values(result, "critic/values_mean")[0][1] == 0.0  # zero-initialised value head
    assert all(v > 0 for _, v in _values(result, "critic/vf_loss"))
    # every push (frozen or not) was verified on both servers
    diffs = _values(result, "weight_sync/verify_max_abs_diff")
    assert [s for s, _ in diffs] == list(range(1, STEPS + 1))
    assert all(d <= 1e-3 for _, d in diffs), diffs
    assert [v for _, v in _values(result, "weight_sync/verified_servers")] == [2.0] * STEPS


def test_non_gae_runs_build_no_critic(staleness_run) -> None:
    result, _ = staleness_run(1)
    assert not any(k in result.history for k in CRITIC_KEYS)
    assert "actor/frozen" not in result.history


def test_gae_resume_restores_the_critic_exactly(
    servers: list[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg(tiny_model_dir, tmp_path, *GAE, "trainer.save_every=1")
    first = RecordingTrainer(cfg, server_urls=servers, stop_after_step=1)
    r1 = first.run_sync()
    assert (tmp_path / "checkpoint" / "critic.pt").exists()
    second = RecordingTrainer(cfg, server_urls=servers, resume=True)
    r2 = second.run_sync()
    assert (r1.steps, r2.steps, r2.version) == (1, STEPS, STEPS)
    # second's first push (version 1, right after loading) sees first's critic at version 1
    saved, loaded = first.critic_at_push[1], second.critic_at_push[1]
    assert saved["global_step"] == loaded["global_step"] == 1
    assert saved["optimizer_steps"] == loaded["optimizer_steps"] and saved["optimizer_steps"]
    assert _same(saved["model"], loaded["model"])
    assert _same(saved["value_head"], loaded["value_head"])
    assert not _same(loaded["value_head"], first.critic_at_push[0]["value_head"])
    # the warmup step is not repeated after resume: the actor trains on steps 2 and 3
    assert [v for _, v in _values(r2, "actor/frozen")] == [0.0, 0.0]
    assert second.critic is not None and second.critic.global_step == STEPS


# ---- validation at val_every, ReMax's greedy baseline, KL in the reward --------------------------
def test_periodic_validation_is_logged_at_the_configured_steps(
    servers: list[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg(tiny_model_dir, tmp_path, "trainer.val_every=1")
    result = Trainer(cfg, server_urls=servers).run_sync()
    assert [step for step, _ in result.val_history] == [1, 2]  # the last step: val_after
    assert result.val_before and result.val_after
    logged = [step for step, _ in result.history["val/accuracy"]]
    assert logged == [0, 1, 2, STEPS]


def test_no_validation_when_asked(servers: list[str], tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(tiny_model_dir, tmp_path, "data.generator_val_size=0", "trainer.total_steps=1")
    result = Trainer(cfg, server_urls=servers).run_sync()
    assert (
        result.val_before == {} and result.val_after == {} and "val/accuracy" not in result.history
    )


def test_remax_trains_on_a_greedy_baseline_and_kl_reaches_the_reward(
    servers: list[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg(
        tiny_model_dir,
        tmp_path,
        "algorithm.advantage=remax",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl={type: adaptive, kl_coef: 0.05, target_kl: 0.01, horizon: 100}",
        "reward.sources.calculator=tests.integration.test_training:even_token_reward",
        "trainer.total_steps=2",
    )
    result = Trainer(cfg, server_urls=servers).run_sync()
    assert result.steps == 2
    assert next(v for _, v in _values(result, "critic/advantages_abs_max")) > 0
    coeffs = [v for _, v in _values(result, "actor/reward_kl_penalty_coeff")]
    assert coeffs[0] == pytest.approx(0.05)  # the step-1 β; the controller moves it afterwards
    assert all(math.isfinite(v) for _, v in _values(result, "actor/reward_kl_penalty"))
