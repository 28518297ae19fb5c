"""Per-call cgroups: where they go and what is written, for cgroup v2 and v1, on a fake sysfs
root (a temporary directory), so both versions are tested on any machine; killing is real."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tools.sandbox.cgroup import (
    BASE,
    CallCgroup,
    CgroupSetup,
    CgroupUsage,
    CgroupVersion,
    detect,
    parse_mountinfo,
    parse_proc_cgroup,
    sweep,
)
from tools.sandbox.command import cgroup_prefix

V2_MOUNT = (
    "41 31 0:38 / /sys/fs/cgroup rw,nosuid,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
)
V1_MOUNTS = (
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
V1_PROC = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n"


def cgroup_dir(path: Path, files: dict[str, str]) -> Path:
    """A fake cgroup directory holding ``files`` (what the kernel would show)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def v2_tree(root: Path, controllers: str = "cpu io memory pids", swap: bool = True) -> Path:
    """A delegated v2 cgroup ``/user.slice/app.scope`` with its base directory already made."""
    own = cgroup_dir(
        root / "sys/fs/cgroup/user.slice/app.scope",
        {
            "cgroup.controllers": controllers + "\n",
            "cgroup.subtree_control": "",
            "cgroup.procs": "",
        },
    )
    if swap:
        (own / "memory.swap.max").write_text("max\n")
    cgroup_dir(own / BASE, {"cgroup.subtree_control": "memory pids\n"})
    return own


def test_proc_self_cgroup_is_parsed_per_controller():
    assert parse_proc_cgroup(V1_PROC) == {
        "name=systemd": "/",
        "pids": "/",
        "memory": "/process_api/abc",
        "cpu": "/",
        "": "/",
    }


def test_mountinfo_gives_the_v1_controllers_and_the_v2_mount():
    mounts = parse_mountinfo(V1_MOUNTS + "50 31 0:40 / /mnt rw - ext4 /dev/sda1 rw\n")
    assert mounts == {
        "memory": ("/sys/fs/cgroup/memory", "/"),
        "pids": ("/sys/fs/cgroup/pids", "/"),
        "": ("/sys/fs/cgroup/unified", "/"),
    }


def test_v2_uses_a_child_of_this_process_cgroup(tmp_path: Path):
    own = v2_tree(tmp_path)
    setup = detect(sys_root=tmp_path, proc_cgroup="0::/user.slice/app.scope\n", mountinfo=V2_MOUNT)
    assert setup == CgroupSetup("v2", (own / BASE,), swap=True)
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_v2_writes_the_limits_of_a_call(tmp_path: Path):
    own = v2_tree(tmp_path)
    setup = CgroupSetup("v2", (own / BASE,), swap=True)
    call = CallCgroup.create(setup, 320 << 20, 19)
    (d,) = call.dirs
    assert d.parent == own / BASE and d.name.startswith("call-")
    assert {p.name: v for p, v in call.limit_files(320 << 20, 19)} == {
        "memory.max": str(320 << 20),
        "memory.swap.max": "0",
        "memory.oom.group": "1",
        "pids.max": "19",
    }
    assert (d / "memory.max").read_text() == str(320 << 20)
    assert (d / "pids.max").read_text() == "19"
    assert call.procs_files() == [str(d / "cgroup.procs")]


def test_v2_without_swap_accounting_writes_no_swap_limit(tmp_path: Path):
    own = v2_tree(tmp_path, swap=False)
    setup = detect(sys_root=tmp_path, proc_cgroup="0::/user.slice/app.scope\n", mountinfo=V2_MOUNT)
    assert isinstance(setup, CgroupSetup) and not setup.swap
    names = [p.name for p, _ in CallCgroup(setup, (own / BASE / "c",)).limit_files(1, 2)]
    assert names == ["memory.max", "memory.oom.group", "pids.max"]


def test_v2_inside_a_container_maps_the_path_below_the_mounted_root(tmp_path: Path):
    own = v2_tree(tmp_path)
    mount = V2_MOUNT.replace(" / /sys/fs/cgroup ", " /docker/c1 /sys/fs/cgroup ")
    found = detect(
        sys_root=tmp_path, proc_cgroup="0::/docker/c1/user.slice/app.scope\n", mountinfo=mount
    )
    assert found == CgroupSetup("v2", (own / BASE,), swap=True)
    outside = detect(sys_root=tmp_path, proc_cgroup="0::/elsewhere\n", mountinfo=mount)
    assert isinstance(outside, str) and "outside the mounted hierarchy" in outside


