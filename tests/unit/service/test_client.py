"""SDK helpers: the SSE parser, the reader's cursor bookkeeping, Parquet and batch export."""

from __future__ import annotations

import json
import random

import pytest

from agentrl.client import _Reader, _SSEParser, to_batch, to_columns, to_parquet
from tests.fakes import random_trajectories


def test_sse_parser_assembles_events_and_skips_comments():
    p = _SSEParser()
    lines = [
        "retry: 1000",
        "",
        ": keep-alive",
        "",
        "id: 7",
        "event: trajectory",
        'data: {"a":',
        "data: 1}",
        "",
    ]
    events = [e for line in lines if (e := p.feed(line)) is not None]
    assert events == [("trajectory", "7", '{"a":\n1}')]


def test_reader_skips_replayed_cursors_and_resumes_after_the_last_one():
    traj = random_trajectories(1)[0].model_dump(mode="json")
    r = _Reader("job", None, "manual", 32, 10.0)
    assert r.params() == {"after": 0}  # the server starts after max(0, acked)
    ev = lambda seq: ("trajectory", str(seq), json.dumps({"seq": seq, "trajectory": traj}))  # noqa: E731
    assert r.handle(ev(1)) is not None and r.handle(ev(2)) is not None
    assert r.handle(ev(2)) is None  # a replay after a reconnect is not yielded twice
    assert r.params() == {"after": 0}  # manual: reconnect from the acked cursor
    auto = _Reader("job", 5, "auto", 32, 10.0)
    assert auto.params() == {"after": 5}
    r.handle(("end", None, '{"status": "finished"}'))
    assert r.end == {"status": "finished"}


def test_reader_gives_up_without_progress():
    r = _Reader("job", None, "auto", 32, 0.0)
    with pytest.raises(Exception, match="no progress"):
        r.backoff(OSError("down"))


def test_parquet_round_trip_is_exact(tmp_path):
    import pyarrow.parquet as pq

    trajs = random_trajectories(6, seed=3)
    for t in trajs:
        t.rollout_logprobs[:] = [random.uniform(-3, 0) if m else 0.0 for m in t.loss_mask]
    path = to_parquet(trajs, tmp_path / "x.parquet")
    table = pq.read_table(path).to_pydict()
    assert table == to_columns(trajs)
    assert table["rollout_logprobs"][0] == trajs[0].rollout_logprobs  # float64: exact
    batch = to_batch(trajs, pad_token_id=0)
    assert batch.batch_size[0] == 6
