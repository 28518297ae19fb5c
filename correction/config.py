"""Typed correction settings and the named presets.

Why a stdlib dataclass: ``correction`` imports only torch, so the pydantic config layer embeds this
type through :meth:`CorrectionConfig.to_dict` / :meth:`CorrectionConfig.from_dict` rather than the
other way round. Every field is validated in ``__post_init__`` with an error that names the field;
every preset is a value of this type, so a preset name is resolved in exactly one place.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from correction.types import ISLevel, RejectionRule, RSOption, as_is_level, as_rules

__all__ = ["PRESETS", "CorrectionConfig", "LossType", "ProximalMethod", "preset"]


class LossType(StrEnum):
    """Policy loss used in bypass mode (where π_rollout is the anchor)."""

    PPO_CLIP = "ppo_clip"
    """PPO clip of r = π_θ / π_rollout; the ratio already corrects, so no IS weight."""
    REINFORCE = "reinforce"
    """−A · log π_θ · stopgrad(w), with w the IS weight (1 when IS is off)."""


class ProximalMethod(StrEnum):
    """How decoupled mode gets π_old (the proximal policy its PPO clip and IS weights use)."""

    RECOMPUTE = "recompute"
    """A forward pass with the weights before the update (exact)."""
    LOGLINEAR = "loglinear"
    """AReaL's log-linear interpolation between π_rollout and π_θ by version, inside the update
    (no forward pass; ``correction.proximal``)."""


_FIELDS = (
    "bypass",
    "loss_type",
    "is_level",
    "is_threshold",
    "is_batch_normalize",
    "rs_rules",
    "proximal",
    "m2po_threshold",
    "opsm_threshold",
    "stale_rs_multiplier",
    "stale_rs_floor",
)


def _optional_number(name: str, value: Any, *, allow_zero: bool) -> float | None:
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise ValueError(
            f"CorrectionConfig.{name} must be null or a finite number {need}, got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class CorrectionConfig:
    """How the trainer corrects for the gap between π_rollout and the policy it trains.

    Attributes:
        bypass: skip the π_old forward pass and anchor on π_rollout (``log_ratio`` is then
            log π_θ.detach() − log π_rollout).
        loss_type: the policy loss in bypass mode (``ppo_clip`` or ``reinforce``); decoupled mode
            uses the trainer's own policy loss and requires ``ppo_clip`` here.
        is_level: IS weight level (``token``, ``sequence``, ``geometric``), or None for no IS.
        is_threshold: the truncation C of the IS weights (> 0).
        is_batch_normalize: rescale IS weights so their batch mean is 1.
        rs_rules: rejection rules, AND-combined (empty: no RS).
        proximal: how decoupled mode gets π_old: ``recompute`` (a forward pass) or
            ``loglinear`` (AReaL's interpolation by version inside the update, no forward pass).
        m2po_threshold: M2PO's bound τ on the batch's mean squared log-ratio (None: off).
        opsm_threshold: OPSM's δ: drop negative-advantage samples whose mean k1 divergence
            exceeds it (None: off).
        stale_rs_multiplier: staleness-adaptive RS: drop sequences that drifted more than this
            many times the batch's measured drift per version of their staleness (None: off).
        stale_rs_floor: the staleness-adaptive bound at staleness 0 (log-ratio, ≥ 0).

    Example::

        CorrectionConfig(is_level="token", rs_rules=(RejectionRule("token_k1", 2.0),))
    """

    bypass: bool = False
    loss_type: LossType = LossType.PPO_CLIP
    is_level: ISLevel | None = None
    is_threshold: float = 2.0
    is_batch_normalize: bool = False
    rs_rules: tuple[RejectionRule, ...] = ()
    proximal: ProximalMethod = ProximalMethod.RECOMPUTE
    m2po_threshold: float | None = None
    opsm_threshold: float | None = None
    stale_rs_multiplier: float | None = None
    stale_rs_floor: float = 0.001

    def __post_init__(self) -> None:
        for name in ("bypass", "is_batch_normalize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"CorrectionConfig.{name} must be true or false, got {getattr(self, name)!r}"
                )
        try:
            loss_type = (
                self.loss_type if isinstance(self.loss_type, LossType) else LossType(self.loss_type)
            )
        except ValueError:
            raise ValueError(
                f"CorrectionConfig.loss_type={self.loss_type!r} is not a loss type; "
                f"use one of {[t.value for t in LossType]}"
            ) from None
        object.__setattr__(self, "loss_type", loss_type)
        if self.is_level is not None:
            object.__setattr__(
                self, "is_level", as_is_level(self.is_level, "CorrectionConfig.is_level")
            )
        threshold = self.is_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float):
            raise ValueError(
                f"CorrectionConfig.is_threshold must be a number > 0, got {threshold!r}"
            )
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(
                f"CorrectionConfig.is_threshold must be a finite number > 0 (e.g. 2.0), got {threshold!r}"
            )
        object.__setattr__(self, "is_threshold", float(threshold))
        try:
            rules = as_rules(self.rs_rules)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"CorrectionConfig.rs_rules: {exc}") from None
        object.__setattr__(self, "rs_rules", rules)
        if not self.bypass and loss_type is not LossType.PPO_CLIP:
            raise ValueError(
                f"CorrectionConfig.loss_type={loss_type.value!r} applies only in bypass mode; "
                "set bypass=true or loss_type='ppo_clip'"
            )
        if self.bypass and loss_type is LossType.PPO_CLIP and self.is_level is not None:
            raise ValueError(
                "CorrectionConfig.is_level must be null with bypass=true and loss_type='ppo_clip': the "
                "PPO ratio π_θ/π_rollout already is the IS correction (a weight would count it twice); "
                "use loss_type='reinforce' for explicit IS weights"
            )
        self._check_stale_sample_options()

    def _check_stale_sample_options(self) -> None:
        """The fields of the newer off-policy variants (M2PO, OPSM, staleness RS, proximal)."""
        try:
            proximal = ProximalMethod(self.proximal)
        except ValueError:
            raise ValueError(
                f"CorrectionConfig.proximal={self.proximal!r} is not a proximal method; "
                f"use one of {[p.value for p in ProximalMethod]}"
            ) from None
        object.__setattr__(self, "proximal", proximal)
        for name, allow_zero in (
            ("m2po_threshold", False),
            ("opsm_threshold", True),
            ("stale_rs_multiplier", False),
        ):
            object.__setattr__(
                self, name, _optional_number(name, getattr(self, name), allow_zero=allow_zero)
            )
        floor = _optional_number("stale_rs_floor", self.stale_rs_floor, allow_zero=True)
        if floor is None:
            raise ValueError("CorrectionConfig.stale_rs_floor must be a finite number >= 0")
        object.__setattr__(self, "stale_rs_floor", floor)
        if proximal is ProximalMethod.LOGLINEAR:
            self._check_loglinear()

    def _check_loglinear(self) -> None:
        """loglinear forms π_old inside the update: nothing may need it before."""
        if self.bypass:
            raise ValueError(
                "CorrectionConfig.proximal='loglinear' is a decoupled-mode option (bypass anchors "
                "on π_rollout); set bypass=false or proximal='recompute'"
            )
        before = [
            name
            for name, on in (
                ("rs_rules", bool(self.rs_rules)),
                ("is_batch_normalize", self.is_batch_normalize),
                ("m2po_threshold", self.m2po_threshold is not None),
                ("opsm_threshold", self.opsm_threshold is not None),
                ("stale_rs_multiplier", self.stale_rs_multiplier is not None),
            )
            if on
        ]
        if before:
            raise ValueError(
                f"CorrectionConfig.proximal='loglinear' forms π_old inside the update, per "
                f"micro-batch, but {before} need(s) it before the update; drop them or use "
                "proximal='recompute'"
            )

    @property
    def enabled(self) -> bool:
        """True when the trainer has anything to do (bypass, IS, RS or another mask)."""
        return (
            self.bypass
            or self.is_level is not None
            or self.masks_before_update
            or self.proximal is ProximalMethod.LOGLINEAR
        )

    @property
    def masks_before_update(self) -> bool:
        """Some mask (RS rules, M2PO, OPSM, staleness RS) needs ℓ before the update."""
        return bool(self.rs_rules) or any(
            v is not None
            for v in (self.m2po_threshold, self.opsm_threshold, self.stale_rs_multiplier)
        )

    @property
    def needs_old_log_probs(self) -> bool:
        """Decoupled mode recomputes π_old before the update (``proximal='recompute'``); bypass
        mode and ``proximal='loglinear'`` do not."""
        return not self.bypass and self.proximal is ProximalMethod.RECOMPUTE

    @property
    def needs_train_log_probs(self) -> bool:
        """π_train is needed before the update (IS weights or a mask); never with loglinear,
        whose π_old exists only inside the update."""
        if self.proximal is ProximalMethod.LOGLINEAR:
            return False
        return self.is_level is not None or self.masks_before_update

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (enums as their string values, rules as dicts)."""
        return {
            "bypass": self.bypass,
            "loss_type": self.loss_type.value,
            "is_level": None if self.is_level is None else self.is_level.value,
            "is_threshold": self.is_threshold,
            "is_batch_normalize": self.is_batch_normalize,
            "rs_rules": [rule.to_dict() for rule in self.rs_rules],
            "proximal": self.proximal.value,
            "m2po_threshold": self.m2po_threshold,
            "opsm_threshold": self.opsm_threshold,
            "stale_rs_multiplier": self.stale_rs_multiplier,
            "stale_rs_floor": self.stale_rs_floor,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CorrectionConfig:
        """Build from :meth:`to_dict` output (missing keys take defaults; unknown keys error).

        ``rs_rules`` entries may be dicts (``{"option": ..., "upper": ..., "lower": ...}``) or
        ``RejectionRule`` values.
        """
        unknown = set(data) - set(_FIELDS)
        if unknown:
            raise ValueError(
                f"CorrectionConfig got unknown key(s) {sorted(unknown)}; valid keys: {list(_FIELDS)}"
            )
        kwargs = dict(data)
        if "rs_rules" in kwargs:
            raw = kwargs["rs_rules"]
            if raw is None:
                raw = []
            if isinstance(raw, Mapping | str):
                raise ValueError(
                    "CorrectionConfig.rs_rules must be a list of rules, e.g. "
                    '[{"option": "token_k1", "upper": 2.0}]'
                )
            rules = []
            for i, item in enumerate(raw):
                if isinstance(item, RejectionRule):
                    rules.append(item)
                elif isinstance(item, Mapping):
                    try:
                        rules.append(RejectionRule.from_dict(dict(item)))
                    except ValueError as exc:
                        raise ValueError(f"CorrectionConfig.rs_rules[{i}]: {exc}") from None
                else:
                    raise ValueError(
                        f"CorrectionConfig.rs_rules[{i}] must be a dict with option/upper/lower, "
                        f"got {item!r}"
                    )
            kwargs["rs_rules"] = tuple(rules)
        return cls(**kwargs)


OPSM_DELTA = 0.05
"""δ of the OPSM presets (slime defaults to 1e-4, TRL suggests 0.5; see docs/correction.md)."""


def _k1(option: RSOption, lower: float, upper: float) -> RejectionRule:
    return RejectionRule(option, upper=upper, lower=lower)


_PRESETS: dict[str, CorrectionConfig] = {
    # No correction: plain (decoupled) PPO on whatever the rollouts were.
    "disabled": CorrectionConfig(),
    # Token-level TIS (C = 2): low variance, some bias; the robust default for mild mismatch.
    "decoupled_token_is": CorrectionConfig(is_level=ISLevel.TOKEN, is_threshold=2.0),
    # Sequence-level TIS: unbiased up to truncation, high variance on long responses.
    "decoupled_seq_is": CorrectionConfig(is_level=ISLevel.SEQUENCE, is_threshold=2.0),
    # Sequence TIS plus sequence RS on the summed k1 (ratio of the whole sequence within [0.5, 2]).
    "decoupled_seq_is_rs": CorrectionConfig(
        is_level=ISLevel.SEQUENCE,
        is_threshold=2.0,
        rs_rules=(_k1(RSOption.SEQ_SUM_K1, 0.5, 2.0),),
    ),
    # Geometric RS: drop sequences whose per-token geometric-mean ratio leaves [0.999, 1.001].
    "decoupled_geo_rs": CorrectionConfig(rs_rules=(_k1(RSOption.SEQ_MEAN_K1, 0.999, 1.001),)),
    # k3 RS: drop sequences whose mean k3 (a KL estimate) exceeds 0.01.
    "decoupled_k3_rs": CorrectionConfig(rs_rules=(RejectionRule(RSOption.SEQ_MEAN_K3, 0.01),)),
    # Bypass: no π_old pass; PPO clip directly on π_θ / π_rollout.
    "bypass_ppo_clip": CorrectionConfig(bypass=True, loss_type=LossType.PPO_CLIP),
    # Bypass + geometric RS.
    "bypass_ppo_clip_geo_rs": CorrectionConfig(
        bypass=True,
        loss_type=LossType.PPO_CLIP,
        rs_rules=(_k1(RSOption.SEQ_MEAN_K1, 0.999, 1.001),),
    ),
    # Bypass REINFORCE with sequence-level TIS: −A · log π_θ · stopgrad(w).
    "bypass_pg_is": CorrectionConfig(
        bypass=True, loss_type=LossType.REINFORCE, is_level=ISLevel.SEQUENCE, is_threshold=2.0
    ),
    # IcePop: mask tokens whose ratio leaves [0.5, 2] (decoupled).
    "icepop": CorrectionConfig(rs_rules=(_k1(RSOption.TOKEN_K1, 0.5, 2.0),)),
    # M2PO (AReaL): token TIS + mask the largest-ℓ² tokens until the batch's mean ℓ² < 0.04.
    "decoupled_m2po": CorrectionConfig(
        is_level=ISLevel.TOKEN, is_threshold=2.0, m2po_threshold=0.04
    ),
    # AReaL's proximal approximation: token TIS with π_old interpolated by version, no π_old pass.
    "decoupled_loglinear": CorrectionConfig(
        is_level=ISLevel.TOKEN, is_threshold=2.0, proximal=ProximalMethod.LOGLINEAR
    ),
    # OPSM (slime --use-opsm, TRL off_policy_mask_threshold) on top of token TIS.
    "decoupled_token_is_opsm": CorrectionConfig(
        is_level=ISLevel.TOKEN, is_threshold=2.0, opsm_threshold=OPSM_DELTA
    ),
    # OPSM on top of bypass PPO clip.
    "bypass_ppo_clip_opsm": CorrectionConfig(
        bypass=True, loss_type=LossType.PPO_CLIP, opsm_threshold=OPSM_DELTA
    ),
    # Token TIS + a geometric bound that widens with each sequence's measured staleness.
    "decoupled_token_is_stale_rs": CorrectionConfig(
        is_level=ISLevel.TOKEN, is_threshold=2.0, stale_rs_multiplier=2.0
    ),
}

PRESETS: Mapping[str, CorrectionConfig] = MappingProxyType(_PRESETS)
"""Every named preset (read-only)."""


def preset(name: str) -> CorrectionConfig:
    """The preset called ``name``; an unknown name errors with the list and the closest match."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(str(name), list(PRESETS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown correction preset {name!r}.{hint} Available presets: {sorted(PRESETS)}"
        ) from None
