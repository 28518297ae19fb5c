"""Embedded servers forked from the zygote (:mod:`agentrl.inference.zygote`), over real HTTP.

What a user sees must not change: the server is ``agentrl serve-model`` in ``ps``, its output
goes to its log, its exit code and signals behave like a subprocess's, it dies with the process
that launched it (even on SIGKILL, even when the zygote itself is killed), and the zygote stops
with its owner. What changes is that the second server of a process forks from the same
zygote instead of importing torch and transformers again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from agentrl.inference import zygote
from agentrl.inference.handle import ServerStartError
from agentrl.inference.server import launch_embedded_server
from tests.integration.test_lifetime import _alive, children_of

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_servers_fork_from_one_zygote_and_behave_like_subprocesses(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    first = launch_embedded_server(tiny_model_dir, log_path=tmp_path / "a.log")
    second = launch_embedded_server(tiny_model_dir, log_path=tmp_path / "b.log")
    try:
        assert isinstance(first.process, zygote.ForkedProcess)
        parent = _parent(first.pid)
        assert _parent(second.pid) == parent != os.getpid()  # one zygote, both forked from it
        cmdline = Path(f"/proc/{second.pid}/cmdline").read_bytes().decode()
        assert cmdline.startswith("agentrl serve-model ") and str(tiny_model_dir) in cmdline
        assert "embedded server" in (tmp_path / "b.log").read_text()
        assert httpx.get(second.base_url + "/health", timeout=5).status_code == 200
        assert second.process.poll() is None
        os.kill(second.pid, signal.SIGKILL)  # a crash seen through the handle, as with Popen
        assert second.process.wait(timeout=10) == -signal.SIGKILL
        assert not second.is_running()
        assert first.stop() == -signal.SIGTERM  # uvicorn's graceful stop, then the code
    finally:
        first.stop()
        second.stop()


def test_a_server_that_fails_reports_its_exit_code_and_log(tmp_path: Path) -> None:
    with pytest.raises(ServerStartError, match="exited with code 2") as err:
        launch_embedded_server(tmp_path, log_path=tmp_path / "bad.log", startup_timeout_s=60)
    assert "not a Hugging Face model directory" in str(err.value)


def test_a_killed_zygote_takes_its_servers_and_the_next_launch_starts_a_new_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    handle = launch_embedded_server(tiny_model_dir, log_path=tmp_path / "a.log")
    old = _parent(handle.pid)
    os.kill(old, signal.SIGKILL)
    assert _wait_gone([handle.pid], 10) == []  # PDEATHSIG from the zygote
    assert handle.process.poll() is not None
    again = launch_embedded_server(tiny_model_dir, log_path=tmp_path / "b.log")
    try:
        assert _parent(again.pid) not in (old, os.getpid())
    finally:
        again.stop()


def test_off_switch_starts_a_plain_subprocess(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(zygote.ENV_ZYGOTE, "0")
    with launch_embedded_server(tiny_model_dir, log_path=tmp_path / "a.log") as handle:
        assert isinstance(handle.process, subprocess.Popen)
        assert _parent(handle.pid) == os.getpid()


LAUNCHER = """
import sys, time
from agentrl.inference.server import launch_embedded_server
handles = [launch_embedded_server(sys.argv[1], log_path=f"{sys.argv[2]}/{i}.log") for i in range(2)]
print(" ".join(str(h.pid) for h in handles), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_zygote_and_its_servers_die_with_their_owner(
    sig: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LAUNCHER), str(tiny_model_dir), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        servers = [int(p) for p in owner.stdout.readline().split()]
        assert len(servers) == 2, "the launcher did not start its servers"
        everything = children_of(owner.pid)  # the zygote and both servers carry the marker
        assert set(servers) <= set(everything) and len(everything) == 3
        owner.send_signal(sig)
        owner.wait(timeout=30)
        assert _wait_gone(everything, 15) == []
    finally:
        owner.kill()


@pytest.mark.parametrize("how", ["exit", "shutdown", "sigkill"])
def test_a_zygote_leaves_no_file_however_its_owner_ends(tmp_path: Path, how: str) -> None:
    """Its output goes to a file with no name: an owner that exits (the zygote dies with it,
    even mid-import), shuts it down, or is SIGKILLed (nothing of it runs) leaves nothing in the
    temp folder (4 CI runs once left 253 ``agentrl-zygote-*.log`` in /tmp, most after SIGKILL)."""
    code = "from agentrl.inference import zygote\nzygote.prestart()\n"
    code += {"exit": "", "shutdown": "zygote.shutdown()\n", "sigkill": _SIGKILL_SELF}[how]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=120)
    assert done.returncode == (-signal.SIGKILL if how == "sigkill" else 0)
    deadline = time.monotonic() + 20  # the zygote may still be on its way out
    while zygote_processes(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert zygote_processes(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


_SIGKILL_SELF = """\
import os, signal, time
z = zygote._zygote()
z._await_ready()  # the zygote is up, its imports done
os.kill(os.getpid(), signal.SIGKILL)
"""


def zygote_processes(tmp: Path) -> list[int]:
    """Pids of zygotes whose environment names ``tmp`` as TMPDIR (this test's, none other)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if b"agentrl.inference.zygote" not in (proc / "cmdline").read_bytes():
                continue
            if f"TMPDIR={tmp}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


def test_an_sdk_run_starts_the_zygote_before_resolving_and_stops_it_when_that_fails(
    tmp_path: Path,
) -> None:
    """``Trainer(cfg).run_sync()`` overlaps the servers' imports with its resolution, as
    ``agentrl train`` does; a config that does not resolve leaves no zygote behind."""
    code = textwrap.dedent(
        f"""
        from agentrl.config import load_config
        from agentrl.inference import zygote
        from agentrl.training.resolve import ResolutionError
        from agentrl.training.trainer import Trainer

        cfg = load_config("{ROOT / "configs" / "quickstart.yaml"}", [
            "data.generator=null", "data.train_files=[/nonexistent/train.jsonl]",
            "trainer.output_dir={tmp_path / "out"}"])
        started = []
        prestart = zygote.prestart
        zygote.prestart = lambda: (started.append(zygote.running()), prestart())
        try:
            Trainer(cfg).run_sync()
        except ResolutionError as exc:
            assert "data.train_files[0]" in str(exc), exc
        else:
            raise AssertionError("the run resolved a missing file")
        assert started == [False], started  # started once, before the resolution failed
        assert not zygote.running()
        print("ok")
        """
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert zygote_processes(tmp_path) == []
