"""agentrl.algos: the RL math of agentrl — advantages, policy losses, KL, entropy, aggregation.

Pure tensor functions, importable with torch (and numpy) alone: no config bags, servers,
trackers or Ray on this import path. Every family is a registry looked up by verl's names; an
unknown name raises ``ValueError`` listing the valid ones, and ``register_*`` decorators add
your own. Shapes: ``B`` sequences, ``T`` response tokens, ``V`` vocabulary.

- :func:`compute_advantage` — ``gae``, ``grpo`` (Dr.GRPO with ``norm_adv_by_std_in_grpo=False``),
  ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``remax``, ``opo``, ``gpg``.
- :func:`policy_loss` — ``vanilla`` (PPO clip + dual clip), ``gspo``, ``cispo``, ``bypass``,
  ``reinforce`` (alias ``gpg``).
- :func:`kl_penalty` — ``k1``/``kl``, ``k2``/``mse``, ``k3``/``low_var_kl``, ``abs``, and ``+``
  straight-through variants; :class:`FixedKLController`, :class:`AdaptiveKLController`,
  :func:`apply_kl_penalty`.
- :func:`agg_loss` — ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
  ``seq-mean-token-sum-norm``, with global counts for gradient accumulation.
- :func:`logprobs_from_logits`, :func:`entropy_from_logits`.

Formulas and when to use which: ``docs/algorithms.md``.
"""

from agentrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantage,
    register_advantage,
)
from agentrl.algos.aggregation import AGG_MODES, LossAggMode, agg_loss, loss_normalizers
from agentrl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    kl_estimator_names,
    kl_penalty,
)
from agentrl.algos.logits import entropy_from_logits, logits_disagreement, logprobs_from_logits
from agentrl.algos.losses import POLICY_LOSSES, policy_loss, register_policy_loss, value_loss
from agentrl.algos.registry import Registry
from agentrl.algos.utils import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "LossAggMode",
    "Registry",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "entropy_from_logits",
    "kl_estimator_names",
    "kl_penalty",
    "logits_disagreement",
    "logprobs_from_logits",
    "loss_normalizers",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "register_advantage",
    "register_policy_loss",
    "value_loss",
]
