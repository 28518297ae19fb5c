"""Turn a :class:`~agentrl.serving.spec.ServerSpec` into a running server: the only place that
writes a server's command line.

Guarantees:

- :func:`launch_call` is pure (nothing starts): the launcher and its keyword arguments, so a
  test compares what two callers would start without starting it;
- :func:`launch` returns only once the server answers ``/health`` (the launchers' contract),
  else raises with the server's log tail;
- :func:`launch_all` starts servers in parallel and registers each started one with the exit
  stack the moment it exists, so one that fails to start never orphans the others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.inference.handle import ServerHandle
from agentrl.serving.spec import ServerSpec

__all__ = ["launch", "launch_all", "launch_call"]

LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
"""vLLM loads pushed adapters at run time only with this set (docs/inference.md)."""


def launch_call(spec: ServerSpec) -> tuple[Callable[..., ServerHandle], dict[str, Any]]:
    """The launcher function of ``spec`` and its keyword arguments (nothing started)."""
    if spec.backend == "embedded":
        from agentrl.inference.server import launch_embedded_server

        return launch_embedded_server, _embedded_kwargs(spec)
    from agentrl.inference.vllm_backend import launch_vllm_server

    return launch_vllm_server, _vllm_kwargs(spec)


def launch(spec: ServerSpec) -> ServerHandle:
    """Start the server ``spec`` describes and wait until it is healthy; its handle."""
    launcher, kwargs = launch_call(spec)
    return launcher(**kwargs)


async def launch_all(
    specs: Sequence[ServerSpec], stack: contextlib.AsyncExitStack
) -> list[ServerHandle]:
    """Launch ``specs`` in parallel (threads); each started server is stopped by ``stack``.

    If any fails to start, the first error is raised after the others were registered, so the
    stack stops those on the way out.
    """
    results = await asyncio.gather(
        *(asyncio.to_thread(launch, s) for s in specs), return_exceptions=True
    )
    handles = [r for r in results if not isinstance(r, BaseException)]
    for handle in handles:
        stack.callback(handle.stop)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return handles


def _embedded_kwargs(spec: ServerSpec) -> dict[str, Any]:
    """``launch_embedded_server`` arguments: the role's task, batch, seed, device and dtype."""
    args: list[str] = []
    if spec.role != "policy":  # the other roles name their task; the policy's is found (auto)
        args += ["--task", _EMBEDDED_TASKS[spec.role]]
    if spec.max_batch_size is not None:
        args += ["--max-batch-size", str(spec.max_batch_size)]
    if spec.prefix_cache_mb is not None:
        args += ["--prefix-cache-mb", str(spec.prefix_cache_mb)]
    args += ["--seed", str(spec.seed)]
    if spec.device is not None:
        args += ["--device", spec.device]
    if spec.dtype is not None:
        args += ["--dtype", spec.dtype]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    env = {**(spec.threads.env() if spec.threads is not None else {}), **(spec.env or {})}
    return {
        "model_dir": spec.model,
        "host": spec.host,
        "api_key": spec.api_key,
        "log_path": spec.log_path,
        "startup_timeout_s": spec.startup_timeout_s,
        "env": env or None,
        "extra_args": [*args, *spec.extra_args],
    }


_EMBEDDED_TASKS = {"reward_model": "score", "judge": "generate", "teacher": "logprobs"}
"""The embedded server's ``--task`` of each role but the policy's."""


def _vllm_kwargs(spec: ServerSpec) -> dict[str, Any]:
    """``launch_vllm_server`` arguments: the runner, batch, LoRA and the extra arguments."""
    args: list[str] = []
    if spec.role == "reward_model":
        args += ["--runner", "pooling"]
    if spec.max_batch_size is not None:
        args += ["--max-num-seqs", str(spec.max_batch_size)]
    if spec.prefix_cache_mb == 0:
        args.append("--no-enable-prefix-caching")
    if spec.trust_remote_code:
        args.append("--trust-remote-code")
    if spec.lora:  # adapter-only pushes load as a LoRA adapter (docs/inference.md)
        args += ["--enable-lora", "--max-lora-rank", str(spec.max_lora_rank)]
    env = {**(LORA_ENV if spec.lora else {}), **(spec.env or {})}
    return {
        "model_dir": spec.model,
        "host": spec.host,
        "api_key": spec.api_key,
        "python": spec.python,
        "log_path": spec.log_path,
        "startup_timeout_s": spec.startup_timeout_s,
        "threads": spec.threads,
        "seed": spec.seed,
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
        "env": env or None,
        "extra_args": [*args, *spec.extra_args],
    }
