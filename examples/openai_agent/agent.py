"""A black-box agent: plain ``openai`` client code, trained by agentrl through its proxy.

Nothing here knows about tokens: the framework records every request token-exact and scores
the episode with ``reward.py``. The same ``solve`` function runs unchanged against any
OpenAI-compatible endpoint (``AsyncOpenAI(base_url=...)``).
"""

from __future__ import annotations

import ast
import json
import operator

from agentrl.rollout.openai_agent import OpenAIAgent
from agents import register_agent

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12+3)*4"}},
            "required": ["expression"],
        },
    },
}
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculate(expression: str) -> str:
    """The agent's own tool: arithmetic only, no eval."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers and + - * / ( )")

    try:
        return f"{value(ast.parse(expression, mode='eval').body):g}"
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


async def solve(client, question: str, *, max_turns: int = 3) -> list[dict]:
    """The agent itself: ask, run the calculator when asked to, stop at a plain answer."""
    messages: list[dict] = [
        {"role": "system", "content": "Use the calculate tool, then answer as \\boxed{N}."},
        {"role": "user", "content": question},
    ]
    for _ in range(max_turns):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR], max_tokens=48
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = calculate(str(args.get("expression", "")))
            except (json.JSONDecodeError, AttributeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages


@register_agent("calc_chat")
class CalcChat(OpenAIAgent):
    """``solve`` run through the framework's recording proxy."""

    async def rollout(self, client, task):
        await solve(client, task.prompt)
        return None  # the stop reason of the last generation
