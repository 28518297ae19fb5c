"""The secret-number game: each task hides a number; `probe` says higher or lower."""

from __future__ import annotations

from agents import Environment, register_environment
from tools import ToolResult, tool


@register_environment("secret_number")
class SecretNumber(Environment):
    """One episode: the task's hidden `target`, the probes so far, whether it was found."""

    def __init__(self, task):
        self.target = int(task.extra["target"])
        self.probes = 0
        self.found = False

    @tool
    def probe(self, x: int) -> ToolResult:
        """Compare a guess with the secret number.

        Args:
            x: Your guess.
        """
        self.probes += 1
        if x == self.target:
            self.found = True
            return ToolResult(content="correct", stop=True)
        return ToolResult(content="higher" if x < self.target else "lower")

    @staticmethod
    def reward(state, task):
        """1 for finding the number, minus 0.05 per probe beyond the first; 0 if not found."""
        score = max(0.0, 1.0 - 0.05 * (state["probes"] - 1)) if state["found"] else 0.0
        return {"score": score, "correct": state["found"], "probes": state["probes"]}
