"""Ray fault tolerance on a real local Ray cluster (``ray_cluster``) with the tiny model: actors
killed mid-run are restarted, their work is re-dispatched or retried, and the run finishes with
every task accounted for and every server verified on the trainer's version.

The killing happens from a thread of this test process (the driver's Ray connection) while
``run_with_ray`` trains: ``ray.kill(actor, no_restart=False)`` kills an actor the way a crash
does (Ray restarts it), and a SIGKILL of a server subprocess kills a server under a live actor.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentrl.distributed.ray_backend import run_with_ray
from tests.integration.test_ray import ROOT, _alive, _cfg, _wait_dead

pytestmark = [pytest.mark.integration, pytest.mark.ray]


class _Chaos(threading.Thread):
    """Kills, mid-run, once worker actor 0 holds episodes: worker actor 0, server actor 0 and
    the reward actor (``ray.kill(no_restart=False)``, as a crash), and the server process of
    server actor 1 (SIGKILL; its actor stays alive); server 2 keeps serving. Then waits until
    both replaced servers serve rollouts again."""

    def __init__(self, info: dict[str, Any], timeout_s: float = 240.0) -> None:
        super().__init__(daemon=True)
        self.info = info
        self.deadline = time.monotonic() + timeout_s
        self.done: list[tuple[str, Any]] = []
        """What was killed, in order, with what identifies it (pids, URL)."""
        self.error: BaseException | None = None
        self.stop = threading.Event()
        """Set when the run has returned: no Ray call after that."""

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the test, never lost in a thread
            self.error = exc

    def _wait(self, what: str, ready: Callable[[], Any]) -> Any:
        from ray.exceptions import RayActorError

        while True:
            assert not self.stop.is_set(), f"chaos: the run ended while waiting for {what}"
            try:
                value = ready()
            except RayActorError:  # an actor restarting: not ready yet
                value = None
            if value:
                return value
            assert time.monotonic() < self.deadline, f"chaos: gave up waiting for {what}"
            time.sleep(0.2)

    def _run(self) -> None:
        import ray

        handles = self._wait("the actors", lambda: self.info.get("handles"))
        workers, servers, reward = handles["workers"], handles["servers"], handles["reward"]

        def progress() -> bool:
            infos = ray.get([w.info.remote() for w in workers], timeout=30)
            return sum(i["episodes"] for i in infos) >= 2 and infos[0]["running"] >= 1

        self._wait("worker 0 running episodes", progress)
        actor, process = ray.get([servers[0].info.remote(), servers[1].info.remote()], timeout=30)
        ray.kill(workers[0], no_restart=False)
        ray.kill(servers[0], no_restart=False)
        ray.kill(reward, no_restart=False)
        self.done.append(("actors", actor))
        os.kill(process["server_pid"], signal.SIGKILL)
        self.done.append(("server process", process))
        self._wait_serving(workers, servers[0], actor["url"])
        self._wait_serving(workers, servers[1], process["url"])
        self.done.append(("recovered", None))

    def _wait_serving(self, workers: list[Any], server: Any, old_url: str) -> None:
        """Until ``server`` runs a new server and a worker routes to it (it was pushed to)."""
        import ray

        def replaced() -> dict[str, Any] | None:
            now: dict[str, Any] = ray.get(server.info.remote(), timeout=60)
            return now if now["url"] and now["url"] != old_url else None

        new = self._wait(f"a server to replace {old_url}", replaced)
        self._wait(
            f"a worker routing to {new['url']}",
            lambda: any(
                new["url"] in i["servers"]
                for i in ray.get([w.info.remote() for w in workers], timeout=30)
            ),
        )


PACE_S = 1.0
"""How long each scoring waits (:func:`paced_calculator_reward`)."""


HOLD_ENV = "AGENTRL_TEST_HOLD_FILE"
"""While the file this environment variable names exists, :func:`paced_calculator_reward`
waits (at most ``HOLD_MAX_S``): a test holds every episode's scoring, so no step completes and
no push happens, until the servers it killed have been replaced. Then the replacements join at
the next push whatever the machine's speed, instead of racing the end of the run."""

HOLD_MAX_S = 240.0


async def paced_calculator_reward(traj: Any, task: Any) -> dict[str, Any]:
    """The calculator reward, after ``PACE_S`` seconds (and while the ``HOLD_ENV`` file exists):
    a step takes about two of them at least, however fast the machine, so that the killed
    servers come back well before the run ends (a replacement joins at a push). Sleeping costs
    no CPU."""
    from agentrl.rollout.rewards import calculator_reward

    await asyncio.sleep(PACE_S)
    hold = os.environ.get(HOLD_ENV)
    deadline = time.monotonic() + HOLD_MAX_S
    while hold and Path(hold).exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return calculator_reward(traj, task)


def _last(
    history: dict[str, list[tuple[int, float]]], key: str, default: float | None = None
) -> float:
    """The metric's value at the last step (``default`` when the run never logged it)."""
    if not history.get(key) and default is not None:
        return default
    assert history.get(key), f"no {key} in the run's metrics: {sorted(history)}"
    return history[key][-1][1]


