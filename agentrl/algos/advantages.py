"""Advantage estimators, registered by name (verl's names), all with one signature.

Every estimator is ``fn(token_level_rewards [B, T], response_mask [B, T], *, index=None,
values=None, **options) -> (advantages [B, T], returns [B, T])`` and is looked up with
:func:`compute_advantage`. Guarantees, for every built-in estimator:

- returned in float32 and computed under ``torch.no_grad()`` (advantages are targets, not graph
  nodes); group statistics are taken in float64 so a group of equal scores gives exactly 0;
- advantages are 0 wherever ``response_mask`` is 0 (padding, tool and user tokens);
- group estimators (``grpo``, ``rloo``, ``opo``, ``gpg``, ``reinforce_plus_plus_baseline``,
  ``gdpo``, ``optimal_token_baseline``) need ``index`` (one group id per row, e.g. the batch's
  ``uid``) and give a group of one sequence advantage 0: with nothing to compare against there
  is no learning signal (verl instead lets such a row keep its raw score);
- outcome estimators use the sequence score ``Σ_t token_level_rewards`` and spread it over
  every sampled token.

Multi-turn responses contain tool/user tokens (mask 0) between model turns. The
token-level estimators (``gae``, ``reinforce_plus_plus``, ``remax``) skip those tokens: values
and TD errors of masked tokens are ignored and returns flow through them undiscounted, so a
reward on the last turn reaches the first turn. ``optimal_token_baseline`` aligns the tokens of a
group by their rank among the *sampled* tokens (the k-th model token of every response shares a
baseline), so tool/user tokens never shift the comparison.

Some estimators take run inputs beyond rewards and groups, declared by flags of
:func:`register_advantage` and passed as reserved keywords (never knobs): ``reward_info`` (the
per-row ``Trajectory.reward_info`` dicts, for ``gdpo``'s reward components) and
``old_log_probs`` / ``sum_pi_squared`` / ``rollout_is_weights`` (for ``optimal_token_baseline``).

Register your own with :func:`register_advantage`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from agentrl.algos.registry import Registry, check_kwargs, describe
from agentrl.algos.utils import group_ids, group_stats, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_RESERVED",
    "AdvantageFn",
    "compute_advantage",
    "register_advantage",
]

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry(
    "advantage estimator",
    config_key="algorithm.advantage.name",
    how_to_register="decorate a function with @register_advantage('name') in a module listed "
    "under `imports:`, or give 'module:function'",
)
ADVANTAGE_RESERVED = (
    "index",
    "values",
    "reward_baselines",
    "reward_info",
    "old_log_probs",
    "sum_pi_squared",
    "rollout_is_weights",
)
"""Keyword arguments the run passes itself; every other keyword with a default is a knob."""
GroupIndex = Sequence[Any] | torch.Tensor


def register_advantage(
    name: str,
    *aliases: str,
    needs_critic: bool = False,
    needs_index: bool = False,
    needs_greedy_baseline: bool = False,
    needs_reward_info: bool = False,
    needs_sum_pi_squared: bool = False,
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering a user estimator under ``name``.

    The flags tell the run what the estimator needs: ``needs_critic`` (``values`` from a value
    model), ``needs_index`` (group ids), ``needs_greedy_baseline`` (``reward_baselines``: the
    reward of one greedy response per prompt), ``needs_reward_info`` (``reward_info``: one
    ``Trajectory.reward_info`` dict per row), ``needs_sum_pi_squared`` (``sum_pi_squared``
    ``[B, T]``: Σ_v π_old(v)² at every response position, computed in the π_old forward pass,
    together with ``old_log_probs`` and, when present, ``rollout_is_weights``). Its other
    keyword parameters with defaults are its knobs (``algorithm.advantage: {name: ..., knob:
    value}``); the names in :data:`ADVANTAGE_RESERVED` are inputs, never knobs.

    The function takes ``(token_level_rewards, response_mask, **options)`` plus ``index`` and/or
    ``values`` keywords if it uses them (they are passed only when the caller gives them), and
    returns ``(advantages, returns)``, both ``[B, T]``.

    Example::

        @register_advantage("sign")
        def sign_advantage(token_level_rewards, response_mask, *, index=None, values=None):
            adv = torch.sign(token_level_rewards.sum(-1, keepdim=True)) * response_mask
            return adv, adv
    """

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        describe(
            fn,
            needs_critic=needs_critic,
            needs_index=needs_index,
            needs_greedy_baseline=needs_greedy_baseline,
            needs_reward_info=needs_reward_info,
            needs_sum_pi_squared=needs_sum_pi_squared,
        )
        return ADVANTAGE_ESTIMATORS.register(name, *aliases)(fn)

    return decorator


