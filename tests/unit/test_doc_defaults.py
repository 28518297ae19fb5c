"""Defaults quoted in the docs are the code's (issue 22: docs/agents.md said 8 / 2048 / 4 where
the config says 4 / 512 / 1).

docs/configuration.md is generated from the schema (``tests/unit/test_config.py`` checks it);
this test covers the defaults the other pages quote by hand:

- every markdown table with a ``default`` column whose rows name a config key, an ``agentrl
  serve`` flag or a ``ToolSet`` argument (:data:`TABLES` says which table is which);
- every sentence of the form ```section.key`, default X`` or ```section.key` (default X`` on
  any page, checked against the config schema.
"""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path
from typing import Any

from agentrl.config import ExperimentConfig
from agentrl.service import cli as service_cli
from tools import ToolSet

DOCS = Path(__file__).resolve().parents[2] / "docs"
CONFIG: dict[str, Any] = {}


def _flatten(data: dict[str, Any], prefix: str = "") -> None:
    for key, value in data.items():
        if isinstance(value, dict) and value and key not in ("kwargs", "generator_kwargs"):
            _flatten(value, f"{prefix}{key}.")
        CONFIG[f"{prefix}{key}"] = value


_flatten(ExperimentConfig().model_dump(mode="json"))


def _normal(text: str) -> Any:
    """A quoted default as a value: backticks, units and quotes off; numbers, null, booleans."""
    t = text.strip().strip("`").strip('"').strip()
    t = re.sub(r"\s*(s|chars|MiB|MB)$", "", t)
    if t.lower() in ("none", "null", "off"):
        return None
    if t.lower() in ("true", "on", "false"):
        return t.lower() in ("true", "on")
    try:
        return float(t)
    except ValueError:
        return t


def _tables(page: str) -> list[tuple[list[str], list[list[str]]]]:
    """The markdown tables of ``page``: (header cells, rows of cells)."""
    out, rows = [], []
    for line in [*(DOCS / page).read_text().splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            rows.append(cells)
        elif rows:
            if len(rows) > 2:
                out.append((rows[0], rows[2:]))
            rows = []
    return out


def _default_tables(page: str, first: str) -> list[list[str]]:
    """The rows of ``page``'s tables whose first column is ``first`` and that have a default."""
    found = [rows for head, rows in _tables(page) if head[0] == first and "default" in head]
    assert found, f"{page}: no table with the columns {first!r} and 'default'"
    return [row for rows in found for row in rows]


def test_agent_limits_table_quotes_the_agent_sections_defaults() -> None:
    rows = _default_tables("agents.md", "limit")
    quoted = {row[0].strip("`"): _normal(row[1]) for row in rows}
    assert quoted.pop("max_context_tokens") is None  # AgentLimits: unlimited unless set
    assert quoted == {k: float(CONFIG[f"agent.{k}"]) for k in quoted}, quoted


def _serve_defaults() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    service_cli.add_arguments(parser)
    return {a.option_strings[0]: a.default for a in parser._actions if a.option_strings}


SERVE_SPECIAL = {
    "--api-key": "$AGENTRL_API_KEY",  # resolved from the environment at start
    "--store": "output_dir/service.sqlite",  # trainer.output_dir's, at start
    "--durable": "off",
    "--weights-dir": "none",
    "--data-dir": "none",
    "--max-server-restarts": "inference.max_server_restarts",  # the config key, unless given
}


def test_service_flag_table_quotes_agentrl_serves_defaults() -> None:
    defaults = _serve_defaults()
    checked = 0
    for row in _default_tables("service.md", "flag"):
        flags = re.findall(r"--[a-z-]+", row[0])
        values = [v.strip() for v in re.split(r" / |, ", row[1])]
        if len(values) == 1:
            values *= len(flags)
        assert len(values) == len(flags), row
        for flag, value in zip(flags, values, strict=True):
            if flag in SERVE_SPECIAL:
                assert value.strip("`") == SERVE_SPECIAL[flag], (flag, value)
                continue
            expected = defaults[flag]
            got = _normal(value)
            if isinstance(got, float) and flag.endswith("-mb"):
                expected = float(expected)  # MiB in the parser and in the table
            assert got == (float(expected) if isinstance(got, float) else expected), (flag, value)
            checked += 1
    assert checked >= 8


def _toolset_defaults() -> dict[str, Any]:
    params = inspect.signature(ToolSet.__init__).parameters
    return {name: p.default for name, p in params.items() if p.default is not p.empty}


def test_tool_limits_table_quotes_the_toolsets_defaults() -> None:
    defaults = _toolset_defaults()
    for row in _default_tables("tools.md", "limit"):
        arg = re.search(r"ToolSet\((\w+)=", row[1])
        assert arg is not None, row
        expected = defaults[arg[1]]
        got = _normal(row[2].split(" (")[0])
        assert got == (float(expected) if isinstance(got, float) else expected), row


PROSE = re.compile(r"`([a-z_]+\.[a-z_.]+)`(?:,| \()\s*default ([^,;)]+)")


def test_defaults_quoted_in_prose_match_the_config() -> None:
    checked = []
    for page in sorted(DOCS.glob("*.md")):
        if page.name == "configuration.md":
            continue  # generated from the schema
        for key, value in PROSE.findall(page.read_text().replace("\n", " ")):
            if key not in CONFIG:
                continue
            expected = CONFIG[key]
            got = _normal(value.split(" ")[0] if value[0].isdigit() else value)
            assert got == (float(expected) if isinstance(got, float) else expected), (
                f"docs/{page.name}: `{key}` default {value!r}, the config says {expected!r}"
            )
            checked.append(key)
    assert "reward.timeout_s" in checked, checked
