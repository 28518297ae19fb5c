"""The unit-conversion agent: it may convert, and take notes, for up to ``max_turns`` turns."""

from __future__ import annotations

from agents import AgentLoop, register_agent

SYSTEM = (
    "You convert quantities between units. Call the convert tool, write intermediate results "
    "in the notebook if you need them, and end with the answer as \\boxed{number}."
)


@register_agent("units_agent")
class UnitsAgent(AgentLoop):
    """Every turn under the framework's stop policy: calls run, malformed ones are answered."""

    async def run(self, task, ctx):
        ctx.start_episode(task.initial_messages(ctx.system_prompt or SYSTEM))
        async with ctx.tool_episode() as tools:
            while True:
                turn = await ctx.turn(tools)
                if turn.stop is not None:
                    return ctx.finish(turn.stop)
