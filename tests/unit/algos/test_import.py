"""``import agentrl.algos`` works with torch and numpy alone (no servers, trackers, Ray, configs)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = (
    "pydantic",
    "ray",
    "mlflow",
    "fastapi",
    "uvicorn",
    "httpx",
    "vllm",
    "transformers",
    "yaml",
)


def test_import_needs_only_torch() -> None:
    code = textwrap.dedent(
        f"""
        import importlib.abc, sys

        BLOCKED = {BLOCKED!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked import of {{name}}")
                return None

        sys.meta_path.insert(0, Block())
        import torch
        import agentrl.algos as algos
        r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
        adv, _ = algos.compute_advantage("grpo", r, torch.ones(2, 2), index=[0, 0])
        assert adv[0, 0] > 0
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not leaked, leaked
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
