"""reasoning-gym tasks: a seeded, weighted mixture, scored by reasoning-gym's own scorers,
generated and scored offline."""

from __future__ import annotations

import socket

import pytest

from agentrl.config.reasoning_gym import ReasoningGymConfig
from agentrl.rollout.reasoning_gym import (
    ReasoningGymError,
    generate_reasoning_gym_tasks,
    reasoning_gym_reward,
    task_counts,
)
from agentrl.rollout.rewards import resolve_reward_fn
from agentrl.training.resolve import ResolutionError, resolve_experiment
from agentrl.types import Trajectory
from tests.fakes import experiment

MIX = ["leg_counting", "basic_arithmetic", {"name": "letter_counting", "weight": 2.0}]


def _answering(text: str) -> Trajectory:
    return Trajectory(
        prompt_ids=[1],
        response_ids=[],
        loss_mask=[],
        rollout_logprobs=[],
        policy_version=[],
        uid="u",
        messages=[{"role": "assistant", "content": text}],
    )


def test_same_seed_same_tasks_other_seed_other_tasks() -> None:
    cfg = ReasoningGymConfig(tasks=MIX)
    a = generate_reasoning_gym_tasks(cfg, 12, seed=5)
    assert a == generate_reasoning_gym_tasks(cfg, 12, seed=5)
    b = generate_reasoning_gym_tasks(cfg, 12, seed=6)
    assert [t.messages for t in a] != [t.messages for t in b]


def test_mixture_follows_the_weights_and_names_the_sources() -> None:
    tasks = generate_reasoning_gym_tasks(ReasoningGymConfig(tasks=MIX), 20, seed=0)
    counts = {s: sum(t.data_source == s for t in tasks) for s in {t.data_source for t in tasks}}
    assert counts == {"leg_counting": 5, "basic_arithmetic": 5, "letter_counting": 10}
    assert len({t.id for t in tasks}) == 20
    first = tasks[0]
    assert first.messages is not None and first.messages[0]["role"] == "system"
    assert "<answer>" in first.messages[0]["content"]  # reasoning-gym's default prompt


@pytest.mark.parametrize(
    ("weights", "n", "expected"),
    [([1, 1, 2], 10, [3, 2, 5]), ([1, 100], 3, [1, 2]), ([1, 1, 1], 2, [1, 1, 0])],
)
def test_task_counts(weights: list[float], n: int, expected: list[int]) -> None:
    assert task_counts(weights, n) == expected
    assert sum(task_counts(weights, n)) == n


def test_the_scorer_is_reasoning_gyms_own() -> None:
    cfg = ReasoningGymConfig(tasks=["basic_arithmetic", "spell_backward"])
    for task in generate_reasoning_gym_tasks(cfg, 6, seed=1):
        truth = task.reward_spec["ground_truth"]
        assert reasoning_gym_reward(_answering(f"so <answer>{truth}</answer>"), task)["score"] == 1
        assert reasoning_gym_reward(_answering(truth), task)["score"] == 0  # no answer tag
        wrong = reasoning_gym_reward(_answering("<answer>zzz-not-it</answer>"), task)
        assert wrong["score"] < 1 and wrong["answer"] == "zzz-not-it"
    assert resolve_reward_fn("reasoning_gym") is reasoning_gym_reward


def test_generation_and_scoring_need_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    names = ["leg_counting", "word_sorting", "word_ladder", "codeio", "family_relationships"]
    tasks = generate_reasoning_gym_tasks(ReasoningGymConfig(tasks=names), 10, seed=2)
    assert {t.data_source for t in tasks} == set(names)
    for t in tasks:
        reasoning_gym_reward(_answering(f"<answer>{t.reward_spec['ground_truth']}</answer>"), t)


def test_unknown_task_and_bad_options_name_the_key_and_the_fix() -> None:
    with pytest.raises(ReasoningGymError, match=r"tasks\[1\]\.name.*'leg_counting'\?"):
        generate_reasoning_gym_tasks(
            ReasoningGymConfig(tasks=["chain_sum", "leg_countin"]), 4, seed=0
        )
    bad = ReasoningGymConfig(tasks=[{"name": "chain_sum", "config": {"no_such_knob": 1}}])
    with pytest.raises(ReasoningGymError, match=r"tasks\[0\]\.config.*no_such_knob"):
        generate_reasoning_gym_tasks(bad, 4, seed=0)
    with pytest.raises(ReasoningGymError, match=r"data\.reasoning_gym\.tasks is empty"):
        generate_reasoning_gym_tasks(ReasoningGymConfig(), 4, seed=0)
    with pytest.raises(ValueError, match="more than once"):
        ReasoningGymConfig(tasks=["chain_sum", "chain_sum"])


def test_resolution_requires_the_reasoning_gym_reward() -> None:
    cfg = experiment(
        "data.generator=reasoning_gym",
        "data.reasoning_gym.tasks=[chain_sum, leg_counting]",
        "data.generator_train_size=8",
        "data.generator_val_size=4",
        "tools.enabled=[]",
        "reward.default=exact_match",
    )
    with pytest.raises(ResolutionError, match=r"'chain_sum'.*reward.default: reasoning_gym"):
        resolve_experiment(cfg)
    with pytest.raises(ResolutionError, match=r"reasoning-gym has no task 'chain_summ'"):
        resolve_experiment(
            experiment(
                "data.generator=reasoning_gym",
                "data.reasoning_gym.tasks=[chain_summ]",
                "reward.default=reasoning_gym",
            )
        )
