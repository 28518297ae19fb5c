"""The thread plan: no process without a thread, no oversubscription by default, env for children."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentrl import threads
from agentrl.threads import make_plan


def _in_child(env: dict[str, str], code: str) -> str:
    """What ``code`` prints in a fresh interpreter with only ``env`` (a server's environment)."""
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env}, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_two_cores_three_processes_get_one_thread_each() -> None:
    plan = make_plan(2, cpus=[0, 1])
    assert plan.trainer.threads == 1
    assert [s.threads for s in plan.servers] == [1, 1]
    assert plan.describe().startswith("2 cpus: trainer=1 server0=1~10 server1=1~10")


def test_servers_yield_to_the_trainer_only_when_the_cores_are_oversubscribed() -> None:
    crowded = make_plan(2, cpus=[0, 1], reward_servers=1)
    assert [s.nice for s in (*crowded.servers, *crowded.reward_servers)] == [10, 10, 10]
    assert crowded.trainer.nice == 0
    assert crowded.servers[0].env()["AGENTRL_NICE"] == "10"
    assert make_plan(1, cpus=[0, 1]).servers[0].nice == 0  # 1 + 1 threads on 2 cores
    assert make_plan(2, cpus=8).servers[0].nice == 0
    assert make_plan(1, cpus=[0, 1, 2, 3], pin=True).servers[0].nice == 0
    assert "AGENTRL_NICE" not in make_plan(1, cpus=4).servers[0].env()
    # the knob wins both ways
    assert make_plan(2, cpus=[0, 1], server_nice=0).servers[0].nice == 0
    assert make_plan(1, cpus=8, server_nice=5).servers[0].nice == 5
    with pytest.raises(ValueError, match=r"distributed\.server_nice"):
        make_plan(1, server_nice=20)


def test_a_child_lowers_its_priority_once() -> None:
    env = make_plan(2, cpus=[0, 1]).servers[0].env()
    code = (
        "import os; from agentrl.threads import apply_env_threads; "
        "before = os.nice(0); apply_env_threads(); apply_env_threads(); print(os.nice(0) - before)"
    )
    assert _in_child(env, code) == "10"


def test_cores_are_split_without_oversubscription() -> None:
    plan = make_plan(2, cpus=8)
    total = plan.trainer.threads + sum(s.threads for s in plan.servers)
    assert total == 8
    assert plan.trainer.threads == 3


def test_external_servers_leave_every_cpu_to_the_trainer() -> None:
    plan = make_plan(2, cpus=4, external_servers=True)
    assert plan.trainer.threads == 4
    assert plan.servers == ()


def test_taking_turns_gives_the_trainer_every_core() -> None:
    """Synchronous or colocated: the servers idle while the trainer updates, and vice versa."""
    plan = make_plan(2, cpus=[0, 1], turns=True)
    assert plan.trainer.threads == 2
    assert [s.threads for s in plan.servers] == [1, 1]
    plan = make_plan(1, cpus=8, reward_servers=1, turns=True)
    assert (plan.trainer.threads, plan.servers[0].threads, plan.reward_servers[0].threads) == (
        8,
        4,
        4,
    )
    assert make_plan(0, cpus=4, turns=True).trainer.threads == 4
    assert make_plan(2, cpus=4, trainer_threads=1, turns=True).trainer.threads == 1
    pinned = make_plan(2, cpus=[4, 5, 6, 7], pin=True, turns=True)
    assert pinned.trainer.cpus == (4, 5, 6, 7)
    assert [s.cpus for s in pinned.servers] == [(4, 5), (6, 7)]


def test_explicit_shares_win() -> None:
    plan = make_plan(1, cpus=4, trainer_threads=3, server_threads=2)
    assert (plan.trainer.threads, plan.servers[0].threads) == (3, 2)


def test_pinning_gives_disjoint_cpus_or_none() -> None:
    plan = make_plan(1, cpus=[4, 5, 6, 7], pin=True)
    assert plan.trainer.cpus == (4, 5)
    assert plan.servers[0].cpus == (6, 7)
    assert make_plan(3, cpus=[0, 1], pin=True).trainer.cpus is None


def test_bad_cpu_settings_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"distributed\.cpus"):
        make_plan(1, cpus=0)
    with pytest.raises(ValueError, match=r"distributed\.cpus"):
        make_plan(1, cpus=[])


def test_child_env_sets_the_pools_before_torch_starts() -> None:
    env = make_plan(1, cpus=[0, 1, 2, 3]).servers[0].env()
    assert env["OMP_NUM_THREADS"] == env["AGENTRL_THREADS"] == "2"
    code = (
        "from agentrl.threads import apply_env_threads; import torch; "
        "apply_env_threads(); print(torch.get_num_threads())"
    )
    assert _in_child(env, code) == "2"


def test_plan_pickles() -> None:
    import pickle

    plan = make_plan(2)
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert threads.available_cpus()


def test_a_synchronous_or_colocated_run_plans_turns() -> None:
    from agentrl.config import load_config
    from agentrl.training.build import thread_plan

    def trainer_threads(*overrides: str) -> int:
        return thread_plan(load_config(None, ["distributed.cpus=2", *overrides])).trainer.threads

    assert trainer_threads("trainer.max_staleness=0") == 2
    assert trainer_threads("trainer.max_staleness=0", "distributed.trainer_threads=1") == 1
    assert trainer_threads("trainer.max_staleness=2", "distributed.colocate=true") == 2
    assert trainer_threads("trainer.max_staleness=2") == 1
