"""AReaL's log-linear proximal approximation against a loop written from its documented formula."""

from __future__ import annotations

import pytest
import torch

import correction


def reference_alpha(versions: torch.Tensor, v_theta: int, mask: torch.Tensor) -> torch.Tensor:
    """α = (v_prox − v_b)/(v_θ − v_b), v_prox = v_θ − 1, in [0, 1]; 0 where v_θ ≤ v_b or invalid."""
    out = torch.zeros(versions.shape, dtype=torch.float64)
    for b in range(versions.shape[0]):
        for t in range(versions.shape[1]):
            v_b = int(versions[b, t])
            if mask[b, t] > 0 and v_b >= 0 and v_theta > v_b:
                out[b, t] = min(1.0, max(0.0, (v_theta - 1 - v_b) / (v_theta - v_b)))
    return out


def test_alpha_and_interpolation_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    versions = torch.randint(0, 11, (6, 9), generator=gen)
    mask = (torch.rand(6, 9, generator=gen) > 0.2).float()
    versions[mask == 0] = -1
    alpha, metrics = correction.loglinear_alpha(versions, 10, mask)
    expected = reference_alpha(versions, 10, mask)
    torch.testing.assert_close(alpha.double(), expected, rtol=0, atol=1e-7)
    assert metrics["prox_alpha_mean"] == pytest.approx(float(expected.sum() / mask.sum()))
    behave = -torch.rand(6, 9, generator=gen, dtype=torch.float64)
    theta = behave + 0.3 * torch.randn(6, 9, generator=gen, dtype=torch.float64)
    prox = correction.loglinear_proximal(behave, theta.requires_grad_(), alpha)
    assert not prox.requires_grad
    torch.testing.assert_close(
        prox, behave + expected * (theta.detach() - behave), atol=1e-7, rtol=0
    )


@pytest.mark.parametrize(
    ("staleness", "alpha"), [(0, 0.0), (1, 0.0), (2, 0.5), (4, 0.75), (8, 0.875)]
)
def test_alpha_by_staleness(staleness: int, alpha: float) -> None:
    """(s − 1)/s: one version old keeps π_behave (bypass), older tokens move towards π_θ."""
    a, _ = correction.loglinear_alpha(torch.tensor([[20 - staleness]]), 20, torch.ones(1, 1))
    assert float(a) == pytest.approx(alpha)


def test_future_versions_and_padding_get_zero() -> None:
    a, m = correction.loglinear_alpha(torch.tensor([[12, -1, 3]]), 10, torch.tensor([[1, 0, 0]]))
    assert a.tolist() == [[0.0, 0.0, 0.0]] and m["prox_frac_interpolated"] == 0.0