def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
    **cfg: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as ``name``.

    Args:
        name: a registered name (``gae``, ``grpo``, ``rloo``, ``reinforce_plus_plus``,
            ``reinforce_plus_plus_baseline``, ``remax``, ``opo``, ``gpg``, ``gdpo``,
            ``optimal_token_baseline`` (alias ``tir_optimal_token_baseline``) or your own).
        token_level_rewards: ``[B, T]`` rewards (outcome rewards sit on the last sampled token).
        response_mask: ``[B, T]`` 1 for policy-sampled tokens.
        index: length-B group ids (the prompt ``uid``) for group estimators.
        values: ``[B, T]`` critic values, for ``gae``.
        **cfg: the estimator's own options (e.g. ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``)
            and the run inputs it declares (``reward_baselines``, ``reward_info``,
            ``old_log_probs``, ``sum_pi_squared``, ``rollout_is_weights``); a keyword the
            estimator does not take raises ``ValueError`` naming it.

    Returns:
        ``(advantages [B, T], returns [B, T])`` in float32.
    """
    fn = ADVANTAGE_ESTIMATORS.get(name)
    # index/values go only where given, so user estimators that need neither can omit them.
    kwargs: dict[str, Any] = dict(cfg)
    if index is not None:
        kwargs["index"] = index
    if values is not None:
        kwargs["values"] = values
    check_kwargs("advantage estimator", name, fn, kwargs)
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, T]"
        )
    return fn(token_level_rewards, response_mask, **kwargs)


def _require_index(
    name: str, index: GroupIndex | None, batch_size: int
) -> tuple[torch.Tensor, int]:
    if index is None:
        raise ValueError(
            f"advantage estimator {name!r} compares sequences within a group and needs "
            "`index`: one group id per row (the batch's `uid`)"
        )
    return group_ids(index, batch_size)


def _outcome(
    scores: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spread per-sequence advantages ``[B]`` over the sampled tokens, as float32 ``[B, T]``."""
    adv = scores.float().unsqueeze(-1) * response_mask.float()
    return adv, adv


@register_advantage("gae", needs_critic=True)
@torch.no_grad()
def gae_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438), as in PPO.

    δ_t = r_t + γ V_{t'} − V_t and A_t = δ_t + γλ A_{t'}, where t' is the next *sampled*
    token (masked tool/user tokens are skipped). ``returns = A + V`` (before whitening);
    advantages are whitened over the sampled tokens of the batch when ``whiten``.
    Needs ``values`` ``[B, T]`` from a critic.
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs `values` [B, T] from a critic")
    rewards = token_level_rewards.float()
    vals = values.float()
    mask = response_mask.float()
    next_value = torch.zeros_like(rewards[:, 0])
    last_gae = torch.zeros_like(rewards[:, 0])
    steps = []
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = m * vals[:, t] + (1 - m) * next_value
        last_gae = m * gae_t + (1 - m) * last_gae
        steps.append(last_gae)
    advantages = torch.stack(steps[::-1], dim=1)
    returns = (advantages + vals) * mask
    advantages = masked_whiten(advantages, mask) if whiten else advantages * mask
    return advantages, returns


