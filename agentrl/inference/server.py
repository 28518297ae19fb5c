"""The embedded inference server: the vLLM-compatible HTTP subset over :class:`InferenceEngine`.

Why it exists: one client (``PolicyClient``) must talk to vLLM and to this server alike, so the
server speaks the same endpoints and formats (DESIGN section 3): token-id completions with
processed logprobs, chat completions with hermes tool calls, health/models/metrics, and the
control plane (pause, resume, abort, weight updates, weight version).

Guarantees:

- every response that carries tokens has a top-level ``weight_version`` and an
  ``x-weight-version`` header (the oldest version that produced any of its tokens);
- a client error (unknown model, prompt over the context limit, negative ``max_tokens``,
  malformed tools, out-of-vocabulary token ids, malformed JSON, unsupported options) is a 4xx
  with OpenAI's ``{"error": {"message", "type", "param", "code"}}`` naming the field, never a 500;
- with a request log, each generation request appends exactly one JSON line
  ``{"request_id", "session_id", "prompt_ids", "output_ids", "weight_version", "t"}`` with the
  exact token ids the engine saw and produced (session id: ``x-session-id`` header, else the
  OpenAI ``user`` field);
- there is no prefix cache, so ``/reset_prefix_cache`` is a no-op that answers ok.

Run it with ``agentrl serve-model MODEL_DIR`` or, from tests and the trainer, with
:func:`launch_embedded_server` (a subprocess) or :func:`create_app` (in process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentrl.inference import protocol as P
from agentrl.inference.chat import (
    ChatInputError,
    normalize_messages,
    parse_hermes_tool_calls,
    render_chat,
    validate_tools,
)
from agentrl.inference.engine import EngineOutput, EngineRequestError, WeightLoadError
from agentrl.inference.handle import ServerHandle, free_port
from agentrl.types import SamplingParams

__all__ = [
    "RequestLog",
    "add_arguments",
    "create_app",
    "launch_embedded_server",
    "run",
]


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str | None = None,
        code: int | str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _ERROR_TYPES.get(status, "BadRequestError")
        self.code = code if code is not None else status


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def _error_json(err: APIError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": err.type,
            "param": err.param,
            "code": err.code,
        }
    }


class RequestLog:
    """Appends one JSON line per generation request; thread-safe, flushed per line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")

    def write(
        self,
        *,
        request_id: str,
        session_id: str | None,
        prompt_ids: list[int],
        output_ids: list[int],
        weight_version: int,
    ) -> None:
        line = json.dumps(
            {
                "request_id": request_id,
                "session_id": session_id,
                "prompt_ids": prompt_ids,
                "output_ids": output_ids,
                "weight_version": weight_version,
                "t": time.time(),
            }
        )
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def create_app(
    engine: Any,
    *,
    tokenizer: Any = None,
    served_model_name: str | None = None,
    request_log: str | Path | RequestLog | None = None,
    close_engine_on_shutdown: bool = False,
) -> Any:
    """A FastAPI app serving ``engine`` (an :class:`~agentrl.inference.engine.InferenceEngine`).

    ``tokenizer`` defaults to ``AutoTokenizer`` of the engine's model directory;
    ``served_model_name`` defaults to that directory's name. Use it in process with
    ``httpx.AsyncClient(transport=httpx.ASGITransport(app))`` or uvicorn in a thread.
    """
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(engine.model_dir))
    model_name = served_model_name or Path(engine.model_dir).name
    log_sink = (
        request_log
        if isinstance(request_log, RequestLog) or request_log is None
        else RequestLog(request_log)
    )

    registry = CollectorRegistry()
    m_requests = Counter(
        "agentrl_requests",
        "Generation requests finished, by endpoint and finish reason",
        ["endpoint", "finish_reason"],
        registry=registry,
    )
    m_prompt_tokens = Counter("agentrl_prompt_tokens", "Prompt tokens processed", registry=registry)
    m_gen_tokens = Counter("agentrl_generation_tokens", "Tokens generated", registry=registry)
    Gauge(
        "agentrl_num_requests_running", "Requests in the running batch", registry=registry
    ).set_function(lambda: engine.num_running)
    Gauge(
        "agentrl_num_requests_waiting", "Requests waiting to be admitted", registry=registry
    ).set_function(lambda: engine.num_waiting)
    Gauge("agentrl_weight_version", "Current weight version", registry=registry).set_function(
        lambda: engine.weight_version
    )
    Gauge(
        "agentrl_decode_steps", "Batched decode steps run so far", registry=registry
    ).set_function(lambda: engine.stats["decode_steps"])
    Gauge("agentrl_is_paused", "1 while generation is paused", registry=registry).set_function(
        lambda: float(engine.is_paused)
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if close_engine_on_shutdown:
                await asyncio.to_thread(engine.close)
            if isinstance(log_sink, RequestLog) and log_sink is not request_log:
                log_sink.close()

    app = FastAPI(title="agentrl embedded inference server", lifespan=lifespan)
    app.state.engine = engine

    # ---- errors ------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(_error_json(exc), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            param = None
        else:
            param = ".".join(loc) or None
            msg = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
            if "input" in first and first.get("type") != "missing":
                msg += f" (got {first['input']!r:.100})"
        return JSONResponse(_error_json(APIError(400, msg, param=param)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(_error_json(err), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _server_error(_req: Request, exc: Exception) -> JSONResponse:
        err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
        return JSONResponse(_error_json(err), status_code=500)

    # ---- helpers -----------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{model_name}`",
                param="model",
                type_="NotFoundError",
            )

    def check_unsupported(req: Any) -> None:
        if req.stream:
            raise APIError(
                400, "stream=true is not supported by the embedded server", param="stream"
            )
        if getattr(req, "echo", False):
            raise APIError(400, "echo=true is not supported by the embedded server", param="echo")
        if req.stop:
            raise APIError(
                400,
                "string 'stop' sequences are not supported; use stop_token_ids",
                param="stop",
            )

    def sampling_of(req: Any, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k if req.top_k > 0 else -1,
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids or []),
        )

    def token_str(tid: int, as_ids: bool) -> str:
        return f"token_id:{tid}" if as_ids else tokenizer.decode([tid])

    async def run_engine(
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
        request_id: str,
        session_id: str | None,
        num_top: int,
        endpoint: str,
        ignore_eos: bool = False,
    ) -> list[EngineOutput]:
        futures = []
        try:
            for i in range(n):
                sp = sampling
                if n > 1 and sampling.seed is not None:
                    sp = sampling.model_copy(update={"seed": sampling.seed + i})
                futures.append(
                    engine.submit(
                        prompt_ids,
                        sp,
                        f"{request_id}-{i}",
                        num_top_logprobs=num_top,
                        ignore_eos=ignore_eos,
                    )
                )
        except EngineRequestError as e:
            for f in futures:
                engine.cancel(f)
            raise APIError(400, str(e), param=e.param) from e
        try:
            outs: list[EngineOutput] = list(
                await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
            )
        except asyncio.CancelledError:
            for f in futures:
                engine.cancel(f)
            raise
        for o in outs:
            m_requests.labels(endpoint, o.finish_reason).inc()
            m_prompt_tokens.inc(len(o.prompt_ids))
            m_gen_tokens.inc(len(o.token_ids))
            if log_sink is not None:
                log_sink.write(
                    request_id=o.request_id,
                    session_id=session_id,
                    prompt_ids=o.prompt_ids,
                    output_ids=o.token_ids,
                    weight_version=o.weight_version,
                )
        return outs

    def versioned(body: dict[str, Any], version: int) -> JSONResponse:
        body["weight_version"] = version
        return JSONResponse(body, headers={"x-weight-version": str(version)})

    def usage(outs: Sequence[EngineOutput]) -> dict[str, int]:
        p = len(outs[0].prompt_ids) if outs else 0
        c = sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def default_max_tokens(n_prompt: int) -> int:
        return max(0, engine.max_model_len - n_prompt)

    # ---- generation ------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, request: Request) -> JSONResponse:
        check_model(req.model)
        check_unsupported(req)
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            if len(prompt) != 1:
                raise APIError(
                    400, "batched prompts are not supported; send one prompt", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        else:
            prompt_ids = [int(t) for t in prompt]
        max_tokens = (
            req.max_tokens if req.max_tokens is not None else default_max_tokens(len(prompt_ids))
        )
        rid = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        session = request.headers.get("x-session-id") or req.user
        num_top = req.logprobs or 0
        outs = await run_engine(
            prompt_ids,
            sampling_of(req, max_tokens),
            req.n,
            rid,
            session,
            num_top,
            "completions",
            req.ignore_eos,
        )
        as_ids = req.return_tokens_as_token_ids
        choices = []
        for i, o in enumerate(outs):
            lp = None
            if req.logprobs is not None:
                tokens = [token_str(t, as_ids) for t in o.token_ids]
                offsets, off = [], 0
                for t in o.token_ids:
                    offsets.append(off)
                    off += len(tokenizer.decode([t]))
                tops = []
                for j, (t, v) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
                    top = {token_str(t, as_ids): v}
                    if o.top_logprobs is not None:
                        for tid, tv in o.top_logprobs[j]:
                            top.setdefault(token_str(tid, as_ids), tv)
                    tops.append(top)
                lp = {
                    "text_offset": offsets,
                    "token_logprobs": o.logprobs,
                    "tokens": tokens,
                    "top_logprobs": tops,
                }
            choices.append(
                {
                    "index": i,
                    "text": tokenizer.decode(o.token_ids, skip_special_tokens=True),
                    "logprobs": lp,
                    "finish_reason": o.finish_reason,
                    "stop_reason": None,
                    "prompt_token_ids": o.prompt_ids if req.return_token_ids else None,
                    "token_ids": o.token_ids if req.return_token_ids else None,
                }
            )
        version = min(o.weight_version for o in outs)
        body = P.CompletionResponse(
            id=rid,
            created=int(time.time()),
            model=model_name,
            choices=[P.CompletionChoice.model_validate(c) for c in choices],
            usage=P.Usage(**usage(outs)),
            weight_version=version,
        ).model_dump()
        return versioned(body, version)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> JSONResponse:
        check_model(req.model)
        check_unsupported(req)
        try:
            tools = validate_tools(req.tools)
            messages = normalize_messages(req.messages)
            if req.tool_choice not in (None, "auto", "none"):
                raise ChatInputError(
                    "only tool_choice 'auto' or 'none' is supported", "tool_choice"
                )
            prompt_ids = render_chat(
                tokenizer,
                messages,
                tools if req.tool_choice != "none" else None,
                add_generation_prompt=req.add_generation_prompt,
                **(req.chat_template_kwargs or {}),
            )
        except ChatInputError as e:
            raise APIError(400, str(e), param=e.param) from e
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if max_tokens is None:
            max_tokens = default_max_tokens(len(prompt_ids))
        rid = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
        session = request.headers.get("x-session-id") or req.user
        num_top = (req.top_logprobs or 0) if req.logprobs else 0
        outs = await run_engine(
            prompt_ids,
            sampling_of(req, max_tokens),
            req.n,
            rid,
            session,
            num_top,
            "chat",
            req.ignore_eos,
        )
        as_ids = req.return_tokens_as_token_ids
        choices = []
        for i, o in enumerate(outs):
            text = tokenizer.decode(o.token_ids, skip_special_tokens=True)
            parsed = parse_hermes_tool_calls(text) if tools else None
            content = parsed.content if parsed is not None else text
            tool_calls = parsed.tool_calls if parsed is not None else []
            finish = o.finish_reason
            if tool_calls and finish == "stop":
                finish = "tool_calls"
            lp = None
            if req.logprobs:
                entries = []
                for j, (t, v) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
                    tops = []
                    if o.top_logprobs is not None:
                        tops = [
                            {
                                "token": token_str(tid, as_ids),
                                "logprob": tv,
                                "bytes": list(tokenizer.decode([tid]).encode()),
                            }
                            for tid, tv in o.top_logprobs[j]
                        ]
                    entries.append(
                        {
                            "token": token_str(t, as_ids),
                            "logprob": v,
                            "bytes": list(tokenizer.decode([t]).encode()),
                            "top_logprobs": tops,
                        }
                    )
                lp = {"content": entries}
            choices.append(
                P.ChatChoice(
                    index=i,
                    message=P.ChatMessage(content=content, tool_calls=tool_calls),
                    logprobs=lp,
                    finish_reason=finish,
                    prompt_token_ids=o.prompt_ids if req.return_token_ids else None,
                    token_ids=o.token_ids if req.return_token_ids else None,
                )
            )
        version = min(o.weight_version for o in outs)
        body = P.ChatCompletionResponse(
            id=rid,
            created=int(time.time()),
            model=model_name,
            choices=choices,
            usage=P.Usage(**usage(outs)),
            weight_version=version,
        ).model_dump()
        return versioned(body, version)

    # ---- health, models, metrics ----------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "weight_version": engine.weight_version})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "agentrl",
                        "root": str(engine.model_dir),
                        "max_model_len": engine.max_model_len,
                    }
                ],
            }
        )

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # ---- control plane ---------------------------------------------------------------------
    @app.post("/pause")
    async def pause(mode: str = "keep") -> JSONResponse:
        if mode not in ("keep", "abort", "wait"):
            raise APIError(400, f"mode={mode!r}; use 'keep', 'abort' or 'wait'", param="mode")
        aborted = 0
        if mode == "abort":
            aborted = await asyncio.to_thread(engine.abort_all)
        if mode == "wait":
            while engine.num_running or engine.num_waiting:
                await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.pause)
        return JSONResponse({"status": "paused", "mode": mode, "aborted": aborted})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        engine.resume()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": engine.is_paused})

    @app.post("/abort_requests")
    async def abort_requests() -> JSONResponse:
        n = await asyncio.to_thread(engine.abort_all)
        return JSONResponse({"status": "ok", "aborted": n})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        # The embedded engine has no prefix cache: nothing to reset.
        return JSONResponse({"status": "ok", "prefix_cache": False})

    async def _load(fn: Any, *args: Any, param: str) -> JSONResponse:
        try:
            version = await asyncio.to_thread(fn, *args)
        except WeightLoadError as e:
            raise APIError(400, str(e), param=param) from e
        return JSONResponse(
            {"status": "ok", "weight_version": version},
            headers={"x-weight-version": str(version)},
        )

    @app.post("/update_weights_from_path")
    async def update_weights_from_path(req: P.UpdateWeightsFromPathRequest) -> JSONResponse:
        return await _load(engine.load_weights_from_path, req.path, req.version, param="path")

    @app.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        raw = request.headers.get("x-weight-version")
        version: int | None = None
        if raw is not None:
            try:
                version = int(raw)
            except ValueError as e:
                raise APIError(
                    400,
                    f"x-weight-version header {raw!r} is not an integer",
                    param="x-weight-version",
                ) from e
        data = await request.body()
        if not data:
            raise APIError(400, "empty body; send the safetensors bytes as the body", param="body")
        return await _load(engine.load_weights_from_bytes, data, version, param="body")

    @app.post("/collective_rpc")
    async def collective_rpc(req: P.CollectiveRpcRequest) -> JSONResponse:
        if req.method != "reload_weights":
            raise APIError(
                400,
                f"method {req.method!r} is not supported here; the embedded server knows "
                "'reload_weights' (kwargs: weights_path, optional version)",
                param="method",
            )
        path = req.kwargs.get("weights_path") or (req.args[0] if req.args else None)
        if not isinstance(path, str):
            raise APIError(
                400, "reload_weights needs kwargs.weights_path", param="kwargs.weights_path"
            )
        version = req.kwargs.get("version")
        try:
            new = await asyncio.to_thread(engine.load_weights_from_path, path, version)
        except WeightLoadError as e:
            raise APIError(400, str(e), param="kwargs.weights_path") from e
        return JSONResponse(
            {"results": [None], "weight_version": new}, headers={"x-weight-version": str(new)}
        )

    @app.post("/update_weight_version")
    async def update_weight_version(req: P.WeightVersionRequest) -> JSONResponse:
        v = await asyncio.to_thread(engine.set_weight_version, req.version)
        return JSONResponse(
            {"status": "ok", "weight_version": v}, headers={"x-weight-version": str(v)}
        )

    @app.get("/weight_info")
    async def weight_info() -> JSONResponse:
        info = await asyncio.to_thread(engine.weight_info)
        info["weight_version"] = info["version"]
        return JSONResponse(info, headers={"x-weight-version": str(info["version"])})

    return app


