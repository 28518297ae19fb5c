"""A single-turn taskset written with verifiers (0.4): say the word. Used by the adapter tests."""

import verifiers.v1 as vf

__all__ = ["EchoTaskset"]


class EchoData(vf.TaskData):
    answer: str = ""


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.metric
    async def length(self, trace) -> float:
        return float(len(trace.last_reply))


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        for word in ("alpha", "beta", "gamma", "delta"):
            yield EchoTask(EchoData(prompt=f"Say {word}.", answer=word), self.config.task)
