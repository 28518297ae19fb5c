"""Fixtures of the rollout-service unit tests: the service over a scripted policy, in process.

The service is built on a :class:`FakeServing` (the attributes ``build_serving`` yields): a
``ScriptedPolicy`` (tests/fakes.py) as the pool, the tiny model's tokenizer, a real
``RewardManager`` and real ``AgentLoopManager`` objects, and a real ``CheckpointEngine`` over
``FakeInferenceServer`` control clients. The app is driven over ``httpx.ASGITransport``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentrl.config import load_config
from agentrl.inference.client import PolicyClient
from agentrl.rollout.manager import AgentLoopManager, WorkerConfig
from agentrl.rollout.rewards import RewardManager
from agentrl.service.app import RolloutService, ServiceSettings, create_app
from agentrl.types import SamplingParams, Task
from agentrl.weightsync.engine import CheckpointEngine, HttpStreamTransport
from tests.fakes import FakeInferenceServer, PoolMembers, ScriptedPolicy
from tools import ToolSet, get_tool

ANSWER = "\\boxed{5}"


class FakePool(ScriptedPolicy, PoolMembers):
    """A ScriptedPolicy with the ServerPool's ``stats()`` (what /v1/status reads) and its
    membership calls."""

    def stats(self) -> dict[str, Any]:
        return {}

    @property
    def members(self) -> set[str]:
        """URLs routed to (what the supervisor added and removed; starts as every fake)."""
        return vars(self).setdefault("_members", {"http://fake0", "http://fake1"})


@dataclasses.dataclass
class FakeServing:
    pool: Any
    engine: CheckpointEngine
    tokenizer: Any
    model_dir: Path
    server_urls: list[str]
    version: int
    rewards: RewardManager
    fake_servers: list[FakeInferenceServer]
    cfg: Any = dataclasses.field(default_factory=lambda: load_config(None))

    def make_manager(self, *, admission=None, temperature=None, n_samples=1) -> AgentLoopManager:
        return AgentLoopManager(
            self.pool,
            self.tokenizer,
            tools=ToolSet([get_tool("calculator")]),
            reward=self.rewards,
            config=WorkerConfig(sampling=SamplingParams(max_tokens=32)),
            max_concurrency=8,
            admission=admission,
        )


def calc_tasks(n: int) -> list[Task]:
    return [
        Task(
            id=f"t{i}",
            prompt=f"What is {i} + 5?",
            data_source="calculator",
            reward_spec={"ground_truth": str(i + 5)},
        )
        for i in range(n)
    ]


def make_serving(
    tiny_model_dir: Path, script: Any = (ANSWER,), delay_s: float = 0.0
) -> FakeServing:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fakes = [FakeInferenceServer(f"http://fake{i}") for i in range(2)]
    clients = [PolicyClient(f.url, transport=f.transport(), max_retries=0) for f in fakes]
    engine = CheckpointEngine(clients, HttpStreamTransport(), verify=False)
    return FakeServing(
        pool=FakePool(tok, list(script), delay_s=delay_s),
        engine=engine,
        tokenizer=tok,
        model_dir=Path(tiny_model_dir),
        server_urls=[f.url for f in fakes],
        version=0,
        rewards=RewardManager(sources={"calculator": "calculator"}, default="exact_match"),
        fake_servers=fakes,
    )


@pytest.fixture
async def service_factory(tiny_model_dir, tmp_path):
    """``await make(serving=None, **settings)`` -> (service, app, serving); closed at the end."""
    made: list[RolloutService] = []
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", "tracking.enabled=false"])

    async def make(serving: FakeServing | None = None, **settings: Any):
        serving = serving or make_serving(tiny_model_dir)
        settings.setdefault("store", str(tmp_path / "store.sqlite"))
        settings.setdefault("heartbeat_s", 0.2)
        service = RolloutService(serving, cfg, ServiceSettings(**settings))
        await service.start()
        made.append(service)
        return service, create_app(service), serving

    yield make
    for s in made:
        if not s.jobs._closing:
            await s.close()


def http(app: Any, api_key: str | None = None) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 1234)),
        base_url="http://service",
        headers=headers,
    )