def test_v2_needs_the_memory_and_pids_controllers(tmp_path: Path):
    v2_tree(tmp_path, controllers="cpu io memory")
    why = detect(sys_root=tmp_path, proc_cgroup="0::/user.slice/app.scope\n", mountinfo=V2_MOUNT)
    assert isinstance(why, str) and "does not offer the pids controller" in why
    assert "cgroup v1: no cgroup v1 memory hierarchy is mounted" in why


def test_v2_cgroup_parent_is_used_instead_and_alone(tmp_path: Path):
    other = v2_tree(tmp_path / "other")
    found = detect(str(other), sys_root=tmp_path, proc_cgroup=V1_PROC, mountinfo=V2_MOUNT)
    assert found == CgroupSetup("v2", (other / BASE,), swap=True)
    # A parent that is not a cgroup: only it was asked for, so no v1 fallback either.
    why = detect(
        str(tmp_path / "nope"), sys_root=tmp_path, proc_cgroup=V1_PROC, mountinfo=V1_MOUNTS
    )
    assert isinstance(why, str) and "is not a cgroup v2 directory" in why and "v1" not in why


def v1_tree(root: Path, memsw: bool = True) -> tuple[Path, Path]:
    """This machine's layout: memory at ``/process_api/abc``, pids at the root."""
    mem_files = {"cgroup.procs": "", "memory.limit_in_bytes": "9223372036854771712\n"}
    if memsw:
        mem_files["memory.memsw.limit_in_bytes"] = "9223372036854771712\n"
    memory = cgroup_dir(root / "sys/fs/cgroup/memory/process_api/abc", mem_files)
    pids = cgroup_dir(root / "sys/fs/cgroup/pids", {"cgroup.procs": ""})
    cgroup_dir(root / "sys/fs/cgroup/unified", {"cgroup.controllers": "hugetlb\n"})
    return memory, pids


def test_v1_uses_a_child_in_the_memory_and_the_pids_hierarchies(tmp_path: Path):
    memory, pids = v1_tree(tmp_path)
    setup = detect(sys_root=tmp_path, proc_cgroup=V1_PROC, mountinfo=V1_MOUNTS)
    assert setup == CgroupSetup("v1", (memory / BASE, pids / BASE), swap=True)


def test_v1_writes_memsw_after_memory_and_pids_in_its_own_hierarchy(tmp_path: Path):
    memory, pids = v1_tree(tmp_path)
    setup = CgroupSetup("v1", (memory / BASE, pids / BASE), swap=True)
    (memory / BASE).mkdir()
    (pids / BASE).mkdir()
    call = CallCgroup.create(setup, 320 << 20, 19)
    mem_dir, pid_dir = call.dirs
    assert [(p.parent, p.name, v) for p, v in call.limit_files(320 << 20, 19)] == [
        (mem_dir, "memory.limit_in_bytes", str(320 << 20)),
        (mem_dir, "memory.memsw.limit_in_bytes", str(320 << 20)),
        (pid_dir, "pids.max", "19"),
    ]
    assert (mem_dir / "memory.memsw.limit_in_bytes").read_text() == str(320 << 20)
    assert call.procs_files() == [str(mem_dir / "cgroup.procs"), str(pid_dir / "cgroup.procs")]


def test_v1_without_memsw_sets_memory_only(tmp_path: Path):
    v1_tree(tmp_path, memsw=False)
    setup = detect(sys_root=tmp_path, proc_cgroup=V1_PROC, mountinfo=V1_MOUNTS)
    assert isinstance(setup, CgroupSetup) and setup.version == "v1" and not setup.swap


def test_neither_version_gives_both_reasons(tmp_path: Path):
    why = detect(sys_root=tmp_path, proc_cgroup=V1_PROC, mountinfo=V1_MOUNTS)
    assert isinstance(why, str)
    assert why.startswith("cgroup v2: ") and "; cgroup v1: " in why
    assert "memory directory is not visible" in why


