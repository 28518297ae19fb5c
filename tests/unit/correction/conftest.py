"""Fixtures for the correction tests: small random batches with ragged right padding."""

from __future__ import annotations

import pytest
import torch

import correction._engine as engine


def make_batch(
    batch: int = 5, length: int = 7, scale: float = 0.3, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_log_probs, rollout_log_probs, response_mask) with one all-padding row."""
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 2.0 - 0.1
    train = rollout + torch.randn(batch, length, generator=gen, dtype=torch.float64) * scale
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[min(2, batch - 1)] = 0
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return train, rollout, mask


@pytest.fixture(params=[None, 8], ids=["one-block", "blocks-of-8"])
def block_size(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int | None:
    """Run a test both as one block and with tiny row blocks (the CPU blocking path)."""
    if request.param is not None:
        monkeypatch.setattr(engine, "CPU_BLOCK_ELEMENTS", request.param)
    return request.param
