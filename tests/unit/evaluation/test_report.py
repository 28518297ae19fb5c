"""The evaluation runner: answers and correctness per sample, the report's metrics, JSON and
table, and a run through a real AgentLoopManager with a scripted policy and real rewards."""

from __future__ import annotations

import asyncio
import json
import pickle
from collections import defaultdict
from typing import Any

import pytest

from agentrl.evaluation import (
    EvalReport,
    ValSample,
    answer_of,
    evaluate,
    is_correct,
    log_report,
    pass_at_k,
)
from agentrl.inference.tiny_model import build_tiny_tokenizer
from agentrl.rollout.manager import AgentLoopManager, WorkerConfig
from agentrl.rollout.rewards import RewardManager
from agentrl.tracking import NullTracker
from agentrl.types import SamplingParams, StopReason, Task, Trajectory
from tests.fakes import ScriptedPolicy


def traj(
    uid: str,
    index: int,
    *,
    reward: float,
    text: str = "",
    info: dict[str, Any] | None = None,
    source: str = "math",
    turns: int = 1,
    tools: dict[str, int] | None = None,
    stop: StopReason = StopReason.EOS,
) -> Trajectory:
    return Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        loss_mask=[1, 1, 0],
        rollout_logprobs=[-0.1, -0.2, 0.0],
        policy_version=[0, 0, -1],
        uid=uid,
        index=index,
        task_id=uid.split("#")[0],
        data_source=source,
        reward=reward,
        reward_info=info or {},
        num_turns=turns,
        tool_calls=tools or {},
        stop_reason=stop,
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": text}],
    )


# ---- per-sample rules -----------------------------------------------------------------------


def test_answer_prefers_the_reward_functions_answer():
    assert answer_of(traj("u", 0, reward=1, text="\\boxed{7}", info={"answer": "42"})) == "42"
    # the reward function looked and found nothing: abstain, do not second-guess it
    assert answer_of(traj("u", 0, reward=0, text="\\boxed{7}", info={"answer": None})) is None


def test_answer_falls_back_to_the_marked_final_answer_canonicalised():
    assert answer_of(traj("u", 0, reward=1, text="so \\boxed{42.0}")) == "42"
    assert answer_of(traj("u", 0, reward=1, text="steps\n#### 1,234")) == "1234"
    assert answer_of(traj("u", 0, reward=1, text="\\boxed{ Paris   France }")) == "Paris France"
    assert answer_of(traj("u", 0, reward=0, text="no marked answer 42")) is None
    assert answer_of(traj("u", 0, reward=0, text="#### ")) is None


def test_correct_uses_reward_info_then_the_reward():
    assert is_correct(traj("u", 0, reward=0.0, info={"correct": True}))
    assert not is_correct(traj("u", 0, reward=1.0, info={"correct": False}))
    assert is_correct(traj("u", 0, reward=0.8))
    assert not is_correct(traj("u", 0, reward=0.5))


# ---- the report from a scripted generate function --------------------------------------------


def scripted_trajectories(tasks: list[Task], n: int) -> list[Trajectory]:
    """t0: 3 of 4 right (answers 42, 42, 42, 41); t1: 1 of 4 right; t2 (code): 4 of 4, but
    sample 3's reward function failed."""
    plan = {
        "t0": [(1.0, "42"), (1.0, "42"), (1.0, "42"), (0.0, "41")],
        "t1": [(0.0, "3"), (0.0, "3"), (1.0, "5"), (0.0, "4")],
        "t2": [(1.0, "ok"), (1.0, "ok"), (1.0, "ok"), (0.0, "ok")],
    }
    out = []
    for g, task in enumerate(tasks):
        for i in range(n):
            reward, answer = plan[task.id][i]
            info: dict[str, Any] = {"correct": reward > 0, "answer": answer}
            if task.id == "t2" and i == 3:
                info = {"error": "TimeoutError: reward function timed out"}
            out.append(
                traj(
                    f"{task.id}#{g}",
                    i,
                    reward=reward,
                    info=info,
                    source=task.data_source,
                    turns=2 if task.id == "t0" else 1,
                    tools={"calculator": 1} if task.id == "t0" else {},
                    stop=StopReason.ABORTED if (task.id, i) == ("t1", 3) else StopReason.EOS,
                )
            )
    return out


