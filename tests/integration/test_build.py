"""The builder's exit stack: any failure after the first server starts stops every server."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from agentrl.config import load_config
from agentrl.serving import ServerHandle, ServerSpec, launcher
from agentrl.training.trainer import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def _servers() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "serve-model" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _gone(deadline_s: float = 20.0) -> bool:
    end = time.monotonic() + deadline_s
    while _servers():
        if time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


def _cfg(tiny_model_dir: Path, out: Path, *overrides: str):
    return load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"trainer.output_dir={out}",
            "inference.num_servers=2",
            "tracking.enabled=false",
            *overrides,
        ],
    )


def test_a_model_that_fails_to_load_while_servers_start_stops_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert _servers() == []
    with pytest.raises(Exception, match=r"(?i)cuda"):
        Trainer(_cfg(tiny_model_dir, tmp_path, "trainer.device=cuda")).run_sync()
    assert _gone(), "a server outlived the failed build"


def test_a_second_server_that_fails_to_start_stops_the_first(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launch = launcher.launch
    started: list[int] = []

    def flaky(spec: ServerSpec) -> ServerHandle:
        if spec.log_path is not None and spec.log_path.name == "server-1.log":
            while not started:  # the first server is up, then this one fails
                time.sleep(0.1)
            raise RuntimeError("server 1 failed its health check")
        handle = launch(spec)
        started.append(handle.pid)
        return handle

    monkeypatch.setattr(launcher, "launch", flaky)
    with pytest.raises(RuntimeError, match="server 1 failed"):
        Trainer(_cfg(tiny_model_dir, tmp_path)).run_sync()
    assert started and _gone(), "the first server outlived the failed start"
    assert (
        not psutil.pid_exists(started[0])
        or psutil.Process(started[0]).status() == psutil.STATUS_ZOMBIE
    )
