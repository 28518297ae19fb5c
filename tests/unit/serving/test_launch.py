"""One spec for every server: a local policy server, a model reward's server and a Ray-placed
server are described by the same ``spec_for`` and launched by the same ``launch``.

No process starts: the launchers are replaced by recorders, and Ray by an in-process fake that
pickles every actor argument (as Ray does) and calls the actor's methods directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from agentrl.serving import ServerSpec, served_model, spec_for, start_model_servers, start_servers
from agentrl.threads import make_plan
from tests.fakes import experiment


class _Handle:
    """What a launcher returns, for a server that never ran (its pid is an exited process)."""

    def __init__(self, n: int) -> None:
        done = subprocess.Popen([sys.executable, "-c", "pass"])
        done.wait()
        self.pid, self.base_url, self.log_path = done.pid, f"http://127.0.0.1:{9000 + n}", None
        self.stopped = False

    def stop(self) -> int:
        self.stopped = True
        return 0


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every launch as ``(launcher name, its keyword arguments)``, in order."""
    import agentrl.inference.server
    import agentrl.inference.vllm_backend

    calls: list[tuple[str, dict[str, Any]]] = []

    def recorder(name: str) -> Any:
        def launch(**kwargs: Any) -> _Handle:
            calls.append((name, kwargs))
            return _Handle(len(calls))

        return launch

    for module, name in [
        (agentrl.inference.server, "launch_embedded_server"),
        (agentrl.inference.vllm_backend, "launch_vllm_server"),
    ]:
        monkeypatch.setattr(module, name, recorder(name))
    return calls


def _fake_ray() -> types.SimpleNamespace:
    """``ray.remote(cls).options(...).remote(*args)`` builds ``cls`` here from pickled
    arguments; ``actor.method.remote()`` calls the method; ``ray.get`` returns its input."""

    class Actor:
        def __init__(self, obj: Any) -> None:
            self.obj = obj

        def __getattr__(self, name: str) -> Any:
            return types.SimpleNamespace(remote=getattr(self.obj, name))

    class Remote:
        def __init__(self, cls: type) -> None:
            self.cls = cls

        def options(self, **_: Any) -> Remote:
            return self

        def remote(self, *args: Any, **kwargs: Any) -> Actor:
            args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
            return Actor(self.cls(*args, **kwargs))

    return types.SimpleNamespace(
        remote=Remote, get=lambda refs, timeout=None: refs, is_initialized=lambda: False
    )


def _config(tmp_path: Path, *overrides: str) -> Any:
    for name in ("rm", "judge"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "config.json").write_text("{}")
    models = (
        f"{{rm: {{type: reward_model, path: {tmp_path / 'rm'}}}, "
        f"judge: {{type: judge, path: {tmp_path / 'judge'}}}}}"
    )
    return experiment(
        f"trainer.output_dir={tmp_path / 'run'}",
        "trainer.seed=7",
        "inference.device=cpu",
        f"reward.models={models}",
        "reward.sources={calculator: {terms: {calculator: 1.0, rm: 1.0, judge: 1.0}}}",
        *overrides,
    )


def _place_on_fake_ray(
    cfg: Any, model: Path, plan: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Any], list[str]]:
    from agentrl.distributed import ray_backend

    monkeypatch.setitem(sys.modules, "ray", _fake_ray())
    actors: list[Any] = []
    servers, urls = ray_backend._place_servers(cfg, str(model), "127.0.0.1", plan, actors)
    for actor in actors:
        actor.obj.shutdown()
    return servers, urls


def test_policy_reward_model_judge_and_ray_servers_launch_from_one_spec(
    tmp_path: Path, launched: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path)
    cfg.inference.api_key = "key"  # as run_with_ray hands the run's key to its actors
    model, plan = tmp_path / "policy", make_plan(1, cpus=4, reward_servers=2)

    async def local() -> None:
        async with contextlib.AsyncExitStack() as stack:
            await start_servers(cfg, model, plan, stack, "key")
            await start_model_servers(cfg, plan, stack, "key")

    asyncio.run(local())
    _place_on_fake_ray(cfg, model, plan, monkeypatch)
    (_, policy), (_, rm), (_, judge), (ray_name, on_ray) = launched
    # The Ray actor launches exactly what the local run launches; only its log file is its own.
    assert ray_name == "launch_embedded_server"
    assert {**on_ray, "log_path": None} == {**policy, "log_path": None}
    assert on_ray["log_path"].name == "embedded-0.log" and policy["log_path"].name == "server-0.log"
    # A model reward's server is the policy server with its task and its own model and share.
    base = ["--max-batch-size", "32", "--seed", "7", "--device", "cpu", "--dtype", "float32"]
    assert policy["extra_args"] == [*base[:2], "--prefix-cache-mb", "256.0", *base[2:]]
    assert rm["extra_args"] == ["--task", "score", *base]
    assert judge["extra_args"] == ["--task", "generate", *base]
    assert (rm["model_dir"], judge["model_dir"]) == (tmp_path / "rm", tmp_path / "judge")
    shares = [s.env() for s in (*plan.servers, *plan.reward_servers)]
    assert [policy["env"], rm["env"], judge["env"]] == shares
    assert {c["api_key"] for _, c in launched} == {"key"}


