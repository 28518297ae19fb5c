"""The python tool: what a call returns, its limits, its episode files, and its refusal to run
without OS isolation. The attacks on the boundary are in
tests/integration/test_sandbox_escape.py.

These tests start real (short) sandboxed subprocesses (bubblewrap must be installed: `make
setup` does it): about 0.1 s each.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import os
import pickle
import re
import sys
from pathlib import Path

import pytest

from agentrl.config import PythonToolConfig
from tests.waiting import until, until_sync, within
from tools import ToolSet, get_tool
from tools.python_sandbox import (
    SUPERVISOR_MARKER,
    PythonTool,
    SandboxUnavailableError,
    check_python_sandbox_available,
    interpreter_info,
    isolation,
)


def sandbox_pids() -> set[int]:
    """Pids of live sandbox processes (bwrap and the supervised interpreters) on this machine."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if SUPERVISOR_MARKER.encode() in cmdline and state != "Z":
            found.add(int(entry))
    return found


@pytest.fixture
def no_leftovers():
    """Fails the test if a sandbox process it started is still alive at its end."""
    before = sandbox_pids()
    yield
    until_sync(
        lambda: not sandbox_pids() - before,
        lambda: f"sandbox processes left running: {sorted(sandbox_pids() - before)}",
        poll_s=0.05,
    )


def unsandboxed(**kw) -> PythonTool:
    """The explicit, unsafe fallback (as on a machine without bubblewrap)."""
    return PythonTool(bwrap="/nonexistent/bwrap", allow_unsandboxed=True, **kw)


async def test_runs_code_and_returns_output(no_leftovers):
    r = await PythonTool().run("import math\nprint(math.factorial(10))\nprint('ok')")
    assert r.content == "3628800\nok\n"
    assert not r.error and r.metrics["exit_code"] == 0


async def test_packages_next_to_the_interpreter_are_importable():
    r = await PythonTool().run("import numpy\nprint(numpy.arange(4).sum())")
    assert r.content == "6\n", r.content


async def test_exceptions_show_the_users_traceback_only():
    r = await PythonTool().run("def f():\n    return 1 / 0\nf()")
    assert r.error
    assert 'File "<code>", line 3' in r.content and 'File "<code>", line 2, in f' in r.content
    assert r.content.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in r.content  # the supervisor's own frames are hidden


@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandboxed", "unsandboxed"])
async def test_the_supervisors_frames_and_source_lines_are_cut(sandboxed):
    """Without the audit hook the interpreter can read the supervisor's file and shows its
    source lines; the model still sees its own frames only."""
    tool = PythonTool(audit_hook=False) if sandboxed else unsandboxed(audit_hook=False)
    r = await tool.run("def f():\n    return 1 / 0\nf()")
    assert r.content == (
        "Traceback (most recent call last):\n"
        '  File "<code>", line 3, in <module>\n'
        '  File "<code>", line 2, in f\n'
        "ZeroDivisionError: division by zero\n"
    ), r.content


async def test_exit_code_is_reported():
    r = await PythonTool().run("import sys; sys.exit(3)")
    assert r.error and r.content == "error: exit code 3" and r.metrics["exit_code"] == 3


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    pass",
        "import time\ntime.sleep(60)",
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)",
    ],
    ids=["busy-loop", "sleep", "ignores-sigterm"],
)
@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandboxed", "unsandboxed"])
async def test_killed_at_the_wall_time_limit(no_leftovers, code, sandboxed):
    tool = PythonTool(wall_time_s=1.0) if sandboxed else unsandboxed(wall_time_s=1.0)
    r = await within(tool.run(code), "the code outlived its wall-time limit")
    assert r.error and r.content.endswith("error: timed out after 1 s; the process was killed")
    assert r.metrics["timed_out"] == 1.0
    # SIGKILLed by the supervisor at the code's deadline (it then reported the exit status),
    # not by the parent's backstop ``wall_time_s + 5 s`` later (no status: exit_code -1).
    assert r.metrics["exit_code"] == -9.0
    # Not before the limit: the supervisor's deadline lies inside the measured span (load can
    # only lengthen it; this is not a bound on how fast the machine is).
    assert r.metrics["wall_s"] >= tool.wall_time_s


