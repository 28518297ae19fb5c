"""``agentrl serve CONFIG [key=value ...]``: the rollout service over HTTP.

Starts the config's inference servers (or uses ``inference.backend=external`` URLs), then
serves the API of docs/service.md on ``--host``/``--port`` until SIGINT/SIGTERM; on the way
out it stops admitting, cancels running episodes without recording them (they run again on
the next start with the same ``--store``) and stops the servers it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["add_arguments", "run", "settings_from_args"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``agentrl serve`` command line: config, overrides and the service's limits."""
    parser.add_argument("config", help="experiment YAML (e.g. configs/quickstart.yaml)")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. inference.num_servers=1"
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8400, help="bind port (0 = any free port)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="bearer token for every route but /health ($AGENTRL_API_KEY)",
    )
    parser.add_argument(
        "--store", default=None, help="SQLite store (default: trainer.output_dir/service.sqlite)"
    )
    parser.add_argument("--durable", action="store_true", help="SQLite synchronous=FULL")
    parser.add_argument("--max-body-mb", type=float, default=32.0, help="largest JSON body")
    parser.add_argument(
        "--max-weights-mb", type=float, default=65536.0, help="largest uploaded weights body"
    )
    parser.add_argument("--max-active-jobs", type=int, default=64, help="queued + running jobs")
    parser.add_argument("--max-episodes-per-job", type=int, default=100_000, help="tasks x n")
    parser.add_argument("--session-ttl-s", type=float, default=3600.0, help="idle session TTL")
    parser.add_argument("--max-sessions", type=int, default=10_000, help="open sessions at once")
    parser.add_argument(
        "--weights-dir",
        action="append",
        default=[],
        help="a directory path pushes may read from (repeatable; none = path pushes refused)",
    )
    parser.add_argument(
        "--data-dir",
        action="append",
        default=[],
        help="a directory dataset.path may read from (repeatable; none = refused)",
    )
    parser.add_argument("--heartbeat-s", type=float, default=15.0, help="SSE keep-alive period")
    parser.add_argument(
        "--max-server-restarts",
        type=int,
        default=None,
        help="restarts of each inference server the service launched, once it dies "
        "(0: never; default: the config's inference.max_server_restarts)",
    )
    from agentrl.training import add_log_level_argument

    add_log_level_argument(parser)


def settings_from_args(args: argparse.Namespace) -> Any:
    """The ``ServiceSettings`` of parsed ``agentrl serve`` arguments."""
    from agentrl.auth import resolve_api_key
    from agentrl.service.app import MiB, ServiceSettings

    return ServiceSettings(
        host=args.host,
        port=args.port,
        api_key=resolve_api_key(args.api_key),
        store=args.store,
        durable=args.durable,
        max_body_bytes=int(args.max_body_mb * MiB),
        max_weights_bytes=int(args.max_weights_mb * MiB),
        max_active_jobs=args.max_active_jobs,
        max_episodes_per_job=args.max_episodes_per_job,
        session_ttl_s=args.session_ttl_s,
        max_sessions=args.max_sessions,
        weights_dirs=list(args.weights_dir),
        data_dirs=list(args.data_dir),
        heartbeat_s=args.heartbeat_s,
        max_server_restarts=args.max_server_restarts,
    )


async def _serve(cfg: Any, settings: Any) -> None:
    import uvicorn

    from agentrl.auth import warn_if_exposed
    from agentrl.service.app import create_app, run_service

    warn_if_exposed(settings.host, settings.api_key, "agentrl serve")
    deferred: list[int] = []
    try:
        await _serve_until_stopped(uvicorn, cfg, settings, run_service, create_app, deferred)
    finally:
        # uvicorn re-raises SIGTERM/SIGINT when it stops; here that happens only after the
        # service's cleanup above (servers stopped, store closed), never before it.
        for sig in reversed(deferred):
            signal.raise_signal(sig)


class _DeferredSignalServer:
    """A ``uvicorn.Server`` factory whose captured signals are handed to the caller instead of
    being re-raised inside ``serve()`` (which would skip every cleanup of ``agentrl serve``)."""

    @staticmethod
    def make(uvicorn: Any, config: Any, deferred: list[int]) -> Any:
        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                with super().capture_signals():
                    try:
                        yield
                    finally:
                        deferred.extend(self._captured_signals)
                        self._captured_signals.clear()

        return _Server(config)


async def _serve_until_stopped(
    uvicorn: Any, cfg: Any, settings: Any, run_service: Any, create_app: Any, deferred: list[int]
) -> None:
    from agentrl.http_limits import uvicorn_limits

    async with run_service(cfg, settings) as service:
        config = uvicorn.Config(
            create_app(service),
            host=settings.host,
            port=settings.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            **uvicorn_limits(),
        )
        server = _DeferredSignalServer.make(uvicorn, config, deferred)
        task = asyncio.create_task(server.serve())

        async def end_streams_on_shutdown() -> None:
            """When uvicorn starts shutting down, end the open SSE streams."""
            # Open SSE streams would hold uvicorn's graceful shutdown for its full timeout.
            while not server.should_exit and not task.done():
                await asyncio.sleep(0.1)
            service.jobs.begin_shutdown()

        watcher = asyncio.create_task(end_streams_on_shutdown())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            print(
                f"agentrl serve: ready on http://{settings.host}:{port} "
                f"(servers: {', '.join(service.serving.server_urls)}; version {service.weights.version})",
                flush=True,
            )
        try:
            await task
        finally:
            watcher.cancel()


def _refuse_training_only_keys(cfg: Any) -> None:
    """Keys that only ``agentrl train`` acts on are refused here, never accepted and ignored."""
    if cfg.distributed.colocate:
        raise ValueError(
            "distributed.colocate=true: the rollout service does not colocate (its servers "
            "never share devices with a trainer of its own); remove the key, or train with "
            "agentrl train"
        )


def run(args: argparse.Namespace) -> int:
    """``agentrl serve``: load and resolve the config, serve until stopped; the exit code."""
    from agentrl.config import ConfigError, load_config
    from agentrl.training.train_cli import configure_logging

    configure_logging(args)  # request loggers (httpx, uvicorn.access) at warning: run_log
    from agentrl.training import ResolutionError, resolve_experiment

    try:
        cfg = load_config(args.config, args.overrides)
        resolve_experiment(cfg, require_train=False)  # every name resolves before a server starts
        _refuse_training_only_keys(cfg)
        settings = settings_from_args(args)
    except (ConfigError, ResolutionError, ValueError) as exc:
        print(f"agentrl serve: error: {exc}", file=sys.stderr)
        return 2
    from agentrl.service.weight_state import WeightStateError

    try:
        asyncio.run(_serve(cfg, settings))
    except WeightStateError as exc:  # saved weights that cannot be trusted: say which and why
        print(f"agentrl serve: error: {exc}", file=sys.stderr)
        return 2
    return 0
