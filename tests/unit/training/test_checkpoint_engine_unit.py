"""CheckpointEngine unit tests: the transports (staging, atomic version dirs, cleanup, bytes),
``make_transport``, the report, and the push procedure against the scripted fake server
(``tests/fakes.py``). Real servers are in ``tests/integration/test_checkpoint_engine.py``."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load, load_file

from agentrl.inference.client import PolicyClient
from agentrl.inference.lora import ADAPTER_CONFIG, ADAPTER_FILE, METADATA_KEY, LoraAdapter, LoraSpec
from agentrl.weightsync.engine import (
    VLLM_LORA_NAME,
    CheckpointEngine,
    HttpStreamTransport,
    PushReport,
    ServerPushStatus,
    SharedDirTransport,
    StagedWeights,
    WeightPushError,
    make_transport,
    tied_aliases,
)
from tests.fakes import FakeInferenceServer


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.norm.weight": torch.ones(8),
        "lm_head.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
    }


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


# ---- transports -------------------------------------------------------------------------------


def test_shared_dir_stage_writes_one_complete_version_dir(tmp_path: Path) -> None:
    transport = SharedDirTransport(tmp_path / "w")
    state = _state()
    staged = transport.stage(state, 3)
    assert staged.version == 3
    assert staged.path == tmp_path / "w" / "v3"
    assert staged.data is None
    file = tmp_path / "w" / "v3" / "model.safetensors"
    assert staged.num_bytes == file.stat().st_size > 0
    _assert_same(load_file(str(file)), state)
    # Nothing half-written is left next to it.
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v3"]


def test_shared_dir_restaging_a_version_replaces_it_and_clears_a_crashed_tmp(
    tmp_path: Path,
) -> None:
    transport = SharedDirTransport(tmp_path)
    transport.stage(_state(0), 5)
    # A stage that crashed half-way leaves only its hidden tmp dir behind.
    (tmp_path / ".v5.tmp").mkdir()
    (tmp_path / ".v5.tmp" / "model.safetensors").write_bytes(b"garbage")
    staged = transport.stage(_state(1), 5)
    assert staged.path is not None
    _assert_same(load_file(str(staged.path / "model.safetensors")), _state(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v5"]


def test_shared_dir_stage_is_atomic_a_failed_write_keeps_the_old_version(tmp_path: Path) -> None:
    transport = SharedDirTransport(tmp_path)
    transport.stage(_state(0), 2)
    bad = {"a": torch.zeros(2), "b": torch.zeros(4).as_strided((4,), (0,))}  # non-contiguous
    with pytest.raises(ValueError, match="contiguous"):
        transport.stage(bad, 2)
    # The previous complete v2 was not replaced by a partial one.
    _assert_same(load_file(str(tmp_path / "v2" / "model.safetensors")), _state(0))


def test_shared_dir_cleanup_keeps_only_the_latest_version(tmp_path: Path) -> None:
    transport = SharedDirTransport(tmp_path)
    for v in (1, 2, 3):
        transport.stage(_state(v), v)
    (tmp_path / "unrelated.txt").write_text("kept")
    transport.cleanup(keep_version=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated.txt", "v3"]
    transport.remove()
    assert not tmp_path.exists()


def test_shared_dir_default_root_is_tmpfs_when_available() -> None:
    transport = SharedDirTransport()
    try:
        assert transport.root.is_dir()
        assert transport.root.name.startswith("agentrl-weights-")
        if Path("/dev/shm").is_dir():
            assert transport.root.parent == Path("/dev/shm")
    finally:
        transport.remove()


def test_http_stage_bytes_load_back_to_identical_tensors() -> None:
    state = _state(7)
    staged = HttpStreamTransport().stage(state, 9)
    assert staged.version == 9
    assert staged.path is None
    assert staged.data is not None
    assert staged.num_bytes == len(staged.data)
    _assert_same(load(staged.data), state)


def test_both_transports_move_the_same_bytes(tmp_path: Path) -> None:
    state = _state(2)
    http = HttpStreamTransport().stage(state, 1)
    shared = SharedDirTransport(tmp_path).stage(state, 1)
    assert shared.path is not None
    assert (shared.path / "model.safetensors").read_bytes() == http.data


def test_make_transport_builds_each_transport(tmp_path: Path) -> None:
    shared = make_transport("shared_dir", shared_dir=tmp_path / "w")
    assert isinstance(shared, SharedDirTransport)
    assert shared.root.parent == tmp_path / "w" and shared.root.name.startswith("run-")
    assert isinstance(make_transport("http"), HttpStreamTransport)


def test_two_runs_on_one_shared_dir_keep_their_versions(tmp_path: Path) -> None:
    """Two runs with the same checkpoint.shared_dir (or both the default) stage apart: one's
    cleanup and removal never delete the other's version (seen on a Ray run next to a test
    run: 'no safetensors weights at /dev/shm/agentrl/v1')."""
    a, b = (make_transport("shared_dir", shared_dir=tmp_path) for _ in range(2))
    assert isinstance(a, SharedDirTransport) and isinstance(b, SharedDirTransport)
    staged = a.stage(_state(0), 1)
    b.stage(_state(1), 2)
    b.cleanup(keep_version=2)
    b.remove()
    assert staged.path is not None and (staged.path / "model.safetensors").is_file()
    a.remove()
    assert list(tmp_path.iterdir()) == []


def test_make_transport_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"checkpoint\.transport='ftp'.*shared_dir.*collective"):
        make_transport("ftp")
    with pytest.raises(ValueError, match=r"'nccl' was renamed: use 'collective'"):
        make_transport("nccl")


def test_transport_from_config_passes_the_collective_knobs(tmp_path: Path) -> None:
    from agentrl.config import CheckpointConfig
    from agentrl.weightsync.collective import CollectiveTransport
    from agentrl.weightsync.engine import transport_from_config

    ck = CheckpointConfig(
        transport="collective", bucket_mb=2, collective_backend="gloo", collective_timeout_s=7
    )
    transport = transport_from_config(ck)
    assert isinstance(transport, CollectiveTransport)
    assert (transport.bucket_bytes, transport.resolved_backend(), transport.timeout_s) == (
        2 << 20,
        "gloo",
        7.0,
    )
    shared = transport_from_config(CheckpointConfig(shared_dir=str(tmp_path / "w")))
    assert isinstance(shared, SharedDirTransport) and shared.root.parent == tmp_path / "w"


def test_resolve_says_what_collective_needs_on_a_cpu_machine(monkeypatch) -> None:
    from agentrl.config import ExperimentConfig
    from agentrl.training import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = ExperimentConfig.model_validate({"checkpoint": {"transport": "collective"}})
    resolve._transport(cfg)  # gloo on CPU, embedded servers: fine
    cfg.checkpoint.collective_backend = "nccl"
    with pytest.raises(resolve.RegistryError, match=r"collective_backend: 'nccl' needs GPUs"):
        resolve._transport(cfg)
    cfg = ExperimentConfig.model_validate(
        {"checkpoint": {"transport": "collective"}, "inference": {"backend": "vllm"}}
    )
    with pytest.raises(resolve.RegistryError, match=r"vLLM's NCCL weight-transfer API.*shared_dir"):
        resolve._transport(cfg)


# ---- report -----------------------------------------------------------------------------------


def test_report_describes_each_server_and_raises_when_one_failed() -> None:
    report = PushReport(version=4, transport="http", num_bytes=100)
    report.servers = {
        "http://a": ServerPushStatus("http://a", stage="done", version=4, verify_max_abs_diff=2e-6),
        "http://b": ServerPushStatus("http://b", stage="transfer", version=3, error="HTTP 400"),
        "http://c": ServerPushStatus("http://c", stage="pause", version=None, error="refused"),
    }
    assert not report.ok
    assert report.max_abs_diff == pytest.approx(2e-6)
    text = report.describe()
    assert "http://a: on version 4, serving, ok" in text
    assert "http://b: on version 3, serving, FAILED at transfer: HTTP 400" in text
    assert "http://c: on version None, unreachable, FAILED at pause" in text
    metrics = report.metrics()
    assert metrics["weight_sync/failed_servers"] == 2.0
    assert metrics["weight_sync/bytes"] == 100.0
    assert metrics["weight_sync/verify_max_abs_diff"] == pytest.approx(2e-6)
    with pytest.raises(WeightPushError, match="http://b") as info:
        report.raise_if_failed()
    assert info.value.report is report


def test_an_empty_report_is_not_ok() -> None:
    assert not PushReport(version=1).ok


# ---- the push procedure against scripted servers ----------------------------------------------


def _clients(*fakes: FakeInferenceServer) -> list[PolicyClient]:
    return [
        PolicyClient(f.url, transport=f.transport(), max_retries=1, backoff_s=0.01) for f in fakes
    ]


class _FailingLoad(HttpStreamTransport):
    """Raises in ``load`` for one URL (a trainer-side transfer failure) and records the server's
    paused state while loading."""

    def __init__(self, fail_url: str, fakes: list[FakeInferenceServer]) -> None:
        super().__init__()
        self.fail_url = fail_url
        self.fakes = fakes
        self.paused_during_load: dict[str, bool] = {}

    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        fake = next(f for f in self.fakes if f.url == client.base_url)
        self.paused_during_load[client.base_url] = fake.paused
        if client.base_url == self.fail_url:
            raise OSError("transfer broke")
        await super().load(client, staged)


async def test_push_pauses_loads_resets_sets_version_and_resumes_in_order() -> None:
    a, b = FakeInferenceServer("http://a", version=2), FakeInferenceServer("http://b", version=2)
    ticks = itertools.count()
    engine = CheckpointEngine(
        _clients(a, b), HttpStreamTransport(), pause_mode="abort", clock=lambda: next(ticks)
    )
    report = await engine.push(_state(), 3)
    assert report.ok, report.describe()
    assert report.transport == "http"
    assert report.num_bytes > 0
    for fake in (a, b):
        assert fake.version == 3
        assert not fake.paused
        paths = [p for p, _ in fake.control_calls]
        assert paths == [
            "/push_lease",  # one writer: the fake has no lease (404), so the push goes on
            "/pause",
            "/update_weights",
            "/reset_prefix_cache",
            "/update_weight_version",
            "/weights/verified",  # kept as the weights to roll back to
            "/resume",
            "/is_paused",  # read back: a push never reports serving for a paused server
        ]
        assert fake.control_calls[1][1]["mode"] == "abort"
        # The server resumes by itself if the trainer dies mid-push.
        assert float(fake.control_calls[1][1]["timeout_s"]) > engine.push_timeout_s
    metrics = report.metrics()
    assert set(metrics) >= {
        "weight_sync/push_s",
        "weight_sync/stage_s",
        "weight_sync/bytes",
        "weight_sync/failed_servers",
        "timing_s/push/stage",
        "timing_s/push/pause",
        "timing_s/push/transfer",
        "timing_s/push/verify",
        "timing_s/push/resume",
    }
    # A counting clock (one tick per reading): each phase is timed inside the push, in order,
    # so the phases add up to no more than the whole; no wall clock is read.
    parts = sum(metrics[f"timing_s/push/{k}"] for k in ("stage", "pause", "transfer", "resume"))
    assert 0 < parts <= metrics["weight_sync/push_s"]


async def test_a_failed_transfer_still_resumes_and_reports_the_old_version() -> None:
    a, b = FakeInferenceServer("http://a", version=1), FakeInferenceServer("http://b", version=1)
    transport = _FailingLoad("http://b", [a, b])
    engine = CheckpointEngine(_clients(a, b), transport)
    report = await engine.push(_state(), 2)
    assert transport.paused_during_load == {"http://a": True, "http://b": True}
    assert not report.ok
    sa, sb = report.servers["http://a"], report.servers["http://b"]
    assert sa.ok and sa.version == 2
    assert sb.stage == "transfer" and sb.version == 1 and not sb.paused
    assert sb.error is not None and "transfer broke" in sb.error
    assert not a.paused and not b.paused
    assert ("/resume", {}) in b.control_calls
    with pytest.raises(WeightPushError, match=r"http://b: on version 1, serving, FAILED"):
        report.raise_if_failed()


async def test_an_unreachable_server_is_reported_unreachable_not_paused() -> None:
    a, b = FakeInferenceServer("http://a"), FakeInferenceServer("http://b")
    b.alive = False
    engine = CheckpointEngine(_clients(a, b), HttpStreamTransport(), push_timeout_s=5)
    report = await asyncio.wait_for(engine.push(_state(), 1), timeout=30)
    sb = report.servers["http://b"]
    assert sb.stage == "lease" and sb.version is None and not sb.paused
    assert "unreachable" in report.describe()
    assert report.servers["http://a"].ok and a.version == 1 and not a.paused


async def test_a_hanging_transfer_is_bounded_by_push_timeout_and_resumed() -> None:
    class Hang(HttpStreamTransport):
        async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
            await asyncio.sleep(3600)

    a = FakeInferenceServer("http://a")
    engine = CheckpointEngine(_clients(a), Hang(), push_timeout_s=0.2)
    report = await asyncio.wait_for(engine.push(_state(), 1), timeout=10)
    status = report.servers["http://a"]
    assert status.stage == "transfer" and "TimeoutError" in (status.error or "")
    assert not a.paused and a.version == 0


async def test_a_cancelled_push_still_resumes_the_server() -> None:
    a = FakeInferenceServer("http://a")
    loading = asyncio.Event()

    class Slow(HttpStreamTransport):
        async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
            loading.set()
            await asyncio.sleep(3600)

    engine = CheckpointEngine(_clients(a), Slow())
    task = asyncio.create_task(engine.push(_state(), 1))
    await asyncio.wait_for(loading.wait(), timeout=10)
    assert a.paused
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not a.paused


async def test_verify_compares_probe_logprobs_with_the_trainers_score() -> None:
    # The fake answers every token with logprob -0.5.
    a = FakeInferenceServer("http://a")
    seen: list[tuple[list[int], list[int]]] = []

    def score(prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        seen.append((prompt_ids, token_ids))
        return [-0.5 + 1e-6] * len(token_ids)

    ticks = itertools.count()  # a counting clock: every timed phase spans at least one tick
    engine = CheckpointEngine(
        _clients(a),
        HttpStreamTransport(),
        probe_prompt_ids=[5, 6],
        probe_tokens=3,
        clock=lambda: next(ticks),
    )
    report = await engine.push(_state(), 1, score=score)
    assert report.ok
    # The teacher-forced probe (9, 10, 11 after the prompt) is scored once, before the pause.
    assert seen == [([5, 6], [9, 10, 11])]
    assert report.max_abs_diff == pytest.approx(1e-6, abs=1e-9)
    assert report.metrics()["weight_sync/verify_max_abs_diff"] == pytest.approx(1e-6, abs=1e-9)
    assert 0 < report.verify_seconds < report.total_seconds  # timed inside the push
    # Verified while still paused, through the probe route, before the resume.
    (probe,) = a.probe_requests
    assert probe["paused"] and probe["body"]["temperature"] == 1.0
    assert probe["body"]["token_ids"] == [9, 10, 11] and probe["body"]["prompt"] == [5, 6]
    paths = [p for p, _ in a.control_calls]
    assert paths.index("/update_weight_version") < paths.index("/resume")
    assert not a.generate_requests  # nothing was generated through the queue
    assert report.servers["http://a"].verified_while_paused
    assert report.metrics()["weight_sync/verified_while_paused"] == 1.0


async def test_vllm_is_verified_right_after_the_resume() -> None:
    # vLLM serves nothing while paused: the probe is a generation after the resume.
    a = FakeInferenceServer("http://a", version_in_body=False)
    engine = CheckpointEngine(_clients(a), SharedDirTransportStub(), probe_tokens=2)
    report = await engine.push(_state(), 1, score=lambda p, t: [-0.5] * len(t))
    assert report.ok, report.describe()
    status = report.servers["http://a"]
    assert not status.verified_while_paused and status.verify_max_abs_diff == 0.0
    assert not a.probe_requests and len(a.generate_requests) == 1
    assert a.paths.index("/v1/completions") > a.paths.index("/resume")


class SharedDirTransportStub(HttpStreamTransport):
    """Stages like the HTTP transport but loads through ``update_weights_from_path`` (what a
    vLLM server takes), recording the staged names."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        assert staged.payload is not None
        self.names = [name for name, _ in staged.payload.tensors]
        await client.update_weights_from_path(f"/weights/v{staged.version}", staged.version)


