"""vLLM backend: start a real vLLM OpenAI server as a subprocess, or attach to a running one.

vLLM lives in its own virtual environment (its torch/transformers pins never meet ours) and we
only talk to it over HTTP, with the same :class:`~agentrl.inference.client.PolicyClient` that
talks to the embedded server. The launcher guarantees:

- the server runs with the control endpoints on (``VLLM_SERVER_DEV_MODE=1``: ``/pause``,
  ``/resume``, ``/is_paused``, ``/abort_requests``, ``/reset_prefix_cache``, ``/collective_rpc``,
  ``/update_weight_version``, ``/weight_info``) and with ``--logprobs-mode processed_logprobs``,
  so returned logprobs follow agentrl's convention (after temperature, and after top-k/top-p
  when those are on; vLLM's default ``raw_logprobs`` ignores temperature);
- :func:`launch_vllm_server` returns only once ``GET /health`` answers 200, with the server's
  stdout and stderr streamed to a log file; a failed start raises with the log's tail;
- ``stop()`` ends the whole process group (the API server and its engine-core workers),
  SIGTERM first, SIGKILL after a timeout, so no vLLM worker outlives its handle;
- ``api_key`` reaches vLLM through ``VLLM_API_KEY`` (never its command line). Note that vLLM
  0.32 checks the key on ``/v1/*`` only: its control endpoints (``/pause``, ``/collective_rpc``,
  ...) answer anyone who reaches the port, so the launcher binds 127.0.0.1 by default and a
  vLLM server must never be exposed beyond a trusted network (docs/operations.md).
- CPU threads: without ``threads`` vLLM keeps its own CPU defaults (it binds its worker's
  OpenMP threads to the usable cores but one, which it keeps for its scheduler); with a share of
  the run's thread plan (:class:`agentrl.threads.ProcessThreads`) the worker runs exactly that
  many OpenMP threads, bound to the share's CPUs when the plan pins, unbound otherwise
  (:func:`vllm_cpu_env`), so vLLM never sizes itself to a machine that other processes of the
  run share. Our own parent's thread variables never leak into vLLM's environment.

The python executable that runs vLLM comes from the ``python`` argument, else the
``AGENTRL_VLLM_PYTHON`` environment variable, else ``.venv-vllm/bin/python`` in the project
root (``make setup-vllm`` creates it). On CPU it is the ``vllm-cpu`` build; on GPUs, plain
``vllm``. Weight updates go through ``/collective_rpc`` ``reload_weights`` from a directory
(CPU and GPU); the NCCL path on GPUs is described in ``docs/inference.md``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from agentrl.inference.handle import ServerHandle, ServerStartError, free_port
from agentrl.lifetime import child_preexec, start_reaper
from agentrl.threads import ENV_CPUS, ENV_NICE, ENV_THREADS, THREAD_ENV_VARS

if TYPE_CHECKING:
    from agentrl.threads import ProcessThreads

__all__ = [
    "VLLMNotAvailableError",
    "VLLMServerHandle",
    "attach_vllm_server",
    "checkpoint_dtype",
    "launch_vllm_server",
    "resolve_vllm_python",
    "vllm_command",
    "vllm_cpu_env",
]

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_PYTHON = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"


class VLLMNotAvailableError(RuntimeError):
    """No python with vLLM installed was found; the message says how to get one."""


def resolve_vllm_python(python: str | Path | None = None) -> Path:
    """The python executable that runs vLLM: ``python``, else ``$AGENTRL_VLLM_PYTHON``, else
    ``.venv-vllm/bin/python`` in the project root. Raises :class:`VLLMNotAvailableError`."""
    source = "argument 'python'"
    if python is None and os.environ.get("AGENTRL_VLLM_PYTHON"):
        python, source = os.environ["AGENTRL_VLLM_PYTHON"], "AGENTRL_VLLM_PYTHON"
    if python is None:
        python, source = DEFAULT_VLLM_PYTHON, "the default .venv-vllm"
    path = Path(python)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise VLLMNotAvailableError(
            f"no vLLM python at {path} (from {source}); run `make setup-vllm` to create "
            ".venv-vllm, or set AGENTRL_VLLM_PYTHON to a python that has vllm installed"
        )
    return path


def vllm_command(
    python: str | Path,
    model_dir: str | Path,
    *,
    host: str,
    port: int,
    served_model_name: str | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    seed: int = 0,
    enforce_eager: bool = True,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line :func:`launch_vllm_server` runs (exposed for docs and debugging)."""
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--logprobs-mode",
        "processed_logprobs",
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        "--disable-uvicorn-access-log",
    ]
    if served_model_name is not None:
        cmd += ["--served-model-name", served_model_name]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if enforce_eager:
        cmd.append("--enforce-eager")
    cmd += list(extra_args)
    return cmd


