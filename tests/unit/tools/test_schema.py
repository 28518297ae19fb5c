"""Schemas from type hints and docstrings, and argument validation (tools.schema, @tool)."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Annotated, Any, Literal, Optional

import pytest
from pydantic import BaseModel, Field, ValidationError

from tools import FunctionTool, tool
from tools.schema import parse_docstring


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(BaseModel):
    x: float
    y: float = 0.0


def test_google_docstring_gives_description_and_argument_docs():
    doc = """Look up the weather.

    Uses the local cache when possible.

    Args:
        city (str): The city name,
            in English.
        days: How many days ahead.

    Returns:
        A forecast.
    """
    desc, args = parse_docstring(doc)
    assert desc == "Look up the weather.\n\nUses the local cache when possible."
    assert args == {"city": "The city name, in English.", "days": "How many days ahead."}


def test_numpy_docstring_gives_argument_docs():
    doc = """Add numbers.

    Parameters
    ----------
    a : int
        The first
        number.
    b : int
        The second number.

    Returns
    -------
    int
    """
    desc, args = parse_docstring(doc)
    assert desc == "Add numbers."
    assert args == {"a": "The first number.", "b": "The second number."}


def test_empty_docstring():
    assert parse_docstring(None) == ("", {})


def test_schema_covers_the_supported_types():
    @tool
    def f(
        n: int,
        x: float,
        s: str,
        flag: bool,
        items: list[int],
        table: dict[str, float],
        mode: Literal["fast", "slow"],
        color: Color,
        point: Point,
        note: Optional[str] = None,  # noqa: UP045 (testing the typing.Optional spelling)
        limit: Annotated[int, Field(ge=1, le=10)] = 5,
    ) -> str:
        """Do many things.

        Args:
            n: A count.
            point: Where.
        """
        return "ok"

    schema = f.schema()
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "f"
    assert fn["description"] == "Do many things."
    params = fn["parameters"]
    props = params["properties"]
    assert params["type"] == "object"
    assert params["additionalProperties"] is False
    assert props["n"] == {"type": "integer", "description": "A count."}
    assert props["x"] == {"type": "number"}
    assert props["s"] == {"type": "string"}
    assert props["flag"] == {"type": "boolean"}
    assert props["items"] == {"type": "array", "items": {"type": "integer"}}
    assert props["table"] == {"type": "object", "additionalProperties": {"type": "number"}}
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"]}
    assert props["color"] == {"type": "string", "enum": ["red", "blue"]}
    # pydantic models are inlined (no $ref/$defs: small models and chat templates need that)
    assert props["point"]["type"] == "object"
    assert props["point"]["properties"] == {
        "x": {"type": "number"},
        "y": {"type": "number", "default": 0.0},
    }
    assert props["point"]["description"] == "Where."
    assert "$defs" not in params and "$ref" not in str(params)
    # Optional[X] = None is shown as an optional X
    assert props["note"] == {"type": "string"}
    assert props["limit"] == {"type": "integer", "minimum": 1, "maximum": 10, "default": 5}
    assert sorted(params["required"]) == sorted(
        ["n", "x", "s", "flag", "items", "table", "mode", "color", "point"]
    )
    assert "title" not in str(params)


def test_arguments_are_validated_and_coerced():
    @tool
    def f(n: int, point: Point, color: Color = Color.RED, tags: list[str] | None = None) -> str:
        return f"{n!r} {point!r} {color!r} {tags!r}"

    args = f.validate_arguments({"n": "3", "point": {"x": 1}, "color": "blue"})
    assert args["n"] == 3
    assert args["point"] == Point(x=1.0)
    assert args["color"] is Color.BLUE
    assert args["tags"] is None
    with pytest.raises(ValidationError):
        f.validate_arguments({"n": "three", "point": {"x": 1}})
    with pytest.raises(ValidationError):
        f.validate_arguments({"n": 1, "point": {"x": 1}, "extra": 1})


def test_decorator_options_and_plain_call():
    @tool(name="adder", description="Adds.", timeout_s=2.5)
    def add(a: int, b: int = 1) -> int:
        """Ignored description."""
        return a + b

    assert isinstance(add, FunctionTool)
    assert add.name == "adder"
    assert add.schema()["function"]["description"] == "Adds."
    assert add.timeout_s == 2.5
    assert add(2, 3) == 5  # still callable as the function
    assert "required" in add.parameters and add.parameters["required"] == ["a"]


def test_no_arguments_tool_has_an_empty_object_schema():
    @tool
    def now() -> str:
        """The time."""
        return "noon"

    params = now.schema()["function"]["parameters"]
    assert params["type"] == "object" and params["properties"] == {}
    assert "required" not in params


def test_var_args_are_rejected_with_a_clear_error():
    with pytest.raises(TypeError, match=r"\*args/\*\*kwargs"):

        @tool
        def f(*values: int) -> int:
            return sum(values)


def test_async_function_tool_is_detected():
    @tool
    async def f(a: int) -> int:
        await asyncio.sleep(0)
        return a

    assert f.is_async


def test_untyped_parameter_is_refused_naming_it_and_the_fix():
    # It used to be accepted with an empty schema: the model saw nothing about the argument.
    with pytest.raises(TypeError, match=r"tool 'f': parameter 'x' has no type annotation.*x: int"):

        @tool
        def f(x) -> Any:  # type: ignore[no-untyped-def]  # testing a missing hint on purpose
            return x


def test_parameter_typed_any_explicitly_accepts_anything():
    @tool
    def f(x: Any) -> Any:
        return x

    assert f.validate_arguments({"x": [1, "a"]}) == {"x": [1, "a"]}


def test_sphinx_docstring_gives_argument_docs():
    doc = """Fetch a page.

    :param url: The address
        to fetch.
    :param int retries: How often to retry.
    :returns: The body.
    """
    desc, args = parse_docstring(doc)
    assert desc == "Fetch a page."
    assert args == {"url": "The address to fetch.", "retries": "How often to retry."}


def test_unschemable_signature_is_a_clear_error():
    with pytest.raises(TypeError, match="cannot build a JSON schema"):

        @tool
        def f(cb: Callable[[int], int]) -> str:  # no JSON schema for a callable
            return "x"
