"""A version names exactly one set of weights, under faults (issue 21), on a real embedded
server (a subprocess on the tiny model, 127.0.0.1, every wait bounded).

- two trainers push to one server at once, 10 rounds: the served weights always match the
  digest of the weights whose push reported ok for the served version (0 splits), and at most
  one push per version reports ok (the other is refused by the push lease or the version);
- a push whose verify fails (finite but huge weights: the logits overflow) rolls the server back
  to its last verified weights before it resumes: 0 bad completions are served, before, during
  or after the push.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agentrl.inference.client import InferenceError, PolicyClient
from agentrl.inference.engine import state_digest
from agentrl.inference.handle import ServerHandle
from agentrl.inference.server import launch_embedded_server
from agentrl.training.checkpoint_engine import CheckpointEngine, HttpStreamTransport
from agentrl.types import SamplingParams
from tests.integration.test_checkpoint_engine import perturbed, scorer, state_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
ROUNDS = 10


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    tmp = tmp_path_factory.mktemp("integrity_server")
    handle = launch_embedded_server(
        tiny_model_dir, log_path=tmp / "server.log", startup_timeout_s=300
    )
    try:
        yield handle
    finally:
        handle.stop()


async def test_two_concurrent_pushes_x10_never_split(server: ServerHandle, tiny_model_dir):
    trainers = {"A": perturbed(tiny_model_dir, seed=101), "B": perturbed(tiny_model_dir, seed=202)}
    states = {name: state_of(m) for name, m in trainers.items()}
    digests = {name: state_digest(s) for name, s in states.items()}
    assert digests["A"] != digests["B"]
    clients = {name: PolicyClient(server.base_url, timeout_s=120) for name in trainers}
    observer = PolicyClient(server.base_url, timeout_s=120)
    engines = {
        name: CheckpointEngine([c], HttpStreamTransport(), push_timeout_s=120)
        for name, c in clients.items()
    }
    splits, ok_rounds, double_ok = 0, 0, 0
    try:
        for _ in range(ROUNDS):
            version = await observer.weight_version() + 1
            # Both trainers push the same version at the same moment, different weights.
            reports = dict(
                zip(
                    engines,
                    await asyncio.wait_for(
                        asyncio.gather(*(e.push(states[n], version) for n, e in engines.items())),
                        timeout=240,
                    ),
                    strict=True,
                )
            )
            winners = [n for n, r in reports.items() if r.ok]
            double_ok += len(winners) > 1
            ok_rounds += len(winners) >= 1
            info = await observer.weight_info()
            served_version, served_digest = info["weight_version"], info["digest"]
            owner = [n for n in winners if reports[n].version == served_version]
            if len(owner) != 1 or digests[owner[0]] != served_digest:
                splits += 1
            gen = await asyncio.wait_for(
                observer.generate(PROMPT, SamplingParams(max_tokens=2)), 60
            )
            if gen.weight_version != served_version:
                splits += 1
        assert (splits, double_ok) == (0, 0), f"{splits} split(s), {double_ok} double ok"
        assert ok_rounds == ROUNDS
        # A version lower than the served one is refused (409), unless it says rollback.
        with pytest.raises(InferenceError, match="409"):
            await observer.set_weight_version(0)
        assert (await observer.weight_info())["digest"] == served_digest
    finally:
        for e in engines.values():
            await e.aclose()
        await observer.aclose()


async def test_a_failed_verify_serves_no_bad_completion(server: ServerHandle, tiny_model_dir):
    good, huge = perturbed(tiny_model_dir, seed=303), perturbed(tiny_model_dir, seed=303)
    with torch.no_grad():
        for p in huge.parameters():
            p.mul_(1e18)  # finite in float32, but the logits overflow
    assert all(torch.isfinite(p).all() for p in huge.parameters())
    client = PolicyClient(server.base_url, timeout_s=120)
    engine = CheckpointEngine([PolicyClient(server.base_url, timeout_s=120)], HttpStreamTransport())
    bad, served, stop = 0, 0, asyncio.Event()

    async def sample_forever() -> None:
        nonlocal bad, served
        while not stop.is_set():
            try:
                gen = await client.generate(PROMPT, SamplingParams(max_tokens=4, temperature=1.0))
            except InferenceError:
                bad += 1  # a 5xx from bad weights
                continue
            served += 1
            if gen.weight_version == bad_version or not all(math.isfinite(x) for x in gen.logprobs):
                bad += 1

    try:
        good_version = await client.weight_version() + 1
        (await engine.push(state_of(good), good_version, score=scorer(good))).raise_if_failed()
        bad_version = good_version + 1
        sampler = asyncio.ensure_future(sample_forever())
        report = await asyncio.wait_for(
            engine.push(state_of(huge), bad_version, score=scorer(good)), timeout=240
        )
        status = next(iter(report.servers.values()))
        assert not report.ok and status.stage == "verify" and status.rolled_back, report.describe()
        assert status.version == good_version
        # Keep sampling a while after the push: the server serves the last verified weights.
        for _ in range(8):
            gen = await asyncio.wait_for(client.generate(PROMPT, SamplingParams(max_tokens=4)), 60)
            assert gen.weight_version == good_version
        stop.set()
        await asyncio.wait_for(sampler, timeout=120)
        assert served > 0 and bad == 0, f"{bad} bad completion(s) of {served}"
        info = await client.weight_info()
        assert info["weight_version"] == good_version == info["verified_version"]
        assert info["digest"] == state_digest(state_of(good))
    finally:
        stop.set()
        await engine.aclose()
        await client.aclose()
