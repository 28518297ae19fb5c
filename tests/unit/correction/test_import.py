"""``import correction`` needs only torch and numpy: checked in a subprocess that forbids the rest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_import_needs_only_torch() -> None:
    code = textwrap.dedent(
        """
        import sys

        BLOCKED = ("agentrl", "pydantic", "ray", "mlflow", "vllm", "fastapi", "httpx", "yaml",
                   "tensordict", "transformers", "agents", "tools")

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"correction must not import {name}")
                return None

        sys.meta_path.insert(0, Block())
        import torch
        import correction
        cfg = correction.preset("decoupled_seq_is_rs")
        out = correction.apply_correction(cfg, torch.zeros(2, 3), torch.ones(2, 3))
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok", len(out.metrics))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
