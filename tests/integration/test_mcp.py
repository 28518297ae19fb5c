"""MCP tool servers, for real: ``tests/mcp_server.py`` (written with the mcp SDK) over stdio and
over streamable HTTP on 127.0.0.1, called through a ToolSet under the run's limits, killed
mid-session, and used in ``agentrl train`` runs (and a broken one stopping the run before any
inference server starts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tools import ToolSet
from tools.mcp import MCPServerError, MCPServerParams, close_mcp_connections, connection, mcp_tools

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SERVER = str(ROOT / "tests" / "mcp_server.py")
STDIO = MCPServerParams(name="calc", command=(sys.executable, SERVER), startup_timeout_s=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_server() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The test server on streamable HTTP at 127.0.0.1 (its URL once it lists its tools)."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, SERVER, "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 120
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, "the MCP test server exited"
            assert time.monotonic() < deadline, "the MCP test server did not listen in 120 s"
            time.sleep(0.2)
        yield proc, url
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _server_children() -> list[psutil.Process]:
    return [
        c
        for c in psutil.Process().children(recursive=True)
        if any("mcp_server.py" in part for part in c.cmdline())
    ]


def test_stdio_tools_run_under_the_toolset_limits() -> None:
    tools = mcp_tools([STDIO])
    assert [t.name for t in tools] == ["add", "shout", "long_text", "sleep", "fail"]
    add = tools[0].schema()["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["required"] == ["a", "b"]
    toolset = ToolSet(tools, timeout_s=2.0, max_output_chars=50)

    async def episode() -> list:
        await connection(STDIO).start()  # the session is up before the timed calls
        async with toolset.episode() as ep:
            out = [
                await ep.call("add", {"a": 2, "b": "3"}),
                await ep.call("long_text", {"n": 500}),
                await ep.call("fail", {"message": "boom"}),
                await ep.call("sleep", {"seconds": 120}),
                await ep.call("add", {"a": 1}),
            ]
        await close_mcp_connections()
        return out

    ok, long, failed, slow, missing = asyncio.run(episode())
    assert ok.content == "5" and not ok.error
    assert long.content.startswith("x" * 50 + "...[truncated 450 chars]")
    # the SDK may hide the exception text ("Error executing tool fail"): the error is what counts
    assert failed.error and failed.content.startswith("error:") and "fail" in failed.content
    assert slow.timed_out and "timed out after 2 s" in slow.content
    assert missing.error and "invalid arguments for 'add': b: Field requi" in missing.content
    m = toolset.metrics()
    assert m["tools/add/calls"] == 2 and m["tools/add/errors"] == 1
    assert m["tools/long_text/truncated"] == 1
    assert m["tools/fail/errors"] == 1
    assert m["tools/sleep/timeouts"] == 1
    assert _server_children() == []  # the session's server process is gone


def test_allow_list_and_prefix_and_unknown_tool() -> None:
    some = MCPServerParams(
        name="calc", command=STDIO.command, tools=("shout",), prefix="calc_", startup_timeout_s=120
    )
    (shout,) = mcp_tools([some])
    assert shout.name == "calc_shout"
    typo = MCPServerParams(name="calc", command=STDIO.command, tools=("ad", "shout"), key="k")
    with pytest.raises(
        MCPServerError, match=r"k\.tools: MCP server 'calc'.*'ad' \(did you mean 'add'\?\)"
    ):
        mcp_tools([typo])


def test_a_server_that_will_not_start_is_named_with_its_stderr() -> None:
    broken = MCPServerParams(
        name="broken",
        command=(
            sys.executable,
            "-c",
            "import sys; print('no such module x', file=sys.stderr); sys.exit(3)",
        ),
        key="tools.mcp[0]",
    )
    with pytest.raises(MCPServerError) as info:
        mcp_tools([broken])
    msg = str(info.value)
    assert msg.startswith("tools.mcp[0]: MCP server 'broken'") and "no such module x" in msg
    assert "runs an MCP server over stdin/stdout" in msg
    missing = MCPServerParams(name="gone", command=("no-such-program-agentrl",))
    with pytest.raises(MCPServerError, match=r"'gone'.*FileNotFoundError"):
        mcp_tools([missing])


def test_killed_stdio_server_answers_an_error_then_reconnects() -> None:
    toolset = ToolSet(mcp_tools([STDIO]), timeout_s=120.0)

    async def episode() -> list:
        await connection(STDIO).start()
        async with toolset.episode() as ep:
            first = await ep.call("add", {"a": 1, "b": 1})
            for child in _server_children():
                child.kill()
            await asyncio.sleep(0.5)
            after = [await ep.call("add", {"a": 2, "b": 2}) for _ in range(2)]
        await close_mcp_connections()
        return [first, *after]

    first, broken, again = asyncio.run(episode())
    assert first.content == "2"
    assert broken.error and "MCP server 'calc'" in broken.content
    assert again.content == "4"  # a new session started the server again
    assert toolset.metrics()["tools/add/errors"] == 1


def test_http_server_tools_and_a_killed_server() -> None:
    with http_server() as (proc, url):
        server = MCPServerParams(name="web", url=url, startup_timeout_s=60)
        toolset = ToolSet(mcp_tools([server]), timeout_s=30.0)

        async def episode() -> list:
            async with toolset.episode() as ep:
                out = [await ep.call("shout", {"text": "hi"})]
                proc.kill()
                proc.wait(timeout=30)
                out += [await ep.call("shout", {"text": "hi"}) for _ in range(3)]
            await close_mcp_connections()
            return out

        ok, *dead = asyncio.run(episode())
    assert ok.content == "HI"
    assert all(r.error and "MCP server 'web'" in r.content for r in dead)
    m = toolset.metrics()
    assert m["tools/shout/calls"] == 4 and m["tools/shout/errors"] == 3
    assert m["tools/shout/timeouts"] == 0  # errors at once, not hangs


# -- through `agentrl train` -------------------------------------------------------------------


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "tests" / "integration" / "mcp_project", project)
    return project


def _train_args(project: Path, tmp_path: Path, servers: list[dict], *more: str) -> list[str]:
    return [
        *(sys.executable, "-m", "agentrl", "train", str(project / "config.yaml"), "--quiet"),
        f"tools.mcp={json.dumps(servers)}",
        f"trainer.output_dir={tmp_path / 'out'}",
        *more,
    ]


def _env(log: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "MCP_AGENT_LOG": str(log),
    }


def _records(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def test_train_with_stdio_mcp_tools(tmp_path: Path) -> None:
    project, log, cwd = _project(tmp_path), tmp_path / "calls.jsonl", tmp_path / "elsewhere"
    cwd.mkdir()
    marker = f"--run-marker={tmp_path}"  # the server ignores it; it finds leftover processes
    servers = [{"name": "calc", "command": [sys.executable, SERVER, marker], "tools": ["add"]}]
    out = subprocess.run(
        _train_args(project, tmp_path, servers),
        cwd=cwd,
        env=_env(log),
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout[out.stdout.index("{") :])
    assert summary["steps"] == 2 and summary["weight_pushes"]["verified"] == 2
    records = _records(log)
    # val before (4) + 2 steps x 4 tasks x 2 samples + val after (4), each one call
    assert len(records) >= 4 + 16
    assert all(r["content"].isdigit() for r in records)  # every call answered by the server
    last = records[-1]["metrics"]
    assert last["tools/add/calls"] >= 1 and last["tools/add/errors"] == 0
    leftovers = [
        p.pid for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])
    ]
    assert leftovers == []  # every stdio server the run started (listing, sessions) has exited


def test_killing_the_http_server_mid_run_gives_counted_errors_not_a_hang(tmp_path: Path) -> None:
    project, log = _project(tmp_path), tmp_path / "calls.jsonl"
    with http_server() as (server, url):
        servers = [{"name": "web", "url": url, "tools": ["add"]}]
        args = _train_args(project, tmp_path, servers, "trainer.total_steps=3")
        run = subprocess.Popen(
            args,
            cwd=tmp_path,
            env=_env(log),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 600
            while len(_records(log)) < 8:  # validation and the first training episodes
                assert run.poll() is None, run.communicate()[1][-4000:]
                assert time.monotonic() < deadline, "no MCP calls within 600 s"
                time.sleep(0.2)
            server.kill()
            stdout, stderr = run.communicate(timeout=600)
        finally:
            if run.poll() is None:
                run.kill()
    assert run.returncode == 0, stderr[-4000:]
    summary = json.loads(stdout[stdout.index("{") :])
    assert summary["steps"] == 3
    records = _records(log)
    errors = [r for r in records if r["content"].startswith("error:")]
    assert errors and all("MCP server 'web'" in r["content"] for r in errors)
    assert records[0]["content"].isdigit()
    # each record's counters are its worker's ToolSet's, taken after the call: every error counted
    assert all(r["metrics"]["tools/add/errors"] >= 1 for r in errors)
    assert all(r["metrics"]["tools/add/timeouts"] == 0 for r in records)  # no call hung


@pytest.mark.parametrize(
    ("server", "expected"),
    [
        (
            {"name": "broken", "command": [sys.executable, "-c", "raise SystemExit(3)"]},
            "tools.mcp[0]: MCP server 'broken'",
        ),
        (
            {"name": "calc", "command": [sys.executable, SERVER], "tools": ["addd"]},
            "tools.mcp[0].tools: MCP server 'calc'",
        ),
    ],
)
def test_a_bad_server_stops_the_run_before_any_inference_server(
    tmp_path: Path, server: dict, expected: str
) -> None:
    project, log = _project(tmp_path), tmp_path / "calls.jsonl"
    out = subprocess.run(
        _train_args(project, tmp_path, [server]),
        cwd=tmp_path,
        env=_env(log),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 2, out.stderr[-4000:]
    assert "nothing was started" in out.stderr and expected in out.stderr
    assert not list((tmp_path / "out").rglob("server-*.log"))  # no inference server started
