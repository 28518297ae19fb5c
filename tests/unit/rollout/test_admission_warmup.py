"""The staleness warmup: η ramps up from 0 over the first N versions, then stays."""

from __future__ import annotations

import pytest

from agentrl.rollout.admission import StalenessAdmission


def test_the_bound_ramps_from_zero_to_max_staleness() -> None:
    a = StalenessAdmission(batch_size=4, max_staleness=2, warmup=4)
    bounds = []
    for v in range(7):
        a.version = v
        bounds.append(a.staleness_bound)
    assert bounds == [0, 0, 1, 1, 2, 2, 2]
    a.version = 0
    assert a.capacity == 4  # one batch: synchronous at the start
    a.version = 4
    assert a.capacity == (2 + 4 + 1) * 4


def test_no_warmup_is_max_staleness_from_the_start() -> None:
    a = StalenessAdmission(batch_size=4, max_staleness=3)
    assert a.staleness_bound == 3
    assert a.capacity == 16


def test_a_negative_warmup_is_refused() -> None:
    with pytest.raises(ValueError, match="warmup"):
        StalenessAdmission(batch_size=4, max_staleness=2, warmup=-1)