async def test_memory_limit():
    tool = PythonTool(memory_mb=128)
    small = await tool.run("x = bytearray(16 * 1024 * 1024); print(len(x))")
    assert small.content == f"{16 * 1024 * 1024}\n"
    big = await tool.run("x = bytearray(512 * 1024 * 1024); print('ALLOCATED')")
    assert big.error and "MemoryError" in big.content and "ALLOCATED" not in big.content


async def test_file_size_limit():
    r = await PythonTool(max_file_mb=1).run("open('f', 'wb').write(b'x' * (2 * 1024 * 1024))")
    assert r.error and "File too large" in r.content


async def test_disk_limit_counts_the_working_directory_tmp_and_shm_together():
    code = (
        "import os\n"
        "written = 0\n"
        "try:\n"
        "    for i, d in enumerate(['.', '/tmp', '/dev/shm'] * 10):\n"
        "        with open(os.path.join(d, f'f{i}'), 'wb') as f:\n"
        "            f.write(b'x' * (1 << 20)); written += 1\n"
        "except OSError as e:\n"
        "    print(e.strerror, written)\n"
    )
    r = await PythonTool(disk_mb=8, max_file_mb=4).run(code)
    strerror, written = r.content.rsplit(" ", 1)
    assert strerror == "No space left on device" and 6 <= int(written) <= 8, r.content


async def test_cpu_time_limit():
    # The wall-time limit is far away (a loaded machine gives the loop 1 CPU second slowly).
    r = await PythonTool(wall_time_s=60, cpu_time_s=1).run("while True:\n    pass")
    assert r.error and "killed by SIGXCPU (CPU time limit)" in r.content, r.content
    assert r.metrics["exit_code"] == -24.0 and r.metrics["timed_out"] == 0.0  # not the wall limit


async def test_process_limit(no_leftovers):
    code = (
        "import os, time\n"
        "alive = 1\n"
        "try:\n"
        "    for _ in range(20):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60); os._exit(0)\n"  # alive till the sandbox is killed
        "        alive += 1\n"
        "except OSError as e:\n"
        "    print(e.strerror, alive)\n"
    )
    r = await PythonTool(max_processes=4, audit_hook=False).run(code)
    assert r.content == "Resource temporarily unavailable 4\n", r.content


async def test_output_is_truncated_keeping_head_and_tail():
    r = await PythonTool(max_output_chars=200).run("print('HEAD' + 'x' * 100000 + 'TAIL')")
    assert len(r.content) <= 200
    assert r.content.startswith("HEAD") and r.content.rstrip().endswith("TAIL")
    assert "...[truncated" in r.content


async def test_status_line_survives_truncation():
    r = await PythonTool(wall_time_s=1, max_output_chars=200).run(
        "import sys\nsys.stdout.write('x' * 100000)\nsys.stdout.flush()\nwhile True: pass"
    )
    assert len(r.content) <= 200
    assert r.content.endswith("error: timed out after 1 s; the process was killed")


async def test_episode_files_persist_and_are_removed_on_release(tmp_path, no_leftovers):
    ts = ToolSet([PythonTool(base_dir=tmp_path)])
    async with ts.episode() as ep:
        await ep.call(
            "python",
            {"code": "import os\nos.mkdir('d')\nopen('d/notes.txt', 'w').write('42')\nx = 1"},
        )
        r = await ep.call(
            "python", {"code": "print(open('d/notes.txt').read())\nprint('x' in globals())"}
        )
        host_dir = Path(ep.state("python"))
        assert host_dir.parent == tmp_path.resolve()
        # the host keeps the episode's files as one archive; it never unpacks it
        assert sorted(os.listdir(host_dir)) == ["state.tar"]
    assert r.content == "42\nFalse\n"  # files persist, variables do not
    assert not host_dir.exists()
    m = ts.metrics()
    assert m["tools/python/calls"] == 2 and m["tools/python/errors"] == 0
    assert m["tools/python/wall_s"] > 0


