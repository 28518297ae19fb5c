"""DAPO's soft overlong penalty against hand-computed values (verl's formula)."""

from __future__ import annotations

import pytest

from agentrl.config.section import ConfigError
from agentrl.rollout.rewards.overlong import OverlongPenalty
from agentrl.training.build import worker_config
from tests.fakes import experiment, random_trajectories


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (96, 0.0),  # L_max - L_cache = 128 - 32: the last unpunished length
        (100, -4 / 32),
        (112, -0.5),
        (127, -31 / 32),
        (128, -1.0),  # at the budget: -factor
        (140, -44 / 32),  # past it (cannot happen with the budget enforced): still linear
    ],
)
def test_penalty_is_zero_then_linear_to_minus_one_at_the_budget(
    length: int, expected: float
) -> None:
    assert OverlongPenalty(max_len=128, buffer_len=32).penalty(length) == pytest.approx(expected)


def test_factor_scales_the_penalty() -> None:
    shaping = OverlongPenalty(max_len=10, buffer_len=4, factor=0.5)
    assert [shaping.penalty(n) for n in (6, 7, 8, 10)] == pytest.approx([0.0, -0.125, -0.25, -0.5])


def test_apply_adds_the_penalty_to_the_reward_and_records_it() -> None:
    traj = random_trajectories(2)[1]  # reward 1.0
    n = traj.response_length
    shaped = OverlongPenalty(max_len=n, buffer_len=2).apply(traj)
    assert shaped.reward == pytest.approx(0.0)  # 1.0 - 1.0 at the budget
    assert shaped.reward_info["overlong_penalty"] == pytest.approx(-1.0)
    assert traj.reward == 1.0  # the input is not changed


@pytest.mark.parametrize(("buffer_len", "factor"), [(0, 1.0), (11, 1.0), (4, -1.0)])
def test_bad_settings_name_the_key(buffer_len: int, factor: float) -> None:
    with pytest.raises(ValueError, match=r"reward\.overlong_"):
        OverlongPenalty(max_len=10, buffer_len=buffer_len, factor=factor)


def test_config_turns_it_on_for_the_workers_and_checks_it_against_the_budget() -> None:
    cfg = experiment("agent.max_response_tokens=64", "reward.overlong_buffer_len=16")
    assert worker_config(cfg).overlong == OverlongPenalty(64, 16, 1.0)
    assert worker_config(experiment()).overlong is None
    with pytest.raises((ConfigError, ValueError), match=r"reward\.overlong_buffer_len=65"):
        experiment("agent.max_response_tokens=64", "reward.overlong_buffer_len=65")
