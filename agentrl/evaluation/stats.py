"""Validation statistics per data source: mean_at_N, std_at_N, best_at_k, worst_at_k, maj_at_k, pass_at_k.

Why it exists: one greedy sample per task says little about a stochastic policy. Researchers
read verl's validation numbers (``process_validation_metrics``): for each task (prompt) sampled
``N`` times, the mean and spread of its samples, what best-of-k / worst-of-k / majority-vote-of-k
selection would score (bootstrap estimates over subsets of size k), and pass_at_k with the unbiased
estimator of Chen et al. 2021 (arXiv:2107.03374). This module computes them from plain records;
it imports numpy only (no torch, servers or trackers).

Definitions (per task with ``N`` samples ``x_1..x_N`` of a variable, e.g. the reward):

- ``mean_at_N`` = (1/N) Σ x_i; ``std_at_N`` = sqrt((1/N) Σ (x_i − mean)²) (population std, as verl);
- for each subset size ``k`` in :func:`subset_sizes` (2, 4, 8, ... below N, then N), draw
  ``n_bootstrap`` subsets of ``k`` indices uniformly *with replacement* (the index matrix is
  ``numpy.random.default_rng(seed).integers(0, N, size=(n_bootstrap, k))``, the same for every
  task and variable, so results do not depend on which other tasks were evaluated);
  ``best_at_k/mean`` and ``best_at_k/std`` are the mean and population std over subsets of the subset's
  max; ``worst_at_k`` the same for the min; ``maj_at_k`` for the majority-vote value (below);
- majority vote of a subset (:func:`majority_value`): samples vote with their extracted answer;
  samples without an answer abstain. The answer with the most votes wins and the subset scores
  the mean value of the samples that gave it. **Ties**: every tied answer is taken with equal
  weight, i.e. the score is the mean over the tied answers of their values; this is exactly the
  expectation of breaking the tie uniformly at random, and it does not depend on sample order
  (verl keeps whichever tied answer it met first). A subset in which every sample abstains
  scores the mean of its values;
- ``pass_at_k`` = 1 − C(N−c, k) / C(N, k) with ``c`` correct samples (unbiased for the chance
  that at least one of k samples drawn without replacement is correct), for k ≤ N;
- ``mean_at_N/ci95_lo`` and ``ci95_hi``: the 2.5 and 97.5 percentiles of the mean over tasks of
  ``mean_at_N`` when the *tasks* are resampled with replacement ``n_bootstrap`` times (seeded):
  a confidence interval of the data-source score, which the per-task ``std`` keys are not.

Aggregation: each per-task number is averaged over the tasks of a data source (a task with
fewer than ``k`` samples is left out of the size-``k`` statistics and counted in
``num_incomplete_tasks``). Keys of :func:`validation_statistics` are ``{variable}/{stat}``
(``reward/mean_at_4``, ``acc/maj_at_4/mean``) plus ``pass_at_{k}``, ``num_tasks``, ``num_samples`` and
``num_incomplete_tasks``; :func:`flatten_statistics` prefixes them as
``val/{data_source}/{key}``.

Example::

    samples = [ValSample("gsm8k", "t0", {"reward": r}, answer=a, correct=r > 0)
               for r, a in [(1.0, "42"), (0.0, "41"), (1.0, "42"), (0.0, None)]]
    stats = validation_statistics(samples, n=4)
    stats["gsm8k"]["reward/mean_at_4"]   # 0.5
    stats["gsm8k"]["pass_at_2"]          # 1 - C(2,2)/C(4,2) = 5/6
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ValSample",
    "bootstrap_indices",
    "bootstrap_metric",
    "default_ks",
    "flatten_statistics",
    "group_statistics",
    "majority_value",
    "pass_at_k",
    "subset_sizes",
    "task_ci95",
    "validation_statistics",
]


@dataclass(frozen=True)
class ValSample:
    """One scored sample of one task, as the statistics see it (plain data).

    ``group`` identifies the task run (all samples of one task share it, e.g. the trajectory's
    ``uid``); ``values`` holds the numeric variables to summarise (``reward``, ``acc``, ...);
    ``answer`` is the vote for maj_at_k (None = abstain); ``correct`` feeds pass_at_k (None = unknown,
    left out of pass_at_k).
    """

    data_source: str
    group: str
    values: Mapping[str, float] = field(default_factory=dict)
    answer: str | None = None
    correct: bool | None = None


def subset_sizes(n: int) -> list[int]:
    """Bootstrap subset sizes for ``n`` samples: 2, 4, 8, ... below ``n``, then ``n``.

    Empty for ``n == 1`` (best/worst/maj of one sample is the sample: ``mean_at_1`` says it).
    """
    if n < 1:
        raise ValueError(f"subset_sizes: n must be >= 1, got {n}")
    sizes = []
    k = 2
    while k < n:
        sizes.append(k)
        k *= 2
    if n > 1:
        sizes.append(n)
    return sizes


def default_ks(n: int) -> list[int]:
    """The pass_at_k sizes reported by default: 1, then :func:`subset_sizes` (1, 2, 4, ..., n)."""
    return [1, *subset_sizes(n)]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass_at_k of one task: ``1 − C(n−c, k) / C(n, k)`` (Chen et al. 2021).

    Args:
        n: samples of the task; c: how many were correct; k: the budget, ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k} with n={n} samples")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def bootstrap_indices(n_items: int, subset_size: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """``[n_bootstrap, subset_size]`` indices into ``n_items``, drawn with replacement (seeded)."""
    if n_items < 1 or subset_size < 1 or n_bootstrap < 1:
        raise ValueError(
            f"bootstrap_indices(n_items={n_items}, subset_size={subset_size}, "
            f"n_bootstrap={n_bootstrap}): all must be >= 1"
        )
    return np.random.default_rng(seed).integers(0, n_items, size=(n_bootstrap, subset_size))


def bootstrap_metric(
    data: Sequence[Any],
    subset_size: int,
    reduce_fns: Sequence[Callable[[list[Any]], float]],
    *,
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> list[tuple[float, float]]:
    """Bootstrap ``(mean, std)`` of each ``reduce_fn`` over subsets of ``data`` (generic form).

    The subsets are the rows of :func:`bootstrap_indices`; std is the population std over the
    ``n_bootstrap`` subset values. :func:`group_statistics` computes the same numbers vectorized.
    """
    idx = bootstrap_indices(len(data), subset_size, n_bootstrap, seed)
    results = np.array([[fn([data[i] for i in row]) for fn in reduce_fns] for row in idx])
    return [
        (float(results[:, j].mean()), float(results[:, j].std())) for j in range(len(reduce_fns))
    ]


def majority_value(values: Sequence[float], answers: Sequence[str | None]) -> float:
    """The majority-vote value of one subset (rule in the module docstring; ties share weight).

    ``values[i]`` is sample i's value, ``answers[i]`` its vote (None abstains).
    """
    if len(values) != len(answers) or not values:
        raise ValueError(
            f"majority_value: need as many answers as values (> 0), got {len(values)} values "
            f"and {len(answers)} answers"
        )
    by_answer: dict[str, list[float]] = defaultdict(list)
    for v, a in zip(values, answers, strict=True):
        if a is not None:
            by_answer[a].append(float(v))
    if not by_answer:
        return float(np.mean(values))
    top = max(len(vs) for vs in by_answer.values())
    tied = [float(np.mean(vs)) for vs in by_answer.values() if len(vs) == top]
    return float(np.mean(tied))


def _majority_rows(
    arrays: Mapping[str, np.ndarray], codes: np.ndarray, idx: np.ndarray
) -> dict[str, np.ndarray]:
    """:func:`majority_value` of every row of ``idx`` at once, for each value array.

    ``codes`` are dense answer ids ``0..A-1`` (-1 abstains); votes are counted with one
    ``bincount`` over ``(row, answer)`` cells, so the cost is ``O(S·k)`` whatever ``A``.
    """
    n_ans = int(codes.max()) + 1 if codes.size else 0
    if n_ans == 0:
        return {name: arr[idx].mean(axis=1) for name, arr in arrays.items()}
    rows, width = idx.shape[0], n_ans + 1  # the extra column collects abstentions
    sub_codes = codes[idx]
    cell = (np.arange(rows)[:, None] * width + np.where(sub_codes < 0, n_ans, sub_codes)).ravel()
    counts = np.bincount(cell, minlength=rows * width).reshape(rows, width)[:, :n_ans]
    top = counts.max(axis=1)
    tied = (counts == top[:, None]) & (top[:, None] > 0)
    n_tied = np.maximum(tied.sum(axis=1), 1)
    out = {}
    for name, arr in arrays.items():
        sub = arr[idx]
        sums = np.bincount(cell, weights=sub.ravel(), minlength=rows * width)
        means = sums.reshape(rows, width)[:, :n_ans] / np.maximum(counts, 1)
        voted = np.where(tied, means, 0.0).sum(axis=1) / n_tied
        out[name] = np.where(top > 0, voted, sub.mean(axis=1))
    return out


def group_statistics(
    values: Mapping[str, Sequence[float]],
    answers: Sequence[str | None] | None = None,
    correct: Sequence[bool | None] | None = None,
    *,
    n: int,
    ks: Sequence[int],
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> dict[str, float]:
    """The statistics of one task's samples (keys ``{variable}/{stat}`` and ``pass_at_{k}``).

    Args:
        values: variable name -> one value per sample (all of the same length ``m``).
        answers: one vote per sample for maj_at_k (None abstains); None = no maj_at_k.
        correct: one flag per sample for pass_at_k (None = unknown); None = no pass_at_k.
        n: the nominal samples per task; it names ``mean_at_{n}``/``std_at_{n}`` and bounds the
            subset sizes (a task with ``m < k`` samples gets no size-k statistics).
        ks: pass_at_k sizes.
        n_bootstrap: subsets drawn per size; seed: their seed.
    """
    lengths = {name: len(v) for name, v in values.items()}
    m = next(iter(lengths.values()), 0)
    if m == 0 or any(length != m for length in lengths.values()):
        raise ValueError(
            f"group_statistics: every variable needs the same number (> 0) of samples, got {lengths}"
        )
    out: dict[str, float] = {}
    arrays = {name: np.asarray(v, dtype=float) for name, v in values.items()}
    for name, arr in arrays.items():
        out[f"{name}/mean_at_{n}"] = float(arr.mean())
        if m > 1:
            out[f"{name}/std_at_{n}"] = float(arr.std())
    codes = None
    if answers is not None:
        if len(answers) != m:
            raise ValueError(f"group_statistics: {len(answers)} answers for {m} samples")
        ids: dict[str, int] = {}
        codes = np.array([-1 if a is None else ids.setdefault(a, len(ids)) for a in answers])
    for k in subset_sizes(n):
        if k > m:
            continue
        idx = bootstrap_indices(m, k, n_bootstrap, seed)
        majority = _majority_rows(arrays, codes, idx) if codes is not None else {}
        for name, arr in arrays.items():
            sub = arr[idx]
            reduced = {"best": sub.max(axis=1), "worst": sub.min(axis=1)}
            if name in majority:
                reduced["maj"] = majority[name]
            for stat, per_subset in reduced.items():
                out[f"{name}/{stat}_at_{k}/mean"] = float(per_subset.mean())
                out[f"{name}/{stat}_at_{k}/std"] = float(per_subset.std())
    if correct is not None:
        known = [bool(c) for c in correct if c is not None]
        for k in ks:
            if 1 <= k <= len(known):
                out[f"pass_at_{k}"] = pass_at_k(len(known), sum(known), k)
    return out


def task_ci95(
    task_means: Sequence[float], *, n_bootstrap: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean over tasks (tasks resampled with replacement)."""
    arr = np.asarray(task_means, dtype=float)
    if arr.size == 0:
        raise ValueError("task_ci95: no task means")
    idx = bootstrap_indices(arr.size, arr.size, n_bootstrap, seed)
    means = arr[idx].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def validation_statistics(
    samples: Sequence[ValSample],
    *,
    n: int | None = None,
    ks: Sequence[int] | None = None,
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Statistics per data source: ``{data_source: {key: value}}`` (keys in the module docstring).

    Args:
        samples: every scored sample; samples of one task share ``group``.
        n: nominal samples per task (default: the largest group).
        ks: pass_at_k sizes (default :func:`default_ks` of ``n``); each must be in ``1..n``.
        n_bootstrap: bootstrap subsets per task and size (and task resamples of the CI).
        seed: seed of every bootstrap draw.
    """
    if not samples:
        return {}
    groups: dict[str, dict[str, list[ValSample]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        groups[s.data_source][s.group].append(s)
    n_eff = n if n is not None else max(len(g) for src in groups.values() for g in src.values())
    if n_eff < 1:
        raise ValueError(f"validation_statistics: n must be >= 1, got {n}")
    ks_eff = list(ks) if ks is not None else default_ks(n_eff)
    bad = [k for k in ks_eff if not 1 <= k <= n_eff]
    if bad:
        raise ValueError(
            f"pass_at_k sizes {bad} are outside 1..n={n_eff}; choose k <= the samples per task"
        )
    return {
        source: _source_statistics(by_group, n_eff, ks_eff, n_bootstrap, seed)
        for source, by_group in sorted(groups.items())
    }


def _source_statistics(
    by_group: Mapping[str, list[ValSample]], n: int, ks: Sequence[int], n_bootstrap: int, seed: int
) -> dict[str, float]:
    per_task: list[dict[str, float]] = []
    for group, members in by_group.items():
        names = set(members[0].values)
        if any(set(s.values) != names for s in members):
            raise ValueError(
                f"task group {group!r}: samples report different variables "
                f"{sorted({tuple(sorted(s.values)) for s in members})}; give every sample the same keys"
            )
        has_answers = any(s.answer is not None for s in members)
        has_correct = any(s.correct is not None for s in members)
        per_task.append(
            group_statistics(
                {name: [s.values[name] for s in members] for name in sorted(names)},
                [s.answer for s in members] if has_answers else None,
                [s.correct for s in members] if has_correct else None,
                n=n,
                ks=ks,
                n_bootstrap=n_bootstrap,
                seed=seed,
            )
        )
    collected: dict[str, list[float]] = defaultdict(list)
    for stats in per_task:
        for key, value in stats.items():
            collected[key].append(value)
    out = {key: float(np.mean(vals)) for key, vals in sorted(collected.items())}
    for key, vals in sorted(collected.items()):
        if key.endswith(f"/mean_at_{n}"):
            out[f"{key}/ci95_lo"], out[f"{key}/ci95_hi"] = task_ci95(
                vals, n_bootstrap=n_bootstrap, seed=seed
            )
    out["num_tasks"] = float(len(by_group))
    out["num_samples"] = float(sum(len(g) for g in by_group.values()))
    out["num_incomplete_tasks"] = float(sum(len(g) < n for g in by_group.values()))
    return out


def flatten_statistics(
    stats: Mapping[str, Mapping[str, float]], prefix: str = "val"
) -> dict[str, float]:
    """``{source: {key: v}}`` -> ``{f"{prefix}/{source}/{key}": v}`` (what a tracker logs)."""
    return {
        f"{prefix}/{source}/{key}": value
        for source, per in stats.items()
        for key, value in per.items()
    }
