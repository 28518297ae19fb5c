"""The embedded inference server: the vLLM-compatible HTTP subset over :class:`InferenceEngine`.

Why it exists: one client (``PolicyClient``) must talk to vLLM and to this server alike, so the
server speaks the same endpoints and formats (DESIGN section 3): token-id completions with
processed logprobs, chat completions with hermes tool calls, health/models/metrics, and the
control plane (pause, resume, abort, weight updates, weight version, and a probe served while
paused). The routes live in :mod:`agentrl.inference.routes` (generation, control, weights,
metrics); :func:`create_app` assembles them. A reward model (a ``*ForSequenceClassification``
directory; ``--task score``, or detected from its ``config.json``) is served by a
:class:`~agentrl.inference.scoring.ScoringEngine` instead, with the scoring route (vLLM's
``POST /pooling``) and health/models/metrics in place of generation, control and weights.

Guarantees:

- every response that carries tokens has a top-level ``weight_version`` and an
  ``x-weight-version`` header (the oldest version that produced any of its tokens);
- a client error (unknown model, prompt over the context limit, negative ``max_tokens``,
  malformed tools, out-of-vocabulary token ids, malformed JSON, a seed outside int64, a version
  that is not an int in ``[0, 2**63 - 1]``, text that is not Unicode, unsupported options, bad
  weights) is a 4xx with OpenAI's ``{"error": {"message", "type", "param", "code"}}`` naming the
  field; one bad request fails only itself; an answer >= 500 carries ``Connection: close``;
- control routes need the API key (``--api-key`` / ``AGENTRL_API_KEY``) when one is set and a
  loopback caller when none is (:mod:`agentrl.inference.routes.auth`); binding a non-loopback
  address without a key prints a warning;
- a client that disconnects has its generation aborted; every pause ends by its deadline; on
  SIGTERM the server aborts whatever is running, parked or queued and exits within ~10 s;
- with a request log (created 0600), each generation request appends exactly one JSON line
  ``{"request_id", "session_id", "prompt_ids", "output_ids", "weight_version",
  "finish_reason", "t"}`` with the exact token ids the engine saw and produced (session id:
  ``x-session-id`` header, else the OpenAI ``user`` field);
- prompt prefixes computed before are reused (``--prefix-cache-mb``, 0 = off;
  :mod:`~agentrl.inference.engine.prefix_cache`); a weight change empties that cache by itself
  and ``/reset_prefix_cache`` empties it on demand; no response contains a filesystem path of
  the server.

Run it with ``agentrl serve-model MODEL_DIR`` or, from tests and the trainer, with
:func:`launch_embedded_server` (a subprocess) or :func:`create_app` (in process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from agentrl.http_limits import BodyDeadline, uvicorn_limits
from agentrl.inference.handle import ServerHandle, ServerProcess, free_port
from agentrl.inference.routes import control, generation, metrics, scoring, weights
from agentrl.inference.routes.auth import AccessControl, is_loopback
from agentrl.inference.routes.common import RequestLog, ServerState, install_error_handlers
from agentrl.lifetime import child_preexec, owner_env, watch_owner

__all__ = [
    "DEFAULT_PREFIX_CACHE_MB",
    "ENV_API_KEY",
    "RequestLog",
    "add_arguments",
    "create_app",
    "embedded_device",
    "launch_embedded_server",
    "run",
]

ENV_API_KEY = "AGENTRL_API_KEY"
"""Environment variable holding the API key (server, and ``PolicyClient`` by default)."""
DEFAULT_PREFIX_CACHE_MB = 256.0
"""``--prefix-cache-mb`` (and ``inference.prefix_cache_mb``) by default."""
SHUTDOWN_GRACE_S = 3
"""How long uvicorn waits for open requests after SIGTERM (the engine aborts them at once)."""


def create_app(
    engine: Any,
    *,
    tokenizer: Any = None,
    served_model_name: str | None = None,
    request_log: str | Path | RequestLog | None = None,
    close_engine_on_shutdown: bool = False,
    api_key: str | None = None,
    trust_request_chat_template: bool = False,
) -> Any:
    """A FastAPI app serving ``engine``: an :class:`~agentrl.inference.engine.InferenceEngine`
    (generation, control, weights) or a :class:`~agentrl.inference.scoring.ScoringEngine`
    (scoring).

    ``tokenizer`` defaults to ``AutoTokenizer`` of the engine's model directory;
    ``served_model_name`` defaults to that directory's name. ``api_key`` protects every route
    but health, metrics and docs; without it the control routes answer loopback callers only.
    Use it in process with ``httpx.AsyncClient(transport=httpx.ASGITransport(app))`` or uvicorn.
    """
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(engine.model_dir))
    log_sink = (
        request_log
        if isinstance(request_log, RequestLog) or request_log is None
        else RequestLog(request_log)
    )
    st = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_name=served_model_name or Path(engine.model_dir).name,
        log_sink=log_sink,
        api_key=api_key or None,
        trust_request_chat_template=trust_request_chat_template,
    )
    registry = metrics.make_metrics(st)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if close_engine_on_shutdown:
                await asyncio.to_thread(engine.close, 5.0)
            if isinstance(log_sink, RequestLog) and log_sink is not request_log:
                log_sink.close()

    app = FastAPI(title="agentrl embedded inference server", lifespan=lifespan)
    app.state.engine = engine
    app.state.server = st
    install_error_handlers(app)
    app.add_middleware(AccessControl, api_key=st.api_key)
    app.add_middleware(BodyDeadline)  # outermost: bounds every body read (agentrl.http_limits)
    from agentrl.inference.scoring import ScoringEngine

    if isinstance(engine, ScoringEngine):
        scoring.register(app, st)
    else:
        generation.register(app, st)
        control.register(app, st)
        weights.register(app, st)
    metrics.register(app, st, registry)
    return app


# ---- CLI: ``agentrl serve-model MODEL_DIR`` ----------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``agentrl serve-model`` options."""
    parser.add_argument(
        "model_dir",
        help="a local Hugging Face directory: a causal LM (generation) or a sequence "
        "classifier (scoring)",
    )
    parser.add_argument(
        "--task",
        default="auto",
        choices=["auto", "generate", "score", "logprobs"],
        help="generate (completions, chat, weight updates), score (a reward model: "
        "POST /pooling) or logprobs (a distillation teacher: POST /pooling task logprobs); "
        "auto = score when config.json names a *ForSequenceClassification",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=int, default=8000, help="bind port")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests without a seed")
    parser.add_argument(
        "--max-batch-size", type=int, default=32, help="most requests decoded together"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context limit (prompt + output)"
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=_mebibytes,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="MiB of KV kept for prompt prefixes computed before (reused by later prompts "
        "that start with them: the samples of a task, the next turn of an episode); 0 = off",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model name (default: directory name)"
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weight dtype",
    )
    parser.add_argument(
        "--weight-version", type=int, default=0, help="version of the initial weights"
    )
    parser.add_argument("--request-log", default=None, help="append one JSON line per request here")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: $AGENTRL_THREADS from the run's thread plan, "
        "else every usable cpu)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default: ${ENV_API_KEY}); prefer the "
        "environment variable, which other users cannot read from the process list",
    )
    parser.add_argument(
        "--max-pause-s",
        type=float,
        default=300.0,
        help="longest a pause lasts before the server resumes by itself",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in requests (rendered off the event loop, time-limited)",
    )


