"""Policy-gradient losses, registered by name (verl's names), each returning ``(loss, metrics)``.

Every loss is ``fn(old_log_prob [B, T], log_prob [B, T], advantages [B, T], response_mask
[B, T], *, loss_agg_mode, rollout_is_weights=None, global_tokens=None, global_seqs=None,
loss_scale_factor=None, **options) -> (scalar loss, dict[str, float])`` and is called through
:func:`policy_loss`. Guarantees for the built-in losses:

- math in float32 whatever the input dtype; the scalar is aggregated by
  :func:`agentrl.algos.agg_loss`, so global token/sequence counts make micro-batch losses add
  up to the mini-batch loss (gradient accumulation) — except ``clip_cov`` and ``kl_cov``, which
  pick their tokens within each call (a micro-batch), as verl does;
- log-ratios are clamped to [−20, 20] before ``exp`` (GSPO: ≤ 10), so gradients stay finite
  for any finite input (``dro`` has no ``exp`` and keeps the raw log-ratio in its penalty);
- ``rollout_is_weights`` ``[B, T]`` (decoupled off-policy correction) multiplies the per-token
  loss and is always detached (``geo_mean``: their per-sequence geometric mean); in bypass mode
  the run passes none to a ratio loss (its ratio already is π_θ/π_rollout: a second weight
  would count the correction twice; ``agentrl.training.algorithm``);
- metrics: ``pg_clipfrac`` (fraction of tokens where clipping or the trust-region mask is
  active), ``pg_clipfrac_lower`` (dual clip, or DPPO's IS truncation, active), ``ppo_kl``
  (masked mean of log π_old − log π_θ); 0.0 where not applicable, so every loss logs these keys
  (``clip_cov`` and ``kl_cov`` add ``cov_fraction``).

Each loss's knobs are its keyword options with defaults and nothing else (the typed config
variant is built from the signature, so a knob a loss does not use is an error, never ignored):
``vanilla`` (alias ``ppo_clip``) has ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
``clip_ratio_c``; ``gspo`` and ``cispo`` the first three; ``reinforce`` none; ``dppo_tv``/``dppo_kl`` read the first three as
divergence thresholds, as verl does; ``geo_mean`` and ``clip_cov`` clip with the first three;
``sapo`` (``tau_pos``, ``tau_neg``), ``dro`` (``dro_beta``) and ``kl_cov`` (``kl_cov_ratio``,
``ppo_kl_coef``) have their own.

One family per module: :mod:`.registry` (the registry and :func:`policy_loss`), :mod:`.common`
(what every loss shares), :mod:`.ppo` (``vanilla``), :mod:`.sequence` (``gspo``,
``geo_mean``), :mod:`.trust_region` (``cispo``, ``dppo_tv``, ``dppo_kl``, ``sapo``),
:mod:`.covariance` (``clip_cov``, ``kl_cov``), :mod:`.reinforce` (``reinforce``, ``dro``) and
:mod:`.value` (the critic's ``value_loss``). Importing the package registers every built-in.
"""

from agentrl.algos.losses.covariance import clip_cov_loss, kl_cov_loss
from agentrl.algos.losses.ppo import vanilla_loss
from agentrl.algos.losses.registry import (
    LOSS_RESERVED,
    POLICY_LOSSES,
    PolicyLossFn,
    policy_loss,
    register_policy_loss,
)
from agentrl.algos.losses.reinforce import dro_loss, reinforce_loss
from agentrl.algos.losses.sequence import geo_mean_loss, gspo_loss
from agentrl.algos.losses.trust_region import cispo_loss, dppo_kl_loss, dppo_tv_loss, sapo_loss
from agentrl.algos.losses.value import value_loss

__all__ = [
    "LOSS_RESERVED",
    "POLICY_LOSSES",
    "PolicyLossFn",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "geo_mean_loss",
    "gspo_loss",
    "kl_cov_loss",
    "policy_loss",
    "register_policy_loss",
    "reinforce_loss",
    "sapo_loss",
    "value_loss",
    "vanilla_loss",
]
