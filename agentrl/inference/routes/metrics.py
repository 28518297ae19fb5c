"""Health, model list and Prometheus metrics of the embedded server.

Guarantees: ``/health`` and ``/metrics`` never need a key and never fail (a gauge that cannot be
read reports NaN rather than turning the scrape into a 500); ``/v1/models`` names the model by
its served name and never shows a filesystem path.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from agentrl.inference.routes.common import ServerState

__all__ = ["make_metrics", "register"]

logger = logging.getLogger(__name__)


def _safe(read: Callable[[], float]) -> Callable[[], float]:
    def value() -> float:
        try:
            v = float(read())
        except (ArithmeticError, ValueError, TypeError, RuntimeError):
            return math.nan
        return v

    return value


def make_metrics(st: ServerState) -> CollectorRegistry:
    """The server's registry; fills ``st.metrics`` with the counters the routes update."""
    engine = st.engine
    registry = CollectorRegistry()
    st.metrics["requests"] = Counter(
        "agentrl_requests",
        "Generation requests finished, by endpoint and finish reason",
        ["endpoint", "finish_reason"],
        registry=registry,
    )
    st.metrics["prompt_tokens"] = Counter(
        "agentrl_prompt_tokens", "Prompt tokens processed", registry=registry
    )
    st.metrics["gen_tokens"] = Counter(
        "agentrl_generation_tokens", "Tokens generated", registry=registry
    )
    gauges: dict[str, tuple[str, Callable[[], float]]] = {
        "agentrl_num_requests_running": (
            "Requests in the running batch",
            lambda: engine.num_running,
        ),
        "agentrl_num_requests_waiting": (
            "Requests waiting to be admitted",
            lambda: engine.num_waiting,
        ),
        "agentrl_weight_version": ("Current weight version", lambda: engine.weight_version),
        "agentrl_decode_steps": (
            "Batched decode steps run so far",
            lambda: engine.stats["decode_steps"],
        ),
        "agentrl_prefill_forwards": (
            "Prefill forwards run so far (waiting requests are prefilled together)",
            lambda: engine.stats["prefill_forwards"],
        ),
        "agentrl_prefix_cache_hit_tokens": (
            "Prompt tokens whose KV came from the prefix cache (not computed again)",
            lambda: engine.stats["prefix_cache_hit_tokens"],
        ),
        "agentrl_prefix_cache_tokens": (
            "Tokens of KV the prefix cache holds now",
            lambda: engine.stats["prefix_cache_tokens"],
        ),
        "agentrl_is_paused": ("1 while generation is paused", lambda: engine.is_paused),
        "agentrl_sleep_level": (
            "0 awake; 1 or 2 while asleep (colocated mode: KV cache, and at 2 the weights, released)",
            lambda: engine.sleep_level,
        ),
        "agentrl_pause_expired": (
            "Pauses that ended by their deadline (no resume came)",
            lambda: engine.stats["pause_expired"],
        ),
        "agentrl_requests_aborted": (
            "Requests the engine ended with finish_reason abort (pauses, deadlines, disconnects)",
            lambda: engine.stats["finish_abort"],
        ),
        "agentrl_requests_failed": (
            "Requests that failed alone (a broken prefill or non-finite logits)",
            lambda: engine.stats["requests_failed"],
        ),
    }
    for name, (doc, read) in gauges.items():
        Gauge(name, doc, registry=registry).set_function(_safe(read))
    return registry


def register(app: FastAPI, st: ServerState, registry: CollectorRegistry) -> None:
    """Add ``/health``, ``/v1/models`` and ``/metrics`` to ``app``."""
    engine = st.engine

    @app.get("/health")
    async def _health() -> JSONResponse:
        return JSONResponse({"status": "ok", "weight_version": engine.weight_version})

    @app.get("/v1/models")
    async def _models() -> JSONResponse:
        card = {
            "id": st.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "agentrl",
            "root": st.model_name,
            "max_model_len": engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def _metrics() -> PlainTextResponse:
        try:
            text = generate_latest(registry)
        except Exception:  # a scrape must never fail the scraper
            logger.exception("metrics collection failed")
            text = b"# agentrl: metrics collection failed; see the server log\n"
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)