def _mebibytes(text: str) -> float:
    """``--prefix-cache-mb``'s value: a finite number >= 0 (argparse names the option on error)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: use a number of MiB >= 0 (0 turns it off)")
    return value


def _warn_if_exposed(host: str, api_key: str | None) -> None:
    if api_key or is_loopback(host if host not in ("localhost", "") else "127.0.0.1"):
        return
    print(
        f"WARNING: agentrl serve-model binds {host} without an API key: anyone who reaches this "
        "port can generate. Control routes (pause, weights, versions) stay loopback-only, but "
        f"set --api-key or ${ENV_API_KEY} to serve other machines safely.",
        file=sys.stderr,
        flush=True,
    )


def run(args: argparse.Namespace) -> int:
    """``agentrl serve-model``: load the model and serve it until SIGTERM/SIGINT."""
    if not (Path(args.model_dir) / "config.json").is_file():
        print(
            f"agentrl serve-model: {args.model_dir!r} is not a Hugging Face model directory "
            "(no config.json); pass a directory written by save_pretrained or `agentrl tiny-model`",
            file=sys.stderr,
        )
        return 2
    watch_owner()  # launched by a run: exit when that run's process dies (agentrl.lifetime)
    from agentrl.threads import ENV_THREADS, apply_env_threads, available_cpus

    if args.threads:
        os.environ[ENV_THREADS] = str(args.threads)
    threads = apply_env_threads(len(available_cpus()))
    api_key = args.api_key or os.environ.get(ENV_API_KEY) or None
    _warn_if_exposed(args.host, api_key)
    print(f"agentrl serve-model: loading {args.model_dir} ({threads} threads) ...", flush=True)
    engine = _load_engine(args)
    app = create_app(
        engine,
        served_model_name=args.served_model_name,
        request_log=args.request_log,
        close_engine_on_shutdown=True,
        api_key=api_key,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    print(
        f"agentrl embedded server: model {Path(args.model_dir).name} on "
        f"http://{args.host}:{args.port} (api key: {'on' if api_key else 'off'})",
        flush=True,
    )
    _serve(app, engine, args.host, args.port, args.log_level)
    return 0


def _load_engine(args: argparse.Namespace) -> Any:
    """The engine ``args.task`` asks for: generation, or scoring for a reward model."""
    import torch

    from agentrl.inference.scoring import ScoringEngine, is_classifier_dir

    dtype = getattr(torch, args.dtype)
    task = getattr(args, "task", "auto")
    if task in ("score", "logprobs") or (task == "auto" and is_classifier_dir(args.model_dir)):
        return ScoringEngine(
            args.model_dir,
            device=args.device,
            dtype=dtype,
            max_batch_size=args.max_batch_size,
            max_model_len=args.max_model_len,
            task="logprobs" if task == "logprobs" else "classify",
        )
    from agentrl.inference.engine import InferenceEngine

    return InferenceEngine(
        args.model_dir,
        device=args.device,
        dtype=dtype,
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        seed=args.seed,
        weight_version=args.weight_version,
        max_pause_s=args.max_pause_s,
        prefix_cache_mb=getattr(args, "prefix_cache_mb", DEFAULT_PREFIX_CACHE_MB),
    )


def _serve(app: Any, engine: Any, host: str, port: int, log_level: str) -> None:
    """uvicorn, with SIGTERM/SIGINT first stopping the engine (it aborts whatever is running,
    parked or queued, so every open request answers at once and the process exits)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            engine.shutdown_nowait()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        proxy_headers=False,  # the peer address decides what loopback-only routes answer
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        **uvicorn_limits(),
    )
    _Server(config).run()


