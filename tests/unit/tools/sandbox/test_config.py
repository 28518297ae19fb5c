"""The limits of one call and the supervisor's configuration built from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.sandbox.config import SCRATCH, STATE_IN, WORKDIR, SandboxLimits, supervisor_config


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("wall_time_s", 0),
        ("memory_mb", 16),
        ("output_chars", 10),
        ("max_processes", 0),
        ("disk_mb", 0),
    ],
)
def test_a_bad_limit_names_itself(field, value):
    with pytest.raises(ValueError, match=field.replace("output_chars", "max_output_chars")):
        SandboxLimits(**{field: value})


def test_the_parent_kills_after_the_supervisor_had_time_to_save_the_files():
    limits = SandboxLimits(wall_time_s=5, disk_mb=100)
    assert limits.hard_deadline_s == 5 + 5 + 100 / 50


def test_rlimits_count_the_supervisor_and_bwraps_init_in_the_process_limit():
    limits = SandboxLimits(max_processes=4, cpu_time_s=2.5, memory_mb=64)
    assert limits.rlimits("root")["RLIMIT_NPROC"] == 5
    assert limits.rlimits("userns")["RLIMIT_NPROC"] == 6
    assert limits.rlimits("root")["RLIMIT_CPU"] == 3
    assert limits.rlimits("root")["RLIMIT_AS"] == 64 * 1024 * 1024


def test_the_sandboxed_configuration_uses_the_layout_inside(tmp_path: Path):
    cfg = supervisor_config(
        SandboxLimits(max_processes=4), "root", tmp_path, 7, audit=True, site_dirs=[], read_roots=[]
    )
    assert (cfg["cwd"], cfg["write_root"], cfg["restore"]) == (WORKDIR, SCRATCH, STATE_IN)
    assert cfg["archive"] and cfg["sandboxed"] and cfg["max_forks"] == 3 and cfg["status_fd"] == 7
    host = supervisor_config(
        SandboxLimits(), None, tmp_path, 7, audit=True, site_dirs=[], read_roots=[]
    )
    assert (host["cwd"], host["write_root"], host["restore"]) == (str(tmp_path),) * 2 + ("",)
    assert not host["archive"] and host["max_forks"] == 0