def _grpo(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None,
    epsilon: float,
    norm_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    ids, n = _require_index(name, index, token_level_rewards.shape[0])
    scores = token_level_rewards.double().sum(dim=-1)
    count, mean, std = group_stats(scores, ids, n)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + epsilon)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return _outcome(adv, response_mask)


@register_advantage("grpo", needs_index=True)
@torch.no_grad()
def grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    norm_adv_by_std: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): A_i = (s_i − mean_g) / (std_g + ε).

    ``std_g`` is the unbiased std of the group's scores. With ``norm_adv_by_std_in_grpo=False``
    this is Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): A_i = s_i − mean_g, which removes the
    difficulty bias of dividing by the std. ``norm_adv_by_std`` is accepted as an alias.
    """
    if norm_adv_by_std is not None:
        norm_adv_by_std_in_grpo = norm_adv_by_std
    return _grpo(
        "grpo", token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo
    )


@register_advantage("rloo", needs_index=True)
@torch.no_grad()
def rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): A_i = s_i − mean_{j≠i} s_j.

    The leave-one-out baseline makes the estimator unbiased; equivalently
    A_i = n/(n−1) · (s_i − mean_g).
    """
    ids, n = _require_index("rloo", index, token_level_rewards.shape[0])
    scores = token_level_rewards.double().sum(dim=-1)
    count, mean, _ = group_stats(scores, ids, n)
    adv = (scores - mean) * count / (count - 1).clamp(min=1.0)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return _outcome(adv, response_mask)


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ G_{t'} over sampled tokens; masked tokens pass the return through undiscounted."""
    running = torch.zeros_like(rewards[:, 0])
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = rewards[:, t] + (m * gamma + (1 - m)) * running
        out[:, t] = running * m
    return out


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return G_t, whitened over the batch.

    No critic and no groups: the batch-wide whitening is the baseline. ``returns`` are the raw
    discounted returns.
    """
    mask = response_mask.float()
    returns = _discounted_returns(token_level_rewards.float(), mask, gamma)
    return masked_whiten(returns, mask), returns


@register_advantage("reinforce_plus_plus_baseline", needs_index=True)
@torch.no_grad()
def reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): s_i − mean_g, then whitened over the batch.

    The whitening statistics use only the sampled tokens of rows whose group has at least two
    sequences; singleton groups get advantage 0.
    """
    ids, n = _require_index("reinforce_plus_plus_baseline", index, token_level_rewards.shape[0])
    scores = token_level_rewards.double().sum(dim=-1)
    count, mean, _ = group_stats(scores, ids, n)
    mask = response_mask.float() * (count > 1).float().unsqueeze(-1)
    centered = (scores - mean).unsqueeze(-1) * mask
    adv = masked_whiten(centered, mask)
    return adv, adv


@register_advantage("remax", needs_greedy_baseline=True)
@torch.no_grad()
def remax_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): A_t = G_t − b, with b the greedy response's reward.

    ``G_t`` is the undiscounted reward-to-go over the masked rewards; ``reward_baselines`` ``[B]``
    is the score of a greedy (temperature 0) response to the same prompt.
    """
    if reward_baselines is None:
        raise ValueError(
            "advantage estimator 'remax' needs `reward_baselines` [B]: the reward of a greedy "
            "response to each prompt"
        )
    mask = response_mask.float()
    returns = (token_level_rewards.float() * mask).flip(-1).cumsum(-1).flip(-1) * mask
    baseline = reward_baselines.float().reshape(-1).to(returns.device)
    if baseline.shape[0] != returns.shape[0]:
        raise ValueError(
            f"reward_baselines has {baseline.shape[0]} entries but the batch has {returns.shape[0]} rows"
        )
    return returns - baseline.unsqueeze(-1) * mask, returns


@register_advantage("opo", needs_index=True)
@torch.no_grad()
def opo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, On-Policy RL with Optimal reward baseline, arXiv:2505.23585).

    A_i = s_i − b_g with the length-weighted baseline b_g = Σ_j |o_j| s_j / Σ_j |o_j|, the
    variance-optimal baseline when gradient norms grow with length.
    """
    ids, n = _require_index("opo", index, token_level_rewards.shape[0])
    scores = token_level_rewards.double().sum(dim=-1)
    lengths = response_mask.double().sum(dim=-1)
    ids = ids.to(scores.device)
    zeros = torch.zeros(n, dtype=torch.float64, device=scores.device)
    weighted = zeros.clone().index_add_(0, ids, lengths * scores)
    total_len = zeros.clone().index_add_(0, ids, lengths)
    count = zeros.clone().index_add_(0, ids, torch.ones_like(scores))
    baseline = (weighted / total_len.clamp(min=1.0))[ids]
    adv = torch.where(count[ids] > 1, scores - baseline, torch.zeros_like(scores))
    return _outcome(adv, response_mask)


