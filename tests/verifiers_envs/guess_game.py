"""A multi-turn game written with verifiers (0.4): guess the hidden number; the env answers
"higher" / "lower" until the guess is right or the guesses run out. Used by the adapter tests."""

import re

import verifiers.v1 as vf

__all__ = ["GuessEnv", "GuessTaskset"]


class GuessData(vf.TaskData):
    target: int = 0


class GuessTasksetConfig(vf.TasksetConfig):
    size: int = 6
    """How many games (targets 1..size)."""


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def solved(self, task, trace) -> float:
        return float(_guess(trace.last_reply) == task.target)

    @vf.reward(weight=0.0)
    async def brevity(self, trace) -> float:
        return 1.0 / max(1, len(trace.assistant_messages))


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    def load(self):
        for t in range(1, self.config.size + 1):
            yield GuessTask(GuessData(prompt="Guess my number (1-9).", target=t), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    guesses: int = 3


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as game:
            segment = await game.turn()
            for _ in range(self.config.guesses - 1):
                guess = _guess(segment.last_reply)
                if guess == task.data.target:
                    return
                segment = await game.turn("higher" if (guess or 0) < task.data.target else "lower")


def _guess(text: str) -> int | None:
    found = re.findall(r"\d+", text or "")
    return int(found[-1]) if found else None
