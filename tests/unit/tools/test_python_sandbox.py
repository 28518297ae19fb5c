"""The python sandbox: it cannot read outside its directory, reach the network, or outlive
its limits. Every layer is tested alone where it can be, with a control run that shows the
test would notice if the layer did nothing.

These tests start real (short) subprocesses: about 0.3 s each.
"""

from __future__ import annotations

import ast
import asyncio
import os
import time
from pathlib import Path

import pytest

from tools import ToolSet
from tools.python_sandbox import PythonTool, interpreter_info, isolation

ISOLATION = isolation()
needs_ns = pytest.mark.skipif(
    ISOLATION is None, reason="unshare cannot create network/PID namespaces on this machine"
)
needs_mount = pytest.mark.skipif(
    ISOLATION is None or not ISOLATION.mount,
    reason="no mount namespace here (unshare -m, mount, chroot)",
)


def _procs_with_cwd_in(directory: Path) -> list[int]:
    """Pids of live processes whose working directory is ``directory`` (or below it)."""
    found = []
    target = str(directory.resolve())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            found.append(int(entry))
    return found


async def test_runs_code_and_returns_output():
    r = await PythonTool().run("import math\nprint(math.factorial(10))\nprint('ok')")
    assert r.content == "3628800\nok\n"
    assert not r.error and r.metrics["exit_code"] == 0


async def test_exceptions_show_the_users_traceback_only():
    r = await PythonTool().run("def f():\n    return 1 / 0\nf()")
    assert r.error
    assert 'File "<code>", line 3' in r.content and 'File "<code>", line 2, in f' in r.content
    assert r.content.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in r.content  # the sandbox's own frames are hidden


async def test_exit_code_is_reported():
    r = await PythonTool().run("import sys; sys.exit(3)")
    assert r.error and r.content == "error: exit code 3" and r.metrics["exit_code"] == 3


_READ_ATTEMPTS = """
import os, pathlib
target = {target!r}
attempts = {{
    "open": lambda: open(target).read(),
    "os.open": lambda: os.read(os.open(target, os.O_RDONLY), 100),
    "pathlib": lambda: pathlib.Path(target).read_text(),
    "listdir": lambda: os.listdir(os.path.dirname(os.path.abspath(target))),
    "scandir": lambda: [e.name for e in os.scandir(os.path.dirname(os.path.abspath(target)))],
}}
for name, attempt in attempts.items():
    try:
        print(name, "LEAKED", attempt())
    except PermissionError as e:
        print(name, "blocked:", e)
"""


@pytest.mark.parametrize("target", ["/etc/passwd", "../secret.txt", "PARENT_ABS"])
async def test_cannot_read_outside_the_working_directory(tmp_path, target):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    if target == "PARENT_ABS":
        target = str(secret)
    r = await PythonTool(base_dir=tmp_path).run(_READ_ATTEMPTS.format(target=target))
    lines = r.content.splitlines()
    assert [line.split()[0] for line in lines] == [
        "open",
        "os.open",
        "pathlib",
        "listdir",
        "scandir",
    ]
    assert all("blocked: sandbox: access to" in line for line in lines), r.content
    assert "TOPSECRET" not in r.content and "root:x:0" not in r.content


_KERNEL_READS = """
import os
for target in ['/etc/passwd', '../secret.txt', {secret!r}, {repo_file!r}]:
    try:
        print(target, 'LEAKED', open(target).read()[:20])
    except OSError as e:
        print(target, type(e).__name__)
try:
    open({python_file!r}, 'a').write('x')
    print('python install WRITABLE')
except OSError as e:
    print('python install', type(e).__name__, e.strerror)
print(sorted(os.listdir('/')))
print(sorted(os.listdir('/etc')))
"""


