"""A safe arithmetic calculator tool: parsed with ``ast``, evaluated node by node, never ``eval``.

Why it exists: math agents need exact arithmetic, and handing model-written text to ``eval``
is remote code execution. This evaluator walks the syntax tree and accepts only numbers and
the operators ``+ - * / // % **`` (unary and binary) with parentheses.

Guarantees:

- no names, calls, attributes, subscripts, comprehensions or strings are ever evaluated:
  anything but the allowed nodes is an error naming the construct;
- work is bounded: the expression length (``max_length``), the exponent
  (``|exponent| <= max_exponent``), the size of integer results (``max_int_digits``) and the
  nesting depth are capped, so ``9**9**9`` fails fast instead of hanging the worker;
- integer division that is exact stays an exact integer (``10**20 / 10``); integral results
  print as integers (``6/3`` -> ``2``), other floats with ``repr``
  (shortest round-trip form); division by zero and overflow become ``error: ...`` messages.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from tools.base import Tool, ToolResult

__all__ = [
    "Calculator",
    "CalculatorError",
    "calculator",
    "evaluate",
    "format_number",
    "make_calculator",
]


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message says why."""


_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_SYMBOL = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}


def evaluate(
    expression: str,
    *,
    max_length: int = 1000,
    max_exponent: int = 10_000,
    max_int_digits: int = 4000,
    max_depth: int = 100,
) -> int | float:
    """Evaluate an arithmetic expression safely; raise :class:`CalculatorError` otherwise."""
    tree = _parse(expression, max_length)
    evaluator = _Evaluator(
        max_exponent=max_exponent, max_int_digits=max_int_digits, max_depth=max_depth
    )
    try:
        return evaluator.ev(tree, 0)
    except RecursionError:
        raise CalculatorError(f"expression nests deeper than {max_depth} levels") from None


