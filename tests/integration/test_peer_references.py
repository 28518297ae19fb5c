"""Our OPSM mask against TRL's own ``GRPOTrainer.get_off_policy_mask`` (run in ``.venv-trl``).

The unit tests compare every correction with a reference written from its paper; this one
compares with a peer's shipped function, on random batches, in TRL's own environment (nothing of
TRL is imported here or copied into the project). TRL is never skipped silently (see
``test_benchmark_smoke.trl_python_or_fail``).
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

import correction
from tests.integration.test_benchmark_smoke import trl_python_or_fail

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

_TRL_SIDE = textwrap.dedent(
    """
    import sys, torch
    from trl import GRPOTrainer
    cases = torch.load(sys.argv[1])
    keeps = [GRPOTrainer.get_off_policy_mask(a, th, sa, m, d) for sa, th, m, a, d in cases]
    torch.save(keeps, sys.argv[2])
    """
)


def test_opsm_equals_trls_off_policy_mask(tmp_path: Path) -> None:
    python = trl_python_or_fail()
    cases = []
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        b, t = (
            int(torch.randint(1, 10, (1,), generator=g)),
            int(torch.randint(1, 30, (1,), generator=g)),
        )
        sampling = -torch.rand(b, t, generator=g) * 3
        theta = sampling + float(torch.rand(1, generator=g)) * torch.randn(b, t, generator=g)
        mask = (torch.rand(b, t, generator=g) > 0.3).float()
        adv = torch.randn(b, 1, generator=g)
        cases.append((sampling, theta, mask, adv, [0.0, 0.01, 0.1, 0.5][seed % 4]))
    torch.save(cases, tmp_path / "cases.pt")
    subprocess.run(
        [str(python), "-c", _TRL_SIDE, str(tmp_path / "cases.pt"), str(tmp_path / "keeps.pt")],
        check=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin"},
    )
    keeps = torch.load(tmp_path / "keeps.pt")
    masked = 0
    for (sampling, theta, mask, adv, delta), theirs in zip(cases, keeps, strict=True):
        ours, _ = correction.opsm_mask(theta - sampling, adv, mask, delta)
        assert torch.equal(ours, theirs.expand_as(mask) * mask)
        masked += int(((mask > 0) & (ours == 0)).any(dim=1).sum())
    assert masked > 0  # the comparison exercised the masking branch
