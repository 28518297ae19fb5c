"""The sandbox supervisor as a program: run by path (unsandboxed here; the sandboxed runs are
tests/unit/tools/test_python_sandbox.py), and as a module its tests import."""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tools.sandbox import supervisor
from tools.sandbox.command import supervisor_argv
from tools.sandbox.config import SUPERVISOR_FILE
from tools.sandbox.supervisor import STARTED_LINE


def run(
    tmp_path: Path, code: str, *, archive: bool = False, **overrides: Any
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], bytes]:
    """Run the supervisor by its host path on ``code``: (process, status line, archive bytes)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    read_fd, write_fd = os.pipe()
    cfg: dict[str, Any] = {
        "rlimits": {},
        "cwd": str(work),
        "write_root": str(work),
        "restore": "",
        "archive": archive,
        "sandboxed": False,
        "status_fd": write_fd,
        "wall_time_s": 10,
        "audit": False,
        "max_forks": 0,
        "site_dirs": [],
        "read_roots": [],
        "seccomp": "",
        "protect_pids": [1, 2],
        **overrides,
    }
    try:
        proc = subprocess.run(
            supervisor_argv(sys.executable, cfg, sandboxed=False),
            input=code,
            capture_output=True,
            text=True,
            pass_fds=(write_fd,),
            timeout=60,
            check=False,
            start_new_session=True,
        )
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as status:
        started = status.readline()
        line = status.readline()
        rest = status.read()
    assert started == STARTED_LINE, started
    return proc, json.loads(line), rest


def test_it_imports_the_standard_library_only():
    """It runs in a bare interpreter (``-I -S``); nothing else is there to import."""
    tree = ast.parse(SUPERVISOR_FILE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported


def test_the_host_runs_the_file_tests_import():
    assert Path(supervisor.__file__).resolve() == SUPERVISOR_FILE


def test_the_check_mode_only_proves_it_starts():
    out = subprocess.run(
        [sys.executable, "-I", "-S", str(SUPERVISOR_FILE), supervisor.CHECK],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == supervisor.CHECK_OK + "\n"


def test_without_its_marker_it_refuses_to_run():
    out = subprocess.run(
        [sys.executable, "-I", "-S", str(SUPERVISOR_FILE), "{}"], capture_output=True, text=True
    )
    assert out.returncode != 0 and supervisor.MARKER in out.stderr


def test_cpu_gets_a_hard_limit_one_second_above_the_soft_one():
    inf = -1
    assert supervisor.limit_pair("RLIMIT_CPU", 6, inf, inf) == (6, 7)
    assert supervisor.limit_pair("RLIMIT_AS", 100, inf, inf) == (100, 100)
    # an existing hard limit is never raised (an unprivileged process could not)
    assert supervisor.limit_pair("RLIMIT_NOFILE", 256, 64, inf) == (64, 64)


def test_the_status_line_reports_the_exit_code(tmp_path):
    proc, head, _ = run(tmp_path, "import sys\nprint('hi')\nsys.exit(3)")
    assert proc.stdout == "hi\n"
    assert head == {"exit_code": 3, "timed_out": False, "restore_error": ""}


def test_the_code_is_killed_at_the_wall_time(tmp_path):
    _, head, _ = run(tmp_path, "import time\ntime.sleep(60)", wall_time_s=0.5)
    assert head["timed_out"] is True and head["exit_code"] == -9


def test_the_code_is_main_and_sees_none_of_the_supervisor(tmp_path):
    code = (
        "names = sorted(globals())\n"
        "import __main__, sys\n"
        "print(names, __main__.__dict__ is globals(), sys.argv)"
    )
    proc, head, _ = run(tmp_path, code)
    assert proc.stdout == "['__builtins__', '__name__'] True ['<code>']\n"
    assert head["exit_code"] == 0


def test_files_are_archived_after_the_code_and_restored_next_time(tmp_path):
    _, _, archive = run(tmp_path, "open('notes.txt', 'w').write('42')", archive=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert tar.getnames() == ["notes.txt"]
    saved = tmp_path / "state.tar"
    saved.write_bytes(archive)
    (tmp_path / "work" / "notes.txt").unlink()
    proc, head, _ = run(tmp_path, "print(open('notes.txt').read())", restore=str(saved))
    assert proc.stdout == "42\n" and head["restore_error"] == ""


def test_an_archive_that_cannot_be_restored_is_reported(tmp_path):
    broken = tmp_path / "state.tar"
    broken.write_bytes(b"not a tar archive")
    proc, head, _ = run(tmp_path, "print('still runs')", restore=str(broken))
    assert proc.stdout == "still runs\n"
    assert head["restore_error"].startswith("ReadError")


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("open('/etc/hostname')", "outside the working directory"),
        ("import socket\nsocket.socket(socket.AF_INET)", "network access is disabled"),
        ("import os\nos.system('true')", "starting programs is disabled"),
        ("import ctypes", "module 'ctypes' is disabled"),
        ("import os\nos.fork()", "fork is disabled"),
    ],
    ids=["file", "socket", "spawn", "ctypes", "fork"],
)
def test_the_audit_hook_refuses(tmp_path, code, message):
    proc, head, _ = run(tmp_path, code, audit=True)
    assert head["exit_code"] == 1 and message in proc.stderr, proc.stderr


def test_the_audit_hook_allows_the_working_directory_and_the_read_roots(tmp_path):
    root = tmp_path / "readable"
    root.mkdir()
    (root / "data.txt").write_text("ok")
    code = f"open('mine.txt', 'w').write('1')\nprint(open({str(root / 'data.txt')!r}).read())"
    proc, head, _ = run(tmp_path, code, audit=True, read_roots=[str(root)])
    assert proc.stdout == "ok\n" and head["exit_code"] == 0, proc.stderr


def test_the_supervisors_frames_are_hidden_from_the_code(tmp_path):
    code = (
        "import sys\n"
        "try:\n"
        "    open('/etc/hostname')\n"
        "except PermissionError as e:\n"
        "    tb = e.__traceback__\n"
        "    names = []\n"
        "    try:\n"
        "        while tb is not None:\n"
        "            names.append(tb.tb_frame.f_code.co_filename)\n"
        "            tb = tb.tb_next\n"
        "    except PermissionError as hidden:\n"
        "        print(names, hidden)\n"
    )
    proc, _, _ = run(tmp_path, code, audit=True)
    assert proc.stdout == "['<code>'] sandbox: the sandbox's own frames are hidden\n"
