"""Tool-call parsers: well-formed calls parse; every malformed call is reported, never dropped."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.parsers import ParseResult, ToolCallParser, get_parser, list_parsers, register_parser


def test_hermes_parses_calls_and_content():
    text = (
        "Let me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
    )
    res = get_parser("hermes").parse(text)
    assert res.errors == []
    assert [(c.name, c.arguments) for c in res.calls] == [
        ("calculator", {"expression": "2+2"}),
        ("search", {"q": "x"}),
    ]
    assert res.content == "Let me compute."
    assert res.calls[0].raw.startswith("<tool_call>") and res.calls[0].raw.endswith("</tool_call>")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('{"name": "calculator", "arguments": {"expression": "2+2"}', "invalid JSON"),
        ('{"arguments": {}}', 'missing "name"'),
        ('{"name": "calculator", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "calculator", "arguments": "{not json"}', "arguments are not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_hermes_malformed_calls_become_errors(body, needle):
    text = (
        f'<tool_call>{body}</tool_call><tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call>'
    )
    res = get_parser("hermes").parse(text)
    assert len(res.errors) == 1 and needle in res.errors[0] and "#1" in res.errors[0]
    assert [c.name for c in res.calls] == ["ok"]


def test_hermes_unclosed_call_is_an_error():
    res = get_parser("hermes").parse('thinking <tool_call>{"name": "calc", "argu')
    assert res.calls == [] and len(res.errors) == 1 and "not closed" in res.errors[0]
    assert res.content == "thinking"


def test_hermes_plain_text():
    assert get_parser("hermes").parse("  The answer is 4. ") == ParseResult(
        content="The answer is 4."
    )


def test_json_parser_llama3_style():
    p = get_parser("llama3_json")
    res = p.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "1+1"}}')
    assert res.errors == [] and res.calls[0].name == "calculator"
    assert res.calls[0].arguments == {"expression": "1+1"}
    multi = p.parse('{"name": "a", "arguments": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert [c.name for c in multi.calls] == ["a", "b"]
    listed = p.parse('[{"name": "a", "arguments": {}}, {"arguments": {}}]')
    assert [c.name for c in listed.calls] == ["a"] and 'missing "name"' in listed.errors[0]
    assert p.parse("The answer is 4.").calls == []
    bad = p.parse('{"name": "a", "arguments": {')
    assert bad.calls == [] and "invalid JSON" in bad.errors[0]


def test_mistral_parser():
    p = get_parser("mistral")
    res = p.parse('Sure.[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "3*3"}}]')
    assert res.content == "Sure." and res.calls[0].arguments == {"expression": "3*3"}
    assert "invalid JSON" in p.parse("[TOOL_CALLS][{oops").errors[0]
    assert p.parse("no calls").content == "no calls"


def test_registry():
    assert {"hermes", "json", "llama3_json", "mistral"} <= set(list_parsers())
    with pytest.raises(ValueError, match=r"unknown tool-call format .nope.*hermes"):
        get_parser("nope")

    class Upper(ToolCallParser):
        name = "upper"

        def parse(self, text: str) -> ParseResult:
            return ParseResult(content=text.upper())

    register_parser("upper", Upper)
    assert get_parser("upper").parse("a").content == "A"
    inst = Upper()
    assert get_parser(inst) is inst


def test_tool_call_to_openai():
    call = (
        get_parser("hermes")
        .parse('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
        .calls[0]
    )
    call.id = "call_0"
    assert call.to_openai() == {
        "id": "call_0",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}'},
    }


@given(st.text(max_size=200))
def test_parsers_never_raise(text):
    for name in ("hermes", "json", "mistral"):
        res = get_parser(name).parse(text)
        assert isinstance(res, ParseResult)
