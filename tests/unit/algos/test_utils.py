"""Masked statistics, group bookkeeping and the registry helper."""

from __future__ import annotations

import statistics

import pytest
import torch

from agentrl.algos import masked_mean, masked_sum, masked_var, masked_whiten
from agentrl.algos.utils import group_ids, group_stats

X = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_masked_sum_mean_var() -> None:
    assert masked_sum(X, M).item() == 6.0
    torch.testing.assert_close(masked_sum(X, M, dim=-1), torch.tensor([3.0, 3.0]))
    assert masked_mean(X, M).item() == 2.0
    torch.testing.assert_close(masked_mean(X, M, dim=-1), torch.tensor([1.5, 3.0]))
    assert masked_var(X, M).item() == pytest.approx(statistics.variance([1, 2, 3]))
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(statistics.pvariance([1, 2, 3]))


def test_empty_and_single_entries_do_not_nan() -> None:
    zero = torch.zeros(2, 3)
    assert masked_mean(X, zero).item() == 0.0
    assert torch.equal(masked_whiten(X, zero), torch.zeros(2, 3))
    one = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(masked_whiten(X, one), torch.zeros(2, 3))


def test_masked_whiten() -> None:
    w = masked_whiten(X, M)
    valid = w[M.bool()]
    sd = statistics.stdev([1, 2, 3])
    torch.testing.assert_close(valid, torch.tensor([-1 / sd, 0.0, 1 / sd]), rtol=1e-4, atol=1e-5)
    assert torch.equal(w[~M.bool()], torch.zeros(3))
    unshifted = masked_whiten(X, M, shift_mean=False)[M.bool()]
    torch.testing.assert_close(unshifted, valid + 2.0)


def test_group_ids_and_stats() -> None:
    ids, n = group_ids(["b", "a", "b", "c"], 4)
    assert ids.tolist() == [0, 1, 0, 2] and n == 3
    count, mean, std = group_stats(torch.tensor([1.0, 5.0, 3.0, 7.0]), ids, n)
    assert count.tolist() == [2.0, 1.0, 2.0, 1.0]
    assert mean.tolist() == [2.0, 5.0, 2.0, 7.0]
    assert std[0].item() == pytest.approx(statistics.stdev([1.0, 3.0]))
    assert std[1].item() == 0.0
    with pytest.raises(ValueError, match="uid"):
        group_ids(["a"], 2)
