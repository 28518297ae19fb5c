"""Faults under ``agentrl serve`` (real subprocesses, SIGKILL):

- one of two inference servers dies mid-job: the job completes, every episode is a trajectory
  or a counted drop, none is delivered twice;
- the service itself is killed mid-stream and restarted on the same store: the SDK reader
  reconnects and resumes from its cursor; every episode arrives exactly once.
"""

from __future__ import annotations

from collections import Counter

import pytest

from agentrl.client import RolloutClient
from agentrl.inference.handle import free_port
from tests.integration.service_helpers import (
    API_KEY,
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
    svc = ServiceProcess(config, free_port(), tmp / "restart.sqlite", tmp / "restart.log").start()
    try:
        with RolloutClient(svc.url, api_key=API_KEY) as client:
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
    finally:
        svc.stop()
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