# ---- CLI: ``agentrl serve-model MODEL_DIR`` ----------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a local Hugging Face causal-LM directory")
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


def run(args: argparse.Namespace) -> int:
    if not (Path(args.model_dir) / "config.json").is_file():
        print(
            f"agentrl serve-model: {args.model_dir!r} is not a Hugging Face model directory "
            "(no config.json); pass a directory written by save_pretrained or `agentrl tiny-model`",
            file=sys.stderr,
        )
        return 2
    from agentrl.threads import ENV_THREADS, apply_env_threads, available_cpus

    if args.threads:
        os.environ[ENV_THREADS] = str(args.threads)
    threads = apply_env_threads(len(available_cpus()))
    print(f"agentrl serve-model: loading {args.model_dir} ({threads} threads) ...", flush=True)
    import torch
    import uvicorn

    from agentrl.inference.engine import InferenceEngine

    engine = InferenceEngine(
        args.model_dir,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        seed=args.seed,
        weight_version=args.weight_version,
    )
    app = create_app(
        engine,
        served_model_name=args.served_model_name,
        request_log=args.request_log,
        close_engine_on_shutdown=True,
    )
    print(
        f"agentrl embedded server: model {args.model_dir} on http://{args.host}:{args.port}",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


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
) -> ServerHandle:
    """Start ``python -m agentrl serve-model`` as a subprocess and wait for ``/health``.

    ``port=None`` picks a free port; ``log_path=None`` writes the server's output to a temp
    file; ``env`` is added to the child's environment (e.g. its share of the run's thread plan,
    :meth:`agentrl.threads.ProcessThreads.env`). Raises :class:`~agentrl.inference.handle.ServerStartError` (with the log tail) if the
    server exits or is not healthy within ``startup_timeout_s``.
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
    env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
    handle = ServerHandle(proc, f"http://{host}:{port}", log_path)
    handle.wait_healthy(startup_timeout_s)
    return handle