@register_advantage("gpg", needs_index=True)
@torch.no_grad()
def gpg_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, Group Policy Gradient, arXiv:2504.02546): A_i = α (s_i − mean_g) / F_norm.

    α = B / #(rows with a non-zero score) rescales the gradient so that batches where most
    groups are all-zero do not shrink it. Pair with the ``reinforce`` loss (no ratio, no clip).
    """
    ids, n = _require_index("gpg", index, token_level_rewards.shape[0])
    scores = token_level_rewards.double().sum(dim=-1)
    count, mean, _ = group_stats(scores, ids, n)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).double()
    adv = alpha * (scores - mean) / f_norm
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return _outcome(adv, response_mask)


def _reward_components(
    reward_info: Sequence[Mapping[str, Any]] | None, keys: Sequence[str], batch_size: int
) -> torch.Tensor:
    """``[B, K]`` float64: ``reward_info[row][key]`` for every row and every key in ``keys``."""
    if reward_info is None:
        raise ValueError(
            f"advantage estimator 'gdpo' with gdpo_reward_keys={list(keys)} needs `reward_info`: "
            "one Trajectory.reward_info dict per row, passed by the run because 'gdpo' is "
            "registered with needs_reward_info (or drop gdpo_reward_keys to normalize the score)"
        )
    if len(reward_info) != batch_size:
        raise ValueError(
            f"reward_info has {len(reward_info)} rows but the batch has {batch_size}; pass one "
            "Trajectory.reward_info dict per row, in batch order"
        )
    out = torch.zeros(batch_size, len(keys), dtype=torch.float64)
    for row, info in enumerate(reward_info):
        for k, key in enumerate(keys):
            if key not in info:
                raise ValueError(
                    f"gdpo_reward_keys: row {row} has no reward_info[{key!r}] (it has "
                    f"{sorted(info)}); the reward function must report every listed component "
                    "for every trajectory"
                )
            value = info[key]
            if not isinstance(value, numbers.Real) or not torch.isfinite(
                torch.tensor(float(value))
            ):
                raise ValueError(
                    f"gdpo_reward_keys: reward_info[{key!r}] of row {row} must be a finite "
                    f"number, got {value!r}"
                )
            out[row, k] = float(value)
    return out


@register_advantage("gdpo", needs_index=True, needs_reward_info=True)
@torch.no_grad()
def gdpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
    reward_info: Sequence[Mapping[str, Any]] | None = None,
    gdpo_reward_keys: tuple[str, ...] = (),
    gdpo_reward_weights: tuple[float, ...] | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (NVIDIA 2026, Group reward-Decoupled normalization Policy Optimization, arXiv:2601.05242).

    With K reward components c_{i,k} (``reward_info[i][key]`` for each of ``gdpo_reward_keys``),
    each is normalized within its group *separately*, then combined and whitened over the batch:

        Â_{i,k} = (c_{i,k} − mean_g c_k) / (std_g c_k + ε)      (GRPO per component)
        A_i = whiten_batch(Σ_k w_k Â_{i,k})                      (w = ``gdpo_reward_weights``, default 1)

    Summing first (GRPO on Σ_k c_k) lets the component with the largest spread decide the sign
    and the scale of every advantage; normalizing first gives each component an equal say.
    ``norm_adv_by_std_in_grpo=False`` drops the per-component std (Dr.GRPO style).

    Without ``gdpo_reward_keys`` the one component is the sequence score Σ_t r_t (GDPO of one
    reward is GRPO followed by batch whitening). Components replace the score: a KL-in-reward
    penalty in ``token_level_rewards`` is not seen when keys are given (as in verl). Rows of a
    group of one get 0 and stay out of the whitening statistics (verl whitens their raw score).
    """
    batch_size = token_level_rewards.shape[0]
    ids, n = _require_index("gdpo", index, batch_size)
    if gdpo_reward_keys:
        comps = _reward_components(reward_info, gdpo_reward_keys, batch_size)
        comps = comps.to(token_level_rewards.device)
    else:
        comps = token_level_rewards.double().sum(dim=-1, keepdim=True)
    weights = [1.0] * comps.shape[1] if gdpo_reward_weights is None else gdpo_reward_weights
    if len(weights) != comps.shape[1]:
        raise ValueError(
            f"gdpo_reward_weights has {len(weights)} entries but there are {comps.shape[1]} "
            f"reward components (gdpo_reward_keys={list(gdpo_reward_keys)}); give one weight each"
        )
    combined = torch.zeros(batch_size, dtype=torch.float64, device=comps.device)
    count = torch.ones_like(combined)
    for k, weight in enumerate(weights):
        count, mean, std = group_stats(comps[:, k], ids, n)
        normalized = comps[:, k] - mean
        if norm_adv_by_std_in_grpo:
            normalized = normalized / (std + epsilon)
        combined = combined + float(weight) * normalized
    in_group = (count > 1).unsqueeze(-1)
    mask = response_mask.float() * in_group.to(response_mask.device).float()
    adv = masked_whiten(combined.float().unsqueeze(-1).to(mask.device) * mask, mask)
    return adv, adv


