"""A tool taskset written with verifiers (0.4): add two numbers with the `add` tool of an MCP
Toolset (served by verifiers per rollout). Used by the adapter tests."""

import verifiers.v1 as vf

__all__ = ["CalcTaskset"]


class Calc(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # tool names as they are

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class CalcData(vf.TaskData):
    answer: str = ""


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calc(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for a, b in ((2, 3), (4, 5)):
            yield CalcTask(
                CalcData(prompt=f"What is {a} + {b}?", answer=str(a + b)), self.config.task
            )


if __name__ == "__main__":
    Calc.run()
