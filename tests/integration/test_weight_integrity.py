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

import pytest
import torch

from agentrl.inference.client import InferenceError, PolicyClient
from agentrl.inference.engine import state_digest
from agentrl.inference.handle import ServerHandle
from agentrl.types import SamplingParams
from agentrl.weightsync.engine import CheckpointEngine, HttpStreamTransport
from tests.integration.test_checkpoint_engine import perturbed, scorer, state_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
ROUNDS = 10


async def test_two_concurrent_pushes_x10_never_split(
    own_embedded_server: ServerHandle, tiny_model_dir
):
    trainers = {"A": perturbed(tiny_model_dir, seed=101), "B": perturbed(tiny_model_dir, seed=202)}
    states = {name: state_of(m) for name, m in trainers.items()}
    digests = {name: state_digest(s) for name, s in states.items()}
    assert digests["A"] != digests["B"]
    clients = {name: PolicyClient(own_embedded_server.base_url, timeout_s=120) for name in trainers}
    observer = PolicyClient(own_embedded_server.base_url, timeout_s=120)
    engines = {
        name: CheckpointEngine([c], HttpStreamTransport(), push_timeout_s=120)
        for name, c in clients.items()
    }
    # One writer racing itself (a push and its retry, two ranks of one run): the lease alone
    # must keep them apart. Two runs are fenced instead (the test below).
    engines["B"].writer = engines["A"].writer
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


async def test_a_new_run_takes_over_and_the_old_one_is_fenced(
    own_embedded_server: ServerHandle, tiny_model_dir
):
    """A second trainer run on the same server starts its own versions (at 0, below the first
    run's) and the first run's next push is refused, naming the new writer: two runs never
    interleave versions (the CI failure of stop 29 was the opposite: a new run refused)."""
    old_run, new_run = perturbed(tiny_model_dir, seed=404), perturbed(tiny_model_dir, seed=505)
    observer = PolicyClient(own_embedded_server.base_url, timeout_s=120)
    engines = [
        CheckpointEngine(
            [PolicyClient(own_embedded_server.base_url, timeout_s=120)], HttpStreamTransport()
        )
        for _ in range(2)
    ]
    try:
        high = await observer.weight_version() + 5
        (await engines[0].push(state_of(old_run), high)).raise_if_failed()
        (await engines[1].push(state_of(new_run), 0)).raise_if_failed()
        info = await observer.weight_info()
        assert (info["weight_version"], info["digest"]) == (0, state_digest(state_of(new_run)))
        assert info["writer"] == engines[1].writer
        report = await engines[0].push(state_of(old_run), high + 1)
        assert not report.ok and f"replaced by writer {engines[1].writer!r}" in report.describe()
        assert (await observer.weight_info())["digest"] == info["digest"]
    finally:
        for e in engines:
            await e.aclose()
        await observer.aclose()


async def test_a_failed_verify_serves_no_bad_completion(
    own_embedded_server: ServerHandle, tiny_model_dir
):
    good, huge = perturbed(tiny_model_dir, seed=303), perturbed(tiny_model_dir, seed=303)
    with torch.no_grad():
        for p in huge.parameters():
            p.mul_(1e18)  # finite in float32, but the logits overflow
    assert all(torch.isfinite(p).all() for p in huge.parameters())
    client = PolicyClient(own_embedded_server.base_url, timeout_s=120)
    engine = CheckpointEngine(
        [PolicyClient(own_embedded_server.base_url, timeout_s=120)], HttpStreamTransport()
    )
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


async def test_while_a_push_holds_the_lease_nobody_else_touches_weights_or_the_group(
    own_embedded_server: ServerHandle,
) -> None:
    """Every weight-changing route, the collective weight-group ones included, needs the
    lease's token while a push holds it (409 otherwise); released, they answer as before."""
    import httpx

    url = own_embedded_server.base_url
    holder = PolicyClient(url, timeout_s=60)
    token = await holder.take_push_lease("test push", 60.0, "writer-under-test")
    assert token
    join = {
        "group_id": "g",
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank": 1,
        "world_size": 2,
        "timeout_s": 1,
    }
    receive = {"group_id": "g", "version": 99, "buckets": [{"names": []}]}
    routes = [
        ("/weight_group/join", join),
        ("/weight_group/receive", receive),
        ("/weight_group/leave", {}),
        ("/update_weights_from_path", {"path": "/nonexistent", "version": 99}),
    ]
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for path, body in routes:
                r = await http.post(path, json=body)
                assert r.status_code == 409 and "lease" in r.text, (path, r.status_code, r.text)
            await holder.release_push_lease()
            r = await http.post("/weight_group/leave", json={})
            assert r.status_code == 200, r.text  # released: the route answers as before
    finally:
        await holder.aclose()