async def test_files_of_a_failed_or_timed_out_call_are_kept():
    tool = PythonTool(wall_time_s=1)
    state = await tool.create()
    try:
        await tool.execute(state, {"code": "open('a', 'w').write('1')\n1 / 0"})
        await tool.execute(state, {"code": "open('b', 'w').write('2')\nwhile True: pass"})
        r = await tool.execute(state, {"code": "import os\nprint(sorted(os.listdir('.')))"})
    finally:
        await tool.release(state)
    assert r.content == "['a', 'b']\n"


async def test_calls_of_one_episode_run_one_at_a_time():
    ts = ToolSet([PythonTool()])
    code = "import os\nn = len(os.listdir('.'))\nopen(f'f{n}', 'w').write('x')\nprint(n)"
    async with ts.episode() as ep:
        results = await asyncio.gather(*(ep.call("python", {"code": code}) for _ in range(3)))
    assert sorted(r.content for r in results) == ["0\n", "1\n", "2\n"]


async def test_cancellation_kills_the_sandbox(no_leftovers):
    tool = PythonTool(wall_time_s=30)
    state = await tool.create()
    before = sandbox_pids()
    task = asyncio.create_task(tool.execute(state, {"code": "import time\ntime.sleep(60)"}))
    await until(lambda: bool(sandbox_pids() - before), "the sandbox never started", poll_s=0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert os.listdir(state) == []  # no half-written archive left behind
    await tool.release(state)
    assert not Path(state).exists()


async def test_environment_is_built_from_nothing(monkeypatch):
    monkeypatch.setenv("AGENTRL_TEST_SECRET", "hunter2")
    code = (
        "import os, sys\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.getcwd())\n"
        "print(sys.flags.isolated)"
    )
    r = await PythonTool().run(code)
    assert "AGENTRL_TEST_SECRET" not in r.content and "hunter2" not in r.content
    names = ast.literal_eval(r.content.splitlines()[0])
    assert set(names) <= {
        "PATH",
        "HOME",
        "TMPDIR",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "PWD",
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
    }
    assert r.content.splitlines()[1:] == ["True", "1"]


def test_constructor_checks():
    with pytest.raises(ValueError, match="wall_time_s"):
        PythonTool(wall_time_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        PythonTool(memory_mb=1)
    with pytest.raises(ValueError, match="max_processes"):
        PythonTool(max_processes=0)
    with pytest.raises(ValueError, match="disk_mb"):
        PythonTool(disk_mb=0)
    schema = PythonTool().schema()["function"]
    assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]


def test_config_section_builds_the_tool():
    section = PythonToolConfig(wall_time_s=2, max_processes=4, disk_mb=16, cpu_time_s=3)
    tool = get_tool("python", **section.model_dump())
    assert isinstance(tool, PythonTool)
    assert (tool.wall_time_s, tool.max_processes, tool.disk_mb, tool.cpu_time_s) == (2, 4, 16, 3)
    check_python_sandbox_available(section)  # bubblewrap works here: no error


def test_refuses_to_start_without_bubblewrap():
    with pytest.raises(SandboxUnavailableError) as info:
        PythonTool(bwrap="/nonexistent/bwrap")
    msg = str(info.value)
    assert "bubblewrap (`bwrap`) was not found at '/nonexistent/bwrap'" in msg
    assert "apt-get install -y bubblewrap" in msg
    assert "tools.python.allow_unsandboxed: true" in msg
    with pytest.raises(SandboxUnavailableError, match="apt-get install -y bubblewrap"):
        check_python_sandbox_available({"bwrap": "/nonexistent/bwrap"})
    check_python_sandbox_available({"bwrap": "/nonexistent/bwrap", "allow_unsandboxed": True})


def test_refuses_to_start_when_bubblewrap_cannot_build_a_sandbox():
    with pytest.raises(SandboxUnavailableError, match="cannot create a sandbox here"):
        PythonTool(bwrap="/bin/false")


def test_check_reads_the_interpreter_of_the_section(tmp_path):
    with pytest.raises(SandboxUnavailableError, match="cannot ask the interpreter"):
        check_python_sandbox_available({"python_executable": str(tmp_path / "no-python")})


async def test_allow_unsandboxed_runs_with_a_loud_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="tools.python_sandbox"):
        tool = unsandboxed()
    assert "WITHOUT OS isolation" in caplog.text
    r = await tool.run("print(6 * 7)")
    assert r.content == "42\n"


