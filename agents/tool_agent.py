"""The built-in multi-turn tool agent (``agent: tool_agent``).

Loop: generate -> parse tool calls -> run them (at most ``max_parallel_calls`` at once) ->
append the tool messages as a token delta -> generate again. Stops, with the stop reason:

- ``eos``: the model ended its turn without a tool call (and without a malformed one);
- ``length``: the response-token budget or the context limit is used up, or the turn was cut by
  ``max_tokens`` without a tool call;
- ``max_turns``: ``max_turns`` model turns are done (the last turn's calls are not run: no turn
  would read their results);
- ``tool_stop``: a tool returned ``stop=True`` (its message is still appended);
- ``aborted``: the server aborted the request.

Malformed tool calls and calls to unknown tools are answered with an ``error: ...`` tool message
(counted in ``tool_calls["<invalid>"]`` and the ``tool_calls_malformed`` / ``tool_calls_unknown``
metrics), so the model can correct itself; they never end the episode on their own.
"""

from __future__ import annotations

from agentrl.types import StopReason, Task, Trajectory
from agents.base import AgentContext, AgentLoop, register_agent

__all__ = ["ToolAgent"]


@register_agent("tool_agent")
class ToolAgent(AgentLoop):
    """Generate, call tools, repeat (see the module docstring for the stop rules)."""

    async def run(self, task: Task, ctx: AgentContext) -> Trajectory:
        rec = ctx.start_episode(task.initial_messages(ctx.system_prompt))
        async with ctx.tool_episode() as tools:
            for _turn in range(ctx.limits.max_turns):
                if rec.remaining_budget <= 0:
                    return ctx.finish(StopReason.LENGTH)
                gen = await ctx.generate()
                parsed = ctx.parse(gen)
                if gen.finish_reason == "abort":
                    return ctx.finish(StopReason.ABORTED)
                if rec.truncated:
                    return ctx.finish(StopReason.LENGTH)
                if not parsed.calls and not parsed.errors:
                    return ctx.finish(ctx.stop_reason_for(gen))
                if _turn + 1 >= ctx.limits.max_turns:
                    break
                messages, stop = await ctx.call_tools(tools, parsed)
                ctx.add_messages(messages)
                if rec.truncated:
                    return ctx.finish(StopReason.LENGTH)
                if stop:
                    return ctx.finish(StopReason.TOOL_STOP)
        return ctx.finish(StopReason.MAX_TURNS)