@pytest.mark.timeout(420)
def test_killed_actors_and_server_mid_run_the_run_finishes_and_accounts_for_every_task(
    ray_cluster: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    report_metric: Callable[[str, float], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray
    import ray._private.auto_init_hook

    steps = 20
    cfg = _cfg(
        tiny_model_dir,
        tmp_path / "run",
        f"distributed.ray_address={ray_cluster}",
        f"trainer.total_steps={steps}",
        "inference.num_servers=3",
        "rollout.num_workers=2",
        "rollout.max_concurrency=2",
        "inference.health_check_interval_s=1",
        f"reward.sources.calculator={__name__}:paced_calculator_reward",
    )
    # A Ray call from the chaos thread after the run must fail, never start a local cluster;
    # this test owns the connection (run_with_ray joins it), so it outlives the chaos thread.
    monkeypatch.setattr(ray._private.auto_init_hook, "enable_auto_connect", False)
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    ray.init(
        address=ray_cluster, runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=False
    )
    info: dict[str, Any] = {}
    chaos = _Chaos(info)
    chaos.start()
    try:
        result = run_with_ray(cfg, placement_info=info)
    finally:
        chaos.stop.set()
        chaos.join(timeout=60)
        ray.shutdown()
    acc = info["accounting"]
    assert chaos.error is None, f"the chaos thread failed: {chaos.error!r}; servers: {acc}"
    assert [k for k, _ in chaos.done] == ["actors", "server process", "recovered"], chaos.done
    assert result.steps == steps and result.version == steps  # the run finished
    numbers = _assert_every_task_accounted_for(acc, result.history, steps * cfg.data.batch_size)
    numbers.update(
        _assert_servers_verified(acc["servers"], result, cfg.checkpoint.verify_tolerance)
    )
    # No server is left running: the killed ones (reaper / SIGKILL) and the final ones.
    final = {s["index"]: s for s in info["servers_final"]}
    assert [final[s["index"]]["url"] for s in acc["servers"]["slots"]] == [
        s["url"] for s in acc["servers"]["slots"]
    ]
    for _, gone in chaos.done[:2]:
        assert _wait_dead(gone["server_pid"], 30), gone
    for s in final.values():
        assert _wait_dead(s["server_pid"], 60), s
    assert not any(_alive(s["server_pid"]) for s in info["servers"])
    numbers["train_wall_s"] = info["train_wall_s"]
    for name, value in numbers.items():
        report_metric(name, float(value))


def _assert_every_task_accounted_for(
    acc: dict[str, Any],
    h: dict[str, list[tuple[int, float]]],
    trained_tasks: int,
    worker_killed: bool = True,
) -> dict[str, float]:
    """Tasks: trained once, or dropped (and counted), or pending; never two of these.
    Episodes: every admitted one finished, dropped (counted) or running at the last step; the
    dead worker's (``worker_killed``) re-dispatched (counted), none lost to the reward actor's
    death."""
    trained, dropped, dispatched = acc["trained"], acc["dropped"], acc["dispatched"]
    assert len(trained) == len(set(trained)) == trained_tasks
    assert not set(trained) & set(dropped)
    assert set(trained) | set(dropped) <= set(dispatched)
    pending = [t for t in dispatched if t not in set(trained) | set(dropped)]
    dropped_members = sum(
        _last(h, f"async/dropped_{r}_total")
        for r in ("stale", "uniform_reward", "incomplete_group")
    )
    assert dropped_members >= len(dropped)  # every dropped task was counted
    admitted, finished = _last(h, "rollout/admitted"), _last(h, "rollout/finished")
    dropped_eps, running = _last(h, "rollout/dropped", 0.0), _last(h, "rollout/running")
    assert admitted == finished + dropped_eps + running
    redispatched = _last(h, "rollout/redispatched", 0.0)
    assert _last(h, "rollout/worker_errors", 0.0) >= redispatched
    if worker_killed:
        assert redispatched >= 1 and _last(h, "rollout/worker_restarts") >= 1
    assert _last(h, "rollout/dropped/reward_error", 0.0) == 0
    return {
        "tasks_dispatched": len(dispatched),
        "tasks_trained": len(trained),
        "tasks_dropped": len(dropped),
        "tasks_pending": len(pending),
        "episodes_admitted": admitted,
        "episodes_finished": finished,
        "episodes_dropped": dropped_eps,
        "episodes_running_at_last_step": running,
        "episodes_redispatched": redispatched,
        "worker_errors": _last(h, "rollout/worker_errors", 0.0),
        "reward_retries": _last(h, "rollout/reward_retries", 0.0),
    }


def _assert_servers_verified(
    servers: dict[str, Any], result: Any, tolerance: float
) -> dict[str, float]:
    """Servers 0 and 1 were replaced (new URLs); every server, the replacements included, took
    the last push, verified while paused, on the trainer's final version."""
    assert servers["counts"]["replaced"] == 2, servers
    for slot in servers["slots"]:
        assert slot["state"] == "serving", servers
        launches = len({launch["url"] for launch in slot["launches"]})
        assert launches == (2 if slot["index"] < 2 else 1), slot
        push = slot["last_push"]
        assert push["ok"] and push["server_version"] == result.version, slot
        assert push["verified_while_paused"]
        assert push["verify_max_abs_diff"] <= tolerance, slot
    h = result.history
    assert _last(h, "weight_sync/servers_serving") == 3
    assert _last(h, "weight_sync/verify_max_abs_diff") <= tolerance
    return {
        "servers_replaced": servers["counts"]["replaced"],
        "servers_detached_total": servers["counts"]["detached"],
        "verify_max_abs_diff_last": _last(h, "weight_sync/verify_max_abs_diff"),
    }