@needs_mount
async def test_private_root_file_system_alone_hides_the_host(tmp_path):
    """The kernel layer by itself (no audit hook): the host's files are simply not there."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    repo_file = str(Path(__file__).resolve())
    python_file = os.path.realpath(os.__file__)
    code = _KERNEL_READS.format(secret=str(secret), repo_file=repo_file, python_file=python_file)
    r = await PythonTool(base_dir=tmp_path, audit_hook=False).run(code)
    lines = r.content.splitlines()
    assert lines[:4] == [
        "/etc/passwd FileNotFoundError",
        "../secret.txt FileNotFoundError",
        f"{secret} FileNotFoundError",
        f"{repo_file} FileNotFoundError",
    ], r.content
    assert lines[4] == "python install OSError Read-only file system"
    root_listing = set(ast.literal_eval(lines[5]))
    assert not root_listing & {"home", "proc", "sys", "var", "mnt", "opt", "srv", "boot"}
    assert set(ast.literal_eval(lines[6])) <= {"ld.so.cache"}


async def test_control_without_namespaces_or_hook_the_host_is_readable(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    r = await PythonTool(base_dir=tmp_path, audit_hook=False, namespaces=False).run(
        "print(open('../secret.txt').read())"
    )
    assert r.content == "TOPSECRET\n"  # so the tests above would fail if both layers did nothing


async def test_cannot_write_outside_or_escape_by_symlink_or_chdir(tmp_path):
    code = (
        "import os\n"
        "for attempt in [lambda: open('../out.txt', 'w'), lambda: os.chdir('/'),\n"
        "                lambda: os.symlink('/etc/passwd', 'link'), lambda: os.remove('../x'),\n"
        "                lambda: os.rename('a', '../b'), lambda: os.mkdir('/tmp/evil')]:\n"
        "    try:\n"
        "        attempt(); print('ALLOWED')\n"
        "    except PermissionError as e:\n"
        "        print('blocked')\n"
        "open('inside.txt', 'w').write('fine'); print(open('inside.txt').read())\n"
    )
    r = await PythonTool(base_dir=tmp_path).run(code)
    assert r.content == "blocked\n" * 6 + "fine\n"
    assert not (tmp_path / "out.txt").exists()


@pytest.mark.parametrize(
    "code",
    [
        "import os; os.system('cat /etc/passwd')",
        "import subprocess; subprocess.run(['cat', '/etc/passwd'])",
        "import os; os.execv('/bin/cat', ['cat', '/etc/passwd'])",
        "import ctypes",
        "import _posixsubprocess, importlib, sys; del sys.modules['_posixsubprocess']; import _posixsubprocess",
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
    ],
)
async def test_cannot_start_programs_or_lift_limits(code):
    r = await PythonTool().run(code)
    assert r.error
    assert "sandbox:" in r.content
    assert "root:" not in r.content


@pytest.fixture
async def tcp_server():
    """A real listening server on 127.0.0.1 that answers 'hello' to anyone who connects."""

    async def handle(reader, writer):
        writer.write(b"hello")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield port
    server.close()
    await server.wait_closed()


_CONNECT = (
    "import socket\n"
    "s = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
    "print('CONNECTED', s.recv(5))\n"
)


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        ({}, "PermissionError: sandbox: network access is disabled"),
        ({"namespaces": False}, "PermissionError: sandbox: network access is disabled"),
        pytest.param({"audit_hook": False}, "Network is unreachable", marks=needs_ns),
    ],
    ids=["both-layers", "audit-hook-only", "network-namespace-only"],
)
async def test_cannot_connect_to_localhost(tcp_server, layers, expected):
    r = await PythonTool(**layers).run(_CONNECT.format(port=tcp_server))
    assert r.error, r.content
    assert "CONNECTED" not in r.content
    assert expected in r.content


async def test_control_without_both_layers_the_server_is_reachable(tcp_server):
    r = await PythonTool(namespaces=False, audit_hook=False).run(_CONNECT.format(port=tcp_server))
    assert r.content == "CONNECTED b'hello'\n"


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    pass",
        "import time\ntime.sleep(60)",
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)",
    ],
    ids=["busy-loop", "sleep", "ignores-sigterm"],
)
@pytest.mark.parametrize(
    "layers", [{}, {"namespaces": False, "audit_hook": False}], ids=["all", "bare"]
)
async def test_killed_at_the_wall_time_limit(tmp_path, code, layers):
    tool = PythonTool(wall_time_s=1.0, base_dir=tmp_path, **layers)
    t0 = time.monotonic()
    r = await tool.run(code)
    elapsed = time.monotonic() - t0
    assert r.error and r.content.endswith("error: timed out after 1 s; the process was killed")
    assert r.metrics["timed_out"] == 1.0
    assert 1.0 <= elapsed < 4.0
    assert _procs_with_cwd_in(tmp_path) == []


async def test_memory_limit(tmp_path):
    tool = PythonTool(memory_mb=128)
    small = await tool.run("x = bytearray(16 * 1024 * 1024); print(len(x))")
    assert small.content == f"{16 * 1024 * 1024}\n"
    big = await tool.run("x = bytearray(512 * 1024 * 1024); print('ALLOCATED')")
    assert big.error and "MemoryError" in big.content and "ALLOCATED" not in big.content


async def test_file_size_limit():
    r = await PythonTool(max_file_mb=1).run("open('f', 'wb').write(b'x' * (2 * 1024 * 1024))")
    assert r.error and "File too large" in r.content


_FORK_AND_ESCAPE = """
import os, time
pid = os.fork()
if pid == 0:
    os.setsid()  # leave the process group, as a daemon would
    open('started.txt', 'w').write('1')
    time.sleep(1.0)
    open('survivor.txt', 'w').write('I outlived the sandbox')
    os._exit(0)