def test_lora_on_vllm_reaches_the_ray_server_as_it_reaches_the_local_one(
    tmp_path: Path, launched: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(
        tmp_path,
        "inference.backend=vllm",
        "model.lora.rank=4",
        "model.trust_remote_code=true",
        "inference.vllm_extra_args=[--max-model-len, '256']",
    )
    cfg.inference.api_key = "key"
    model, plan = tmp_path / "policy", make_plan(1, external_servers=True)

    async def local() -> None:
        async with contextlib.AsyncExitStack() as stack:
            await start_servers(cfg, model, plan, stack, "key")

    asyncio.run(local())
    _place_on_fake_ray(cfg, model, make_plan(1), monkeypatch)
    (_, policy), (ray_name, on_ray) = launched
    assert ray_name == "launch_vllm_server"
    assert {**on_ray, "log_path": None} == {**policy, "log_path": None}
    assert on_ray["extra_args"] == [
        *("--max-num-seqs", "32", "--trust-remote-code"),
        *("--enable-lora", "--max-lora-rank", "8", "--max-model-len", "256"),
    ]
    assert on_ray["env"] == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert on_ray["threads"] is None  # vLLM sizes itself, on Ray as locally
    assert served_model(cfg) == "agentrl-lora"  # rollouts (Ray workers too) ask for the adapter


def test_prefix_cache_mb_reaches_both_backends(tmp_path: Path, launched: list) -> None:
    """The knob is not ignored on vLLM: 0 turns vLLM's own prefix caching off."""
    for backend, mb, expect in (
        ("embedded", 0, ["--prefix-cache-mb", "0.0"]),
        ("embedded", 64, ["--prefix-cache-mb", "64.0"]),
        ("vllm", 0, ["--no-enable-prefix-caching"]),
    ):
        launched.clear()
        cfg = _config(tmp_path, f"inference.backend={backend}", f"inference.prefix_cache_mb={mb}")
        plan = make_plan(1, external_servers=backend == "vllm")

        async def local(cfg: Any = cfg, plan: Any = plan) -> None:
            async with contextlib.AsyncExitStack() as stack:
                await start_servers(cfg, tmp_path / "policy", plan, stack, "key")

        asyncio.run(local())
        args = launched[0][1]["extra_args"]
        assert all(a in args for a in expect), (backend, mb, args)
    cfg = _config(tmp_path, "inference.backend=vllm")  # vLLM keeps its default otherwise
    launched.clear()

    async def vllm_default() -> None:
        async with contextlib.AsyncExitStack() as stack:
            await start_servers(
                cfg, tmp_path / "policy", make_plan(1, external_servers=True), stack, "key"
            )

    asyncio.run(vllm_default())
    assert not any("prefix-caching" in a for a in launched[0][1]["extra_args"])


def test_lora_with_vllm_on_ray_is_no_longer_refused() -> None:
    from agentrl.training.resolve import resolve_experiment

    cfg = experiment("model.lora.rank=4", "inference.backend=vllm", "distributed.backend=ray")
    assert resolve_experiment(cfg).plan is not None


def test_a_spec_pickles_hides_its_key_and_names_a_wrong_backend(tmp_path: Path) -> None:
    spec = spec_for(_config(tmp_path), model=tmp_path, api_key="secret", plan=make_plan(1))
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert "secret" not in repr(spec)
    with pytest.raises(ValueError, match=r"inference\.backend='external'"):
        spec_for(
            _config(tmp_path, "inference.backend=external", "inference.urls=[http://h:1]"),
            model=tmp_path,
        )
    with pytest.raises(ValueError, match=r"reward.models.rm.type is 'reward_model', not 'judge'"):
        spec_for(_config(tmp_path), "judge", name="rm")
    with pytest.raises(ValueError, match="needs model="):
        spec_for(_config(tmp_path))
    with pytest.raises(ValueError, match=r"ServerSpec.role='critic'"):
        ServerSpec(backend="embedded", model=tmp_path, role="critic")  # type: ignore[arg-type]


def test_the_teacher_launches_from_the_same_spec_with_its_task_and_the_next_share(
    tmp_path: Path, launched: list
) -> None:
    from agentrl.serving import start_teacher_servers

    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "config.json").write_text("{}")
    cfg = _config(tmp_path, f"teacher.path={tmp_path / 'teacher'}")
    plan = make_plan(1, cpus=4, reward_servers=3)  # rm, judge, then the teacher

    async def local() -> list[str]:
        async with contextlib.AsyncExitStack() as stack:
            return await start_teacher_servers(cfg, plan, stack, "key")

    assert asyncio.run(local()) == ["http://127.0.0.1:9001"]
    ((name, teacher),) = launched
    base = ["--max-batch-size", "32", "--seed", "7", "--device", "cpu", "--dtype", "float32"]
    assert name == "launch_embedded_server"
    assert teacher["extra_args"] == ["--task", "logprobs", *base]
    assert (
        teacher["model_dir"] == tmp_path / "teacher"
        and teacher["env"] == plan.reward_servers[2].env()
    )
    vllm = spec_for(
        _config(
            tmp_path,
            f"teacher.path={tmp_path / 'teacher'}",
            "teacher.backend=vllm",
            "teacher.vllm_extra_args=[--max-model-len, '512']",
        ),
        "teacher",
    )
    assert vllm.backend == "vllm" and vllm.extra_args == ("--max-model-len", "512")
    assert asyncio.run(_no_teacher(_config(tmp_path), plan)) == []


async def _no_teacher(cfg: Any, plan: Any) -> list[str]:
    from agentrl.serving import start_teacher_servers

    async with contextlib.AsyncExitStack() as stack:
        return await start_teacher_servers(cfg, plan, stack, None)
