"""Ray beyond one node (issue 21): a real two-node Ray cluster on this machine (two raylets,
Ray's own ``ray.cluster_utils.Cluster``), servers and workers spread over both nodes
(``distributed.placement: spread``), and the second node killed mid-run (its raylet and every
process on it). The run must finish with every task accounted for: the lost server and worker
restart on the surviving node, the lost episodes are re-dispatched (counted), and every server
ends on the trainer's final version, verified.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentrl.distributed.ray_backend import run_with_ray
from tests.integration.conftest import _free_ray_port
from tests.integration.test_ray import ROOT, _alive, _cfg, _wait_dead
from tests.integration.test_ray_faults import HOLD_ENV, _assert_every_task_accounted_for, _last

pytestmark = [pytest.mark.integration, pytest.mark.ray]

FAST_FAILURE_DETECTION = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
"""The head declares a silent node dead after ~2 s instead of Ray's default ~30 s."""


class _NodeKiller(threading.Thread):
    """Kills node ``node`` (``Cluster.remove_node``, not graceful) once a worker actor on it
    runs episodes; records what ran there. From the kill until every server that ran there has
    a replacement, the ``hold`` file holds all scoring (``HOLD_ENV``), so the replacements join
    at a push however slowly they start. Errors are kept for the test, never lost."""

    def __init__(
        self, cluster: Any, node: Any, info: dict[str, Any], hold: Path, timeout_s: float = 240
    ):
        super().__init__(daemon=True)
        self.cluster, self.node, self.info, self.hold = cluster, node, info, hold
        self.deadline = time.monotonic() + timeout_s
        self.killed: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.seen: dict[str, Any] = {}
        """The last placement observed (for the failure message)."""

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.error = exc

    def _run(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        node_id = self.node.node_id
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            handles = self.info.get("handles")
            if handles:
                try:
                    workers = ray.get([w.info.remote() for w in handles["workers"]], timeout=30)
                    servers = ray.get([s.info.remote() for s in handles["servers"]], timeout=30)
                except GetTimeoutError:  # an actor busy on a loaded machine: ask again
                    continue
                self.seen = {"node": node_id, "workers": workers, "servers": servers}
                mine = [w for w in workers if w["node_id"] == node_id]
                theirs = [s for s in servers if s["node_id"] == node_id]
                # Mid-run: some episodes done, and the node holds a server or a busy worker.
                busy = any(w["running"] for w in mine) or (theirs and not mine)
                if sum(w["episodes"] for w in workers) >= 4 and busy:
                    self.killed = {
                        "workers": mine,
                        "servers": theirs,
                        "nodes_before": {s["node_id"] for s in servers}
                        | {w["node_id"] for w in workers},
                    }
                    self.hold.touch()
                    try:
                        self.cluster.remove_node(self.node, allow_graceful=False)
                        self._wait_replaced(handles["servers"], theirs)
                    finally:
                        self.hold.unlink(missing_ok=True)
                    return
            time.sleep(0.2)
        raise AssertionError("the second node never held a server or a busy worker mid-run")

    def _wait_replaced(self, actors: list[Any], killed: list[dict[str, Any]]) -> None:
        """Until the actor of every server in ``killed`` runs a new one (a new URL), then the
        registry's poll interval twice over, for it to be pending at the next push."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        for old in killed:
            while True:
                assert time.monotonic() < self.deadline, f"no server replaced {old['url']}"
                try:
                    now = ray.get(actors[old["index"]].info.remote(), timeout=30)
                except (RayActorError, GetTimeoutError):  # restarting on the other node
                    now = None
                if now and now["url"] and now["url"] != old["url"]:
                    break
                time.sleep(0.2)
        time.sleep(2.0)


@pytest.mark.timeout(480)
def test_two_nodes_one_killed_mid_run_the_run_finishes_and_accounts_for_every_task(
    tiny_model_dir: Path,
    tmp_path: Path,
    report_metric: Callable[[str, float], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray
    import ray._private.auto_init_hook
    import ray._private.utils
    from ray.cluster_utils import Cluster

    monkeypatch.setattr(ray._private.auto_init_hook, "enable_auto_connect", False)
    address_file = Path(ray._private.utils.get_ray_address_file(None))
    recorded = address_file.read_text() if address_file.exists() else None
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"trainer_node": 1},  # the trainer actor is not restarted: keep it here
            "gcs_server_port": _free_ray_port(),
            "include_dashboard": False,
            "_system_config": FAST_FAILURE_DETECTION,
        },
    )
    try:
        second = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        hold = tmp_path / "hold"
        ray.init(
            address=cluster.address,
            runtime_env={"env_vars": {"PYTHONPATH": path, HOLD_ENV: str(hold)}},
            log_to_driver=True,  # the actors' warnings in the captured output of a failure
        )
        steps = 6
        cfg = _cfg(
            tiny_model_dir,
            tmp_path / "run",
            f"trainer.total_steps={steps}",
            "distributed.placement=spread",
            "distributed.resources={trainer: {trainer_node: 1}}",
            "inference.num_servers=2",
            "rollout.num_workers=2",
            "rollout.max_concurrency=2",
            "inference.health_check_interval_s=1",
            "reward.sources.calculator=tests.integration.test_ray_faults:paced_calculator_reward",
        )
        info: dict[str, Any] = {}
        killer = _NodeKiller(cluster, second, info, hold)
        killer.start()
        try:
            result = run_with_ray(cfg, placement_info=info)
        except Exception as exc:
            raise AssertionError(f"the run failed; the node killer saw {killer.killed}") from exc
        finally:
            killer.stop.set()
            killer.join(timeout=60)
            ray.shutdown()
    finally:
        cluster.shutdown()
        # Cluster() records its address as "the last ray start": put back what was there, so
        # a later `agentrl train` on this machine does not look for this cluster.
        if recorded is None:
            address_file.unlink(missing_ok=True)
        else:
            address_file.write_text(recorded)
    assert killer.error is None, f"the node killer failed: {killer.error!r}; saw {killer.seen}"
    killed = killer.killed
    assert len(killed["nodes_before"]) == 2, killed  # spread: both nodes ran servers/workers
    # dealt out in turn: the second node held one server and one worker
    assert len(killed["servers"]) == len(killed["workers"]) == 1, killed
    assert result.steps == steps and result.version == steps  # the run finished
    acc = info["accounting"]
    trained = steps * cfg.data.batch_size
    numbers = _assert_every_task_accounted_for(
        acc, result.history, trained, worker_killed=bool(killed["workers"])
    )
    assert acc["servers"]["counts"]["replaced"] == len(killed["servers"]), acc["servers"]
    h = result.history
    assert _last(h, "weight_sync/servers_serving") == 2  # both servers serve at the end
    for slot in acc["servers"]["slots"]:
        assert slot["state"] == "serving" and slot["last_push"]["ok"], slot
        assert slot["last_push"]["server_version"] == result.version, slot
    # Every server that ran on the killed node is gone, and so is every final one.
    for s in killed["servers"]:
        assert _wait_dead(s["server_pid"], 30), s
    for s in info["servers_final"]:
        assert _wait_dead(s["server_pid"], 60), s
    assert not any(_alive(s["server_pid"]) for s in info["servers"])
    numbers["servers_on_killed_node"] = len(killed["servers"])
    numbers["workers_on_killed_node"] = len(killed["workers"])
    numbers["servers_replaced"] = acc["servers"]["counts"]["replaced"]
    for name, value in numbers.items():
        report_metric(name, float(value))
