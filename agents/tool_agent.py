"""The built-in multi-turn tool agent (``agent: tool_agent``).

Loop: generate -> parse tool calls -> run them (at most ``max_parallel_calls`` at once) ->
append the tool messages as a token delta -> generate again. Stops, with the stop reason:

- ``eos``: the model ended its turn without a tool call (and without a malformed one);
- ``length``: the response-token budget or the context limit is used up, or the turn was cut by
  ``max_tokens`` without a tool call;
- ``max_turns``: ``max_turns`` model turns are done (the last turn's calls are not run: no turn
  would read their results; they are counted as ``tool_calls_unrun``, malformed ones answered);
- ``tool_stop``: a tool returned ``stop=True`` (its message is still appended);
- ``aborted``: the server aborted the request.

Malformed tool calls and calls to unknown tools are answered with an ``error: ...`` tool message
(counted in ``tool_calls["<invalid>"]`` and the ``tool_calls_malformed`` / ``tool_calls_unknown``
metrics), so the model can correct itself; they never end the episode on their own. The loop
itself is :meth:`agents.base.AgentContext.turn`, the stop policy every agent shares.
"""

from __future__ import annotations

from agentrl.types import Task, Trajectory
from agents.base import AgentContext, AgentLoop, register_agent

__all__ = ["ToolAgent"]


@register_agent("tool_agent")
class ToolAgent(AgentLoop):
    """Generate, call tools, repeat, under the framework's stop policy (``AgentContext.turn``)."""

    async def run(self, task: Task, ctx: AgentContext) -> Trajectory:
        """Turns of generate + tool calls until the stop policy ends the episode."""
        ctx.start_episode(task.initial_messages(ctx.system_prompt))
        async with ctx.tool_episode() as tools:
            while True:
                turn = await ctx.turn(tools)
                if turn.stop is not None:
                    return ctx.finish(turn.stop)