class VLLMServerHandle(ServerHandle):
    """A :class:`ServerHandle` whose stop/kill reach vLLM's whole process group.

    vLLM's API server forks engine-core worker processes; signalling only the API server's pid
    could leave them running, so the launcher starts vLLM in its own session and this handle
    signals the group.
    """

    reaper: subprocess.Popen[bytes] | None = None
    """The group's reaper (:func:`agentrl.lifetime.start_reaper`): it stops the group if the
    process that launched vLLM dies without stopping it (SIGKILL, or a thread that never
    cleans up), and exits by itself once the server is gone."""

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def _end_reaper(self) -> None:
        if self.reaper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.reaper.wait(timeout=5)  # it sees the server gone within 0.5 s

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait(timeout=30)
        # Workers may linger a moment after the API server exits; make sure they go.
        self._signal_group(signal.SIGKILL)
        self._end_reaper()
        return self.process.returncode

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(timeout=30)
        self._end_reaper()


_VLLM_DTYPES = frozenset({"float32", "float16", "bfloat16", "half", "float"})


def checkpoint_dtype(model_dir: str | Path) -> str:
    """The dtype a model directory's ``config.json`` declares (``"auto"`` when it has none).

    The launcher passes it to vLLM explicitly: vLLM's own ``auto`` serves a float32 checkpoint
    in bfloat16/float16, so its logprobs would no longer match the trainer's float32 ones.
    """
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if isinstance(dtype, str) and dtype in _VLLM_DTYPES else "auto"


def vllm_cpu_env(
    base: Mapping[str, str],
    threads: ProcessThreads | None = None,
    cpu_kvcache_space_gb: int | None = 1,
) -> dict[str, str]:
    """The environment a vLLM server starts with: ``base`` minus our venv and thread settings,
    plus the control endpoints, the KV cache size and (when given) a thread share.

    - The parent's thread variables (``OMP_NUM_THREADS`` ... and ``AGENTRL_THREADS``, which our
      own plan put in the trainer's environment) are dropped: they describe the parent's share.
    - ``threads`` with CPUs (a pinning plan): ``VLLM_CPU_OMP_THREADS_BIND`` lists them, so the
      worker's OpenMP threads bind there (one per CPU).
    - ``threads`` without CPUs: ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``OMP_NUM_THREADS`` =
      the share: that many unbound threads, like every other process of an unpinned plan.
    - ``threads=None``: vLLM's own defaults (``auto`` binding, a core kept for the scheduler).
    Values already in ``base`` for ``VLLM_CPU_*`` win over the share (a user's explicit choice).
    """
    env = {
        k: v
        for k, v in base.items()
        if k not in (*THREAD_ENV_VARS, ENV_THREADS, ENV_CPUS, ENV_NICE)
    }
    # Our own venv must not leak into vLLM's interpreter.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    if cpu_kvcache_space_gb is not None:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_space_gb))
    if threads is not None:
        if threads.cpus is not None:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in threads.cpus))
        else:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        for name in THREAD_ENV_VARS:
            env[name] = str(threads.threads)
    return env


