"""The proxy served on a local port, inside the running event loop.

Why it exists: an agent in the same process (or a test) needs a real URL to hand to
``AsyncOpenAI``; this runs the proxy's app with uvicorn as a task of the caller's event loop.

Guarantees: :meth:`RecordingProxy.start` returns only once the server accepts requests, and
raises (after stopping it) when it dies or does not start within ``startup_timeout_s``;
:meth:`RecordingProxy.stop` waits up to 10 s for requests in flight, then cancels; binding a
non-loopback host without an API key logs a loud warning.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

from agentrl.auth import resolve_api_key, warn_if_exposed
from agentrl.http_limits import uvicorn_limits
from agentrl.rollout.proxy.app import build_app, with_auth
from agentrl.rollout.proxy.recorder import ProxyRecorder
from agentrl.types import Policy, Task, Trajectory

__all__ = ["RecordingProxy"]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RecordingProxy:
    """The proxy served on a local port, in the current event loop.

    Example::

        async with RecordingProxy(policy, tokenizer, api_key="s3cret") as proxy:
            sid = proxy.open_session(task)               # an unguessable id, bound to the task
            client = AsyncOpenAI(base_url=proxy.session_url(sid), api_key="s3cret")
            await my_agent(client)                       # unmodified OpenAI-client code
            trajectories = proxy.finish(sid)             # uid/task_id/data_source from task
    """

    def __init__(
        self,
        policy: Policy,
        tokenizer: Any,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 30.0,
        api_key: str | None = None,
        **options: Any,
    ) -> None:
        self.recorder = ProxyRecorder(policy, tokenizer, **options)
        self.api_key = resolve_api_key(api_key)
        self.app = with_auth(build_app(self.recorder), self.api_key)
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running proxy (``RuntimeError`` before :meth:`start`)."""
        if self.port is None or self._server is None:
            raise RuntimeError("the proxy is not running; use 'async with RecordingProxy(...)'")
        return f"http://{self.host}:{self.port}"

    def session_url(self, session_id: str) -> str:
        """The ``base_url`` to give ``AsyncOpenAI`` for one session."""
        return f"{self.base_url}/sessions/{session_id}/v1"

    def open_session(self, task: Task | None = None, **options: Any) -> str:
        """See :meth:`ProxyRecorder.open_session`."""
        return self.recorder.open_session(task, **options)

    def finish(self, session_id: str, **meta: Any) -> list[Trajectory]:
        """See :meth:`ProxyRecorder.finish`."""
        return self.recorder.finish(session_id, **meta)

    def metrics(self) -> dict[str, float]:
        """See :meth:`ProxyRecorder.metrics`."""
        return self.recorder.metrics()

    async def start(self) -> RecordingProxy:
        """Serve on ``host:port`` (a free port if none given); return once it accepts requests."""
        import uvicorn

        if self.port is None:
            self.port = _free_port(self.host)
        warn_if_exposed(self.host, self.api_key, "the recording proxy")
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            lifespan="off",
            **uvicorn_limits(),
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raise the start-up error (e.g. port in use)
                raise RuntimeError(f"the proxy stopped during start-up on port {self.port}")
            if time.monotonic() > deadline:
                await self.stop()
                raise TimeoutError(f"the proxy did not start within {self.startup_timeout_s} s")
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        """Stop the server (waits up to 10 s for requests in flight, then cancels)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=10)
            except (TimeoutError, SystemExit):
                self._task.cancel()
            self._task = None
        self._server = None

    async def __aenter__(self) -> RecordingProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
