"""Faults under ``agentrl serve`` (real subprocesses, SIGKILL):

- one of two inference servers dies mid-job: the job completes, every episode is a trajectory
  or a counted drop, none is delivered twice; the next weight push succeeds on the survivor
  and ``/health`` says degraded;
- the service itself is killed mid-stream and restarted on the same store: the SDK reader
  reconnects and resumes from its cursor; every episode arrives exactly once, and the service
  comes back at its last pushed version and digest, not model.path's;
- the service's own server is SIGKILLed: ``/health`` says degraded, a push meanwhile is a 503
  (the version does not move), the server is restarted and rejoins at the current version (the
  saved weights pushed to it first), then takes pushes again; nothing outlives the service.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections import Counter

import httpx
import pytest

from agentrl.client import RolloutClient
from agentrl.inference.handle import free_port
from tests.integration.service_helpers import (
    API_KEY,
    CHECKPOINT,
    ServiceProcess,
    running_service,
    start_inference_servers,
    write_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TASKS, N = 64, 4


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    handles = start_inference_servers(tmp, 2)
    try:
        yield handles, tmp
    finally:
        for h in handles:
            h.stop()


def _expected() -> set[tuple[int, int]]:
    return {(t, s) for t in range(TASKS) for s in range(N)}


def _key(traj) -> tuple[int, int]:
    return int(traj.uid.rsplit("/", 1)[1]), traj.index


def test_killing_one_of_two_servers_mid_job_loses_and_duplicates_nothing(servers, report_metric):
    handles, tmp = servers
    victim = handles[0]
    config = write_config(tmp, [h.base_url for h in handles], request_timeout_s=30.0)
    with (
        running_service(config, tmp, name="kill-server") as svc,
        RolloutClient(svc.url, api_key=API_KEY) as client,
    ):
        job = client.submit(dataset={"split": "train", "limit": TASKS}, n=N)
        seen: list = []
        for traj in client.trajectories(job.id):
            seen.append(traj)
            if len(seen) == 8:
                at_kill = client.job(job.id)
                victim.kill()
        status = client.job(job.id)
        service_status = client.status()
        # a push goes on on the survivor; the dead server given as a URL is ejected, not failed
        pushed = client.push_weights((CHECKPOINT / "model.safetensors").read_bytes())
        health = httpx.get(svc.url + "/health").json()
    assert pushed["ok"] and list(pushed["servers"]) == [handles[1].base_url]
    assert victim.base_url in pushed["ejected"] and pushed["version"] > service_status["version"]
    assert health["status"] == "degraded" and health["servers"][0]["url"] == victim.base_url
    assert not at_kill.done and at_kill.counts["finished"] < TASKS * N  # really mid-job
    keys = Counter(_key(t) for t in seen)
    assert max(keys.values()) == 1, "a trajectory was delivered twice"
    c = status.counts
    assert status.status == "finished"
    assert c["finished"] + c["dropped"] == TASKS * N == c["episodes"]
    assert c["finished"] == len(seen) and set(keys) <= _expected()
    alive = {s["url"]: s["alive"] for s in service_status["servers"]}
    assert alive[victim.base_url] is False and alive[handles[1].base_url] is True
    report_metric("server_kill_trajectories", len(seen))
    report_metric("server_kill_dropped", c["dropped"])


def test_killing_and_restarting_the_service_mid_stream_resumes_exactly_once(servers, report_metric):
    handles, tmp = servers
    alive = [h for h in handles if h.is_running()]
    config = write_config(tmp, [h.base_url for h in alive])
    weights = (CHECKPOINT / "model.safetensors").read_bytes()
    svc = ServiceProcess(config, free_port(), tmp / "restart.sqlite", tmp / "restart.log").start()
    try:
        with RolloutClient(svc.url, api_key=API_KEY) as client:
            pushed = client.push_weights(weights, version=client.weights()["version"] + 5)
            job = client.submit(dataset={"split": "train", "limit": TASKS}, n=N)
            seen: list = []
            restarted = False
            for traj in client.trajectories(job.id, ack_every=8, reconnect_timeout_s=180):
                seen.append(traj)
                if len(seen) == 20 and not restarted:
                    at_kill = client.job(job.id)
                    svc.kill()  # SIGKILL: no shutdown path runs
                    svc.start()  # same port, same store
                    restarted = True
            status = client.job(job.id)
            info, service_status = client.weights(), client.status()
    finally:
        svc.stop()
    # the weights are durable: the restarted service is at the pushed version and digest
    assert pushed["ok"] and pushed["persisted"]
    assert info["version"] == service_status["version"] == pushed["version"]
    assert info["sha256"] == pushed["sha256"] == hashlib.sha256(weights).hexdigest()
    assert info["digest"] is not None and info["digest"] == service_status["weights"]["digest"]
    assert set(info["servers"].values()) == {pushed["version"]}
    keys = Counter(_key(t) for t in seen)
    assert restarted and max(keys.values()) == 1, "a trajectory was delivered twice"
    assert set(keys) == _expected(), "a trajectory was lost"
    assert status.status == "finished" and status.counts["dropped"] == 0
    assert status.counts["acked"] == TASKS * N and status.counts["pending_delivery"] == 0
    report_metric("service_restart_trajectories", len(seen))
    report_metric("service_restart_stored_at_kill", at_kill.counts["finished"])
    report_metric("service_restart_running_at_kill", at_kill.counts["running"])


def test_sigterm_mid_stream_exits_promptly_and_the_job_resumes(servers, report_metric):
    import time

    handles, tmp = servers
    alive = [h for h in handles if h.is_running()]
    config = write_config(tmp, [h.base_url for h in alive])
    svc = ServiceProcess(config, free_port(), tmp / "term.sqlite", tmp / "term.log").start()
    try:
        with RolloutClient(svc.url, api_key=API_KEY) as client:
            job = client.submit(dataset={"split": "train", "limit": TASKS}, n=N)
            seen: list = []
            for traj in client.trajectories(job.id, reconnect_timeout_s=180):
                seen.append(traj)
                if len(seen) == 10 and svc.proc is not None and svc.proc.poll() is None:
                    t0 = time.monotonic()
                    svc.stop()  # SIGTERM with this stream open and episodes running
                    exit_s = time.monotonic() - t0
                    svc.start()
            status = client.job(job.id)
    finally:
        svc.stop()
    keys = Counter(_key(t) for t in seen)
    assert max(keys.values()) == 1 and set(keys) == _expected()
    assert status.status == "finished" and status.counts["dropped"] == 0
    assert exit_s < 15, f"SIGTERM took {exit_s:.1f} s"
    report_metric("service_sigterm_exit_s", exit_s)


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    """True once no process ``pid`` exists (within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_a_killed_server_is_restarted_and_rejoins_at_the_current_version(tmp_path, report_metric):
    # One server of the service's own (the push going on on the others is the test above).
    config = write_config(tmp_path, [], backend="embedded", num_servers=1)
    weights = (CHECKPOINT / "model.safetensors").read_bytes()
    with (
        running_service(config, tmp_path, name="own-server") as svc,
        RolloutClient(svc.url, api_key=API_KEY) as client,
    ):
        assert client.push_weights(weights)["version"] == 1
        (victim,) = client.status()["servers"]
        os.kill(victim["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        refused = httpx.post(
            svc.url + "/v1/weights",
            content=weights,
            headers={
                "authorization": f"Bearer {API_KEY}",
                "content-type": "application/octet-stream",
            },
        )
        health = httpx.get(svc.url + "/health").json()
        while time.monotonic() - t0 < 120:
            status = client.status()
            if status["health"]["status"] == "ok":
                break
            time.sleep(0.5)
        rejoin_s = time.monotonic() - t0
        info = client.weights()
        after = client.push_weights(weights)  # the restarted server takes pushes again
    assert refused.status_code == 503 and "no live inference server" in refused.text
    assert health["status"] == "degraded" and health["servers"][0]["url"] == victim["url"]
    (back,) = status["servers"]
    assert status["health"]["status"] == "ok", status["health"]
    assert back["state"] == "serving" and back["restarts"] == 1 and back["pid"] != victim["pid"]
    assert status["server_counts"]["restarts"] == 1 and status["weights"]["catch_ups"] == 1
    assert info["version"] == 1 and set(info["servers"].values()) == {1}  # rejoined at 1
    assert after["ok"] and after["version"] == 2 and list(after["servers"]) == [back["url"]]
    assert _gone(back["pid"]), "a restarted server outlived agentrl serve"
    report_metric("server_restart_rejoin_s", rejoin_s)