def _tied_state() -> dict[str, torch.Tensor]:
    state = _state()
    del state["lm_head.weight"]  # what state_dict_for_push gives for a tied model
    return state


@pytest.mark.parametrize("vllm", [True, False])
async def test_a_tied_lm_head_is_sent_explicitly_to_vllm_only(vllm: bool) -> None:
    a = FakeInferenceServer("http://a", version_in_body=not vllm)
    transport = SharedDirTransportStub()
    report = await CheckpointEngine(_clients(a), transport).push(_tied_state(), 1)
    assert report.ok, report.describe()
    assert ("lm_head.weight" in transport.names) is vllm
    assert tied_aliases(_tied_state()) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tied_aliases(_state()) == {}


async def test_a_pause_that_lands_after_the_resume_is_resumed_again_and_never_reported_serving():
    # A `wait` pause whose answer timed out can land on the server after the push's resume.
    a = FakeInferenceServer("http://a")
    late = {"n": 1}

    class LatePause(HttpStreamTransport):
        async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
            await asyncio.sleep(3600)  # the push times out in the transfer

    original = a._handle

    async def handle(request):  # the first resume is overtaken by the late pause
        response = await original(request)
        if request.url.path == "/resume" and late["n"]:
            late["n"] -= 1
            a.paused = True
        return response

    a._handle = handle  # type: ignore[method-assign]  # scripted race
    engine = CheckpointEngine(_clients(a), LatePause(), push_timeout_s=0.2)
    report = await asyncio.wait_for(engine.push(_state(), 1), timeout=10)
    status = report.servers["http://a"]
    assert not a.paused and not status.paused
    assert [p for p, _ in a.control_calls].count("/resume") == 2
    assert "serving" in report.describe() and status.stage == "transfer"