TASKS = [
    Task(id="t0", prompt="a", data_source="math"),
    Task(id="t1", prompt="b", data_source="math"),
    Task(id="t2", prompt="c", data_source="code"),
]


def run_scripted(**kw: Any) -> EvalReport:
    async def generate(tasks, n_samples):
        return scripted_trajectories(list(tasks), n_samples)

    return asyncio.run(
        evaluate(generate, TASKS, n=4, temperature=1.0, n_bootstrap=200, seed=0, **kw)
    )


def test_report_metrics_hand_values():
    report = run_scripted()
    m = report.metrics
    assert m["val/math/reward/mean_at_4"] == pytest.approx((0.75 + 0.25) / 2)
    assert m["val/math/acc/mean_at_4"] == pytest.approx(0.5)
    assert m["val/math/pass_at_1"] == pytest.approx(0.5)
    assert m["val/math/pass_at_2"] == pytest.approx((pass_at_k(4, 3, 2) + pass_at_k(4, 1, 2)) / 2)
    assert m["val/math/pass_at_4"] == 1.0
    assert m["val/math/num_turns/mean"] == pytest.approx(1.5)
    assert m["val/math/tool_call_counts/mean"] == pytest.approx(0.5)
    # the failed reward is left out: code has 3 scored samples, all right
    assert m["val/code/reward/mean_at_4"] == 1.0
    assert m["val/code/num_samples"] == 3.0
    assert m["val/code/num_incomplete_tasks"] == 1.0
    assert m["val/reward_errors"] == 1.0
    assert m["val/accuracy"] == pytest.approx(7 / 11)
    assert m["val/num_tasks"] == 3.0
    assert m["val/num_samples"] == 12.0
    assert m["val/dropped_samples"] == 0.0
    assert m["val/aborted_ratio"] == pytest.approx(1 / 12)
    assert m["val/tool_calls_mean"] == pytest.approx(4 / 12)
    for key in (
        "best_at_4/mean",
        "worst_at_2/std",
        "maj_at_4/mean",
        "maj_at_2/std",
        "mean_at_4/ci95_lo",
    ):
        assert f"val/math/acc/{key}" in m
    assert report.ks == [1, 2, 4]


def test_report_dropped_samples_and_prefix():
    async def generate(tasks, n_samples):
        return scripted_trajectories(list(tasks), n_samples)[:-2]

    report = asyncio.run(
        evaluate(generate, TASKS, n=4, temperature=None, prefix="eval", n_bootstrap=50)
    )
    assert report.metrics["eval/dropped_samples"] == 2.0
    assert all(k.startswith("eval/") for k in report.metrics)


def test_report_round_trips_json_and_makes_a_table():
    report = run_scripted()
    again = EvalReport.from_json(report.to_json())
    assert again == report
    assert json.loads(report.to_json())["tasks"][0]["answers"] == ["42", "42", "42", "41"]
    rows = report.rows(step=7)
    assert {"step": 7, "data_source": "math", "metric": "pass_at_4", "value": 1.0} in rows
    assert {
        "step": 7,
        "data_source": "all",
        "metric": "accuracy",
        "value": report.metrics["val/accuracy"],
    } in rows
    # every metric appears once in the table
    assert len(rows) == len(report.metrics)


def test_log_report_logs_metrics_table_and_report():
    class Recording(NullTracker):
        def __init__(self) -> None:
            super().__init__()
            self.dicts: dict[str, Any] = {}

        def log_dict(self, data: Any, artifact_file: str) -> None:
            self.dicts[artifact_file] = data

    tracker = Recording()
    report = run_scripted()
    log_report(tracker, report, step=3)
    assert tracker.history["val/math/pass_at_4"] == [(3, 1.0)]
    assert tracker.dicts["eval/table_step_00003.json"] == report.rows(step=3)
    assert tracker.dicts["eval/report_step_00003.json"]["n"] == 4


def test_evaluate_rejects_bad_n():
    with pytest.raises(ValueError, match="n \\(samples per task\\) must be >= 1, got 0"):
        run_scripted_n0()


def run_scripted_n0() -> None:
    async def generate(tasks, n_samples):
        return []

    asyncio.run(evaluate(generate, TASKS, n=0, temperature=1.0))


