"""Fixtures for integration tests that need real servers (vLLM, embedded) and a way to report
measured numbers.

vLLM is never skipped silently: when no vLLM python is found (``AGENTRL_VLLM_PYTHON`` or
``.venv-vllm``), the vLLM tests FAIL and say to run ``make setup-vllm``, unless the run sets
``AGENTRL_ALLOW_NO_VLLM=1`` explicitly. One vLLM server is shared by the whole test session
(each start costs about a minute on CPU); tests that change its weights restore them.

Measured numbers (e.g. logprob differences against ``transformers``) go through the
``report_metric`` fixture: they become JUnit properties and are printed in pytest's terminal
summary, with or without ``-s``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def report_metric(
    record_property: Callable[[str, object], None],
) -> Callable[[str, float], None]:
    """``report_metric(name, value)``: record a measured number for the run's summary (a
    JUnit property; ``tests/conftest.py`` prints them, from every xdist worker's reports)."""

    def report(name: str, value: float) -> None:
        record_property(name, float(value))

    return report


def vllm_python_or_fail() -> Path:
    """The vLLM python, or a test failure that says how to get one (skip only when allowed)."""
    from agentrl.inference.vllm_backend import VLLMNotAvailableError, resolve_vllm_python

    try:
        return resolve_vllm_python()
    except VLLMNotAvailableError as exc:
        if os.environ.get("AGENTRL_ALLOW_NO_VLLM") == "1":
            pytest.skip(f"vLLM not installed and AGENTRL_ALLOW_NO_VLLM=1: {exc}")
        pytest.fail(
            f"{exc}\nThe vLLM integration tests need a real vLLM: run `make setup-vllm` "
            "(or set AGENTRL_ALLOW_NO_VLLM=1 to skip them explicitly).",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A real vLLM server (CPU build) on the tiny model, shared by the whole session."""
    from agentrl.inference.vllm_backend import launch_vllm_server

    python = vllm_python_or_fail()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    handle = launch_vllm_server(
        tiny_model_dir,
        python=python,
        log_path=log_path,
        dtype="float32",
        max_model_len=2048,
        startup_timeout_s=900,
    )
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def embedded_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A real embedded server subprocess on the tiny model, shared by the whole session."""
    from agentrl.inference.server import launch_embedded_server

    tmp = tmp_path_factory.mktemp("embedded")
    handle = launch_embedded_server(
        tiny_model_dir,
        log_path=tmp / "server.log",
        request_log=tmp / "requests.jsonl",
        startup_timeout_s=300,
    )
    handle.request_log = tmp / "requests.jsonl"  # type: ignore[attr-defined]  # for tests that read it
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def own_embedded_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """An embedded server of the test module's own (one per module): for tests that change its
    weights or move its version, which the session's shared server keeps as launched."""
    from agentrl.inference.server import launch_embedded_server

    tmp = tmp_path_factory.mktemp("own_embedded")
    with launch_embedded_server(
        tiny_model_dir, log_path=tmp / "server.log", startup_timeout_s=300
    ) as handle:
        yield handle


@pytest.fixture(
    scope="session",
    params=[
        pytest.param("embedded", id="embedded"),
        pytest.param("vllm", id="vllm", marks=pytest.mark.vllm),
    ],
)
def inference_server(request: pytest.FixtureRequest):
    """Each backend in turn (embedded, then vLLM): the same test runs against both."""
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """One Ray head (``ray start --head --block``, 127.0.0.1, a free port, 2 CPUs, its own temp
    dir) for the whole test session, token-authenticated with a token of its own
    (:func:`agentrl.distributed.cluster.head_env`): the test process and every child it starts
    get that token in their environment, so a ``~/.ray/auth_token`` left by an earlier Ray run
    on the machine is never read. The process group is ended at the end of the session."""
    from agentrl.distributed.cluster import AUTH_ENV, head_env, set_auth_env, wait_ready

    ray_bin = Path(sys.executable).parent / "ray"
    assert ray_bin.exists(), f"{ray_bin} is missing: install ray into the venv (pip install ray)"
    port = _free_ray_port()
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a limit
    log = open(Path(tmp) / "head.log", "wb")  # noqa: SIM115 (closed in the finally below)
    auth = head_env()
    env = {k: v for k, v in os.environ.items() if k not in AUTH_ENV} | auth
    proc = subprocess.Popen(
        [
            str(ray_bin),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=2",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={tmp}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    address = f"127.0.0.1:{port}"
    try:
        import ray  # noqa: F401 (fail, not skip, when Ray is missing)

        try:
            wait_ready(ray_bin, address, auth, timeout_s=90, alive=lambda: proc.poll() is None)
        except (TimeoutError, RuntimeError) as exc:
            raise AssertionError(f"{exc}\n{(Path(tmp) / 'head.log').read_text()[-3000:]}") from exc
        saved = set_auth_env(auth)
        try:
            yield address
        finally:
            set_auth_env(saved)
    finally:
        with_pg = os.getpgid(proc.pid) if proc.poll() is None else None
        if with_pg is not None:
            os.killpg(with_pg, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            # Whatever of that session is left (raylet workers) goes too.
            for sig_wait in (5, 0):
                try:
                    os.killpg(with_pg, signal.SIGKILL if sig_wait == 0 else signal.SIGTERM)
                except ProcessLookupError:
                    break
                time.sleep(sig_wait)
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _free_ray_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
