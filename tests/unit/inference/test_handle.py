"""ServerHandle: health wait, stop (SIGTERM then SIGKILL), kill, context manager."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.inference.handle import ServerHandle, ServerStartError, free_port

_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _spawn(code: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:
        return subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=f, stderr=subprocess.STDOUT
        )


def test_healthy_server_and_stop(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "s.log"
    with ServerHandle(_spawn(_SERVER, log, str(port)), f"http://127.0.0.1:{port}/", log) as h:
        h.wait_healthy(timeout_s=60)
        assert h.base_url == f"http://127.0.0.1:{port}" and h.is_running() and h.pid > 0
        assert "serving" in h.log_tail()
    assert not h.is_running()
    assert h.stop() is not None  # idempotent


def test_process_that_exits_fails_with_log(tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    h = ServerHandle(_spawn("print('boom'); raise SystemExit(3)", log), "http://127.0.0.1:9", log)
    with pytest.raises(ServerStartError, match="boom"):
        h.wait_healthy(timeout_s=60)


def test_timeout_kills_and_sigkill_after_ignored_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"
    h = ServerHandle(_spawn(stubborn, log), f"http://127.0.0.1:{free_port()}", log)
    with pytest.raises(ServerStartError, match="not healthy"):
        h.wait_healthy(timeout_s=1.0)
    assert not h.is_running()
    h2 = ServerHandle(_spawn(stubborn, log), "http://127.0.0.1:9", log)
    deadline = time.monotonic() + 60  # SIGTERM must arrive after the handler is installed
    while log.read_text().count("up") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h2.stop(timeout_s=0.5) == -9
    h3 = ServerHandle(_spawn(stubborn, log), "http://127.0.0.1:9", log)
    h3.kill()
    assert h3.process.returncode == -9