# ---- through a real AgentLoopManager ---------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_evaluate_runs_each_task_n_times_through_the_manager(tok):
    """Task q0 answers 42 three times out of four (right), q1 answers 7 always (wrong)."""
    calls: dict[str, int] = defaultdict(int)

    def script(prompt_ids: list[int], k: int) -> str:
        prompt = tok.decode(prompt_ids)
        key = "q0" if "q0" in prompt else "q1"
        calls[key] += 1
        if key == "q1":
            return "It is \\boxed{7}."
        return "It is \\boxed{41}." if calls[key] == 2 else "It is \\boxed{42}."

    tasks = [
        Task(
            id=f"q{i}",
            prompt=f"q{i}: what is 6*7?",
            agent="single_turn",
            data_source="calc",
            reward_spec={"ground_truth": "42"},
        )
        for i in range(2)
    ]
    manager = AgentLoopManager(
        ScriptedPolicy(tok, script),
        tok,
        reward=RewardManager({"calc": "numeric_match"}),
        config=WorkerConfig(sampling=SamplingParams(max_tokens=32, temperature=0.7)),
    )
    report = asyncio.run(evaluate(manager, tasks, n=4, temperature=0.7, n_bootstrap=100))
    m = report.metrics
    assert m["val/num_samples"] == 8.0
    assert m["val/calc/num_samples"] == 8.0
    assert m["val/calc/acc/mean_at_4"] == pytest.approx((0.75 + 0.0) / 2)
    assert m["val/calc/pass_at_1"] == pytest.approx(0.375)
    assert m["val/calc/pass_at_4"] == pytest.approx(0.5)
    assert m["val/accuracy"] == pytest.approx(3 / 8)
    answers = {t.task_id: sorted(a or "" for a in t.answers) for t in report.tasks}
    assert answers == {"q0": ["41", "42", "42", "42"], "q1": ["7", "7", "7", "7"]}
    assert report.temperature == 0.7


def test_evaluate_refuses_a_manager_with_another_temperature(tok):
    manager = AgentLoopManager(
        ScriptedPolicy(tok, ["\\boxed{1}"]),
        tok,
        config=WorkerConfig(sampling=SamplingParams(temperature=1.0)),
    )
    tasks = [Task(id="q", prompt="q", agent="single_turn")]
    with pytest.raises(ValueError, match=r"samples at temperature 1\.0"):
        asyncio.run(evaluate(manager, tasks, n=2, temperature=0.0))


def test_report_and_samples_pickle():
    report = run_scripted()
    assert pickle.loads(pickle.dumps(report)) == report
    sample = ValSample("s", "g", {"reward": 1.0}, answer="42", correct=True)
    assert pickle.loads(pickle.dumps(sample)) == sample


def test_evaluate_counts_samples_whose_reward_raised(tok):
    """A reward that raises drops the sample in the manager (never a 0.0); validation still
    counts it in ``val/reward_errors`` (issue 22: it stayed 0)."""

    def flaky(traj: Trajectory, task: Task) -> float:
        if task.id == "q1":
            raise ValueError("no ground truth")
        return 1.0

    tasks = [Task(id=f"q{i}", prompt=f"q{i}", agent="single_turn", data_source="s") for i in (0, 1)]
    manager = AgentLoopManager(
        ScriptedPolicy(tok, lambda prompt_ids, k: "\\boxed{1}"),
        tok,
        reward=RewardManager({"s": flaky}),
        config=WorkerConfig(sampling=SamplingParams(max_tokens=16, temperature=0.7)),
    )
    m = asyncio.run(evaluate(manager, tasks, n=2, temperature=0.7, n_bootstrap=10)).metrics
    assert m["val/reward_errors"] == 2.0
    assert m["val/num_samples"] == 2.0 and m["val/dropped_samples"] == 2.0
    assert m["val/reward_mean"] == 1.0


def test_the_json_report_carries_each_samples_reward_info():
    """``agentrl eval --report`` users read why a sample scored what it did (issue 22)."""

    async def generate(tasks, n_samples):
        return [
            traj(
                f"{t.id}#0", i, reward=1.0, info={"answer": "42", "probes": i + 1, "correct": True}
            )
            for t in tasks
            for i in range(n_samples)
        ]

    report = asyncio.run(evaluate(generate, TASKS[:1], n=2, temperature=None, n_bootstrap=10))
    task = json.loads(report.to_json())["tasks"][0]
    assert [info["probes"] for info in task["reward_info"]] == [1, 2]
    assert task["reward_info"][0] == {"answer": "42", "probes": 1, "correct": True}
