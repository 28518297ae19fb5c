"""The bwrap command line: what each stage puts in it (nothing is started here)."""

from __future__ import annotations

import json
from pathlib import Path

from tools.sandbox.command import bwrap_command, supervisor_argv
from tools.sandbox.config import (
    SCRATCH,
    STATE_IN,
    SUPERVISOR_FILE,
    SUPERVISOR_IN_SANDBOX,
    WORKDIR,
    Isolation,
)
from tools.sandbox.supervisor import MARKER

ROOT = Isolation(bwrap="/usr/bin/bwrap", mode="root", bind_paths=(), setpriv="/usr/bin/setpriv")
USERNS = Isolation(bwrap="/usr/bin/bwrap", mode="userns", bind_paths=())


def pairs(cmd: list[str], option: str) -> list[tuple[str, str]]:
    """The (source, target) of every two-argument ``option`` in ``cmd``."""
    return [(cmd[i + 1], cmd[i + 2]) for i, a in enumerate(cmd) if a == option]


def test_the_supervisor_is_run_by_path_with_its_marker_and_config():
    argv = supervisor_argv("/usr/bin/python3", {"wall_time_s": 1}, sandboxed=True)
    assert argv[:6] == ["/usr/bin/python3", "-I", "-S", SUPERVISOR_IN_SANDBOX, MARKER, argv[5]]
    assert json.loads(argv[5]) == {"wall_time_s": 1}
    host = supervisor_argv("/usr/bin/python3", {}, sandboxed=False)
    assert host[3] == str(SUPERVISOR_FILE)


def test_the_supervisor_and_the_archive_are_bound_read_only(tmp_path: Path):
    cmd = bwrap_command(ROOT, tmp_path, ["python"], disk_mb=8)
    assert (str(SUPERVISOR_FILE), SUPERVISOR_IN_SANDBOX) in pairs(cmd, "--ro-bind")
    assert not any(target == STATE_IN for _, target in pairs(cmd, "--ro-bind"))
    (tmp_path / "state.tar").write_bytes(b"")
    cmd = bwrap_command(ROOT, tmp_path, ["python"], disk_mb=8)
    assert (str(tmp_path / "state.tar"), STATE_IN) in pairs(cmd, "--ro-bind")
    assert not any(a in ("--bind", "--bind-try") for a in cmd)  # nothing of the host writable


def test_the_environment_is_cleared_before_it_is_set(tmp_path: Path):
    cmd = bwrap_command(USERNS, tmp_path, ["python"], disk_mb=8)
    assert cmd.index("--clearenv") < cmd.index("--setenv")
    assert dict(pairs(cmd, "--setenv"))["HOME"] == WORKDIR


def test_the_scratch_is_one_size_limited_tmpfs_and_the_root_ends_read_only(tmp_path: Path):
    cmd = bwrap_command(USERNS, tmp_path, ["python", "-c", "pass"], disk_mb=8)
    i = cmd.index(SCRATCH)
    assert cmd[i - 3 : i] == ["--size", str(8 * 1024 * 1024), "--tmpfs"]
    sep = cmd.index("--")
    assert cmd[sep - 2 : sep] == ["--remount-ro", "/"]
    assert cmd[sep + 1 :] == ["python", "-c", "pass"]


def test_root_drops_to_the_per_call_user_and_userns_disables_nested_namespaces(tmp_path: Path):
    root = bwrap_command(ROOT, tmp_path, ["python"], disk_mb=8, uid=123456)
    sep = root.index("--")
    assert root[sep + 1 : sep + 4] == ["/usr/bin/setpriv", "--reuid=123456", "--regid=123456"]
    assert "--no-new-privs" in root and "--unshare-user" not in root
    userns = bwrap_command(USERNS, tmp_path, ["python"], disk_mb=8)
    assert "--unshare-user" in userns and "--disable-userns" in userns
    assert "/usr/bin/setpriv" not in userns
    for cmd in (root, userns):
        assert {"--unshare-net", "--unshare-pid", "--die-with-parent"} <= set(cmd)
