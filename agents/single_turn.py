"""The built-in single-turn agent (``agent: single_turn``): one generation, no tools.

Stop reason: ``eos`` when the model ended its turn, ``length`` when ``max_tokens`` or a budget
cut it, ``aborted`` when the server aborted the request.
"""

from __future__ import annotations

from agentrl.types import StopReason, Task, Trajectory
from agents.base import AgentContext, AgentLoop, register_agent

__all__ = ["SingleTurnAgent"]


@register_agent("single_turn")
class SingleTurnAgent(AgentLoop):
    """Answer the prompt in one model turn."""

    async def run(self, task: Task, ctx: AgentContext) -> Trajectory:
        """One generation; stop reason from it (``length`` when the budget cut it)."""
        rec = ctx.start_episode(task.initial_messages(ctx.system_prompt), tools=[])
        gen = await ctx.generate()
        ctx.parse(gen)
        if rec.truncated:
            return ctx.finish(StopReason.LENGTH)
        return ctx.finish(ctx.stop_reason_for(gen))
