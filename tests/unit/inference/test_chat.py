"""Chat helpers: hermes tool-call parsing, tools/messages validation, rendering."""

from __future__ import annotations

import json

import pytest

from agentrl.inference.chat import (
    ChatInputError,
    normalize_messages,
    parse_hermes_tool_calls,
    render_chat,
    validate_tools,
)
from agentrl.inference.tiny_model import build_tiny_tokenizer


def test_parse_single_and_multiple_calls() -> None:
    text = (
        'Sure.\n<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"a\\"}"}</tool_call>'
    )
    out = parse_hermes_tool_calls(text)
    assert out.content == "Sure."
    assert [c["function"]["name"] for c in out.tool_calls] == ["calc", "search"]
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"x": 1}
    assert json.loads(out.tool_calls[1]["function"]["arguments"]) == {"q": "a"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in out.tool_calls)
    assert out.errors == []


def test_plain_text_has_no_calls() -> None:
    out = parse_hermes_tool_calls("just text")
    assert out.content == "just text" and out.tool_calls == [] and out.errors == []
    assert parse_hermes_tool_calls("").content is None


@pytest.mark.parametrize(
    "body",
    ["{not json}", '{"arguments": {}}', '{"name": 3}', '{"name": "f", "arguments": "{bad"}'],
)
def test_malformed_calls_are_reported_and_kept(body: str) -> None:
    text = f"<tool_call>{body}</tool_call>"
    out = parse_hermes_tool_calls(text)
    assert out.tool_calls == [] and len(out.errors) == 1
    assert out.content == text


def test_unterminated_call_is_an_error() -> None:
    out = parse_hermes_tool_calls('<tool_call>{"name": "f"')
    assert out.tool_calls == [] and out.errors and "is not closed" in out.errors[0]


def test_validate_tools_names_the_field() -> None:
    good = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert validate_tools(good) == good
    assert validate_tools(None) == []
    cases = [
        ({"type": "function"}, "tools"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        (
            [good[0], {"type": "function", "function": {"name": "g", "parameters": 3}}],
            "tools[1].function.parameters",
        ),
    ]
    for tools, param in cases:
        with pytest.raises(ChatInputError) as e:
            validate_tools(tools)
        assert e.value.param == param


def test_normalize_messages() -> None:
    msgs = normalize_messages(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
        ]
    )
    assert msgs[0]["content"] == "ab"
    for bad, param in [
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        (
            [{"role": "assistant", "content": "x", "tool_calls": [{}]}],
            "messages[0].tool_calls[0].function",
        ),
    ]:
        with pytest.raises(ChatInputError) as e:
            normalize_messages(bad)
        assert e.value.param == param


def test_render_chat_matches_the_template() -> None:
    tok = build_tiny_tokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    ids = render_chat(tok, msgs)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_start|>") == ids[0]
