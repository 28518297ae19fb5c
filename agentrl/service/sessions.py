"""Black-box agents over HTTP: recording-proxy sessions that end as scored trajectories.

Why it exists: an agent in any language, written against any OpenAI client, should be trainable
without changing a line: it gets a ``base_url`` (``/v1/sessions/{id}/v1``) and the service's
API key, and every chat completion it makes is recorded token-exact by the recording proxy
(:class:`agentrl.rollout.proxy.ProxyRecorder`) against the service's inference servers.

Guarantees: a session exists only after ``POST /v1/sessions`` issued its unguessable id, is
bound to the task given there, and is evicted after its idle TTL; ``finish`` scores every
segment with the service's reward manager against that task and returns the trajectories; a
segment whose reward failed is reported under ``dropped`` (never returned as a 0.0 reward).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentrl.rollout.proxy import ChatCompletionRequest, ProxyError, ProxyRecorder
from agentrl.service.models import (
    SessionFinishResponse,
    SessionInfo,
    SessionOpenRequest,
)
from agentrl.types import SamplingParams, StopReason

__all__ = ["SessionService"]


class SessionService:
    """Sessions of the rollout service (module docstring)."""

    def __init__(
        self,
        serving: Any,
        cfg: Any,
        *,
        session_ttl_s: float = 3600.0,
        max_sessions: int = 10_000,
    ) -> None:
        inf = cfg.inference
        self.serving = serving
        self.base_sampling = SamplingParams(
            max_tokens=inf.max_tokens_per_turn,
            temperature=inf.temperature,
            top_p=inf.top_p,
            top_k=inf.top_k,
        )
        self.recorder = ProxyRecorder(
            serving.pool,
            serving.tokenizer,
            parser=cfg.agent.tool_call_format,
            model_name=serving.model_dir.name,
            default_max_tokens=inf.max_tokens_per_turn,
            max_response_tokens=cfg.agent.max_response_tokens,
            default_sampling=self.base_sampling,
            session_ttl_s=session_ttl_s,
            max_sessions=max_sessions,
        )
        self.counts = {"opened": 0, "finished": 0, "reward_errors": 0}

    def open(self, req: SessionOpenRequest) -> SessionInfo:
        """Open a session bound to ``req.task`` (its data source must have a reward)."""
        try:
            self.serving.rewards.reward_fn_for(req.task.data_source)
        except ValueError as exc:
            raise ProxyError(400, str(exc), "task.data_source") from None
        overrides = req.sampling.model_dump(exclude_none=True)
        sampling = self.base_sampling.model_copy(update=overrides)
        sid = self.recorder.open_session(req.task, ttl_s=req.ttl_s, sampling=sampling)
        self.counts["opened"] += 1
        return self.info(sid)

    def info(self, sid: str) -> SessionInfo:
        """The session's URL, task, expiry and how many turns and segments it recorded."""
        data = self.recorder.session_info(sid)
        return SessionInfo(
            id=sid,
            base_url=f"/v1/sessions/{sid}/v1",
            task_id=data["task_id"] or "",
            expires_in_s=data["expires_in_s"],
            turns=data["turns"],
            segments=data["segments"],
        )

    async def chat(self, sid: str, req: ChatCompletionRequest) -> dict[str, Any]:
        """One recorded chat completion of session ``sid``."""
        return await self.recorder.chat(sid, req)

    def models(self, sid: str) -> dict[str, Any]:
        """The one model the session serves (404 for an unknown session)."""
        self.recorder.task_of(sid)  # 404 for an unknown session
        return {
            "object": "list",
            "data": [
                {
                    "id": self.recorder.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "agentrl",
                }
            ],
        }

    async def finish(self, sid: str, stop_reason: StopReason | None) -> SessionFinishResponse:
        """End the session: its trajectories scored (a failed reward is a listed drop)."""
        task = self.recorder.task_of(sid)
        assert task is not None  # service sessions are always opened with a task
        try:
            trajs = self.recorder.finish(sid, stop_reason=stop_reason)
        except KeyError as exc:
            raise ProxyError(404, str(exc.args[0]), "session_id") from None
        scored = await asyncio.gather(
            *(self.serving.rewards.score(t, task) for t in trajs), return_exceptions=True
        )
        out: list[dict[str, Any]] = []
        dropped: list[dict[str, Any]] = []
        for i, traj in enumerate(scored):
            if isinstance(traj, asyncio.CancelledError):
                raise traj
            # A failed reward raises (RewardError, counted by the reward manager): a drop.
            error = str(traj) if isinstance(traj, BaseException) else traj.reward_info.get("error")
            if error or isinstance(traj, BaseException):
                self.counts["reward_errors"] += 1
                dropped.append({"segment": i, "reason": "reward_error", "error": str(error)})
            else:
                out.append(traj.model_dump(mode="json"))  # type: ignore[union-attr]  # not an exception here
        self.counts["finished"] += 1
        return SessionFinishResponse(trajectories=out, dropped=dropped)

    def discard(self, sid: str) -> None:
        """Forget the session without scoring it (404 when unknown)."""
        if not self.recorder.discard(sid):
            raise ProxyError(404, "unknown or expired session id", "session_id")

    def stats(self) -> dict[str, float]:
        """Session and proxy counters for ``/v1/status``."""
        m = self.recorder.metrics()
        return {
            "sessions_open": m["proxy/open_sessions"],
            "sessions_evicted": m["proxy/evicted"],
            "proxy_requests": m["proxy/requests"],
            "proxy_errors": m["proxy/errors"],
            **{f"sessions_{k}": float(v) for k, v in self.counts.items()},
        }
