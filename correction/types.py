"""The vocabulary of the correction package: IS levels, RS options and rules.

Read this first. An IS *level* says how importance weights are formed (per token, per sequence, or
the per-token geometric mean of the sequence); an RS *option* names a statistic (k1, k2, k3) and a
scope (the token, or the sum / mean / max over the sequence); a :class:`RejectionRule` pairs an
option with its bounds. All are plain, hashable, JSON-able values; strings convert to the enums with
an error that lists the valid values (and the closest one) on a typo.

Example::

    RejectionRule("token_k1", 2.0)            # IcePop: keep 0.5 <= π_rollout/π_train <= 2
    RejectionRule(RSOption.SEQ_MEAN_K3, 0.01) # drop sequences whose mean k3 exceeds 0.01
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["ISLevel", "RSOption", "RejectionRule"]


class ISLevel(StrEnum):
    """At which granularity an IS weight is computed."""

    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"


def as_is_level(level: ISLevel | str, field: str = "level") -> ISLevel:
    """``level`` as an :class:`ISLevel`; a ``ValueError`` names ``field`` and the valid levels."""
    if isinstance(level, ISLevel):
        return level
    try:
        return ISLevel(level)
    except ValueError:
        raise ValueError(
            f"{field}={level!r} is not an IS level; use one of {[lv.value for lv in ISLevel]}"
        ) from None


def check_threshold(threshold: float, field: str = "threshold") -> float:
    """``threshold`` as a float, checked to be finite and > 0 (the error names ``field``)."""
    value = float(threshold)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{field} must be a finite number > 0 (e.g. 2.0), got {threshold!r}")
    return value


class RSOption(StrEnum):
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
        """The rule thresholds the log-ratio itself (k1), with a lower and an upper bound."""
        return self.value.endswith("k1")

    @property
    def is_token(self) -> bool:
        """The rule keeps or drops single tokens (else whole sequences)."""
        return self.value.startswith("token_")


def as_rs_option(option: RSOption | str, field: str = "option") -> RSOption:
    """``option`` as an :class:`RSOption`; a ``ValueError`` names ``field``, the closest match and
    the valid options."""
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