NOT_V2 = "is not a cgroup v2 directory|no cgroup v2 hierarchy is mounted"


def test_the_cgroups_knob_is_checked():
    with pytest.raises(ValueError, match="cgroups='always' is not one of auto, required, off"):
        PythonTool(cgroups="always")


async def test_without_a_writable_cgroup_it_warns_and_falls_back_to_rlimits(tmp_path, caplog):
    """A ``cgroup_parent`` that is no cgroup: nothing else is tried (it is what was asked)."""
    with caplog.at_level(logging.WARNING, logger="tools.python_sandbox"):
        tool = PythonTool(cgroup_parent=str(tmp_path))
    assert "NO PER-CALL CGROUP" in caplog.text
    assert re.search(NOT_V2, caplog.text), caplog.text
    assert "tools.python.cgroup_parent" in caplog.text  # the fix
    r = await tool.run("print(6 * 7)")
    assert r.content == "42\n" and "memory_peak_mb" not in r.metrics  # rlimits only
    r = await tool.run("x = bytearray(400 << 20)")  # RLIMIT_AS still holds per process
    assert r.error and "MemoryError" in r.content


def test_cgroups_required_refuses_to_start_without_one(tmp_path):
    with pytest.raises(SandboxUnavailableError, match="cgroups='required'") as info:
        PythonTool(cgroups="required", cgroup_parent=str(tmp_path))
    assert re.search(NOT_V2, str(info.value)), info.value
    assert "tools.python.cgroup_parent" in str(info.value)
    with pytest.raises(SandboxUnavailableError, match=r"tools\.python\.cgroups: 'required'"):
        check_python_sandbox_available({"cgroups": "required", "cgroup_parent": str(tmp_path)})


async def test_a_call_runs_in_its_own_cgroup_where_this_machine_allows_it():
    """Here (root, cgroup v1 or a writable v2): the kernel's numbers come back per call."""
    from tools.sandbox.cgroup import CgroupSetup, detect

    if not isinstance(detect(), CgroupSetup):
        pytest.skip(f"no per-call cgroup on this machine: {detect()}")
    tool = PythonTool(cgroups="required")
    r = await tool.run("x = b'x' * (40 << 20)\nprint(len(x) >> 20)")
    assert r.content == "40\n"
    assert 40 <= r.metrics["memory_peak_mb"] <= tool.memory_mb + tool.disk_mb
    assert r.metrics["oom_kills"] == 0


async def test_unsandboxed_fork_is_refused():
    r = await unsandboxed().run("import os; os.fork()")
    assert r.error and "PermissionError: sandbox: fork is disabled" in r.content


async def test_pickled_tool_runs_in_a_fresh_state():
    tool = pickle.loads(pickle.dumps(PythonTool(wall_time_s=2)))
    assert (await tool.run("print('ok')")).content == "ok\n"


