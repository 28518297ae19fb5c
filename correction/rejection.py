"""Rejection sampling (RS): a hard trust region that removes tokens or whole sequences from the loss.

Reference: Liu, Li et al., "When Speed Kills Stability" (2025) for the k1/k2/k3 family and geometric
RS; Team Ling, "IcePop" (2025) for token-level k1 masking.

Per-token statistics of ℓ_t = log π_train − log π_rollout:
  k1_t = log π_rollout − log π_train = −ℓ_t,   k2_t = ½ ℓ_t²,   k3_t = exp(ℓ_t) − 1 − ℓ_t.
An option picks a statistic and a scope: the token itself, or the masked sum, mean or max over the
sequence. k1 options keep iff ``log L ≤ stat ≤ log U`` (bounds given in ratio space; one number U means
``[1/U, U]``); k2/k3 options keep iff ``stat ≤ U``. A sequence-scope rejection drops every token of the
sequence. Several rules combine with AND. Only the response mask changes; nothing is rescaled.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from correction._common import LOG_RATIO_BOUND, _Stats, metrics_to_floats

__all__ = ["RSOption", "RejectionRule", "rejection_mask"]


class RSOption(str, Enum):
    """Which statistic an RS rule thresholds, and over which scope."""

    TOKEN_K1 = "token_k1"
    TOKEN_K2 = "token_k2"
    TOKEN_K3 = "token_k3"
    SEQ_SUM_K1 = "seq_sum_k1"
    SEQ_SUM_K2 = "seq_sum_k2"
    SEQ_SUM_K3 = "seq_sum_k3"
    SEQ_MEAN_K1 = "seq_mean_k1"
    SEQ_MEAN_K2 = "seq_mean_k2"
    SEQ_MEAN_K3 = "seq_mean_k3"
    SEQ_MAX_K2 = "seq_max_k2"
    SEQ_MAX_K3 = "seq_max_k3"

    @property
    def is_k1(self) -> bool:
        return self.value.endswith("k1")

    @property
    def is_token(self) -> bool:
        return self.value.startswith("token_")


def as_rs_option(option: RSOption | str, field: str = "option") -> RSOption:
    if isinstance(option, RSOption):
        return option
    try:
        return RSOption(option)
    except ValueError:
        valid = [o.value for o in RSOption]
        close = difflib.get_close_matches(str(option), valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{field}={option!r} is not an RS option{hint}; valid options: {valid}"
        ) from None


@dataclass(frozen=True)
class RejectionRule:
    """One RS criterion: keep a token/sequence iff its statistic lies within the bounds.

    Attributes:
        option: the statistic and scope (``RSOption`` or its string value).
        upper: U. For k1 options a ratio-space bound (> 0); for k2/k3 an upper bound on the
            statistic (> 0).
        lower: L, k1 options only (ratio space, 0 < L ≤ U); omitted means 1/U (then U must be ≥ 1).

    Example: ``RejectionRule("token_k1", 2.0)`` keeps tokens with ``0.5 ≤ π_rollout/π_train ≤ 2``
    (IcePop); ``RejectionRule("seq_mean_k3", 0.01)`` drops sequences whose mean k3 exceeds 0.01.
    """

    option: RSOption
    upper: float
    lower: float | None = None

    def __post_init__(self) -> None:
        option = as_rs_option(self.option, "RejectionRule.option")
        object.__setattr__(self, "option", option)
        upper = float(self.upper)
        if not (math.isfinite(upper) and upper > 0):
            raise ValueError(
                f"RejectionRule.upper for {option.value} must be a finite number > 0, got {self.upper!r}"
            )
        object.__setattr__(self, "upper", upper)
        if not option.is_k1:
            if self.lower is not None:
                raise ValueError(
                    f"RejectionRule.lower is only for k1 options; {option.value} has an upper bound only "
                    "(drop lower)"
                )
            return
        if self.lower is None:
            if upper < 1.0:
                raise ValueError(
                    f"RejectionRule.upper={upper} for {option.value} without lower means [1/U, U], "
                    "which needs U >= 1; give lower explicitly or use U >= 1"
                )
            lower = 1.0 / upper
        else:
            lower = float(self.lower)
        if not (math.isfinite(lower) and 0 < lower <= upper):
            raise ValueError(
                f"RejectionRule.lower for {option.value} must satisfy 0 < lower <= upper={upper}, "
                f"got {self.lower!r}"
            )
        object.__setattr__(self, "lower", lower)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the option as its string value)."""
        return {"option": self.option.value, "upper": self.upper, "lower": self.lower}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RejectionRule:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        unknown = set(data) - {"option", "upper", "lower"}
        if unknown:
            raise ValueError(
                f"RejectionRule got unknown key(s) {sorted(unknown)}; valid keys: option, upper, lower"
            )
        if "option" not in data or "upper" not in data:
            raise ValueError(f"RejectionRule needs 'option' and 'upper', got {data!r}")
        return cls(option=data["option"], upper=data["upper"], lower=data.get("lower"))


def as_rules(rules: RejectionRule | Iterable[RejectionRule]) -> tuple[RejectionRule, ...]:
    """Normalize to a tuple, rejecting non-rules and two rules for one option."""
    items = (rules,) if isinstance(rules, RejectionRule) else tuple(rules)
    seen: set[RSOption] = set()
    for rule in items:
        if not isinstance(rule, RejectionRule):
            raise TypeError(
                f"rs rules must be RejectionRule values, got {type(rule).__name__}: {rule!r}"
            )
        if rule.option in seen:
            raise ValueError(
                f"two rules for {rule.option.value}; keep one (rules already combine with AND)"
            )
        seen.add(rule.option)
    return items


def rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rules: RejectionRule | Sequence[RejectionRule],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Apply RS rules (AND-combined) to the response mask.

    Args:
        log_ratio: ``[B, T]`` ℓ = log π_train − log π_rollout (padding values ignored).
        response_mask: ``[B, T]`` 0/1 (any dtype).
        rules: one rule or a sequence of rules; an empty sequence keeps everything.

    Returns:
        ``(new_mask [B, T], metrics)``: ``new_mask`` has ``response_mask``'s dtype and is
        ``response_mask AND every rule's keep mask``. Metrics: ``rs_masked_frac_token/<option>`` and
        ``rs_masked_frac_seq/<option>`` per rule, and the combined ``rs_masked_frac_token`` and
        ``rs_masked_frac_seq`` (fractions of valid tokens / sequences with ≥ 1 valid token).
    """
    stats = _Stats(log_ratio, response_mask)
    keep, metrics = rejection_from_stats(stats, as_rules(rules))
    return keep.to(response_mask.dtype), metrics_to_floats(metrics)


def _k3_of(lr: torch.Tensor) -> torch.Tensor:
    clamped = torch.clamp(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.expm1(clamped) - clamped


def _token_keep(stats: _Stats, rule: RejectionRule) -> torch.Tensor:
    """``[B, T]`` bool keep mask of a token-scope rule; padding may be True or False."""
    if rule.option is RSOption.TOKEN_K1:
        assert rule.lower is not None  # resolved in RejectionRule.__post_init__
        # log L ≤ −ℓ ≤ log U  ⇔  −log U ≤ ℓ ≤ −log L
        lo, hi = -math.log(rule.upper), -math.log(rule.lower)
        return (stats.lr >= lo) & (stats.lr <= hi)
    if rule.option is RSOption.TOKEN_K2:
        return stats.lr.abs() <= math.sqrt(2.0 * rule.upper)
    return stats.k3 <= rule.upper


def _seq_keep(stats: _Stats, rule: RejectionRule) -> torch.Tensor:
    """``[B]`` bool keep vector of a sequence-scope rule."""
    option = rule.option
    if option.is_k1:
        assert rule.lower is not None  # resolved in RejectionRule.__post_init__
        total = -stats.seq_sum
        stat = total if option is RSOption.SEQ_SUM_K1 else stats.seq_mean_of(total)
        return (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
    if option is RSOption.SEQ_MAX_K2:
        lo, hi = stats.lr_minmax  # padding zeros never raise a max of a non-negative statistic
        stat = 0.5 * torch.maximum(lo * lo, hi * hi)
    elif option is RSOption.SEQ_MAX_K3:
        lo, hi = stats.lr_minmax  # k3 grows monotonically with |ℓ| on each side of 0
        stat = torch.maximum(_k3_of(lo), _k3_of(hi))
    else:
        total = stats.seq_sum_k2 if option.value.endswith("k2") else stats.seq_sum_k3
        stat = total if option.value.startswith("seq_sum") else stats.seq_mean_of(total)
    return stat <= rule.upper


def rejection_from_stats(
    stats: _Stats, rules: tuple[RejectionRule, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """The work of :func:`rejection_mask` on precomputed statistics; returns a bool mask."""
    metrics: dict[str, torch.Tensor | float] = {}
    keep = stats.mask
    if not rules:
        metrics["rs_masked_frac_token"] = 0.0
        metrics["rs_masked_frac_seq"] = 0.0
        return keep, metrics
    n_tok = stats.n_tok.clamp(min=1.0)
    n_seq = stats.n_seq.clamp(min=1.0)
    seq_keep_all: torch.Tensor | None = None  # [B] AND of all sequence-scope rules
    for rule in rules:
        name = rule.option.value
        if rule.option.is_token:
            token_keep = _token_keep(stats, rule)
            rejected = stats.mask & ~token_keep
            # per-sequence count of rejected valid tokens
            rej_per_seq = rejected.sum(dim=-1)
            metrics[f"rs_masked_frac_token/{name}"] = rej_per_seq.sum().to(torch.float64) / n_tok
            metrics[f"rs_masked_frac_seq/{name}"] = (rej_per_seq > 0).sum().to(
                torch.float64
            ) / n_seq
            keep = keep & ~rejected
        else:
            seq_keep = _seq_keep(stats, rule) | ~stats.seq_valid
            dropped = ~seq_keep
            metrics[f"rs_masked_frac_token/{name}"] = (
                torch.where(dropped, stats.seq_len, 0.0).sum() / n_tok
            )
            metrics[f"rs_masked_frac_seq/{name}"] = dropped.sum().to(torch.float64) / n_seq
            seq_keep_all = seq_keep if seq_keep_all is None else seq_keep_all & seq_keep
    if seq_keep_all is not None:
        keep = keep & seq_keep_all.unsqueeze(-1)
    kept_per_seq = keep.sum(dim=-1).to(torch.float64)
    metrics["rs_masked_frac_token"] = (stats.n_tok - kept_per_seq.sum()) / n_tok
    metrics["rs_masked_frac_seq"] = (kept_per_seq < stats.seq_len).sum().to(torch.float64) / n_seq
    return keep, metrics
