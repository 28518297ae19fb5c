"""Validation statistics against hand calculations: pass_at_k, maj_at_k ties, bootstrap, aggregation."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from agentrl.evaluation.stats import (
    ValSample,
    bootstrap_indices,
    bootstrap_metric,
    default_ks,
    flatten_statistics,
    group_statistics,
    majority_value,
    pass_at_k,
    subset_sizes,
    task_ci95,
    validation_statistics,
)


def test_subset_sizes_are_powers_of_two_then_n():
    assert subset_sizes(1) == []
    assert subset_sizes(2) == [2]
    assert subset_sizes(4) == [2, 4]
    assert subset_sizes(5) == [2, 4, 5]
    assert subset_sizes(8) == [2, 4, 8]
    assert default_ks(4) == [1, 2, 4]
    with pytest.raises(ValueError, match="n must be >= 1"):
        subset_sizes(0)


# ---- pass_at_k ---------------------------------------------------------------------------------


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # C(2,2)/C(4,2) = 1/6
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass_at_1 is the accuracy


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_matches_brute_force_enumeration(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            hits = sum(any(outcomes[i] for i in s) for s in subsets)
            assert pass_at_k(n, c, k) == pytest.approx(hits / len(subsets), abs=1e-12)


def test_pass_at_k_rejects_k_over_n():
    with pytest.raises(ValueError, match="k=5 with n=4"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


# ---- majority vote --------------------------------------------------------------------------


def test_majority_clear_winner_scores_its_value():
    assert majority_value([1.0, 1.0, 0.0], ["42", "42", "41"]) == 1.0
    assert majority_value([1.0, 0.0, 0.0], ["42", "41", "41"]) == 0.0


def test_majority_tie_is_the_mean_over_tied_answers():
    # two answers with one vote each: half credit (the expectation of a random tie-break)
    assert majority_value([1.0, 0.0], ["42", "41"]) == 0.5
    assert majority_value([0.0, 1.0], ["41", "42"]) == 0.5  # order does not matter
    # three-way tie
    assert majority_value([1.0, 0.0, 0.0], ["a", "b", "c"]) == pytest.approx(1 / 3)
    # tie between two answers of two votes each; the lone third answer is not tied
    assert majority_value([1.0, 1.0, 0.0, 0.0, 1.0], ["a", "a", "b", "b", "c"]) == 0.5


def test_majority_tied_answer_value_is_the_mean_of_its_samples():
    # answer "a" scored 1.0 and 0.0 (e.g. a format term): its value is 0.5; "b" ties with 0.2
    assert majority_value([1.0, 0.0, 0.2, 0.2], ["a", "a", "b", "b"]) == pytest.approx(0.35)


def test_majority_abstentions():
    # only the answered sample votes
    assert majority_value([1.0, 0.0, 0.0], ["42", None, None]) == 1.0
    # nobody answered: the subset's mean value
    assert majority_value([1.0, 0.0], [None, None]) == 0.5
    with pytest.raises(ValueError, match="as many answers as values"):
        majority_value([1.0], [])


def test_vectorized_statistics_equal_the_generic_bootstrap():
    rng = random.Random(3)
    vals = [float(rng.random() < 0.5) for _ in range(6)]
    answers = [rng.choice(["a", "b", "c", None]) for _ in range(6)]
    stats = group_statistics({"r": vals}, answers, None, n=6, ks=[1], n_bootstrap=300, seed=7)
    pairs = list(zip(vals, answers, strict=True))
    for k in subset_sizes(6):
        (best, best_sd), (worst, worst_sd), (maj, maj_sd) = bootstrap_metric(
            pairs,
            k,
            [
                lambda rows: max(v for v, _ in rows),
                lambda rows: min(v for v, _ in rows),
                lambda rows: majority_value([v for v, _ in rows], [a for _, a in rows]),
            ],
            n_bootstrap=300,
            seed=7,
        )
        assert stats[f"r/best_at_{k}/mean"] == pytest.approx(best)
        assert stats[f"r/best_at_{k}/std"] == pytest.approx(best_sd)
        assert stats[f"r/worst_at_{k}/mean"] == pytest.approx(worst)
        assert stats[f"r/worst_at_{k}/std"] == pytest.approx(worst_sd)
        assert stats[f"r/maj_at_{k}/mean"] == pytest.approx(maj)
        assert stats[f"r/maj_at_{k}/std"] == pytest.approx(maj_sd)


# ---- bootstrap ------------------------------------------------------------------------------


def test_bootstrap_two_samples_matches_hand_calculation():
    """Values (0, 1) with answers ("x", "y"), subsets of 2 drawn with replacement.

    A subset is (0,0), (1,1) or mixed. best = 0 only for (0,0); worst = 1 only for (1,1); maj
    is 0, 1, or 0.5 (a tie) for mixed. Count the subset kinds in the seeded draws by hand and
    the statistics follow.
    """
    draws = 16
    idx = bootstrap_indices(2, 2, draws, seed=11)
    zeros = int(((idx[:, 0] == 0) & (idx[:, 1] == 0)).sum())
    ones = int(((idx[:, 0] == 1) & (idx[:, 1] == 1)).sum())
    mixed = draws - zeros - ones
    stats = group_statistics(
        {"r": [0.0, 1.0]}, ["x", "y"], None, n=2, ks=[], n_bootstrap=draws, seed=11
    )

    best = (ones + mixed) / draws
    assert stats["r/best_at_2/mean"] == pytest.approx(best)
    assert stats["r/best_at_2/std"] == pytest.approx(math.sqrt(best * (1 - best)))
    assert stats["r/worst_at_2/mean"] == pytest.approx(ones / draws)
    maj = (ones + 0.5 * mixed) / draws
    assert stats["r/maj_at_2/mean"] == pytest.approx(maj)
    maj_var = (zeros * maj**2 + ones * (1 - maj) ** 2 + mixed * (0.5 - maj) ** 2) / draws
    assert stats["r/maj_at_2/std"] == pytest.approx(math.sqrt(maj_var))
    assert stats["r/mean_at_2"] == 0.5
    assert stats["r/std_at_2"] == 0.5


def test_bootstrap_two_samples_converges_to_the_exact_expectation():
    stats = group_statistics(
        {"r": [0.0, 1.0]}, ["x", "y"], None, n=2, ks=[], n_bootstrap=40_000, seed=0
    )
    assert stats["r/best_at_2/mean"] == pytest.approx(0.75, abs=0.01)  # 1 - P(both 0) = 3/4
    assert stats["r/best_at_2/std"] == pytest.approx(math.sqrt(3) / 4, abs=0.01)
    assert stats["r/worst_at_2/mean"] == pytest.approx(0.25, abs=0.01)
    assert stats["r/maj_at_2/mean"] == pytest.approx(0.5, abs=0.01)
    assert stats["r/maj_at_2/std"] == pytest.approx(math.sqrt(0.125), abs=0.01)


def test_bootstrap_is_reproducible_and_seeded():
    data = {"r": [0.1, 0.9, 0.4, 0.7]}
    a = group_statistics(data, None, None, n=4, ks=[], n_bootstrap=200, seed=5)
    b = group_statistics(data, None, None, n=4, ks=[], n_bootstrap=200, seed=5)
    c = group_statistics(data, None, None, n=4, ks=[], n_bootstrap=200, seed=6)
    assert a == b
    assert a["r/best_at_2/mean"] != c["r/best_at_2/mean"]


def test_task_ci95_brackets_the_mean_and_collapses_for_equal_tasks():
    lo, hi = task_ci95([0.0, 1.0, 0.5, 0.25, 0.75], n_bootstrap=2000, seed=0)
    assert 0.0 <= lo < 0.5 < hi <= 1.0
    assert task_ci95([0.3, 0.3, 0.3]) == pytest.approx((0.3, 0.3))


# ---- aggregation per data source ------------------------------------------------------------


def _samples(source, group, rewards, answers):
    return [
        ValSample(source, group, {"reward": r}, answer=a, correct=r > 0.5)
        for r, a in zip(rewards, answers, strict=True)
    ]


def _exact_maj(values, answers, k):
    draws = list(itertools.product(range(len(values)), repeat=k))
    return sum(
        majority_value([values[i] for i in d], [answers[i] for i in d]) for d in draws
    ) / len(draws)


def test_validation_statistics_aggregate_over_tasks_per_source():
    samples = [
        *_samples("math", "t0", [1.0, 1.0, 0.0, 0.0], ["4", "4", "5", "6"]),  # maj: "4" (right)
        *_samples("math", "t1", [0.0, 0.0, 0.0, 1.0], ["7", "7", "8", "9"]),  # maj: "7" (wrong)
        *_samples("code", "t2", [1.0, 1.0, 1.0, 1.0], ["x", "x", "x", "x"]),
    ]
    stats = validation_statistics(samples, n=4, n_bootstrap=5000, seed=0)
    assert sorted(stats) == ["code", "math"]
    math_stats = stats["math"]
    assert math_stats["reward/mean_at_4"] == pytest.approx((0.5 + 0.25) / 2)
    assert math_stats["reward/std_at_4"] == pytest.approx((0.5 + math.sqrt(3) / 4) / 2)
    # pass_at_k per task, then averaged: t0 has c=2, t1 c=1
    assert math_stats["pass_at_1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert math_stats["pass_at_2"] == pytest.approx((pass_at_k(4, 2, 2) + pass_at_k(4, 1, 2)) / 2)
    assert math_stats["pass_at_4"] == 1.0
    # maj_at_4 draws 4 of the 4 samples with replacement: it converges to the exact expectation
    # over all 4**4 ordered draws
    assert math_stats["reward/maj_at_4/mean"] == pytest.approx(
        (
            _exact_maj([1.0, 1.0, 0.0, 0.0], ["4", "4", "5", "6"], 4)
            + _exact_maj([0.0, 0.0, 0.0, 1.0], ["7", "7", "8", "9"], 4)
        )
        / 2,
        abs=0.02,
    )
    assert math_stats["num_tasks"] == 2.0
    assert math_stats["num_samples"] == 8.0
    assert math_stats["num_incomplete_tasks"] == 0.0
    code = stats["code"]
    assert code["reward/mean_at_4"] == 1.0
    assert code["reward/maj_at_4/mean"] == 1.0
    assert code["reward/worst_at_4/mean"] == 1.0
    assert code["reward/mean_at_4/ci95_lo"] == code["reward/mean_at_4/ci95_hi"] == 1.0
    flat = flatten_statistics(stats)
    assert flat["val/math/reward/mean_at_4"] == math_stats["reward/mean_at_4"]
    assert flat["val/code/pass_at_2"] == 1.0
    assert "val/math/reward/best_at_2/std" in flat


def test_incomplete_tasks_are_left_out_of_larger_subsets_and_counted():
    samples = [
        *_samples("s", "full", [1.0, 0.0, 1.0, 0.0], ["a", "b", "a", "b"]),
        *_samples("s", "short", [1.0], ["a"]),  # one episode came back out of four
    ]
    stats = validation_statistics(samples, n=4, n_bootstrap=100, seed=0)["s"]
    assert stats["num_incomplete_tasks"] == 1.0
    assert stats["reward/mean_at_4"] == pytest.approx((0.5 + 1.0) / 2)
    assert stats["pass_at_1"] == pytest.approx((0.5 + 1.0) / 2)
    assert stats["pass_at_4"] == pytest.approx(pass_at_k(4, 2, 4))  # only the full task
    short_only = validation_statistics(_samples("s", "short", [1.0], ["a"]), n=4)["s"]
    assert "reward/best_at_2/mean" not in short_only


def test_single_sample_tasks_report_mean_and_pass_at_1_only():
    stats = validation_statistics(_samples("s", "t", [1.0], ["a"]), n=1)["s"]
    assert stats["reward/mean_at_1"] == 1.0
    assert stats["pass_at_1"] == 1.0
    assert not any("best_at_" in k or "maj_at_" in k or "std_at_" in k for k in stats)


def test_validation_statistics_errors_name_the_problem():
    samples = _samples("s", "t", [1.0, 0.0], ["a", "b"])
    with pytest.raises(ValueError, match=r"pass_at_k sizes \[3\] are outside 1..n=2"):
        validation_statistics(samples, n=2, ks=[3])
    mixed = [ValSample("s", "t", {"reward": 1.0}), ValSample("s", "t", {"acc": 1.0})]
    with pytest.raises(ValueError, match="different variables"):
        validation_statistics(mixed, n=2)
    assert validation_statistics([], n=2) == {}


def test_maj_and_pass_need_answers_and_correctness():
    samples = [ValSample("s", "t", {"reward": r}) for r in (1.0, 0.0)]
    stats = validation_statistics(samples, n=2)["s"]
    assert "reward/best_at_2/mean" in stats
    assert not any(k.startswith("pass_at_") or "maj_at_" in k for k in stats)


def test_bootstrap_metric_generic_api():
    out = bootstrap_metric([3.0, 3.0, 3.0], 2, [np.max, np.min], n_bootstrap=10, seed=0)
    assert out == [(3.0, 0.0), (3.0, 0.0)]
