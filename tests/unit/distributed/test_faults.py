"""Ray fault tolerance without a cluster: the ServerRegistry against scripted servers and
scripted server actors (a replacement serves only after a verified push; a dead server is
detached, not fatal), the CheckpointEngine's client replacement, and the trainer-side stand-ins
of worker and reward actors (restarts seen, retries counted). The same on a real Ray cluster:
tests/integration/test_ray_faults.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError

from agentrl.distributed.actors import (
    AgentLoopWorkerActor,
    RemoteScorer,
    RemoteWorker,
    wait_reachable,
)
from agentrl.distributed.faults import ServerDirectory, ServerRegistry
from agentrl.inference.client import PolicyClient
from agentrl.inference.pool import ServerPool
from agentrl.rollout.manager import WorkerConfig
from agentrl.weightsync.engine import (
    CheckpointEngine,
    HttpStreamTransport,
    WeightPushError,
)
from tests.fakes import FakeInferenceServer, experiment
from tests.waiting import until, within


class Remote:
    """``handle.method.remote(*args)``: runs ``fn`` (a coroutine is awaitable like a Ray
    ``ObjectRef``)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls = 0

    def remote(self, *args: Any) -> Any:
        self.calls += 1
        return self.fn(*args)


class ServerActor:
    """A server actor's ``ensure_serving`` answering its current launch (or raising)."""

    def __init__(self, url: str, launch_id: str) -> None:
        self.launch = {"url": url, "launch_id": launch_id, "server_pid": 1, "actor_pid": 2}
        self.error: BaseException | None = None
        self.ensure_serving = Remote(self._ensure)

    async def _ensure(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        return dict(self.launch)


class WrongWeights(FakeInferenceServer):
    """Answers the verify probe with log-probs that are not the trainer's."""

    def _probe(self, body: dict[str, Any]) -> httpx.Response:
        n = len(body["token_ids"])
        return httpx.Response(
            200, json={"token_ids": body["token_ids"], "logprobs": [-3.0] * n, "weight_version": 0}
        )


class Actor:
    """What a push needs of the trainer's actor: weights and the probe's log-probs."""

    def state_dict_for_push(self) -> dict[str, torch.Tensor]:
        return {"model.norm.weight": torch.ones(4)}

    def score_tokens(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        return [-0.5] * len(token_ids)  # what the scripted servers answer


class Setup:
    """Two servers (``a``, ``b``) behind a registry, an engine, a pool and a directory;
    ``servers`` maps every URL that may appear to its scripted server."""

    def __init__(self, *extra: FakeInferenceServer) -> None:
        self.a, self.b = FakeInferenceServer("http://a"), FakeInferenceServer("http://b")
        self.servers = {f.url: f for f in (self.a, self.b, *extra)}
        self.actors = [ServerActor("http://a", "a1"), ServerActor("http://b", "b1")]
        self.engine = CheckpointEngine(
            [self.client(u) for u in ("http://a", "http://b")], HttpStreamTransport(mode="push")
        )
        self.pool = ServerPool(
            ["http://a", "http://b"], client_factory=self.client, health_check_interval_s=None
        )
        self.directory = ServerDirectory(urls=["http://a", "http://b"])
        self.registry = ServerRegistry(
            self.actors,
            ["http://a", "http://b"],
            self.engine,
            [self.pool],
            make_client=self.client,
            directory=self.directory,
            push_retries=1,
            wait_for_server_s=0.3,
            health_timeout_s=0.5,
        )

    def client(self, url: str) -> PolicyClient:
        fake = self.servers[url.rstrip("/")]
        return PolicyClient(url, transport=fake.transport(), max_retries=0)

    async def poll_all(self) -> None:
        for slot in self.registry.slots:
            await self.registry.poll(slot)

    def engine_urls(self) -> list[str]:
        return sorted(c.base_url for c in self.engine.clients)


async def test_a_replacement_serves_only_after_a_verified_push_of_the_current_version():
    s = Setup(FakeInferenceServer("http://a2"))
    await s.poll_all()  # adopts the launches the run started with: nothing changes
    assert [slot.state for slot in s.registry.slots] == ["serving", "serving"]
    assert s.directory.snapshot() == (0, ["http://a", "http://b"])
    # Server a dies; its actor comes back with a new server (a new URL, initial weights).
    s.a.alive = False
    s.actors[0].launch = {**s.actors[0].launch, "url": "http://a2", "launch_id": "a2"}
    await s.poll_all()
    slot = s.registry.slots[0]
    assert (slot.state, slot.url) == ("pending", "http://a2")
    assert s.engine_urls() == ["http://a2", "http://b"]  # it gets the next push ...
    assert s.pool.urls == ["http://b"] and s.directory.urls == ["http://b"]  # ... but no rollout
    generation = s.directory.generation
    await asyncio.gather(*(s.pool.generate([i], _sp()) for i in range(4)))
    assert not s.servers["http://a2"].generate_requests
    report = await s.registry.push(Actor(), 3)
    assert report.ok, report.describe()
    a2 = s.servers["http://a2"]
    assert a2.version == 3 and a2.probe_requests and a2.probe_requests[0]["paused"]
    assert report.servers["http://a2"].verify_max_abs_diff == 0.0
    assert slot.state == "serving" and slot.last_push is not None
    assert slot.last_push["server_version"] == 3 and slot.last_push["verified_while_paused"]
    assert sorted(s.pool.urls) == ["http://a2", "http://b"]
    assert s.directory.urls == ["http://a2", "http://b"] and s.directory.generation > generation
    m = report.metrics()
    assert m["weight_sync/servers_replaced"] == 1 and m["weight_sync/servers_joined"] == 1
    assert m["weight_sync/servers_serving"] == 2 and m["weight_sync/servers_pending"] == 0


async def test_a_dead_server_is_detached_before_a_push_and_rejoins_when_it_answers_again():
    s = Setup()
    await s.poll_all()
    s.b.alive = False
    report = await s.registry.push(Actor(), 1)  # not fatal: pushed to the live one
    assert report.ok and list(report.servers) == ["http://a"] and s.a.version == 1
    assert s.registry.slots[1].state == "detached"
    assert s.engine_urls() == ["http://a"] and s.pool.urls == ["http://a"]
    assert s.directory.urls == ["http://a"]
    assert report.metrics()["weight_sync/servers_detached"] == 1
    # The same server answers again: pending, and back at the next push (with its weights).
    s.b.alive = True
    await s.poll_all()
    assert s.registry.slots[1].state == "pending" and s.pool.urls == ["http://a"]
    report = await s.registry.push(Actor(), 2)
    assert report.ok and s.b.version == 2 and s.registry.slots[1].state == "serving"
    assert s.directory.urls == ["http://a", "http://b"]


async def test_a_live_server_that_fails_verification_still_fails_the_push():
    s = Setup(WrongWeights("http://a2"))
    await s.poll_all()
    s.a.alive = False
    s.actors[0].launch = {**s.actors[0].launch, "url": "http://a2", "launch_id": "a2"}
    await s.poll_all()
    with pytest.raises(WeightPushError, match="verify"):
        await s.registry.push(Actor(), 1)
    assert s.registry.slots[0].state == "pending" and s.pool.urls == ["http://b"]
    assert not s.servers["http://a2"].paused  # the push resumed it


async def test_an_actor_gone_for_good_is_retired_and_a_run_without_servers_says_so():
    s = Setup()
    await s.poll_all()
    s.actors[0].error = ActorDiedError()
    await s.registry.poll(s.registry.slots[0])
    assert s.registry.slots[0].state == "retired" and s.engine_urls() == ["http://b"]
    # A restarting actor is asked again next round (its slot is unchanged meanwhile).
    s.actors[1].error = ActorUnavailableError("restarting", None)
    await s.registry.poll(s.registry.slots[1])
    assert s.registry.slots[1].state == "serving"
    s.b.alive = False
    with pytest.raises(RuntimeError, match=r"no inference server is reachable.*server 0.*retired"):
        await s.registry.push(Actor(), 1)


async def test_the_watchers_poll_until_closed():
    s = Setup()
    s.registry.poll_interval_s = 0.01
    s.registry.start()
    await until(
        lambda: all(a.ensure_serving.calls >= 2 for a in s.actors), "the watchers stopped polling"
    )
    await s.registry.aclose()
    calls = [a.ensure_serving.calls for a in s.actors]
    # A live watcher's 0.01 s timer would end before this one, on this loop (timer order, not
    # a race with the wall clock): it would have polled again.
    await asyncio.sleep(0.05)
    assert [a.ensure_serving.calls for a in s.actors] == calls


async def test_closing_as_an_answer_arrives_still_stops_the_watcher():
    # Python 3.11's asyncio.wait_for drops a cancellation that lands as its awaitable
    # completes: a watcher polling through it outlived aclose(), which then never returned.
    s = Setup()
    s.registry.poll_interval_s = 0.01
    closing: list[asyncio.Future[None]] = []
    actor = s.actors[0]
    answer = actor.ensure_serving.fn

    async def answer_then_close() -> dict[str, Any]:
        out = await answer()
        if not closing:  # aclose() starts on the loop's next turn, as the answer is taken in
            asyncio.get_running_loop().call_soon(
                lambda: closing.append(asyncio.ensure_future(s.registry.aclose()))
            )
        return out

    actor.ensure_serving.fn = answer_then_close
    s.registry.start()
    await until(lambda: bool(closing), "the watcher never polled")
    await within(closing[0], "aclose() never returned: a watcher outlived its cancellation")
    calls = actor.ensure_serving.calls
    await asyncio.sleep(0.05)  # a live watcher's 0.01 s timer ends first (timer order)
    assert actor.ensure_serving.calls == calls


def test_the_registry_needs_one_url_per_actor():
    with pytest.raises(ValueError, match="one URL per actor"):
        ServerRegistry([object()], [], None, [], make_client=PolicyClient)


async def test_engine_replace_client_changes_the_next_pushs_servers():
    a, b = FakeInferenceServer("http://a"), FakeInferenceServer("http://b")
    old = PolicyClient(a.url, transport=a.transport())
    engine = CheckpointEngine([old], HttpStreamTransport(mode="push"))
    assert engine.replace_client("http://a/", PolicyClient(b.url, transport=b.transport())) is old
    assert engine.replace_client("http://nowhere", None) is None
    report = await engine.push({"w": torch.ones(2)}, 4)
    assert list(report.servers) == ["http://b"] and b.version == 4 and a.version == 0
    await old.aclose()
    await engine.aclose()


# ---- the trainer-side stand-ins of worker and reward actors ----------------------------------


def _sp() -> Any:
    from agentrl.types import SamplingParams

    return SamplingParams(max_tokens=2)


class WorkerHandle:
    """A worker actor handle whose calls follow a script of results and exceptions."""

    def __init__(self, script: list[Any], ping: list[Any] | None = None) -> None:
        self.script = list(script)
        self.pings = list(ping or [])
        self.seen: list[Any] = []
        self.run_episode_counted = Remote(self._run)
        self.ping = Remote(self._ping)
        self.score = Remote(self._run)

    async def _run(self, *args: Any) -> Any:
        self.seen.append(args)
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step

    async def _ping(self) -> bool:
        step = self.pings.pop(0) if self.pings else True
        if isinstance(step, BaseException):
            raise step
        return True


async def test_remote_worker_keeps_counters_across_restarts_and_waits_for_a_restarting_actor():
    lost = ActorUnavailableError("the actor was restarted", None)
    handle = WorkerHandle(
        [
            ("t1", {"errors": 1}, "one"),
            ("t2", {"errors": 2}, "one"),
            lost,
            ("t3", {"errors": 1}, "two"),
        ],
        ping=[ActorUnavailableError("restarting", None), True],
    )
    directory = ServerDirectory(urls=["http://a"])
    worker = RemoteWorker(handle, 0, directory=directory, restart_timeout_s=5)
    assert await worker.run_episode(None, "u", 0) == "t1"  # type: ignore[arg-type]
    assert await worker.run_episode(None, "u", 1) == "t2"  # type: ignore[arg-type]
    assert worker.counts == {"errors": 2}
    with pytest.raises(ActorUnavailableError):
        await worker.run_episode(None, "u", 2)  # type: ignore[arg-type]
    directory.set(["http://a2"])
    assert await worker.run_episode(None, "u", 2) == "t3"  # type: ignore[arg-type]
    assert handle.ping.calls == 2  # waited for the actor to answer before sending it more
    assert worker.counts == {"errors": 3, "worker_restarts": 1}
    assert handle.seen[-1][-1] == (1, ["http://a2"])  # the directory travels with each call
    assert worker.available


async def test_remote_worker_of_an_actor_gone_for_good_is_unavailable():
    handle = WorkerHandle([ActorUnavailableError("gone", None)], ping=[ActorDiedError()])
    worker = RemoteWorker(handle, 3)
    with pytest.raises(ActorUnavailableError):
        await worker.run_episode(None, "u", 0)  # type: ignore[arg-type]
    with pytest.raises(ActorDiedError):
        await worker.run_episode(None, "u", 0)  # type: ignore[arg-type]
    assert not worker.available


async def test_remote_scorer_scores_again_once_after_the_reward_actor_died():
    traj = SimpleNamespace(uid="u", index=0)
    died = ActorUnavailableError("the actor was restarted", None)
    scorer = RemoteScorer(WorkerHandle([died, "scored"]), restart_timeout_s=5)
    assert await scorer.score(traj, None) == "scored"  # type: ignore[arg-type]
    assert scorer.counts == {"reward_retries": 1}
    twice = RemoteScorer(WorkerHandle([died, died]), restart_timeout_s=5)
    with pytest.raises(ActorUnavailableError):
        await twice.score(traj, None)  # type: ignore[arg-type]
    assert twice.counts == {"reward_retries": 1}
    # An error of the reward itself is not retried.
    own = WorkerHandle([ValueError("bad answer format"), "never"])
    with pytest.raises(ValueError):
        await RemoteScorer(own).score(traj, None)  # type: ignore[arg-type]
    assert len(own.seen) == 1


async def test_wait_reachable_names_what_did_not_come_back():
    handle = WorkerHandle([], ping=[ActorUnavailableError("restarting", None)] * 10)
    with pytest.raises(TimeoutError, match=r"worker actor 7 did not answer within 0\.2 s"):
        await wait_reachable(handle, 0.2, what="worker actor 7")


async def test_a_worker_actor_follows_the_directory():
    a, b = FakeInferenceServer("http://a"), FakeInferenceServer("http://b")
    fakes = {f.url: f for f in (a, b)}
    cfg = experiment()
    actor = AgentLoopWorkerActor(cfg, ["http://a"], "unused", WorkerConfig())
    await actor._follow((0, ["http://b"]))  # the generation it was built with: no change
    assert actor.server_urls == ["http://a"]
    await actor._follow((2, ["http://b"]))  # before its pool exists: built from these
    assert actor.server_urls == ["http://b"]
    actor._pool = ServerPool(
        ["http://b"],
        client_factory=lambda u: PolicyClient(u, transport=fakes[u].transport()),
        health_check_interval_s=None,
    )
    await actor._follow((3, ["http://a", "http://b"]))
    assert sorted(actor._pool.urls) == ["http://a", "http://b"]
    await actor._follow((4, []))  # nothing serves right now: keep failing over as before
    assert sorted(actor._pool.urls) == ["http://a", "http://b"]
    await actor.shutdown()
