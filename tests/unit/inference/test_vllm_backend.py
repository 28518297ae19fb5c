"""The vLLM launcher without vLLM: a stand-in "python" records the command line and
environment it was started with, serves /health, and forks a worker like vLLM's engine core.
The real server is exercised in tests/integration/test_vllm.py."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agentrl.inference.handle import ServerStartError
from agentrl.inference.vllm_backend import (
    VLLMNotAvailableError,
    checkpoint_dtype,
    launch_vllm_server,
    resolve_vllm_python,
    vllm_command,
)

FAKE_SERVER = textwrap.dedent(
    """
    import http.server, json, os, subprocess, sys, time
    args = sys.argv[1:]
    out = os.environ["FAKE_VLLM_RECORD"]
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(out, "w") as f:
        json.dump({"argv": args, "env": dict(os.environ), "worker_pid": worker.pid}, f)
    if os.environ.get("FAKE_VLLM_FAIL"):
        print("engine core failed: something vLLM would say", flush=True)
        sys.exit(3)
    port = int(args[args.index("--port") + 1])

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    print("ready", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')  # drop "-m mod"
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"dtype": "float32"}')
    return d


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); treat it as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_launch_sets_dev_mode_and_processed_logprobs_and_stop_reaches_workers(
    fake_python, model_dir, tmp_path, monkeypatch
):
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    handle = launch_vllm_server(
        model_dir,
        python=fake_python,
        log_path=tmp_path / "vllm.log",
        extra_args=["--max-num-seqs", "8"],
        startup_timeout_s=60,
        api_key="vk",
    )
    try:
        assert handle.is_running()
        seen = json.loads(record.read_text())
        argv = seen["argv"]
        # The key travels in the environment, never on the command line (ps shows argv).
        assert seen["env"]["VLLM_API_KEY"] == "vk" and "vk" not in argv
        assert handle.api_key == "vk"
        assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
        assert argv[argv.index("--model") + 1] == str(model_dir)
        assert "--enforce-eager" in argv and argv[-2:] == ["--max-num-seqs", "8"]
        # The checkpoint's dtype, not vLLM's "auto" (which would serve float32 as bfloat16).
        assert argv[argv.index("--dtype") + 1] == "float32"
        assert seen["env"]["VLLM_SERVER_DEV_MODE"] == "1"
        assert seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
        assert "ready" in handle.log_path.read_text()
        worker = seen["worker_pid"]
        assert pid_alive(worker)
    finally:
        handle.stop(timeout_s=5)
    assert not handle.is_running()
    deadline = time.monotonic() + 60  # a hang guard: the worker goes once stop() has run
    while pid_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(worker), "stop() left vLLM's worker process running"


def test_failed_start_raises_with_the_log_tail(fake_python, model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(ServerStartError, match="something vLLM would say"):
        launch_vllm_server(model_dir, python=fake_python, startup_timeout_s=60)


def test_missing_vllm_python_says_to_run_make_setup_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(VLLMNotAvailableError, match="make setup-vllm") as info:
        resolve_vllm_python()
    assert "AGENTRL_VLLM_PYTHON" in str(info.value)


def test_model_dir_without_config_is_rejected(fake_python, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        launch_vllm_server(tmp_path, python=fake_python)


def test_checkpoint_dtype_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_dtype(tmp_path) == "auto"
    assert checkpoint_dtype(tmp_path / "missing") == "auto"


def test_vllm_command_names_the_server_module_and_options():
    cmd = vllm_command(
        "/py", "/m", host="127.0.0.1", port=9, served_model_name="tiny", max_model_len=512
    )
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny"
    assert cmd[cmd.index("--max-model-len") + 1] == "512"


def test_vllm_env_takes_the_plans_share_and_drops_the_parents_threads():
    from agentrl.inference.vllm_backend import vllm_cpu_env
    from agentrl.threads import ProcessThreads

    parent = {"OMP_NUM_THREADS": "1", "AGENTRL_THREADS": "1", "PYTHONPATH": "/ours", "HOME": "/h"}
    own = vllm_cpu_env(parent)  # vLLM's own defaults: nothing of the parent's share leaks
    assert "OMP_NUM_THREADS" not in own and "AGENTRL_THREADS" not in own
    assert "VLLM_CPU_OMP_THREADS_BIND" not in own and "PYTHONPATH" not in own
    assert own["HOME"] == "/h" and own["VLLM_SERVER_DEV_MODE"] == "1"
    unpinned = vllm_cpu_env(parent, ProcessThreads("server0", 2))
    assert unpinned["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert unpinned["OMP_NUM_THREADS"] == "2"
    pinned = vllm_cpu_env(parent, ProcessThreads("server1", 2, cpus=(2, 3)))
    assert pinned["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    # A user's explicit vLLM setting wins over the plan.
    mine = vllm_cpu_env({"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, ProcessThreads("server0", 1))
    assert mine["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