def _parse(expression: str, max_length: int) -> ast.Expression:
    """The syntax tree of ``expression`` after normalizing ``^ × ÷`` (nothing evaluated yet)."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    expr = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not expr:
        raise CalculatorError("empty expression")
    if len(expr) > max_length:
        raise CalculatorError(
            f"expression is {len(expr)} characters long; the limit is {max_length}"
        )
    try:
        return ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"invalid syntax at column {exc.offset}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"cannot parse expression: {exc}") from None


class _Evaluator:
    """Walks an arithmetic syntax tree node by node under the limits of one :func:`evaluate` call.

    ``ev`` is the only recursive method (one Python frame per nesting level, so the depth limit,
    not the interpreter's recursion limit, is what stops deep expressions).
    """

    def __init__(self, *, max_exponent: int, max_int_digits: int, max_depth: int) -> None:
        self.max_exponent = max_exponent
        self.max_int_digits = max_int_digits
        self.max_depth = max_depth
        self.max_bits = int(max_int_digits * math.log2(10)) + 1

    def ev(self, node: ast.AST, depth: int) -> int | float:
        """The value of ``node``, nested ``depth`` levels below the root."""
        if depth > self.max_depth:
            raise CalculatorError(f"expression nests deeper than {self.max_depth} levels")
        if isinstance(node, ast.Expression):
            return self.ev(node.body, depth + 1)
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CalculatorError(f"only numbers are allowed, got {v!r}")
            return self.check_size(v)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.ev(node.operand, depth + 1))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left = self.ev(node.left, depth + 1)
            right = self.ev(node.right, depth + 1)
            return self.binary(node.op, left, right)
        if isinstance(node, (ast.BinOp, ast.UnaryOp)):
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed")
        raise CalculatorError(
            f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses"
        )

    def binary(self, op: ast.operator, left: int | float, right: int | float) -> int | float:
        """``left op right``, refused before computing when the result would be too large."""
        self.check_operands(op, left, right)
        if (
            isinstance(op, ast.Div)
            and isinstance(left, int)
            and isinstance(right, int)
            and right != 0
            and left % right == 0
        ):
            return left // right  # exact: keep integers exact (10**20 / 10 stays an int)
        try:
            result = _BINOPS[type(op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("numeric overflow (result too large for a float)") from None
        if isinstance(result, complex):
            raise CalculatorError(
                "result is a complex number (a negative number to a fractional power)"
            )
        return self.check_size(result)

    def check_operands(self, op: ast.operator, left: int | float, right: int | float) -> None:
        """Refuse a power or product whose exponent or integer result exceeds the limits."""
        too_many_digits = f"result has more than {self.max_int_digits} digits"
        if isinstance(op, ast.Pow):
            if abs(right) > self.max_exponent:
                raise CalculatorError(
                    f"exponent {format_number(right)} is too large (limit {self.max_exponent})"
                )
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and right > 0
                and abs(left) > 1
                and right * math.log2(abs(left)) > self.max_bits
            ):
                raise CalculatorError(too_many_digits)
        if (
            isinstance(op, ast.Mult)
            and isinstance(left, int)
            and isinstance(right, int)
            and left.bit_length() + right.bit_length() > self.max_bits + 1
        ):
            raise CalculatorError(too_many_digits)

    def check_size(self, value: int | float) -> int | float:
        """``value`` itself, or an error when it is too long an integer, NaN or infinite."""
        if isinstance(value, int) and value.bit_length() > self.max_bits:
            raise CalculatorError(f"result has more than {self.max_int_digits} digits")
        if isinstance(value, float) and math.isnan(value):
            raise CalculatorError("result is not a number")
        if isinstance(value, float) and math.isinf(value):
            raise CalculatorError("numeric overflow (result too large for a float)")
        return value


def format_number(value: int | float) -> str:
    """``2`` for ints and integral floats that are exactly representable, else ``repr``."""
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    expression: str = Field(description='The expression, e.g. "(3 + 4) * 2".')


class Calculator(Tool):
    """``calculator(expression)``: exact arithmetic with bounded work (see :func:`evaluate`).

    Args:
        max_length: Longest expression accepted, in characters.
        max_exponent: Largest ``|exponent|`` of ``**``.
        max_int_digits: Most decimal digits of an integer result.
        name: Tool name the model sees.
    """

    description = "Exact arithmetic: numbers, ( ), + - * / // % ** (^ is power)."
    arguments_model: ClassVar[type[BaseModel] | None] = _Args

    def __init__(
        self,
        *,
        max_length: int = 1000,
        max_exponent: int = 10_000,
        max_int_digits: int = 4000,
        name: str = "calculator",
    ) -> None:
        self.name = name
        self.max_length = max_length
        self.max_exponent = max_exponent
        self.max_int_digits = max_int_digits

    def evaluate(self, expression: str) -> int | float:
        """:func:`evaluate` with this tool's limits."""
        return evaluate(
            expression,
            max_length=self.max_length,
            max_exponent=self.max_exponent,
            max_int_digits=self.max_int_digits,
        )

    # Evaluation is microseconds of CPU: it runs inline on the event loop, not in a thread.
    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        """The value of ``arguments["expression"]``, or an ``error: ...`` result saying why not."""
        try:
            value = self.evaluate(arguments["expression"])
        except CalculatorError as exc:
            return ToolResult(content=f"error: {exc}", error=True)
        return ToolResult(content=format_number(value))


def make_calculator(
    *,
    max_length: int = 1000,
    max_exponent: int = 10_000,
    max_int_digits: int = 4000,
    name: str = "calculator",
) -> Calculator:
    """A calculator tool with the given limits (same as ``Calculator(...)``)."""
    return Calculator(
        max_length=max_length, max_exponent=max_exponent, max_int_digits=max_int_digits, name=name
    )


calculator = Calculator()
"""The default calculator tool (also ``get_tool("calculator")``)."""
