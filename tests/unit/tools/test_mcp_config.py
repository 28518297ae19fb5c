"""``tools.mcp`` entries are checked when the config loads, and MCP tools travel to Ray workers."""

from __future__ import annotations

import pickle

import pytest

from agentrl.config import ConfigError
from tests.fakes import experiment
from tools.mcp import MCPServerParams, MCPTool, _as_result, _RemoteTool


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ("{name: a}", "exactly one of `command`"),
        ("{name: a, command: [x], url: 'http://h/mcp'}", "exactly one of `command`"),
        ("{name: a, command: []}", "`command` is empty"),
        ("{name: a, url: 'ftp://h'}", "must start with http:// or https://"),
        ("{name: 'a b', command: [x]}", "must start with a letter"),
        ("{name: a, command: [x], tool: [y]}", "tool"),
    ],
)
def test_bad_entries_fail_when_the_config_loads(entry: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        experiment(f"tools.mcp=[{entry}]")
    assert "tools.mcp" in str(info.value)


def test_headers_are_never_logged_or_saved() -> None:
    cfg = experiment("tools.mcp=[{name: s, url: 'http://127.0.0.1:1/mcp', headers: {A: secret}}]")
    assert cfg.tools.mcp[0].headers == {"A": "secret"}
    assert "secret" not in cfg.to_yaml() and "secret" not in str(cfg.flatten())
    assert "secret" not in repr(cfg.tools.mcp[0])


def test_an_mcp_tool_pickles_without_its_session() -> None:
    server = MCPServerParams(name="s", url="http://127.0.0.1:1/mcp", prefix="s_")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    t = MCPTool(server, _RemoteTool("add", "Add.", schema))
    back = pickle.loads(pickle.dumps(t))
    assert back.name == "s_add" and back.remote_name == "add" and back.server == server
    assert back.schema() == t.schema()
    assert back.schema()["function"]["parameters"] == schema


def test_results_become_tool_messages() -> None:
    from mcp_types import CallToolResult, ImageContent, TextContent

    ok = CallToolResult(content=[TextContent(text="a"), TextContent(text="b")])
    assert _as_result(ok).content == "a\nb" and not _as_result(ok).error
    bad = CallToolResult(content=[TextContent(text="no such file")], is_error=True)
    assert _as_result(bad).content == "error: no such file" and _as_result(bad).error
    image = CallToolResult(content=[ImageContent(data="AA==", mime_type="image/png")])
    assert _as_result(image).content == "[image content]"
    structured = CallToolResult(content=[], structured_content={"x": 1})
    assert _as_result(structured).content == '{"x": 1}'
