"""``OpenAIAgent``: train an agent written against the stock ``openai`` client with ``agentrl train``.

Why it exists: many agents already are ``AsyncOpenAI`` loops. Subclass :class:`OpenAIAgent`,
write one ``async rollout(client, task)`` with that client, and the framework records every
request token-exact through the recording proxy (:mod:`agentrl.rollout.proxy`) and returns the
episode as a :class:`~agentrl.types.Trajectory`, scored by the run's reward like any native
agent. The client talks to the proxy in-process (an ASGI transport, no port, no network), and
the proxy talks to the run's policy (the server pool) in token ids.

Guarantees: each episode gets its own proxy session bound to its task (unguessable id, never
shared); the session's sampling is the run's (``inference.*``) unless a request overrides it;
an episode whose client rewrote history (a prefix break) keeps its *last* segment and counts the
dropped ones (``proxy_extra_segments``), so what is trained is always token-exact.

Example (``examples/openai_agent/agent.py``)::

    @register_agent("calc_chat")
    class CalcChat(OpenAIAgent):
        async def rollout(self, client, task):
            messages = [{"role": "user", "content": task.prompt}]
            reply = await client.chat.completions.create(model="policy", messages=messages)
            ...
"""

from __future__ import annotations

import weakref
from abc import abstractmethod
from typing import Any

from agentrl.rollout.proxy import ProxyRecorder, create_proxy_app
from agentrl.types import StopReason, Task, Trajectory
from agents import AgentContext, AgentLoop

__all__ = ["OpenAIAgent"]

_APPS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()
"""policy -> {(tokenizer id, limits, parser) -> proxy app}: one proxy per worker, not per episode."""


def _proxy_app(ctx: AgentContext) -> Any:
    limits = ctx.limits
    key = (
        id(ctx.tokenizer),
        limits.max_response_tokens,
        limits.max_context_tokens,
        type(ctx.parser),
    )
    apps = _APPS.setdefault(ctx.policy, {})
    app = apps.get(key)
    if app is None:
        app = create_proxy_app(
            ctx.policy,
            ctx.tokenizer,
            api_key=None,  # in-process only: the ASGI transport's client is loopback
            parser=ctx.parser,
            default_max_tokens=ctx.sampling.max_tokens,
            max_response_tokens=limits.max_response_tokens,
            max_context_tokens=limits.max_context_tokens,
        )
        apps[key] = app
    return app


class OpenAIAgent(AgentLoop):
    """An agent whose episode is ``rollout(client, task)`` with a stock ``openai.AsyncOpenAI``."""

    model_name = "policy"
    """The ``model`` the client may pass (any name is accepted)."""

    @abstractmethod
    async def rollout(self, client: Any, task: Task) -> StopReason | None:
        """Run the episode with ``client``; return a stop reason, or None for the default
        (what the last generation reported: ``eos``, ``length`` or ``aborted``)."""

    async def run(self, task: Task, ctx: AgentContext) -> Trajectory:
        import httpx
        import openai

        app = _proxy_app(ctx)
        recorder: ProxyRecorder = app.state.recorder
        sid = recorder.open_session(
            task, sampling=ctx.sampling, index=ctx.index, agent=ctx.agent_name
        )
        transport = httpx.ASGITransport(app=app)
        finished = False
        try:
            async with httpx.AsyncClient(transport=transport, timeout=None) as http:
                client = openai.AsyncOpenAI(
                    base_url=f"http://agentrl-proxy/sessions/{sid}/v1",
                    api_key="in-process",
                    http_client=http,  # type: ignore[arg-type]  # openai 3 annotates its vendored httpx2; an httpx client works (tested)
                    max_retries=0,
                )
                stop = await self.rollout(client, task)
            trajs = recorder.finish(sid, uid=ctx.uid, stop_reason=stop)
            finished = True
        finally:
            if not finished:
                recorder.discard(sid)
        if not trajs:
            raise RuntimeError(
                f"{type(self).__name__}.rollout made no chat-completions request through the "
                "client it was given; nothing to train on"
            )
        traj = trajs[-1]
        if len(trajs) > 1:
            traj.metrics["proxy_extra_segments"] = float(len(trajs) - 1)
        return traj