for _ in range(200):
    if os.path.exists('started.txt'):
        break
    time.sleep(0.01)
print('parent exits')
"""


@needs_ns
async def test_a_forked_child_does_not_outlive_the_call(tmp_path):
    ts = ToolSet([PythonTool(base_dir=tmp_path)])
    async with ts.episode() as ep:
        r = await ep.call("python", {"code": _FORK_AND_ESCAPE})
        workdir: Path = ep.state("python")
        assert r.content == "parent exits\n"
        assert (workdir / "started.txt").exists()
        assert _procs_with_cwd_in(workdir) == []
        await asyncio.sleep(1.5)
        assert not (workdir / "survivor.txt").exists()


async def test_control_without_namespaces_or_hook_the_child_survives(tmp_path):
    tool = PythonTool(base_dir=tmp_path, namespaces=False, audit_hook=False)
    workdir = await tool.create()
    try:
        r = await tool.execute(workdir, {"code": _FORK_AND_ESCAPE})
        assert r.content == "parent exits\n"
        for _ in range(100):  # the escaped child finishes on its own within ~1 s
            if (workdir / "survivor.txt").exists():
                break
            await asyncio.sleep(0.05)
        assert (workdir / "survivor.txt").exists()  # so the test above would notice
    finally:
        await tool.release(workdir)


async def test_without_a_pid_namespace_fork_is_refused():
    r = await PythonTool(namespaces=False).run("import os; os.fork()")
    assert r.error and "PermissionError: sandbox: fork is disabled" in r.content


@needs_ns
async def test_children_may_not_fork_and_forks_are_bounded():
    code = (
        "import os\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        os.fork(); print('GRANDCHILD', flush=True)\n"
        "    except PermissionError as e:\n"
        "        print('child:', e, flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        p = os.fork()\n"
        "        if p == 0: os._exit(0)\n"
        "        os.waitpid(p, 0); n += 1\n"
        "except PermissionError:\n"
        "    print('forks', n + 1)\n"
    )
    r = await PythonTool(max_forks=4).run(code)
    assert r.content == "child: sandbox: fork limit reached (children may not fork)\nforks 4\n"


async def test_cancellation_kills_the_process(tmp_path):
    tool = PythonTool(wall_time_s=30, base_dir=tmp_path)
    workdir = await tool.create()
    task = asyncio.create_task(
        tool.execute(workdir, {"code": "open('up', 'w').write('1')\nimport time\ntime.sleep(60)"})
    )
    for _ in range(200):
        if (workdir / "up").exists():
            break
        await asyncio.sleep(0.02)
    assert _procs_with_cwd_in(workdir), "the sandbox process should be running"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _procs_with_cwd_in(workdir) == []
    await tool.release(workdir)
    assert not workdir.exists()


async def test_environment_is_scrubbed(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTRL_TEST_SECRET", "hunter2")
    code = "import os, sys\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.getcwd())\nprint(sys.flags.isolated)"
    r = await PythonTool(base_dir=tmp_path).run(code)
    assert "AGENTRL_TEST_SECRET" not in r.content and "hunter2" not in r.content
    assert r.content.splitlines()[1:] == ["True", "1"]


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


async def test_episode_files_persist_and_are_removed_on_release(tmp_path):
    ts = ToolSet([PythonTool(base_dir=tmp_path)])
    async with ts.episode() as ep:
        await ep.call("python", {"code": "open('notes.txt', 'w').write('42')\nx = 1"})
        r = await ep.call(
            "python", {"code": "print(open('notes.txt').read())\nprint('x' in globals())"}
        )
        workdir: Path = ep.state("python")
        assert workdir.parent == tmp_path.resolve()
    assert r.content == "42\nFalse\n"  # files persist, variables do not
    assert not workdir.exists()
    m = ts.metrics()
    assert m["tools/python/calls"] == 2 and m["tools/python/errors"] == 0
    assert m["tools/python/wall_s"] > 0


def test_constructor_checks():
    with pytest.raises(ValueError, match="wall_time_s"):
        PythonTool(wall_time_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        PythonTool(memory_mb=1)
    schema = PythonTool().schema()["function"]
    assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]


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


async def test_hook_resists_simple_tampering():
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
    import sys
    import sysconfig

    info = interpreter_info(sys.executable)
    assert sysconfig.get_paths()["purelib"] in info["site_dirs"]
    assert sys.prefix in info["prefixes"]


@needs_mount
def test_isolation_binds_the_interpreter_but_not_the_project():
    assert ISOLATION is not None
    repo = str(Path(__file__).resolve().parents[3])
    import sys

    assert any(
        os.path.realpath(sys.base_prefix).startswith(p) or sys.base_prefix.startswith(p)
        for p in [*ISOLATION.bind_paths, "/usr"]
    )
    assert repo not in ISOLATION.bind_paths
