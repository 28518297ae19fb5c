"""``agentrl serve`` refuses keys only ``agentrl train`` acts on, before any server starts."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_colocate_is_refused_naming_the_key_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentrl.cli import main

    rc = main(
        [
            "serve",
            str(ROOT / "configs" / "quickstart.yaml"),
            "model.path=null",
            "distributed.colocate=true",
            f"trainer.output_dir={tmp_path / 'out'}",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "distributed.colocate=true" in err and "agentrl train" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists(), "something was started"