def _require_policy_stats(
    name: str,
    shape: tuple[int, ...],
    old_log_probs: torch.Tensor | None,
    sum_pi_squared: torch.Tensor | None,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The π_old statistics an estimator registered with ``needs_sum_pi_squared`` must get."""
    if old_log_probs is None or sum_pi_squared is None:
        missing = [
            k
            for k, v in (("old_log_probs", old_log_probs), ("sum_pi_squared", sum_pi_squared))
            if v is None
        ]
        raise ValueError(
            f"advantage estimator {name!r} needs {' and '.join(missing)} [B, T]: log π_old of "
            "each sampled token and Σ_v π_old(v)² at each response position, both from the "
            "π_old forward pass (Σπ² = exp(logsumexp(2z) − 2·logsumexp(z)) of the logits z)"
        )
    for key, t in (
        ("old_log_probs", old_log_probs),
        ("sum_pi_squared", sum_pi_squared),
        ("rollout_is_weights", rollout_is_weights),
    ):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{key} {tuple(t.shape)} must match the [B, T] rewards {shape}")
    return old_log_probs, sum_pi_squared


def _realized_energy(
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    mask: torch.Tensor,
) -> torch.Tensor:
    """W_t = Σ_{j≤t} m_j ρ̄_j² (1 − 2π_j + Σ_v π_j(v)²), float64 ``[B, T]``.

    1 − 2π + Σπ² = ‖e_y − π‖² is the squared norm of ∇_z log π(y) in logit space (the
    "logit-gradient proxy"); it is ≥ 0, so rounding below 0 is clamped away.
    """
    pi = torch.exp(old_log_probs.double().clamp(max=0.0))
    energy = (1.0 - 2.0 * pi + sum_pi_squared.double()).clamp(min=0.0)
    if rollout_is_weights is not None:
        energy = energy * rollout_is_weights.double().detach() ** 2
    return (energy * mask).cumsum(dim=-1)


@register_advantage(
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    needs_index=True,
    needs_sum_pi_squared=True,
)
@torch.no_grad()
def optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline (OTB; Li et al. 2026, arXiv:2602.07078), single- and multi-turn.

    A per-token baseline that minimizes the variance of the policy gradient. With G_{i,k} the
    reward-to-go at the k-th *sampled* token of response i and W_{i,k} its realized energy
    (cumulative squared logit-gradient norm, :func:`_realized_energy`), within a group:

        B_k* = Σ_i G_{i,k} W_{i,k} / (Σ_i W_{i,k} + ε)      A_{i,k} = G_{i,k} − B_k*

    summing over the responses that have a k-th sampled token. Paths that accumulated more
    gradient energy weigh more in the baseline. With ``rollout_is_weights`` ρ̄, W uses ρ̄² (the
    MSE-optimal baseline under truncated IS). ``handle_zero_tail``: where only one response of
    the group reaches position k (the tail of a unique longest response), B_k* would equal its
    own return and cancel its signal; its baseline is set to 0 there instead (A = G).

    Tokens are aligned by their rank among sampled tokens, so tool/user tokens of multi-turn
    responses never shift the comparison: this is verl's ``tir_optimal_token_baseline``, and on
    single-turn responses (mask = a prefix) it equals verl's ``optimal_token_baseline``; both
    names are registered. Needs ``old_log_probs`` and ``sum_pi_squared`` ``[B, T]`` (see
    :func:`register_advantage`). ``returns`` is G on sampled tokens. A group of one gets 0 (verl
    gives it its raw return).
    """
    shape = tuple(token_level_rewards.shape)
    ids, n = _require_index("optimal_token_baseline", index, shape[0])
    old, spsq = _require_policy_stats(
        "optimal_token_baseline", shape, old_log_probs, sum_pi_squared, rollout_is_weights
    )
    mask = response_mask.double()
    returns = (token_level_rewards.double() * mask).flip(-1).cumsum(-1).flip(-1) * mask
    energy = _realized_energy(old, spsq, rollout_is_weights, mask)
    sampled = mask > 0
    rows, cols = sampled.nonzero(as_tuple=True)
    rank = (sampled.long().cumsum(dim=-1) - 1)[rows, cols]  # k of each sampled token
    width = int(rank.max().item()) + 1 if rank.numel() else 0
    g_k = mask.new_zeros(shape[0], width)
    w_k = torch.zeros_like(g_k)
    present = torch.zeros_like(g_k)
    g_k[rows, rank] = returns[rows, cols]
    w_k[rows, rank] = energy[rows, cols]
    present[rows, rank] = 1.0
    ids = ids.to(mask.device)
    per_group = mask.new_zeros(n, width)
    numerator = per_group.clone().index_add_(0, ids, g_k * w_k)
    denominator = per_group.clone().index_add_(0, ids, w_k)
    baseline = (numerator / (denominator + epsilon))[ids]
    if handle_zero_tail:
        reached = per_group.clone().index_add_(0, ids, present)[ids]
        baseline = torch.where(reached == 1, torch.zeros_like(baseline), baseline)
    group_size = mask.new_zeros(n).index_add_(0, ids, mask.new_ones(shape[0]))[ids]
    adv_k = (g_k - baseline) * present * (group_size > 1).double().unsqueeze(-1)
    advantages = torch.zeros_like(mask)
    advantages[rows, cols] = adv_k[rows, rank]
    return advantages.float(), returns.float()
