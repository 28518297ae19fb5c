"""docs/service.md documents every field the service sends (issue 22): each field of a
streamed ``Trajectory`` and of ``JobStatus`` / ``JobCounts`` is named in its wire-format section,
and the stream's event lines are the ones the page lists."""

from __future__ import annotations

import re
from pathlib import Path

from agentrl.service.models import JobCounts, JobStatus
from agentrl.types import StopReason, Trajectory

PAGE = Path(__file__).resolve().parents[3] / "docs" / "service.md"


def _section() -> str:
    text = PAGE.read_text()
    start = text.index("### The wire format")
    return text[start : text.index("\n#", start + 1)]


def test_every_trajectory_field_is_documented_with_its_type() -> None:
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", _section(), flags=re.M))
    assert set(Trajectory.model_fields) <= set(rows), set(Trajectory.model_fields) - set(rows)
    assert all(f"`{r.value}`" in _section() for r in StopReason)


def test_every_job_status_field_is_documented() -> None:
    named = set(re.findall(r"`(\w+)`", _section()))
    fields = set(JobStatus.model_fields) | set(JobCounts.model_fields)
    assert fields <= named, fields - named


def test_the_event_lines_are_the_streams() -> None:
    section = _section()
    source = (Path(__file__).resolve().parents[3] / "agentrl/service/jobs.py").read_text()
    for line in ("retry: 1000", "event: trajectory", "event: end", '"task_index"', '"sample"'):
        assert line.replace('"', "") in section.replace('"', "") and line in source.replace(
            '\\"', '"'
        ), line
