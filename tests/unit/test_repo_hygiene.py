"""The repository holds no leftovers of a merge: no conflict markers in code, docs or configs
(docs/tools.md once shipped with a pair for a whole batch)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def test_no_merge_conflict_markers() -> None:
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.yaml", "*.toml", "Makefile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert files
    found = [f for f in files if (ROOT / f).is_file() and MARKER.search((ROOT / f).read_text())]
    assert found == [], f"conflict markers in {found}"
