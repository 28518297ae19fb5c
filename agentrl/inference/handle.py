"""A handle on an inference server running as a subprocess (embedded server or vLLM).

Both launchers (``launch_embedded_server`` and ``launch_vllm_server``) return a
:class:`ServerHandle`, so tests, the trainer and the server pool stop, kill and address either
server the same way.

Guarantees: ``stop()`` always ends the process (SIGTERM, then SIGKILL after ``timeout_s``) and
is idempotent; the context manager stops the server on exit, even when the body raised;
``wait_healthy`` fails with the tail of the server's log when the process dies or times out.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Protocol

import httpx

__all__ = ["ServerHandle", "ServerProcess", "ServerStartError", "free_port"]


class ServerStartError(RuntimeError):
    """The server process exited or did not become healthy in time; the message has its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess(Protocol):
    """What a handle needs of its process: ``subprocess.Popen`` or a server forked by the
    zygote (:class:`agentrl.inference.zygote.ForkedProcess`)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


class ServerHandle:
    """A running server subprocess: its URL, pid and log file, and how to stop it.

    Attributes: ``base_url`` (e.g. ``http://127.0.0.1:8123``, no trailing slash), ``pid``,
    ``log_path`` (stdout and stderr of the process), ``process`` (the ``Popen``, or the zygote's :class:`ServerProcess`), ``api_key``
    (what clients must send, or None).
    """

    def __init__(
        self,
        process: ServerProcess,
        base_url: str,
        log_path: str | Path,
        *,
        health_path: str = "/health",
        api_key: str | None = None,
    ) -> None:
        self.process = process
        self.base_url = base_url.rstrip("/")
        self.log_path = Path(log_path)
        self.health_path = health_path
        self.api_key = api_key
        """The key the server requires (None when it has none); clients send it."""

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return text[-max_chars:]

    def wait_healthy(self, timeout_s: float = 120.0, poll_s: float = 0.25) -> None:
        """Block until ``GET {base_url}/health`` answers 200; raise :class:`ServerStartError`."""
        deadline = time.monotonic() + timeout_s
        url = self.base_url + self.health_path
        while True:
            if not self.is_running():
                raise ServerStartError(
                    f"server process {self.pid} exited with code {self.process.returncode} "
                    f"before becoming healthy; log {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            if time.monotonic() > deadline:
                self.kill()
                raise ServerStartError(
                    f"server at {self.base_url} was not healthy after {timeout_s:.0f} s "
                    f"(raise inference.startup_timeout_s if it is just slow); log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(poll_s)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Returns the exit code."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL now (failure tests use it to simulate a crashed server)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait(timeout=30)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else f"exited({self.process.returncode})"
        return f"ServerHandle({self.base_url!r}, pid={self.pid}, {state})"
