"""CheckpointEngine against real servers: two embedded-server subprocesses on the tiny model
(and the session's real vLLM server), both transports.

What a user relies on, each checked here: a push moves every server to the new version and its
outputs to the new weights (verified against a ``transformers`` forward pass of the same
weights); verification catches weights that differ from the trainer's; a server that rejects the
update, or dies during the push, is reported with the version it is on while the others move on;
no server is left paused; requests in flight during a ``keep`` push finish.

Measured (terminal summary / JUnit properties): the verify max-abs-diff per transport, and for
vLLM against ``transformers``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from agentrl.inference.client import PolicyClient
from agentrl.inference.handle import ServerHandle
from agentrl.inference.server import launch_embedded_server
from agentrl.types import SamplingParams
from agentrl.weightsync.engine import (
    CheckpointEngine,
    HttpStreamTransport,
    SharedDirTransport,
    StagedWeights,
    WeightPushError,
    WeightTransport,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
SAMPLING = SamplingParams(max_tokens=16, temperature=1.0, seed=5)


# ---- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Two embedded servers (subprocesses) on the tiny model, shared by this module's tests."""
    tmp = tmp_path_factory.mktemp("ckpt_servers")
    handles: list[ServerHandle] = []
    try:
        for i in range(2):
            handles.append(
                launch_embedded_server(
                    tiny_model_dir, log_path=tmp / f"server{i}.log", startup_timeout_s=300
                )
            )
        yield handles
    finally:
        for h in handles:
            h.stop()


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def perturbed(model_dir: Path, seed: int, scale: float = 0.05):
    """The tiny model with Gaussian noise (std ``scale``) added to every weight."""
    model = load_hf(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def state_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}