def test_usage_reads_what_the_kernel_counted(tmp_path: Path):
    d = cgroup_dir(
        tmp_path / "v2",
        {
            "memory.peak": "335544320\n",
            "memory.events": "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n",
            "pids.peak": "7\n",
            "pids.events": "max 3\n",
        },
    )
    assert CallCgroup(CgroupSetup("v2", (d.parent,), True), (d,)).usage() == CgroupUsage(
        memory_peak_bytes=335544320, oom_kills=1, pids_peak=7, pids_refused=3
    )
    mem = cgroup_dir(
        tmp_path / "mem",
        {
            "memory.max_usage_in_bytes": "1048576\n",
            "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        },
    )
    pids = cgroup_dir(tmp_path / "pids", {"pids.events": "max 0\n"})  # no pids.peak: None
    v1 = CallCgroup(CgroupSetup("v1", (mem.parent, pids.parent), True), (mem, pids))
    assert v1.usage() == CgroupUsage(1048576, 2, None, 0)


def test_kill_sigkills_every_listed_process_and_writes_cgroup_kill(tmp_path: Path):
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        d = cgroup_dir(
            tmp_path / "call",
            {"cgroup.procs": "".join(f"{p.pid}\n" for p in sleepers), "cgroup.kill": ""},
        )
        call = CallCgroup(CgroupSetup("v2", (tmp_path,), True), (d,))
        call.kill()  # the fake list never empties, so kill() reports it (False); they die
        assert [p.wait(timeout=10) for p in sleepers] == [-9, -9, -9]
        assert (d / "cgroup.kill").read_text() == "1"
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_the_prefix_joins_every_cgroup_then_runs_the_command(tmp_path: Path):
    procs = [tmp_path / "a.procs", tmp_path / "b.procs"]
    argv = [*cgroup_prefix([str(p) for p in procs]), "/bin/sh", "-c", "echo $$"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    pid = out.stdout.strip()
    assert [p.read_text().strip() for p in procs] == [pid, pid]  # exec: the same process
    assert cgroup_prefix([]) == []
    bad = subprocess.run(
        [*cgroup_prefix([str(tmp_path / "no" / "such")]), "true"], capture_output=True, timeout=30
    )
    assert bad.returncode == 125


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_remove_reports_what_it_could_not_remove(tmp_path: Path, version: CgroupVersion):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert CallCgroup(CgroupSetup(version, (tmp_path,), False), (empty,)).remove()
    assert not empty.exists()
    full = cgroup_dir(tmp_path / "full", {"memory.max": "1"})  # a plain directory with a file
    assert not CallCgroup(CgroupSetup(version, (tmp_path,), False), (full,)).remove()


def test_the_cgroups_of_calls_whose_process_is_gone_are_swept(tmp_path: Path):
    own = v2_tree(tmp_path)
    base = own / BASE
    dead = base / "call-4194305-0-abcdef"  # above any pid_max: no such process
    mine = base / f"call-{os.getpid()}-0-abcdef"
    other = base / "not-a-call"
    for d in (dead, mine, other):
        d.mkdir()
    setup = detect(sys_root=tmp_path, proc_cgroup="0::/user.slice/app.scope\n", mountinfo=V2_MOUNT)
    assert isinstance(setup, CgroupSetup)
    assert not dead.exists() and mine.exists() and other.exists()
    assert sweep(setup) == []  # nothing left to sweep


def test_v2_falls_back_to_the_root_when_its_own_cgroup_cannot_delegate(tmp_path: Path):
    """A cgroup holding processes cannot enable controllers for children (EBUSY; here a file
    that cannot be written); the hierarchy's root can (root on a host)."""
    own = v2_tree(tmp_path)
    (own / "cgroup.subtree_control").unlink()
    (own / "cgroup.subtree_control").mkdir()  # unwritable, as EBUSY would be
    root = cgroup_dir(
        tmp_path / "sys/fs/cgroup",
        {"cgroup.controllers": "memory pids\n", "cgroup.subtree_control": ""},
    )
    cgroup_dir(root / BASE, {"cgroup.subtree_control": "memory pids\n"})
    proc = "0::/user.slice/app.scope\n"
    assert detect(sys_root=tmp_path, proc_cgroup=proc, mountinfo=V2_MOUNT) == CgroupSetup(
        "v2", (root / BASE,), swap=False
    )
    (root / "cgroup.controllers").write_text("cpu\n")
    why = detect(sys_root=tmp_path, proc_cgroup=proc, mountinfo=V2_MOUNT)
    assert isinstance(why, str)
    assert f"cannot enable memory and pids for children of cgroup v2 {own}" in why
    assert f"cgroup v2 {root} does not offer the memory/pids controller(s)" in why
