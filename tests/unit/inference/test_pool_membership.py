"""ServerPool membership at run time: a server replaced on a new URL (a restarted Ray server
actor) is added and the old one removed, without losing requests in flight."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.inference.client import PolicyClient
from agentrl.inference.pool import ServerPool
from agentrl.types import SamplingParams
from tests.fakes import FakeInferenceServer

SP = SamplingParams(max_tokens=2)


def make_pool(*fakes: FakeInferenceServer) -> tuple[ServerPool, dict[str, FakeInferenceServer]]:
    by_url = {f.url: f for f in fakes}
    pool = ServerPool(
        [fakes[0].url],
        client_factory=lambda url: PolicyClient(
            url, transport=by_url[url.rstrip("/")].transport(), max_retries=0
        ),
        health_check_interval_s=None,
        retry_backoff_s=0.0,
    )
    return pool, by_url


async def test_an_added_server_gets_requests_and_a_removed_one_none():
    a, b = FakeInferenceServer("http://a"), FakeInferenceServer("http://b")
    pool, _ = make_pool(a, b)
    async with pool:
        assert pool.add_server("http://b/") == "http://b"
        assert pool.add_server("http://b") == "http://b"  # already there: nothing changes
        assert pool.urls == ["http://a", "http://b"]
        await asyncio.gather(*(pool.generate([i], SP) for i in range(6)))
        assert a.completed and b.completed
        assert await pool.remove_server("http://a")
        assert not await pool.remove_server("http://a")
        before = len(a.completed)
        await asyncio.gather(*(pool.generate([i], SP) for i in range(4)))
        assert len(a.completed) == before and pool.urls == ["http://b"]
        assert set(pool.stats()) == {"http://b"}


async def test_sessions_on_a_removed_server_move_on_their_next_turn():
    a, b = FakeInferenceServer("http://a"), FakeInferenceServer("http://b")
    pool, _ = make_pool(a, b)
    async with pool:
        await pool.generate([1], SP, session_id="s")
        assert pool.session_server("s") == "http://a"
        pool.add_server("http://b")
        await pool.remove_server("http://a")
        assert pool.session_server("s") is None
        gen = await pool.generate([2], SP, session_id="s")
        assert gen.server == "http://b" and pool.session_server("s") == "http://b"


async def test_a_request_in_flight_on_a_removed_server_finishes_then_its_client_closes():
    a, b = FakeInferenceServer("http://a"), FakeInferenceServer("http://b")
    pool, _ = make_pool(a, b)
    async with pool:
        a.gate.clear()
        held = asyncio.create_task(pool.generate([7], SP))
        while not a.generate_requests:
            await asyncio.sleep(0.005)
        client = pool._servers["http://a"].client
        pool.add_server("http://b")
        await pool.remove_server("http://a")
        assert not client._http.is_closed  # still serving the request in flight
        a.gate.set()
        gen = await held
        assert gen.token_ids == [8, 9] and gen.server == "http://a"
        assert client._http.is_closed


async def test_set_servers_makes_the_pool_exactly_those():
    a, b, c = (FakeInferenceServer(f"http://{n}") for n in "abc")
    pool, _ = make_pool(a, b, c)
    async with pool:
        await pool.set_servers(["http://b", "http://c"])
        assert pool.urls == ["http://b", "http://c"]
        with pytest.raises(ValueError, match="at least one"):
            await pool.set_servers([])
        assert pool.urls == ["http://b", "http://c"]
