"""What ``agentrl train`` prints at the end, and when a finished run still counts as failed.

Why it exists: a run that ends is not a run that worked. The summary lists validation and
weight pushes next to the run's drops and errors by reason (rewards, agents, workers, tools,
stale groups, prompts over the limit), so a 25 % reward-failure rate is on the screen, and
:func:`failure_check` turns a failure share above ``trainer.max_failed_episode_share`` into a
non-zero exit status.

An episode **failed** when its reward raised (``rollout/dropped/reward_error``), its agent raised
(``rollout/dropped/agent_error``) or its worker failed for good (``rollout/worker_errors`` less
the re-dispatched ones). Drops by design (a stale group, a uniform-reward group under dynamic
sampling, a prompt over ``data.max_prompt_tokens`` with ``overlong_prompts: drop``, an episode
cancelled at shutdown) are listed but are not failures.
"""

from __future__ import annotations

from typing import Any

__all__ = ["drops_and_errors", "failed_share", "failure_check", "summary"]


def _n(counts: dict[str, float], key: str) -> int:
    return int(counts.get(key, 0.0))


def drops_and_errors(counts: dict[str, float]) -> dict[str, Any]:
    """The run's episode outcomes by reason, from :attr:`TrainResult.episodes`."""
    return {
        "episodes": {
            "admitted": _n(counts, "rollout/admitted"),
            "finished": _n(counts, "rollout/finished"),
            # ended without a trajectory, whatever the reason (each counted below)
            "without_trajectory": _n(counts, "rollout/dropped"),
            "trained": _n(counts, "async/consumed_total"),
        },
        "failed": {
            "rewards": _n(counts, "rollout/dropped/reward_error"),
            "agents": _n(counts, "rollout/dropped/agent_error"),
            "workers": _n(counts, "rollout/worker_errors") - _n(counts, "rollout/redispatched"),
        },
        "dropped": {
            "stale": _n(counts, "async/dropped_stale_total"),
            "prompt_too_long": _n(counts, "rollout/dropped/prompt_too_long"),
            "uniform_reward": _n(counts, "async/dropped_uniform_reward_total"),
            "incomplete_group": _n(counts, "async/dropped_incomplete_group_total"),
            "cancelled_at_shutdown": _n(counts, "rollout/cancelled"),
        },
        "agent_timeouts": _n(counts, "rollout/timeouts"),
    }


def failed_share(counts: dict[str, float]) -> tuple[int, int]:
    """(failed episodes, episodes that ended) of a run (the module docstring's definition)."""
    failed = sum(drops_and_errors(counts)["failed"].values())
    ended = _n(counts, "rollout/admitted") - _n(counts, "rollout/cancelled")
    ended -= _n(counts, "rollout/running")
    return failed, max(ended, 0)


def failure_check(result: Any, max_share: float) -> str | None:
    """Why a finished run failed (more than ``max_share`` of its ended episodes failed), or
    None; the message names the counts and the config key."""
    failed, ended = failed_share(result.episodes)
    if not ended or failed / ended <= max_share:
        return None
    reasons = drops_and_errors(result.episodes)["failed"]
    detail = ", ".join(f"{k} {v}" for k, v in reasons.items() if v)
    return (
        f"{failed} of {ended} episodes failed ({100 * failed / ended:.0f} %: {detail}), more than "
        f"trainer.max_failed_episode_share={max_share:g}; see the warnings above for the first "
        "errors, or raise trainer.max_failed_episode_share to accept them"
    )


def _servers(history: dict[str, list[tuple[int, float]]]) -> dict[str, int]:
    """The run's own servers: ejected, restarted and rejoined since the start (the last
    ``servers/*`` values; zeros when nothing watched them)."""
    last = {k: int(v[-1][1]) for k, v in history.items() if k.startswith("servers/") and v}
    return {k: last.get(f"servers/{k}", 0) for k in ("ejected", "restarts", "rejoined", "failed")}


def summary(result: Any) -> dict[str, Any]:
    """What ``agentrl train`` prints: steps, validation, weight pushes, the servers that died
    and came back, drops and errors by reason, where the run is."""
    diffs = [d for _, d in result.history.get("weight_sync/verify_max_abs_diff", [])]
    failed = [f for _, f in result.history.get("weight_sync/failed_servers", [])]
    return {
        "steps": result.steps,
        "version": result.version,
        "val_before": result.val_before,
        "val_after": result.val_after,
        "weight_pushes": {
            "verified": len(diffs),
            "failed_servers": sum(failed),
            "max_abs_diff": max(diffs) if diffs else None,
        },
        **drops_and_errors(getattr(result, "episodes", {}) or {}),
        "servers": _servers(result.history),
        "wall_time_s": round(result.wall_time_s, 1),
        "output_dir": result.output_dir,
        "mlflow": result.run_location,
    }
