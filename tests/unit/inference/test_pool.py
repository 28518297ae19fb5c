"""ServerPool routing (least outstanding, sticky sessions, LRU), failover and broadcasts,
against scripted in-process servers."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from agentrl.inference.client import InferenceRequestError, InferenceServerError, PolicyClient
from agentrl.inference.pool import Ok, ServerPool
from agentrl.types import Policy, SamplingParams
from tests.fakes import FakeInferenceServer

SP = SamplingParams(max_tokens=2)


def make_pool(n: int = 2, **kwargs) -> tuple[ServerPool, list[FakeInferenceServer]]:
    fakes = [FakeInferenceServer(f"http://s{i}") for i in range(n)]
    by_url = {f.url: f for f in fakes}
    kwargs.setdefault("health_check_interval_s", None)
    kwargs.setdefault("retry_backoff_s", 0.0)
    pool = ServerPool(
        [f.url for f in fakes],
        client_factory=lambda url: PolicyClient(
            url, transport=by_url[url].transport(), max_retries=0
        ),
        **kwargs,
    )
    return pool, fakes


async def wait_until(predicate, timeout_s: float = 60.0) -> None:  # a hang guard, not a bound
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_pool_is_a_policy_and_answers():
    pool, _ = make_pool()
    async with pool:
        assert isinstance(pool, Policy)
        gen = await pool.generate([10], SP)
    assert gen.token_ids == [11, 12]
    assert gen.server in pool.urls


async def test_least_outstanding_routes_around_a_busy_server():
    pool, (a, b) = make_pool()
    async with pool:
        a.gate.clear()  # requests on a stay in flight
        b.gate.clear()
        first = asyncio.create_task(pool.generate([1], SP))
        await wait_until(lambda: len(a.generate_requests) + len(b.generate_requests) == 1)
        busy, idle = (a, b) if a.generate_requests else (b, a)
        idle.gate.set()
        # While `busy` holds one request, every new request goes to `idle`.
        for i in range(5):
            gen = await pool.generate([100 + i], SP)
            assert gen.server == idle.url
        stats = pool.stats()
        assert stats[busy.url].outstanding == 1
        assert stats[idle.url].outstanding == 0 and stats[idle.url].completed == 5
        busy.gate.set()
        assert (await first).server == busy.url
        assert pool.stats()[busy.url].outstanding == 0


async def test_concurrent_requests_spread_evenly():
    pool, (a, b) = make_pool()
    async with pool:
        a.gate.clear()
        b.gate.clear()
        tasks = [asyncio.create_task(pool.generate([i], SP)) for i in range(10)]
        await wait_until(lambda: len(a.generate_requests) + len(b.generate_requests) == 10)
        assert len(a.generate_requests) == len(b.generate_requests) == 5
        a.gate.set()
        b.gate.set()
        await asyncio.gather(*tasks)


async def test_sticky_sessions_stay_on_their_server_even_when_it_is_busier():
    pool, (a, b) = make_pool()
    async with pool:
        first = await pool.generate([1], SP, session_id="ep")
        home = a if first.server == a.url else b
        other = b if home is a else a
        home.gate.clear()
        held = asyncio.create_task(pool.generate([2], SP, session_id="ep"))
        await wait_until(lambda: len(home.generate_requests) == 2)
        # Another turn of the same episode waits for its prefix cache rather than moving.
        second_turn = asyncio.create_task(pool.generate([3], SP, session_id="ep"))
        await wait_until(lambda: len(home.generate_requests) == 3)
        assert other.generate_requests == []
        # A fresh session goes to the less loaded server.
        assert (await pool.generate([4], SP, session_id="new")).server == other.url
        home.gate.set()
        assert (await held).server == home.url
        assert (await second_turn).server == home.url
        assert pool.session_server("ep") == home.url
        assert pool.stats()[home.url].sessions == 1


async def test_session_map_is_an_lru_with_a_bound():
    pool, _ = make_pool(max_sessions=2)
    async with pool:
        await pool.generate([1], SP, session_id="s1")
        await pool.generate([1], SP, session_id="s2")
        await pool.generate([1], SP, session_id="s1")  # s1 is now the most recent
        await pool.generate([1], SP, session_id="s3")  # evicts s2, the least recent
        assert pool.session_server("s1") is not None
        assert pool.session_server("s2") is None
        assert pool.session_server("s3") is not None
        assert sum(s.sessions for s in pool.stats().values()) == 2


async def test_dead_server_request_is_retried_elsewhere_and_session_moves():
    pool, (a, b) = make_pool()
    async with pool:
        first = await pool.generate([1], SP, session_id="ep")
        home = a if first.server == a.url else b
        other = b if home is a else a
        home.fail_next = ["drop"]  # dies mid-request
        home.alive = False
        gen = await pool.generate([5], SP, session_id="ep")
        assert gen.server == other.url and gen.token_ids == [6, 7]
        assert pool.dead_servers() == [home.url]
        assert pool.session_server("ep") == other.url
        stats = pool.stats()
        assert stats[home.url].failures == 1 and not stats[home.url].alive
        assert stats[other.url].completed == 1
        # Dead servers get no new requests.
        n_before = len(home.generate_requests)
        for i in range(4):
            assert (await pool.generate([i], SP)).server == other.url
        assert len(home.generate_requests) == n_before


async def test_in_flight_requests_fail_over_when_their_server_dies():
    pool, (a, b) = make_pool()
    async with pool:
        a.gate.clear()
        b.gate.clear()
        tasks = [asyncio.create_task(pool.generate([1000 + i], SP)) for i in range(8)]
        await wait_until(lambda: len(a.generate_requests) + len(b.generate_requests) == 8)
        a.alive = False  # held requests on a now see a dropped connection
        a.gate.set()
        await wait_until(lambda: len(b.generate_requests) == 8)
        b.gate.set()
        gens = await asyncio.gather(*tasks)
    assert [g.token_ids[0] for g in gens] == [1001 + i for i in range(8)]
    assert all(g.server == b.url for g in gens)
    assert a.completed == [] and len(b.completed) == 8
    assert pool.dead_servers() == [a.url]


async def test_5xx_is_retried_on_another_server_without_declaring_it_dead():
    pool, (a, b) = make_pool()
    async with pool:
        a.fail_next = [503]
        b.fail_next = [503]
        # Both fail once; after one round over every server the pool tries them again.
        gen = await pool.generate([1], SP)
        assert gen.token_ids == [2, 3]
        assert pool.dead_servers() == []
        assert sum(s.failures for s in pool.stats().values()) == 2
        assert sum(s.completed for s in pool.stats().values()) == 1


async def test_4xx_is_raised_at_once_and_never_retried():
    pool, (a, b) = make_pool()
    async with pool:
        a.fail_next = [400]
        b.fail_next = [400]
        with pytest.raises(InferenceRequestError, match="scripted HTTP 400"):
            await pool.generate([1], SP)
        assert len(a.generate_requests) + len(b.generate_requests) == 1
        assert pool.dead_servers() == []


async def test_all_servers_dead_raises_a_server_error():
    pool, fakes = make_pool()
    async with pool:
        for f in fakes:
            f.alive = False
        with pytest.raises(InferenceServerError, match="no server could serve"):
            await pool.generate([1], SP)
        assert sorted(pool.dead_servers()) == sorted(pool.urls)


async def test_health_checks_mark_servers_dead_and_alive_again():
    pool, (a, b) = make_pool(health_check_interval_s=0.01)
    async with pool:
        a.alive = False
        await wait_until(lambda: pool.dead_servers() == [a.url])
        a.alive = True
        await wait_until(lambda: pool.dead_servers() == [])
        assert await pool.check_health() == {a.url: True, b.url: True}


async def test_broadcasts_report_per_server_outcomes():
    pool, (a, b) = make_pool()
    async with pool:
        b.alive = False
        report = await pool.pause("keep")
        assert report[a.url] == Ok(None)
        assert isinstance(report[b.url], InferenceServerError)
        assert a.paused
        assert pool.dead_servers() == [b.url]
        b.alive = True
        await pool.check_health()
        report = await pool.update_weights_from_path("/w/3", 3)
        assert all(isinstance(r, Ok) for r in report.values())
        assert a.version == b.version == 3
        report = await pool.set_weight_version(4)
        infos = await pool.weight_info()
        assert {url: r.value["weight_version"] for url, r in infos.items()} == {  # type: ignore[union-attr]
            a.url: 4,
            b.url: 4,
        }
        for call in (pool.reset_prefix_cache, pool.resume, pool.abort_requests):
            assert all(isinstance(r, Ok) for r in (await call()).values())
        assert not a.paused and not b.paused
        report = await pool.update_weights_from_bytes(b"bytes", 5)
        assert all(isinstance(r, Ok) for r in report.values())


async def test_broadcast_reports_not_implemented_for_vllm_bytes_transport():
    fake = FakeInferenceServer("http://vllm", version_in_body=False)
    pool = ServerPool(
        [fake.url],
        health_check_interval_s=None,
        client_factory=lambda url: PolicyClient(url, transport=fake.transport()),
    )
    async with pool:
        report = await pool.update_weights_from_bytes(b"x", 1)
    assert isinstance(report[fake.url], NotImplementedError)
    assert pool.dead_servers() == []


def test_constructor_validates_urls():
    with pytest.raises(ValueError, match="at least one"):
        ServerPool([])
    with pytest.raises(ValueError, match="duplicates"):
        ServerPool(["http://a", "http://a"])


async def test_aclose_stops_the_health_loop():
    pool, _ = make_pool(health_check_interval_s=0.01)
    pool.start()
    task = pool._health_task
    assert task is not None and not task.done()
    await pool.aclose()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.done()


async def test_from_config_takes_interval_timeout_and_retries():
    from agentrl.config import InferenceConfig

    cfg = InferenceConfig(health_check_interval_s=2.5, request_timeout_s=30, max_retries=4)
    pool = ServerPool.from_config(["http://a", "http://b"], cfg)
    assert pool.health_check_interval_s == 2.5
    assert pool.max_attempts == 5
    await pool.aclose()


async def test_a_dropped_connection_on_a_healthy_server_does_not_mark_it_dead():
    # A server that closed one kept-alive connection (e.g. after a 500) still answers /health.
    pool, (a, b) = make_pool()
    async with pool:
        first = await pool.generate([1], SP, session_id="ep")
        home = a if first.server == a.url else b
        home.fail_next = ["drop"]
        gen = await pool.generate([5], SP, session_id="ep")
        assert gen.token_ids == [6, 7]
        assert pool.dead_servers() == []
        assert pool.stats()[home.url].failures == 1
        assert "/health" in home.paths  # it was asked before being judged


async def test_extra_body_and_the_api_key_reach_the_server():
    fakes = [FakeInferenceServer("http://s0")]
    pool = ServerPool(
        ["http://s0"],
        health_check_interval_s=None,
        client_factory=lambda url: PolicyClient(
            url, transport=fakes[0].transport(), max_retries=0, api_key="k9"
        ),
    )
    async with pool:
        await pool.generate([1], SP, extra_body={"ignore_eos": True})
    request = fakes[0].generate_requests[-1]
    assert request["body"]["ignore_eos"] is True
    assert request["headers"]["authorization"] == "Bearer k9"
    assert float(request["headers"]["x-request-timeout-s"]) > 0
    keyed = ServerPool(["http://127.0.0.1:9"], health_check_interval_s=None, api_key="k10")
    assert keyed.stats() and all(
        s.client._http.headers["authorization"] == "Bearer k10" for s in keyed._servers.values()
    )
    await keyed.aclose()


async def test_an_answer_cut_by_a_server_is_retried_elsewhere_never_passed_as_success():
    pool, (s0, s1) = make_pool(2)
    s0.finish_reason = s1.finish_reason = "abort"
    s1.finish_reason = "length"
    async with pool:
        gens = [await pool.generate([1, 2], SamplingParams(max_tokens=3)) for _ in range(6)]
    # every answer is s1's complete one: s0's cut answers were retried on s1
    assert [g.finish_reason for g in gens] == ["length"] * 6
    stats = pool.stats()
    assert stats["http://s0"].aborted == len(s0.completed) > 0
    assert stats["http://s1"].aborted == 0


async def test_when_every_server_cuts_the_answer_the_agent_sees_abort():
    pool, fakes = make_pool(2)
    for f in fakes:
        f.finish_reason = "abort"
    async with pool:
        gen = await pool.generate([1, 2], SamplingParams(max_tokens=3))
    assert gen.finish_reason == "abort"
    # tried once more on the other server, then reported: no endless retries
    assert sum(len(f.completed) for f in fakes) == 2
    assert sum(s.aborted for s in pool.stats().values()) == 2


async def test_with_every_server_down_a_request_waits_for_one_to_come_back():
    """A lost node can take every server at once; a request rides out the restart
    (``wait_for_server_s``) instead of failing (seen on a two-node Ray run: RunFailed)."""
    pool, (a, b) = make_pool(health_check_interval_s=0.05, wait_for_server_s=10.0)
    async with pool:
        for f in (a, b):
            f.alive = False
        await pool.check_health()
        assert sorted(pool.dead_servers()) == sorted(pool.urls)
        request = asyncio.ensure_future(pool.generate([1], SP))
        await asyncio.sleep(0.3)
        assert not request.done()  # waiting, not failed
        b.alive = True  # the health loop finds it again
        gen = await asyncio.wait_for(request, timeout=5)
        assert gen.token_ids and len(b.generate_requests) == 1