def scorer(model, temperature: float = 1.0) -> Callable[[list[int], list[int]], list[float]]:
    """The trainer side of verification: log softmax(logits / T) of each token under ``model``."""

    def score(prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        ids = torch.tensor([prompt_ids + token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return logp.gather(-1, torch.tensor(token_ids)[:, None])[:, 0].tolist()

    return score


def clients_for(handles: list[ServerHandle], **kwargs) -> list[PolicyClient]:
    return [PolicyClient(h.base_url, **kwargs) for h in handles]


async def close_all(clients: list[PolicyClient]) -> None:
    await asyncio.gather(*(c.aclose() for c in clients))


async def next_version(clients: list[PolicyClient]) -> int:
    return max(await asyncio.gather(*(c.weight_version() for c in clients))) + 1


async def assert_serving(client: PolicyClient, version: int) -> None:
    """Not paused, and a generation completes on ``version``."""
    assert not await client.is_paused(), f"{client.base_url} was left paused"
    gen = await asyncio.wait_for(client.generate(PROMPT, SamplingParams(max_tokens=4)), 60)
    assert gen.weight_version == version
    assert len(gen.token_ids) > 0


def make(kind: str, tmp_path: Path) -> WeightTransport:
    return (
        SharedDirTransport(tmp_path / "weights") if kind == "shared_dir" else HttpStreamTransport()
    )


# ---- push + verify ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["shared_dir", "http"])
async def test_push_moves_every_server_to_the_new_weights_and_verifies(
    servers, tiny_model_dir, tmp_path, kind, report_metric
):
    new_model = perturbed(tiny_model_dir, seed=11 if kind == "shared_dir" else 12)
    clients = clients_for(servers)
    try:
        v = await next_version(clients)
        before = [await c.generate(PROMPT, SAMPLING) for c in clients]
        engine = CheckpointEngine(clients, make(kind, tmp_path), verify_tolerance=1e-4)
        report = await engine.push(state_of(new_model), v, score=scorer(new_model))
        report.raise_if_failed()
        assert report.ok and report.version == v and report.transport == kind
        assert set(report.servers) == {h.base_url for h in servers}
        assert all(s.stage == "done" and s.version == v for s in report.servers.values())
        diff = report.max_abs_diff
        assert diff is not None and diff < 1e-4
        report_metric(f"verify_max_abs_diff_{kind}", diff)
        report_metric(f"push_s_{kind}_2_servers", report.total_seconds)
        metrics = report.metrics()
        assert set(metrics) == {
            "weight_sync/push_s",
            "weight_sync/stage_s",
            "weight_sync/verify_s",
            "weight_sync/bytes",
            "weight_sync/lora",
            "weight_sync/failed_servers",
            "weight_sync/verified_servers",
            "weight_sync/verified_while_paused",
            "weight_sync/verify_max_abs_diff",
            "timing_s/push/stage",
            "timing_s/push/pause",
            "timing_s/push/transfer",
            "timing_s/push/verify",
            "timing_s/push/resume",
        }
        assert metrics["weight_sync/failed_servers"] == 0.0
        assert metrics["weight_sync/verified_servers"] == len(servers)
        # Verified before the resume: no rollout was served by unverified weights.
        assert metrics["weight_sync/verified_while_paused"] == len(servers)
        assert metrics["weight_sync/bytes"] > 0
        for c, old in zip(clients, before, strict=True):
            assert await c.weight_version() == v
            assert not await c.is_paused()
            after = await c.generate(PROMPT, SAMPLING)
            assert after.weight_version == v
            assert (after.token_ids, after.logprobs) != (old.token_ids, old.logprobs)
            # The new outputs are the new weights', not merely different.
            expected = scorer(new_model)(PROMPT, after.token_ids)
            assert max(abs(a - b) for a, b in zip(expected, after.logprobs, strict=True)) < 1e-4
        if isinstance(engine.transport, SharedDirTransport):
            assert sorted(p.name for p in engine.transport.root.iterdir()) == [f"v{v}"]
    finally:
        await close_all(clients)


async def test_verify_catches_weights_that_differ_from_the_trainers(servers, tiny_model_dir):
    pushed, trainer = perturbed(tiny_model_dir, seed=21), perturbed(tiny_model_dir, seed=22)
    clients = clients_for(servers)
    try:
        v = await next_version(clients)
        before = [await c.weight_version() for c in clients]
        engine = CheckpointEngine(clients, HttpStreamTransport(), verify_tolerance=1e-3)
        report = await engine.push(state_of(pushed), v, score=scorer(trainer))
        assert not report.ok
        for status in report.servers.values():
            assert status.stage == "verify" and status.rolled_back
            assert status.verify_max_abs_diff is not None and status.verify_max_abs_diff > 1e-3
        with pytest.raises(WeightPushError) as info:
            report.raise_if_failed()
        message = str(info.value)
        assert "verify" in message
        for h in servers:
            assert h.base_url in message
        # Verification failed while paused: every server rolled back to its last verified
        # weights and serves them, on the version it had before (never the unverified ones).
        assert "rolled back" in message
        for c, old in zip(clients, before, strict=True):
            await assert_serving(c, old)
    finally:
        await close_all(clients)


# ---- failures ---------------------------------------------------------------------------------


class RejectedForOne(WeightTransport):
    """Sends a bad update to one server only, so that the server itself rejects it (HTTP 400
    from its weight loader): corrupted safetensors bytes (``http``) or a directory whose
    ``lm_head.weight`` has the wrong shape (``shared_dir``)."""

    def __init__(self, kind: str, victim_url: str, tmp_path: Path) -> None:
        self.inner = make(kind, tmp_path)
        self.name = self.inner.name
        self.kind = kind
        self.victim_url = victim_url
        self.bad_dir = tmp_path / "bad"

    def stage(self, state_dict: dict[str, torch.Tensor], version: int) -> StagedWeights:
        if self.kind == "shared_dir":
            bad = dict(state_dict)
            bad["lm_head.weight"] = bad["lm_head.weight"][:-1].contiguous()
            self.bad_dir.mkdir(parents=True, exist_ok=True)
            from safetensors.torch import save_file

            save_file(bad, str(self.bad_dir / "model.safetensors"))
        return self.inner.stage(state_dict, version)

    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        if client.base_url != self.victim_url:
            return await self.inner.load(client, staged)
        if self.kind == "shared_dir":
            await client.update_weights_from_path(self.bad_dir, staged.version)
        else:
            assert staged.data is not None
            corrupted = staged.data[:16] + b"\x00garbage\x00" + staged.data[64:]
            await client.update_weights_from_bytes(corrupted, staged.version)

    def cleanup(self, keep_version: int) -> None:
        self.inner.cleanup(keep_version)


@pytest.mark.parametrize("kind", ["http", "shared_dir"])
async def test_a_server_that_rejects_the_update_is_reported_and_nobody_stays_paused(
    servers, tiny_model_dir, tmp_path, kind
):
    new_model = perturbed(tiny_model_dir, seed=31)
    good, victim = clients_for(servers)
    try:
        v = await next_version([good, victim])
        victim_old = await victim.weight_version()
        transport = RejectedForOne(kind, victim.base_url, tmp_path)
        engine = CheckpointEngine([good, victim], transport, verify_tolerance=1e-4)
        report = await asyncio.wait_for(
            engine.push(state_of(new_model), v, score=scorer(new_model)), timeout=120
        )
        assert not report.ok
        bad, ok = report.servers[victim.base_url], report.servers[good.base_url]
        assert bad.stage == "transfer"
        assert bad.version == victim_old and not bad.paused
        assert bad.error is not None and "HTTP 400" in bad.error
        assert ("safetensors" in bad.error) if kind == "http" else ("shape" in bad.error)
        assert ok.ok and ok.version == v
        assert ok.verify_max_abs_diff is not None and ok.verify_max_abs_diff < 1e-4
        assert report.metrics()["weight_sync/failed_servers"] == 1.0
        with pytest.raises(WeightPushError) as info:
            report.raise_if_failed()
        assert f"{victim.base_url}: on version {victim_old}, serving, FAILED at transfer" in str(
            info.value
        )
        assert f"{good.base_url}: on version {v}, serving, ok" in str(info.value)
        await assert_serving(good, v)
        await assert_serving(victim, victim_old)
    finally:
        await close_all([good, victim])


class KillDuringTransfer(HttpStreamTransport):
    """Kills the victim's process after the push paused it, right before its transfer."""

    def __init__(self, victim: ServerHandle) -> None:
        super().__init__()
        self.victim = victim

    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        if client.base_url == self.victim.base_url:
            assert await client.is_paused()
            await asyncio.to_thread(self.victim.kill)
        await super().load(client, staged)


async def test_a_server_killed_during_the_push_is_reported_and_the_rest_update(
    servers, tiny_model_dir, tmp_path
):
    victim = launch_embedded_server(
        tiny_model_dir, log_path=tmp_path / "victim.log", startup_timeout_s=300
    )
    new_model = perturbed(tiny_model_dir, seed=41)
    live = PolicyClient(servers[0].base_url)
    dead = PolicyClient(victim.base_url, max_retries=1, backoff_s=0.1, connect_timeout_s=2.0)
    try:
        v = max(await live.weight_version(), await dead.weight_version()) + 1
        engine = CheckpointEngine(
            [live, dead], KillDuringTransfer(victim), push_timeout_s=60, verify_tolerance=1e-4
        )
        t0 = time.monotonic()
        report = await asyncio.wait_for(
            engine.push(state_of(new_model), v, score=scorer(new_model)), timeout=180
        )
        elapsed = time.monotonic() - t0
        assert not victim.is_running()
        assert elapsed < 90, f"the push took {elapsed:.0f}s with a dead server"
        gone, ok = report.servers[victim.base_url], report.servers[live.base_url]
        assert gone.stage == "transfer" and gone.version is None and not gone.paused
        assert gone.error is not None and "InferenceServerError" in gone.error
        assert ok.ok and ok.version == v
        with pytest.raises(WeightPushError) as info:
            report.raise_if_failed()
        assert f"{victim.base_url}: on version None, unreachable, FAILED" in str(info.value)
        await assert_serving(live, v)
    finally:
        await close_all([live, dead])
        victim.stop()


# ---- in-flight requests -----------------------------------------------------------------------


class RecordWhilePaused(HttpStreamTransport):
    """Records, while the server is paused for the transfer, which requests are still open."""

    def __init__(self, tasks: list[asyncio.Task]) -> None:
        super().__init__()
        self.tasks = tasks
        self.open_during_transfer: list[int] = []
        self.paused_during_transfer = False

    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        self.paused_during_transfer = await client.is_paused()
        self.open_during_transfer = [i for i, t in enumerate(self.tasks) if not t.done()]
        await super().load(client, staged)


async def running_requests(base_url: str) -> float:
    import httpx

    async with httpx.AsyncClient() as http:
        text = (await http.get(base_url + "/metrics", timeout=10)).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if not line.startswith("#") and "num_requests_running" in line.split(" ", 1)[0]
    )


async def test_requests_in_flight_during_a_keep_push_complete(servers, tiny_model_dir):
    new_model = perturbed(tiny_model_dir, seed=51)
    url = servers[0].base_url
    async with PolicyClient(url) as client:
        v_old = await client.weight_version()
        v = v_old + 1
        tasks = [
            asyncio.create_task(
                client.generate([i + 1, 7, 9], SamplingParams(max_tokens=400, seed=100 + i))
            )
            for i in range(6)
        ]
        try:
            async with asyncio.timeout(120):  # wait until every request is in the running batch
                while await running_requests(url) < sum(not t.done() for t in tasks):
                    await asyncio.sleep(0.02)
            transport = RecordWhilePaused(tasks)
            engine = CheckpointEngine([client], transport, pause_mode="keep")
            report = await engine.push(state_of(new_model), v, score=scorer(new_model))
            report.raise_if_failed()
            gens = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
        finally:
            for t in tasks:
                t.cancel()
        assert transport.paused_during_transfer
        assert transport.open_during_transfer, "every request ended before the push paused"
        for i, gen in enumerate(gens):
            assert gen.finish_reason in ("length", "stop"), f"request {i} was {gen.finish_reason}"
            assert len(gen.token_ids) == len(gen.logprobs) > 0
            # The server's guarantee: a response reports the oldest version behind its tokens,
            # and every one of these started on v_old.
            assert gen.weight_version == v_old
        await assert_serving(client, v)


# ---- vLLM -------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(1500)
async def test_push_and_verify_against_vllm(vllm_server, tiny_model_dir, tmp_path, report_metric):
    new_model = perturbed(tiny_model_dir, seed=61)
    original = load_hf(tiny_model_dir)
    temperature = 0.7
    sampling = SamplingParams(max_tokens=16, temperature=temperature, seed=5)
    async with PolicyClient(vllm_server.base_url) as client:
        v = await client.weight_version() + 1
        before = await client.generate(PROMPT, sampling)
        engine = CheckpointEngine(
            [client],
            SharedDirTransport(tmp_path / "weights"),
            pause_mode="wait",
            temperature=temperature,
            verify_tolerance=1e-4,
        )
        try:
            report = await engine.push(state_of(new_model), v, score=scorer(new_model, temperature))
            diff = report.max_abs_diff
            assert diff is not None
            report_metric("vllm_verify_max_abs_diff", diff)
            report_metric("vllm_push_s", report.total_seconds)
            report.raise_if_failed()
            assert await client.weight_version() == v
            assert not await client.is_paused()
            after = await client.generate(PROMPT, sampling)
            assert after.weight_version == v
            assert (after.token_ids, after.logprobs) != (before.token_ids, before.logprobs)

            # vLLM takes no weights in an HTTP body: the push fails at the transfer, says why,
            # and leaves vLLM serving (resumed) on the version it had.
            http = CheckpointEngine([client], HttpStreamTransport())
            failed = await http.push(state_of(new_model), v + 1)
            status = failed.servers[vllm_server.base_url]
            assert status.stage == "transfer" and status.version == v and not status.paused
            assert "shared-directory" in (status.error or "")
            assert not await client.is_paused()
        finally:
            # Put the shared server back on the session's weights (other tests compare with them).
            restore = await engine.push(
                state_of(original), v + 2, score=scorer(original, temperature)
            )
        assert restore.max_abs_diff is not None
        report_metric("vllm_verify_max_abs_diff_restore", restore.max_abs_diff)
        restore.raise_if_failed()
        restored = await client.generate(PROMPT, sampling)
        assert restored.token_ids == before.token_ids


def push_state_of(model) -> dict[str, torch.Tensor]:
    """What ``Actor.state_dict_for_push`` sends: tied tensors once, under the first name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor.detach().contiguous().clone()
    return out


@pytest.mark.vllm
@pytest.mark.timeout(1500)
async def test_a_tied_model_on_vllm_verifies_every_push(tmp_path, report_metric):
    """vLLM 0.32's reload_weights leaves a tied lm_head on the old embedding; the engine sends
    ``lm_head.weight`` explicitly to vLLM, so every push of a tied model verifies."""
    from agentrl.inference.tiny_model import build_tiny_model
    from agentrl.inference.vllm_backend import launch_vllm_server
    from tests.integration.conftest import vllm_python_or_fail

    python = vllm_python_or_fail()
    tied_dir = build_tiny_model(tmp_path / "tied", seed=3, tie_embeddings=True)
    temperature = 0.7
    handle = launch_vllm_server(
        tied_dir,
        python=python,
        log_path=tmp_path / "vllm-tied.log",
        dtype="float32",
        max_model_len=256,
        startup_timeout_s=900,
    )
    try:
        async with PolicyClient(handle.base_url) as client:
            v = await client.weight_version()
            for seed in (71, 72):
                model = perturbed(tied_dir, seed=seed)
                state = push_state_of(model)
                assert "lm_head.weight" not in state  # tied: the head is the embedding
                v += 1
                engine = CheckpointEngine(
                    [client],
                    SharedDirTransport(tmp_path / "weights"),
                    temperature=temperature,
                    verify_tolerance=1e-3,
                )
                report = await engine.push(state, v, score=scorer(model, temperature))
                diff = report.max_abs_diff
                assert diff is not None
                report_metric(f"vllm_tied_verify_max_abs_diff_{seed}", diff)
                report.raise_if_failed()
                assert diff <= 1e-3 and not await client.is_paused()
            # Without the explicit head, vLLM keeps the old one: the verification catches it.
            model = perturbed(tied_dir, seed=73)
            untied = CheckpointEngine(
                [client],
                SharedDirTransport(tmp_path / "weights"),
                temperature=temperature,
                tied_weights={},
            )
            failed = await untied.push(
                push_state_of(model), v + 1, score=scorer(model, temperature)
            )
            report_metric("vllm_tied_without_head_diff", failed.max_abs_diff or 0.0)
            assert not failed.ok and (failed.max_abs_diff or 0.0) > 1e-2
    finally:
        handle.stop()
