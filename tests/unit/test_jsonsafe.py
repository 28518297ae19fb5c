"""JSON from clients and models is parsed with a nesting limit and never raises RecursionError."""

from __future__ import annotations

import json

import pytest

from agentrl.inference.lora import LoraSpec
from agentrl.inference.weights import WeightLoadError, safetensors_metadata
from agentrl.jsonsafe import MAX_JSON_DEPTH, JsonDepthError, json_depth, loads_limited
from agents.parsers import get_parser

DEEP = "[" * 100_000 + "]" * 100_000


def test_depth_ignores_brackets_inside_strings() -> None:
    assert json_depth('{"a": "[[[[{{", "b": [[1]]}') == 3
    assert json_depth('"\\"[["') == 0
    assert loads_limited('{"a": "[[[["}') == {"a": "[[[["}


def test_nesting_past_the_limit_is_a_json_decode_error_naming_the_input() -> None:
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert json.dumps(loads_limited(ok)) == ok.replace("][", "], [")
    too_deep = "[" + ok + "]"
    with pytest.raises(JsonDepthError, match="the header is nested more than 64"):
        loads_limited(too_deep, what="the header")
    with pytest.raises(json.JSONDecodeError):  # what existing handlers already catch
        loads_limited(DEEP.encode())


@pytest.mark.parametrize("name", ["hermes", "json", "mistral"])
def test_parsers_turn_deep_json_into_an_error_not_an_exception(name: str) -> None:
    body = '{"name": "f", "arguments": ' + DEEP + "}"
    text = {
        "hermes": f"<tool_call>{body}</tool_call>",
        "json": body,
        "mistral": f"[TOOL_CALLS][{body}]",
    }[name]
    result = get_parser(name).parse(text)
    assert result.calls == [] and len(result.errors) == 1, result.errors
    args = json.dumps(
        {"name": "f", "arguments": json.dumps({"x": json.loads("[" * 10 + "]" * 10)})}
    )
    assert get_parser("hermes").parse(f"<tool_call>{args}</tool_call>").calls  # shallow is fine


def test_deep_safetensors_headers_and_lora_metadata_are_refused_as_malformed() -> None:
    header = ('{"__metadata__": {"a": ' + DEEP + "}}").encode()
    buf = len(header).to_bytes(8, "little") + header
    with pytest.raises(WeightLoadError, match="nested more than"):
        safetensors_metadata(buf)
    with pytest.raises(WeightLoadError, match="nested more than"):
        LoraSpec.from_json('{"r": ' + DEEP + "}")
