"""Joining or starting the Ray cluster of a run, independent of the user's ``~/.ray`` state.

Why it exists: Ray 2.5x turns token authentication on by itself. A local ``ray.init()`` writes
``~/.ray/auth_token``; from then on every Ray client on the machine reads that file, and a head
started later without authentication (or with another token) refuses them with
``AuthenticationError`` (the CI gate failed that way after a Ray run by hand). So:

- a cluster this project starts (:func:`start_local` in a run, :func:`head_env` for a
  ``ray start --head`` in tests) is token-authenticated with a fresh token held in the
  environment (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``), which Ray reads before any token
  file: a stale ``~/.ray/auth_token`` is never consulted, and nothing is written there;
- a cluster the user runs (``distributed.ray_address``, ``RAY_ADDRESS``, or the last
  ``ray start --head`` on the machine) is joined with Ray's own settings (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``,
  ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``), and an authentication failure says which of
  them to set (docs/distributed.md, "Authentication");
- readiness is asked with the same environment the cluster was started with
  (:func:`wait_ready`), so it cannot trip over a token the user left behind.

The environment a run sets is put back when it disconnects (:func:`disconnect`).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "AUTH_ENV",
    "RayAuthError",
    "connect",
    "disconnect",
    "head_env",
    "set_auth_env",
    "wait_ready",
]

logger = logging.getLogger(__name__)

AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""Ray's own authentication settings (environment variables), read before ``~/.ray``."""

_saved: dict[str, str | None] | None = None  # the auth environment before start_local set it


class RayAuthError(RuntimeError):
    """The cluster refused this client's Ray token; the message says which setting to fix."""


def set_auth_env(env: Mapping[str, str | None]) -> dict[str, str | None]:
    """Set (or, for None, remove) Ray's auth variables in this process and make Ray read them
    again (Ray caches its config when it is imported); returns what they were before."""
    saved = {k: os.environ.get(k) for k in AUTH_ENV}
    for key in AUTH_ENV:
        value = env.get(key)
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    from ray._raylet import Config  # type: ignore[attr-defined]  # compiled module, no stub

    Config.initialize("")
    return saved


def head_env(token: str | None = None) -> dict[str, str]:
    """The authentication environment of a cluster this project starts: token mode with a
    fresh (or the given) token. Give it to ``ray start --head`` and to every client of that
    cluster; Ray reads ``RAY_AUTH_TOKEN`` before any token file."""
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token or secrets.token_hex(32),
    }


def _auth_help(address: str) -> str:
    mode = os.environ.get("RAY_AUTH_MODE") or "unset"
    source = (
        "RAY_AUTH_TOKEN"
        if os.environ.get("RAY_AUTH_TOKEN")
        else os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    )
    return (
        f"the Ray cluster at {address} refused this client's authentication "
        f"(RAY_AUTH_MODE={mode}, token from {source}). For a token-authenticated cluster set "
        "RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN or a file named by "
        "RAY_AUTH_TOKEN_PATH; for a cluster started without authentication set "
        "RAY_AUTH_MODE=disabled (a stale ~/.ray/auth_token from an earlier local run is the "
        "usual cause). See docs/distributed.md, 'Authentication'."
    )


def _is_auth_error(exc: BaseException) -> bool:
    """Ray wraps a refused token in ``ConnectionError`` <- ``RuntimeError`` whose message holds
    the ``AuthenticationError`` as text: look at the types and the messages of the chain."""
    from ray.exceptions import AuthenticationError

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, AuthenticationError) or "InvalidAuthToken" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _init(address: str | None, runtime_env: Mapping[str, object]) -> None:
    import ray

    try:
        # log_to_driver: the actors' output (the trainer's step lines) reaches this console.
        if address is None:
            ray.init(runtime_env=dict(runtime_env), log_to_driver=True)
        else:
            ray.init(address=address, runtime_env=dict(runtime_env), log_to_driver=True)
    except Exception as exc:
        if _is_auth_error(exc):
            raise RayAuthError(_auth_help(address or "auto")) from exc
        raise


def start_local(runtime_env: Mapping[str, object]) -> None:
    """Start a local cluster with a fresh token held in this process's environment."""
    global _saved
    _saved = set_auth_env(head_env())
    try:
        _init(None, runtime_env)
    except BaseException:
        _restore()
        raise


def _recorded_cluster() -> str | None:
    """The cluster Ray itself joins for ``ray.init()`` with no address: ``RAY_ADDRESS``, else
    the last ``ray start --head`` on this machine (Ray's ``ray_current_cluster`` file). Unlike
    ``address="auto"`` this never picks up another run's private cluster found by ``ps``."""
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env
    from ray._private.utils import read_ray_address  # Ray's own lookup (private, stable)

    return read_ray_address(None)


def connect(address: str | None, runtime_env: Mapping[str, object]) -> bool:
    """Join ``address``; without one, the cluster ``ray.init()`` would join (``RAY_ADDRESS``
    or the last ``ray start``), else start a local one. True if this call connected (the
    caller then calls :func:`disconnect`)."""
    import ray

    if ray.is_initialized():
        return False
    if address is not None:
        _init(address, runtime_env)
        return True
    recorded = _recorded_cluster()
    if recorded is None:
        start_local(runtime_env)
        return True
    try:
        _init(recorded, runtime_env)
    except ConnectionError:
        if os.environ.get("RAY_ADDRESS"):
            raise
        logger.info("the last `ray start` cluster (%s) is gone: starting a local one", recorded)
        start_local(runtime_env)
    return True


def _restore() -> None:
    global _saved
    if _saved is not None:
        set_auth_env(_saved)
    _saved = None


def disconnect() -> None:
    """``ray.shutdown()`` and the authentication environment as it was before the run."""
    import ray

    ray.shutdown()
    _restore()


def wait_ready(
    ray_bin: str | Path,
    address: str,
    env: Mapping[str, str],
    *,
    timeout_s: float = 90.0,
    alive: object = None,
) -> None:
    """Poll ``ray status`` (with the cluster's own ``env``) until the head answers.

    ``alive`` (a callable returning False when the head process has died) ends the wait early.
    Raises ``TimeoutError`` with Ray's last answer.
    """
    deadline = time.monotonic() + timeout_s
    full = {**os.environ, **env}
    last = ""
    while True:
        if callable(alive) and not alive():
            raise RuntimeError(f"the Ray head at {address} exited before it was ready")
        r = subprocess.run(
            [str(ray_bin), "status", f"--address={address}"],
            capture_output=True,
            text=True,
            timeout=30,
            env=full,
        )
        if r.returncode == 0:
            return
        last = (r.stderr or r.stdout)[-1500:]
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the Ray head at {address} was not ready in {timeout_s:.0f} s:\n{last}"
            )
        time.sleep(1)
