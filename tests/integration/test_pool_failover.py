"""ServerPool over two real embedded servers: one is SIGKILLed while 64 requests are in flight.

What a user relies on: every request still gets exactly one answer, no request is served to
completion twice (checked against both servers' request logs), and the pool reports the dead
server.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from agentrl.inference.pool import ServerPool
from agentrl.types import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

N_REQUESTS = 64


async def running_requests(base_url: str) -> float:
    """The server's ``*num_requests_running`` gauge from ``/metrics``."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(base_url + "/metrics", timeout=10)).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if not line.startswith("#") and "num_requests_running" in line.split(" ", 1)[0]
    )


def read_request_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_killing_one_of_two_servers_mid_flight_loses_and_duplicates_nothing(
    tiny_model_dir: Path, tmp_path: Path
):
    from agentrl.inference.server import launch_embedded_server

    logs = [tmp_path / f"requests-{i}.jsonl" for i in range(2)]

    def launch(i: int):
        return launch_embedded_server(
            tiny_model_dir,
            log_path=tmp_path / f"server-{i}.log",
            request_log=logs[i],
            startup_timeout_s=300,
        )

    with ThreadPoolExecutor(2) as ex:
        handles = list(ex.map(launch, range(2)))
    victim, survivor = handles
    try:
        # Unique prompts identify each request in the servers' logs.
        prompts = [[100 + i // 16, 120 + i % 16, 7, 9] for i in range(N_REQUESTS)]
        async with ServerPool([h.base_url for h in handles], health_check_interval_s=0.5) as pool:
            tasks = [
                asyncio.create_task(
                    pool.generate(
                        p, SamplingParams(max_tokens=48, seed=i), session_id=f"episode-{i}"
                    )
                )
                for i, p in enumerate(prompts)
            ]
            # Kill the victim while it is decoding a batch of our requests.
            deadline = time.monotonic() + 120
            while await running_requests(victim.base_url) < N_REQUESTS // 8:
                assert time.monotonic() < deadline, "the victim never ran our requests"
                await asyncio.sleep(0.02)
            victim.kill()
            gens = await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
            stats = pool.stats()
            dead = pool.dead_servers()
    finally:
        for h in handles:
            h.stop()

    assert len(gens) == N_REQUESTS
    assert dead == [victim.base_url]
    assert not stats[victim.base_url].alive
    # The kill really hit in-flight requests, and they were served elsewhere.
    assert stats[victim.base_url].failures >= 1
    assert stats[survivor.base_url].failures == 0
    assert sum(s.completed for s in stats.values()) == N_REQUESTS
    assert all(s.outstanding == 0 for s in stats.values())

    served: dict[tuple[int, ...], list[tuple[str, dict]]] = {}
    for handle, log in zip(handles, logs, strict=True):
        for entry in read_request_log(log):
            served.setdefault(tuple(entry["prompt_ids"]), []).append((handle.base_url, entry))
    for prompt, gen in zip(prompts, gens, strict=True):
        entries = served.get(tuple(prompt), [])
        assert len(entries) == 1, f"prompt {prompt} served to completion {len(entries)} times"
        ((url, entry),) = entries
        assert url == gen.server
        assert entry["output_ids"] == gen.token_ids
    assert len(served) == N_REQUESTS