def launch_embedded_server(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    log_path: str | Path | None = None,
    request_log: str | Path | None = None,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    api_key: str | None = None,
) -> ServerHandle:
    """Start ``python -m agentrl serve-model`` as a subprocess and wait for ``/health``.

    ``port=None`` picks a free port; ``log_path=None`` writes the server's output to a temp
    file; ``env`` is added to the child's environment (e.g. its share of the run's thread plan,
    :meth:`agentrl.threads.ProcessThreads.env`); ``api_key`` is handed to the child through
    ``AGENTRL_API_KEY`` (never on its command line) and kept on the handle. Raises
    :class:`~agentrl.inference.handle.ServerStartError` (with the log tail) if the server exits
    or is not healthy within ``startup_timeout_s``.
    """
    port = port or free_port(host)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="agentrl-embedded-", suffix=".log")
        os.close(fd)
        log_path = name
    cmd = [
        sys.executable,
        "-m",
        "agentrl",
        "serve-model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
    ]
    if request_log is not None:
        cmd += ["--request-log", str(request_log)]
    cmd += list(extra_args)
    child_env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1", **owner_env())
    if api_key:
        child_env[ENV_API_KEY] = api_key
    proc = _start_process(cmd, child_env, str(log_path))
    handle = ServerHandle(
        proc, f"http://{host}:{port}", log_path, api_key=api_key or child_env.get(ENV_API_KEY)
    )
    handle.wait_healthy(startup_timeout_s)
    return handle


def _start_process(cmd: list[str], env: dict[str, str], log_path: str) -> ServerProcess:
    """Fork the server from the zygote (imports done: :mod:`agentrl.inference.zygote`), else a
    subprocess. Either dies with this process, even on SIGKILL (:mod:`agentrl.lifetime`)."""
    from agentrl.inference import zygote

    if zygote.enabled():
        try:
            return zygote.spawn(cmd[3:], env=env, log_path=log_path)
        except (zygote.ZygoteError, OSError) as exc:
            print(f"agentrl: starting the server as a subprocess: {exc}", file=sys.stderr)
    with open(log_path, "ab") as logf:
        return subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, preexec_fn=child_preexec()
        )


def embedded_device(cfg: Any) -> tuple[str, str]:
    """(device, dtype) of the embedded servers: ``inference.device`` and ``model.dtype``
    (auto = cuda with bfloat16 when a GPU is visible, else cpu with float32)."""
    import torch

    device = cfg.inference.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, dtype
