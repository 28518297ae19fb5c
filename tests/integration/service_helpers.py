"""Start real embedded servers and real ``agentrl serve`` subprocesses for the service tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "checkpoints" / "calculator-sft"
API_KEY = "test-key-0123456789"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "AGENTRL_THREADS": "1"}


def start_inference_servers(tmp: Path, n: int) -> list[Any]:
    """``n`` embedded servers on the calculator warm start, each with a request log."""
    from agentrl.inference.server import launch_embedded_server

    handles = []
    for i in range(n):
        handles.append(
            launch_embedded_server(
                CHECKPOINT,
                log_path=tmp / f"server-{i}.log",
                request_log=tmp / f"requests-{i}.jsonl",
                extra_args=["--seed", str(i)],
                env=ONE_THREAD,
                startup_timeout_s=300,
            )
        )
    return handles


def write_config(tmp: Path, urls: list[str], **inference: Any) -> Path:
    """The quickstart's agent, tools and rewards over external (test-owned) servers."""
    cfg = {
        "kind": "rl",
        "model": {"path": str(CHECKPOINT), "dtype": "float32"},
        "data": {
            "generator": "calculator",
            "generator_kwargs": {"min_digits": 2, "max_digits": 3},
            "generator_train_size": 256,
            "generator_val_size": 32,
        },
        "agent": {
            "max_turns": 3,
            "max_response_tokens": 256,
            "system_prompt": "Use the calculator tool for arithmetic. Answer with the result as \\boxed{N}.",
            "episode_timeout_s": 60,
        },
        "tools": {"enabled": ["calculator"], "timeout_s": 5, "max_output_chars": 200},
        "reward": {"sources": {"calculator": "calculator"}, "default": None},
        "inference": {
            "backend": "external",
            "urls": urls,
            "max_tokens_per_turn": 48,
            "health_check_interval_s": 1.0,
            "max_retries": 3,
            **inference,
        },
        "rollout": {"max_concurrency": 32},
        "trainer": {"output_dir": str(tmp / "out")},
        "checkpoint": {"shared_dir": str(tmp / "weights")},
        "tracking": {"enabled": False},
    }
    path = tmp / "service.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class ServiceProcess:
    """``python -m agentrl serve`` as a subprocess, with its log and URL."""

    def __init__(self, config: Path, port: int, store: Path, log: Path, *extra: str) -> None:
        self.args = [
            sys.executable,
            "-m",
            "agentrl",
            "serve",
            str(config),
            "--port",
            str(port),
            "--api-key",
            API_KEY,
            "--store",
            str(store),
            "--heartbeat-s",
            "1",
            *extra,
        ]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0) -> ServiceProcess:
        env = dict(os.environ, **ONE_THREAD, PYTHONUNBUFFERED="1")
        with self.log.open("ab") as f:
            self.proc = subprocess.Popen(self.args, stdout=f, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agentrl serve exited: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"agentrl serve not healthy: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def running_service(
    config: Path, tmp: Path, *extra: str, name: str = "svc"
) -> Iterator[ServiceProcess]:
    from agentrl.inference.handle import free_port

    svc = ServiceProcess(config, free_port(), tmp / f"{name}.sqlite", tmp / f"{name}.log", *extra)
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()