async def test_a_server_that_stays_paused_is_reported_paused():
    a = FakeInferenceServer("http://a")
    original = a._handle

    async def handle(request):
        response = await original(request)
        a.paused = True  # nothing resumes it
        return response

    a._handle = handle  # type: ignore[method-assign]  # scripted stuck server
    report = await CheckpointEngine(_clients(a), HttpStreamTransport()).push(_state(), 1)
    status = report.servers["http://a"]
    assert status.paused and not report.ok
    assert "PAUSED" in report.describe() and "still paused" in (status.error or "")


def test_url_clients_carry_the_api_key() -> None:
    engine = CheckpointEngine(["http://a:1"], HttpStreamTransport(), api_key="sekret")
    assert engine.clients[0]._http.headers["authorization"] == "Bearer sekret"


async def test_verify_scores_each_distinct_probe_once() -> None:
    # Both fakes answer the probe with the same tokens (a function of the prompt).
    a, b = FakeInferenceServer("http://a"), FakeInferenceServer("http://b")
    calls: list[list[int]] = []

    def score(prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        calls.append(token_ids)
        return [-0.5] * len(token_ids)

    engine = CheckpointEngine(_clients(a, b), HttpStreamTransport(), probe_tokens=2)
    report = await engine.push(_state(), 1, score=score)
    assert report.ok
    assert len(calls) == 1
    assert all(s.verify_max_abs_diff == 0.0 for s in report.servers.values())


async def test_verify_mismatch_fails_loudly_and_async_score_is_awaited() -> None:
    a = FakeInferenceServer("http://a")

    async def score(prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        return [-0.4] * len(token_ids)

    engine = CheckpointEngine(_clients(a), HttpStreamTransport(), verify_tolerance=1e-3)
    report = await engine.push(_state(), 1, score=score)
    status = report.servers["http://a"]
    assert not report.ok and status.stage == "verify"
    assert status.verify_max_abs_diff == pytest.approx(0.1)
    with pytest.raises(WeightPushError, match=r"http://a.*verify.*verify_tolerance"):
        report.raise_if_failed()
    assert not a.paused


def test_engine_needs_a_server() -> None:
    with pytest.raises(ValueError, match="at least one server"):
        CheckpointEngine([], HttpStreamTransport())


async def test_aclose_closes_the_clients_and_stops_the_weight_server() -> None:
    a = FakeInferenceServer("http://a")
    transport = HttpStreamTransport()
    engine = CheckpointEngine(_clients(a), transport)
    await engine.push(_state(), 1)
    assert transport._server is not None  # pull mode published the payload
    await engine.aclose()
    assert transport._server is None and engine.clients[0]._http.is_closed


# ---- LoRA adapters and the prepare hook ----------------------------------------------------------


def _adapter() -> LoraAdapter:
    g = torch.Generator().manual_seed(3)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return LoraAdapter(
        state={
            f"{prefix}.lora_A.weight": torch.randn(4, 8, generator=g),
            f"{prefix}.lora_B.weight": torch.randn(8, 4, generator=g),
        },
        spec=LoraSpec(r=4, lora_alpha=8, target_modules=("q_proj",)),
    )


def test_shared_dir_stages_an_adapter_as_a_peft_directory(tmp_path: Path) -> None:
    adapter = _adapter()
    staged = SharedDirTransport(tmp_path).stage(adapter.state, 2, lora=adapter.spec)
    assert staged.path is not None and staged.lora == adapter.spec
    assert sorted(p.name for p in staged.path.iterdir()) == [ADAPTER_CONFIG, ADAPTER_FILE]
    _assert_same(load_file(str(staged.path / ADAPTER_FILE)), adapter.state)
    cfg = json.loads((staged.path / ADAPTER_CONFIG).read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (
        "LORA",
        4,
        8,
        ["q_proj"],
    )
    assert LoraSpec.from_dict(cfg) == adapter.spec


def test_http_stages_an_adapter_with_its_spec_in_the_metadata() -> None:
    from agentrl.inference.weights import safetensors_metadata

    adapter = _adapter()
    staged = HttpStreamTransport(mode="push").stage(adapter.state, 2, lora=adapter.spec)
    assert staged.data is not None
    _assert_same(load(staged.data), adapter.state)
    meta = safetensors_metadata(staged.data)
    assert LoraSpec.from_json(meta[METADATA_KEY]) == adapter.spec


async def test_an_adapter_push_is_reported_as_lora_with_the_adapter_bytes(tmp_path: Path) -> None:
    a = FakeInferenceServer("http://a", version=1)
    engine = CheckpointEngine(_clients(a), SharedDirTransport(tmp_path))
    adapter = _adapter()
    report = await engine.push(adapter, 2)
    report.raise_if_failed()
    assert report.kind == "lora" and report.metrics()["weight_sync/lora"] == 1.0
    assert adapter.num_bytes < report.num_bytes < adapter.num_bytes + 1024  # + the header
    assert "LoRA adapter" in report.describe()
    rpc = next(body for path, body in a.control_calls if path == "/collective_rpc")
    assert Path(rpc["kwargs"]["weights_path"]).name == "v2"


class _VllmWithLora(FakeInferenceServer):
    """The vLLM fake plus ``POST /v1/load_lora_adapter`` (vLLM 0.32's body: lora_name,
    lora_path, load_inplace; ``text/plain`` success answer)."""

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/load_lora_adapter":
            body = json.loads(request.content)
            self.control_calls.append((request.url.path, body))
            assert set(body) <= {"lora_name", "lora_path", "load_inplace", "is_3d_lora_weight"}
            return httpx.Response(200, text="Success: LoRA adapter added successfully.")
        return await super()._handle(request)


async def test_a_vllm_adapter_push_loads_the_adapter_and_probes_it_by_name(tmp_path: Path) -> None:
    v = _VllmWithLora("http://v", version=1, version_in_body=False)
    engine = CheckpointEngine(_clients(v), SharedDirTransport(tmp_path))
    report = await engine.push(_adapter(), 2, score=lambda p, t: [-0.5] * len(t))
    assert [p for p, _ in v.control_calls][:3] == [
        "/pause",
        "/v1/load_lora_adapter",
        "/update_weight_version",
    ]
    body = dict(v.control_calls)["/v1/load_lora_adapter"]
    assert body == {
        "lora_name": VLLM_LORA_NAME,
        "lora_path": str(tmp_path / "v2"),
        "load_inplace": True,
    }
    assert v.generate_requests[-1]["body"]["model"] == VLLM_LORA_NAME  # the verify probe
    report.raise_if_failed()


class _PrepareFails(HttpStreamTransport):
    async def prepare(self, clients) -> None:
        raise OSError("no weight group")


async def test_a_failed_prepare_fails_every_server_without_pausing_any() -> None:
    a, b = FakeInferenceServer("http://a", version=5), FakeInferenceServer("http://b", version=5)
    engine = CheckpointEngine(_clients(a, b), _PrepareFails())
    report = await engine.push(_state(), 6)
    assert not report.ok
    for s in report.servers.values():
        assert (s.stage, s.version, s.paused) == ("prepare", 5, False)
        assert "no weight group" in (s.error or "")
    assert not any(p == "/pause" for p, _ in a.control_calls + b.control_calls)
