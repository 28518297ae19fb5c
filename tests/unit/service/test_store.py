"""The SQLite store: once-only recording, cursors, group settlement, acks, persistence."""

from __future__ import annotations

import stat

from agentrl.service.store import Store


def _store(tmp_path) -> Store:
    s = Store(tmp_path / "s.sqlite")
    s.create_job(
        "j", {"num_tasks": 2, "n": 2}, request_hash="h", idempotency_key="k", tasks=[{"a": 1}, {}]
    )
    return s


def test_cursors_are_consecutive_and_an_episode_is_recorded_once(tmp_path):
    s = _store(tmp_path)
    assert s.record_done("j", 0, 0, '{"a":1}', deliver=True) == 1
    assert s.record_done("j", 0, 1, '{"a":2}', deliver=True) == 2
    assert s.record_done("j", 0, 1, '{"a":3}', deliver=True) == -1  # second record ignored
    assert not s.record_dropped("j", 0, 1, "stale")
    assert [(r.seq, r.data) for r in s.read("j", 0)] == [(1, '{"a":1}'), (2, '{"a":2}')]
    assert [r.seq for r in s.read("j", 1)] == [2]
    assert s.job("j").last_seq == 2  # type: ignore[union-attr]


def test_ack_frees_payloads_never_moves_back_and_hides_acked(tmp_path):
    s = _store(tmp_path)
    for i in range(3):
        s.record_done("j", i, 0, f'"{i}"', deliver=True)
    assert s.ack("j", 2) == 2
    assert s.ack("j", 1) == 2  # never backwards
    assert [r.seq for r in s.read("j", 0)] == [3]
    counts = s.counts("j")
    assert (counts["done"], counts["deliverable"], counts["pending_delivery"]) == (3, 3, 1)
    assert s.pending_total() == 1


def test_groups_are_delivered_whole_or_dropped_whole(tmp_path):
    s = _store(tmp_path)
    assert s.record_done("j", 0, 0, '"a"', deliver=False) is None
    assert s.settle_group("j", 0, 2) is None  # a member is still running
    s.record_done("j", 0, 1, '"b"', deliver=False)
    assert s.settle_group("j", 0, 2) == "delivered"
    assert [(r.task, r.sample, r.seq) for r in s.read("j", 0)] == [(0, 0, 1), (0, 1, 2)]
    s.record_done("j", 1, 0, '"c"', deliver=False)
    s.record_dropped("j", 1, 1, "reward_error")
    assert s.settle_group("j", 1, 2) == "dropped"
    assert s.counts("j")["dropped"] == {"reward_error": 1, "group_incomplete": 1}
    assert [r.seq for r in s.read("j", 0)] == [1, 2]


def test_state_survives_reopening_and_the_file_is_private(tmp_path):
    s = _store(tmp_path)
    s.record_done("j", 0, 0, '"x"', deliver=True)
    s.set_status("j", "running")
    s.close()
    s2 = Store(tmp_path / "s.sqlite")
    assert s2.job_by_key("k").id == "j"  # type: ignore[union-attr]
    assert s2.recorded("j") == {(0, 0)}
    assert s2.tasks("j") == [{"a": 1}, {}]
    assert [r.data for r in s2.read("j", 0)] == ['"x"']
    assert [j.id for j in s2.jobs(("running",))] == ["j"]
    assert stat.S_IMODE((tmp_path / "s.sqlite").stat().st_mode) == 0o600
    # an idempotent create returns the existing job
    again = s2.create_job("other", {}, request_hash="h2", idempotency_key="k")
    assert again.id == "j"
    s2.set_status("j", "finished")
    assert s2.delete_jobs_finished_before(float("inf")) == 1 and s2.job("j") is None
