"""The calculator: exact arithmetic through ast, no eval, bounded work."""

from __future__ import annotations

import ast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tools.calculator as calculator_module
from tools import ToolSet
from tools.calculator import CalculatorError, calculator, evaluate, format_number, make_calculator


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("6 / 3", "2"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ^ 10", "1024"),
        ("-3 ** 2", "-9"),
        ("+4", "4"),
        ("2 ** -1", "0.5"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("1e3", "1000"),
        ("2 ** 100", "1267650600228229401496703205376"),
        ("10 ** 20 / 10", "10000000000000000000"),  # float, but exact: printed as an int
        ("3 × 4 ÷ 2", "6"),
    ],
)
def test_values(expr, expected):
    assert format_number(evaluate(expr)) == expected


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("1 / 0", "division by zero"),
        ("1 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("__import__('os').system('echo hi')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("[1, 2]", "List is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("1 << 2", "operator LShift is not allowed"),
        ("~1", "operator Invert is not allowed"),
        ("(1 + 2", "invalid syntax"),
        ("", "empty expression"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 5000", "more than 4000 digits"),
        ("(10 ** 3000) * (10 ** 3000)", "more than 4000 digits"),
        ("1e308 * 10", "overflow"),
        ("2.0 ** 5000", "overflow"),
        ("(-8) ** 0.5", "complex"),
        ("1" + "+1" * 600, "characters long"),
    ],
)
def test_errors(expr, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate(expr)


@pytest.mark.parametrize(
    ("expr", "refusal"),
    [
        ("9**9**9**9", r"exponent 387420489 is too large \(limit 10000\)"),
        ("99999**99999", r"exponent 99999 is too large \(limit 10000\)"),
        ("(2**4000)**(2**4000)", r"exponent \d+ is too large \(limit 10000\)"),
        ("-(" * 150 + "1" + ")" * 150, "nests deeper than 100 levels"),
    ],
)
def test_limits_bound_the_work(monkeypatch, expr, refusal):
    # The work is refused before it is done: every operation actually computed stays within
    # the limits (an expression computed first and measured after would show up here; one
    # that takes forever would time the test out).
    computed: list[tuple[object, object]] = []
    power = calculator_module._BINOPS[ast.Pow]

    def recording_power(left, right):
        computed.append((left, right))
        return power(left, right)

    monkeypatch.setitem(calculator_module._BINOPS, ast.Pow, recording_power)
    with pytest.raises(CalculatorError, match=refusal):
        evaluate(expr)
    assert all(abs(exponent) <= 10_000 for _, exponent in computed), computed


# Small integer expressions: the calculator must agree exactly with Python's arithmetic.
_ints = st.integers(min_value=-1000, max_value=1000).map(lambda v: f"({v})")


def _combine(children):
    ops = st.sampled_from(["+", "-", "*", "//", "%"])
    return st.tuples(children, ops, children).map(lambda t: f"({t[0]} {t[1]} {t[2]})")


@settings(max_examples=200, deadline=None)
@given(st.recursive(_ints, _combine, max_leaves=8))
def test_agrees_with_python_integer_arithmetic(expr):
    try:
        expected = eval(expr, {"__builtins__": {}})  # the test's trusted oracle, not the tool
    except ZeroDivisionError:
        with pytest.raises(CalculatorError, match="division by zero"):
            evaluate(expr)
        return
    got = evaluate(expr)
    assert got == expected and type(got) is int


async def test_calculator_tool_messages():
    ts = ToolSet([calculator])
    async with ts.episode() as ep:
        ok = await ep.call("calculator", {"expression": "(3 + 4) * 2 ** 10 / 7"})
        bad = await ep.call("calculator", '{"expression": "1/0"}')
        missing = await ep.call("calculator", {})
    assert ok.content == "1024" and not ok.error
    assert bad.error and bad.content == "error: division by zero"
    assert missing.error and "expression: Field required" in missing.content
    assert ts.metrics()["tools/calculator/errors"] == 2


def test_calculator_schema_and_custom_limits():
    fn = calculator.schema()["function"]
    assert fn["name"] == "calculator"
    assert fn["parameters"]["required"] == ["expression"]
    assert "expression" in fn["parameters"]["properties"]
    small = make_calculator(max_length=5, name="calc")
    assert small.name == "calc"
    with pytest.raises(CalculatorError):
        evaluate("1+2+3+4", max_length=5)
