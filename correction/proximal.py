"""The proximal policy without a forward pass: AReaL's log-linear interpolation by version.

Reference: AReaL, "Proximal Log-Probability Approximation" (``docs/en/algorithms/prox_approx.md``;
``areal/trainer/ppo/actor.py::compute_prox_logp_approximations``, option
``actor.prox_logp_method: loglinear``), for the decoupled PPO objective of Fu et al., "AReaL: A
Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning" (arXiv 2505.24298).

Decoupled PPO anchors its clip on a proximal policy π_prox and weights by π_prox / π_behave; the
exact π_prox costs a forward pass. AReaL approximates it per token by interpolating, in log space,
between the behaviour policy (log-probs the server returned, version v_b of the token) and the
policy being trained (version v_θ), at the proximal version v_prox = v_θ − 1:

    α = (v_prox − v_b) / (v_θ − v_b), clamped to [0, 1] (α = 0 where v_θ ≤ v_b),
    log π_prox ≈ log π_behave + α · (log π_θ − log π_behave).

So tokens at most one version old keep π_prox = π_behave (the ratio π_θ/π_prox is then the bypass
ratio), and older tokens move towards π_θ: at staleness s, α = (s − 1)/s. Only valid tokens
(response mask 1, version ≥ 0) are interpolated; α is 0 elsewhere. π_θ is detached: the
approximation is an anchor, never a path for gradients.
"""

from __future__ import annotations

import torch

from correction._common import check_pair

__all__ = ["loglinear_alpha", "loglinear_proximal"]


def loglinear_alpha(
    behave_versions: torch.Tensor, theta_version: int, response_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The interpolation weight α of every token (see the module docstring).

    Args:
        behave_versions: ``[B, T]`` integer weight version that sampled each token (−1 on
            padding and on tokens the policy did not sample).
        theta_version: v_θ, the version of the weights being trained (the trainer's version
            before this step's update).
        response_mask: ``[B, T]`` 0/1.

    Returns:
        ``(alpha [B, T] float32, metrics)``; metrics: ``prox_alpha_mean`` (over valid tokens) and
        ``prox_frac_interpolated`` (fraction of valid tokens with α > 0, i.e. ≥ 2 versions old).

    Example::

        alpha, m = loglinear_alpha(batch["policy_version"], version, batch["response_mask"])
    """
    check_pair("behave_versions", behave_versions, response_mask)
    v_b = behave_versions.to(torch.float64)
    v_theta = float(theta_version)
    diff = v_theta - v_b
    valid = (response_mask > 0) & (behave_versions >= 0)
    alpha = torch.where(valid & (diff > 0), (v_theta - 1.0 - v_b) / diff.clamp(min=1.0), 0.0)
    alpha = alpha.clamp(0.0, 1.0)
    n = max(int(valid.sum()), 1)
    metrics = {
        "prox_alpha_mean": float(alpha.sum()) / n,
        "prox_frac_interpolated": float((alpha > 0).sum()) / n,
    }
    return alpha.to(torch.float32), metrics


def loglinear_proximal(
    behave_log_probs: torch.Tensor, theta_log_probs: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """log π_prox ≈ log π_behave + α · (log π_θ − log π_behave), detached, ``[B, T]``.

    Args:
        behave_log_probs: ``[B, T]`` log π_behave (the rollout log-probs).
        theta_log_probs: ``[B, T]`` log π_θ (detached here).
        alpha: ``[B, T]`` from :func:`loglinear_alpha` (0 on padding).
    """
    behave = behave_log_probs.detach()
    theta = theta_log_probs.detach().to(behave.dtype)
    return behave + alpha.to(behave.dtype) * (theta - behave)