_TAMPER = """
import gc, os, sys, traceback

class Sneaky:  # a path that looks inside the first time and outside the second
    calls = 0
    def __fspath__(self):
        Sneaky.calls += 1
        return 'inside.txt' if Sneaky.calls % 2 else '/etc/passwd'

attempts = {
    "pathlike": lambda: os.remove(Sneaky()),  # os.* audits the object, not the str
    "gc": lambda: gc.get_objects(),
    "settrace": lambda: sys.settrace(lambda *a: None),
    "code": lambda: setattr(attempts["gc"], "__code__", (lambda: 1).__code__),
}
open('inside.txt', 'w').write('fine')
print(open(Sneaky()).read())  # open() converts once, then audits the str it opens
for name, attempt in attempts.items():
    try:
        attempt(); print(name, "ALLOWED")
    except PermissionError as e:
        print(name, "blocked")
try:
    open('/etc/passwd')
except PermissionError as e:
    tb = e.__traceback__
    try:
        while tb is not None:
            frame = tb.tb_frame
            tb = tb.tb_next
        print("frames ALLOWED")
    except PermissionError:
        print("frames blocked")
try:
    1 / 0
except ZeroDivisionError:
    traceback.print_exc(file=sys.stdout)  # ordinary tracebacks still work
"""


async def test_audit_hook_resists_simple_tampering():
    """The audit hook is defence in depth; these are its own regression tests."""
    r = await PythonTool().run(_TAMPER)
    lines = r.content.splitlines()
    assert lines[:6] == [
        "fine",
        "pathlike blocked",
        "gc blocked",
        "settrace blocked",
        "code blocked",
        "frames blocked",
    ], r.content
    assert lines[-1] == "ZeroDivisionError: division by zero"
    assert not r.error


async def test_output_before_an_exception_is_kept():
    r = await PythonTool().run("print('before')\nraise ValueError('bad input')")
    assert r.error
    assert r.content.startswith("before\nTraceback (most recent call last):\n")
    assert r.content.rstrip().endswith("ValueError: bad input")


def test_interpreter_info_reports_this_virtualenv():
    import sysconfig

    info = interpreter_info(sys.executable)
    assert sysconfig.get_paths()["purelib"] in info["site_dirs"]
    assert sys.prefix in info["prefixes"]


def test_isolation_binds_the_interpreter_but_not_the_project():
    iso = isolation()
    assert not isinstance(iso, str), iso
    repo = str(Path(__file__).resolve().parents[3])
    assert any(
        os.path.realpath(sys.base_prefix).startswith(p) or sys.base_prefix.startswith(p)
        for p in [*iso.bind_paths, "/usr"]
    )
    assert not any(repo == p or repo.startswith(p + "/") for p in iso.bind_paths)


async def test_an_archive_over_its_cap_is_not_kept_and_the_call_says_so():
    tool = PythonTool(disk_mb=1, wall_time_s=20)  # archive cap: 2 MiB + 1 MiB
    state = await tool.create()
    try:
        await tool.execute(state, {"code": "open('keep.txt', 'w').write('1')"})
        # 8,000 empty files: ~4 MiB of tar headers from a tmpfs that holds no data at all
        r = await tool.execute(
            state, {"code": "for i in range(8000):\n    open(f'e{i}', 'w').close()"}
        )
        after = await tool.execute(state, {"code": "import os\nprint(len(os.listdir('.')))"})
    finally:
        await tool.release(state)
    assert r.content.endswith("note: files not saved for the next call (more than 3 MiB)")
    assert after.content == "1\n"  # the previous call's files


async def test_an_interpreter_under_tmp_runs_sandboxed_with_a_private_tmp(tmp_path):
    """A virtualenv in /tmp (a clone there, CI scratch): its packages import in the sandbox,
    /tmp is still the private, writable scratch, and the host's /tmp stays out of sight."""
    import subprocess

    assert str(tmp_path).startswith("/tmp/")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "venv_only_module.py").write_text("ANSWER = 42\n")
    (tmp_path / "host-secret.txt").write_text("secret")
    exe = str(venv / "bin" / "python")
    iso = isolation(exe)
    assert not isinstance(iso, str), iso
    assert str(venv) in iso.bind_paths, iso.bind_paths
    code = (
        "import os, venv_only_module\n"
        "open('/tmp/x', 'w').write('ok')\n"
        "print(venv_only_module.ANSWER, open('/tmp/x').read(), "
        f"os.path.exists({str(tmp_path / 'host-secret.txt')!r}))"
    )
    r = await PythonTool(python_executable=exe).run(code)
    assert r.content.split() == ["42", "ok", "False"], r.content