def _log_file(log_path: str | Path | None, port: int) -> Path:
    """``log_path`` (its directory made), or a fresh temporary file named after the port."""
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"vllm-{port}-", suffix=".log")
        os.close(fd)
        log_path = name
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def launch_vllm_server(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    python: str | Path | None = None,
    log_path: str | Path | None = None,
    served_model_name: str | None = None,
    dtype: str | None = None,
    max_model_len: int | None = None,
    seed: int = 0,
    enforce_eager: bool = True,
    cpu_kvcache_space_gb: int | None = 1,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    threads: ProcessThreads | None = None,
    startup_timeout_s: float = 600.0,
    api_key: str | None = None,
) -> VLLMServerHandle:
    """Start ``vllm.entrypoints.openai.api_server`` on ``model_dir`` and wait until healthy.

    ``dtype=None`` serves the checkpoint's own dtype (:func:`checkpoint_dtype`); pass
    ``"auto"`` for vLLM's choice (it downcasts float32 checkpoints). ``cpu_kvcache_space_gb``
    sets ``VLLM_CPU_KVCACHE_SPACE`` (ignored by GPU builds; None keeps vLLM's default). ``enforce_eager`` skips graph capture/compilation (start-up ~50 s on CPU).
    ``threads`` is this server's share of the run's thread plan (None = vLLM's own CPU
    defaults; see :func:`vllm_cpu_env`). ``env`` adds environment variables; ``api_key`` is
    required on vLLM's ``/v1`` routes (``VLLM_API_KEY``) and kept on the handle. Raises
    :class:`VLLMNotAvailableError` when no vLLM python is found, :class:`ServerStartError` when
    the server exits or times out.
    """
    exe = resolve_vllm_python(python)
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"model_dir {model_dir} has no config.json; pass a Hugging Face model directory"
        )
    if dtype is None:
        dtype = checkpoint_dtype(model_dir)
    port = port or free_port(host)
    log_path = _log_file(log_path, port)
    child_env = vllm_cpu_env(os.environ, threads, cpu_kvcache_space_gb)
    child_env.update(env or {})
    if api_key:
        child_env["VLLM_API_KEY"] = api_key

    cmd = vllm_command(
        exe,
        model_dir,
        host=host,
        port=port,
        served_model_name=served_model_name,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        enforce_eager=enforce_eager,
        extra_args=extra_args,
    )
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,  # own process group: stop() reaches the engine workers
            preexec_fn=child_preexec(),
        )
    handle = VLLMServerHandle(process, f"http://{host}:{port}", log_path, api_key=api_key)
    # PR_SET_PDEATHSIG reaches only the API server, and only when launched from the main thread;
    # the engine processes it forks never watch us: a reaper stops the whole group instead.
    handle.reaper = start_reaper(process.pid, group=True)
    try:
        handle.wait_healthy(timeout_s=startup_timeout_s, poll_s=1.0)
    except BaseException:
        handle.stop(timeout_s=5)
        raise
    return handle


def attach_vllm_server(base_url: str, *, timeout_s: float = 10.0) -> str:
    """Check that a vLLM server is running at ``base_url`` with the control endpoints on.

    Returns the normalized base URL (use it with ``PolicyClient`` / ``ServerPool``). Raises
    :class:`ServerStartError` naming what is missing (the server, or ``VLLM_SERVER_DEV_MODE=1``).
    """
    url = base_url.rstrip("/")
    try:
        health = httpx.get(url + "/health", timeout=timeout_s)
        info = httpx.get(url + "/is_paused", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ServerStartError(f"no server answers at {url}: {exc}") from exc
    if health.status_code != 200:
        raise ServerStartError(f"{url}/health answered HTTP {health.status_code}")
    if info.status_code == 404:
        raise ServerStartError(
            f"{url} has no control endpoints (/is_paused is 404); start vLLM with "
            "VLLM_SERVER_DEV_MODE=1 so agentrl can pause it and update its weights"
        )
    return url


if (
    __name__ == "__main__"
):  # pragma: no cover - manual use: python -m agentrl.inference.vllm_backend DIR
    h = launch_vllm_server(sys.argv[1])
    print(h.base_url, h.log_path, flush=True)
    try:
        h.process.wait()
    finally:
        h.stop()
