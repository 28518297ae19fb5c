"""Ray authentication does not depend on ``~/.ray`` (issue 27): a stale ``auth_token`` there
neither breaks a cluster agentrl starts nor the session's test cluster, and a refused token is a
clear :class:`RayAuthError`, not a hang or Ray's raw traceback.

Each case runs in a child process with its own ``HOME`` holding a stale token, as on a machine
where Ray was once run by hand."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentrl.distributed.cluster import AUTH_ENV

pytestmark = [pytest.mark.integration, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]


def _child(code: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (home / ".ray").mkdir(parents=True, exist_ok=True)
    (home / ".ray" / "auth_token").write_text("stale-token-from-an-earlier-run\n")
    clean = {k: v for k, v in os.environ.items() if k not in AUTH_ENV}
    clean.update(HOME=str(home), PYTHONPATH=str(ROOT), **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=clean,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_a_cluster_agentrl_starts_ignores_a_stale_token(ray_cluster: str, tmp_path: Path) -> None:
    """With another cluster running on the machine (the session's, as in CI), agentrl starts
    its own instead of joining one it found by ``ps`` with the stale token (CI failed so)."""
    r = _child(
        """
        import os, ray
        from agentrl.distributed.cluster import connect, disconnect
        assert connect(None, {})
        print("resources", ray.cluster_resources().get("CPU"))
        print("gcs", ray.get_runtime_context().gcs_address)
        disconnect()
        print("after", os.environ.get("RAY_AUTH_MODE"), os.environ.get("RAY_AUTH_TOKEN"))
        """,
        tmp_path,
        RAY_ADDRESS="",  # never join a cluster of the machine by accident
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resources" in r.stdout and "after None None" in r.stdout
    assert f"gcs {ray_cluster}" not in r.stdout, r.stdout
    # The user's file is left as it was: nothing is written to ~/.ray.
    assert (tmp_path / ".ray" / "auth_token").read_text() == "stale-token-from-an-earlier-run\n"


def test_the_session_cluster_answers_with_its_token_despite_a_stale_file(
    ray_cluster: str, tmp_path: Path
) -> None:
    r = _child(
        f"""
        import ray
        from agentrl.distributed.cluster import connect, disconnect
        assert connect({ray_cluster!r}, {{}})
        print("nodes", len(ray.nodes()))
        disconnect()
        """,
        tmp_path,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=os.environ["RAY_AUTH_TOKEN"],
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "nodes 1" in r.stdout


def test_a_refused_token_is_a_clear_error(ray_cluster: str, tmp_path: Path) -> None:
    r = _child(
        f"""
        from agentrl.distributed.cluster import RayAuthError, connect
        try:
            connect({ray_cluster!r}, {{}})
        except RayAuthError as exc:
            print("RayAuthError:", exc)
        """,
        tmp_path,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN="not-the-cluster-token",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RayAuthError:" in r.stdout, r.stdout + r.stderr[-2000:]
    for hint in ("RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "disabled"):
        assert hint in r.stdout
