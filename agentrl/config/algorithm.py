"""The ``algorithm`` section: advantage estimator, policy loss, KL and off-policy correction.

The estimator and the loss are :class:`VariantSection` s (a registered name plus that variant's
own knobs, checked later against the registry); ``correction`` mirrors
``correction.CorrectionConfig`` field by field and builds one with :meth:`~CorrectionSection.
to_correction_config` (which imports torch lazily: this module itself imports pydantic only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from agentrl.config.section import ConfigError, Section

if TYPE_CHECKING:
    from correction import CorrectionConfig

__all__ = [
    "AdvantageSection",
    "AlgorithmConfig",
    "CorrectionPresetName",
    "CorrectionSection",
    "KLControlConfig",
    "LossSection",
    "RSOptionName",
    "RejectionRuleConfig",
    "VariantSection",
]


class KLControlConfig(Section):
    """KL-in-reward coefficient controller."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """`fixed` coefficient or `adaptive` (moves it towards `target_kl`)."""
    kl_coef: float = Field(default=0.001, ge=0.0)
    """Initial (fixed: constant) KL coefficient."""
    target_kl: float = Field(default=0.1, gt=0.0)
    """Target KL of the adaptive controller."""
    horizon: int = Field(default=10000, ge=1)
    """Horizon (in samples) of the adaptive controller."""


RSOptionName = Literal[
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
]

CorrectionPresetName = Literal[
    "disabled",
    "decoupled_token_is",
    "decoupled_seq_is",
    "decoupled_seq_is_rs",
    "decoupled_geo_rs",
    "decoupled_k3_rs",
    "bypass_ppo_clip",
    "bypass_pg_is",
    "bypass_ppo_clip_geo_rs",
    "icepop",
    "decoupled_m2po",
    "decoupled_loglinear",
    "decoupled_token_is_opsm",
    "bypass_ppo_clip_opsm",
    "decoupled_token_is_stale_rs",
]


class RejectionRuleConfig(Section):
    """One rejection-sampling rule (a hard trust region on a divergence statistic)."""

    option: RSOptionName
    """Statistic and level (`token_k1`, `seq_mean_k3`, ...; see docs/correction.md)."""
    upper: float = Field(gt=0.0)
    """Upper bound (k1 options: ratio space; a k1 rule without `lower` means [1/upper, upper])."""
    lower: float | None = Field(default=None, gt=0.0)
    """Lower bound, k1 options only (ratio space); None = 1/upper."""


class CorrectionSection(Section):
    """Off-policy correction; mirrors `correction.CorrectionConfig`.

    With `preset` set, the preset gives every field that the file or overrides did not set
    explicitly; explicitly set fields win.
    """

    preset: CorrectionPresetName | None = None
    """Named preset (e.g. `decoupled_token_is`, `icepop`); None = use the fields below."""
    bypass: bool = False
    """Bypass mode: skip the π_old forward pass and use π_rollout as the anchor."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Bypass-mode loss: `ppo_clip` against π_rollout, or `reinforce` with IS weights."""
    is_level: Literal["token", "sequence", "geometric"] | None = None
    """Importance-sampling weight level; None = no IS weights."""
    is_threshold: float = Field(default=2.0, gt=0.0)
    """Upper truncation C of the IS weights."""
    is_batch_normalize: bool = False
    """Divide IS weights by their batch mean."""
    rs_rules: list[RejectionRuleConfig] = Field(default_factory=list)
    """Rejection-sampling rules, AND-combined (each `{option, upper, lower}`)."""
    proximal: Literal["recompute", "loglinear"] = "recompute"
    """Decoupled π_old: `recompute` (a forward pass) or `loglinear` (AReaL's interpolation by version, no pass)."""
    m2po_threshold: float | None = Field(default=None, gt=0.0)
    """M2PO: mask the largest squared log-ratios until the batch's mean is below this (AReaL 0.04); None = off."""
    opsm_threshold: float | None = Field(default=None, ge=0.0)
    """OPSM: drop negative-advantage samples whose mean k1 divergence exceeds this; None = off."""
    stale_rs_multiplier: float | None = Field(default=None, gt=0.0)
    """Staleness-adaptive RS: drop sequences drifting over this many times the measured drift per version of staleness; None = off."""
    stale_rs_floor: float = Field(default=0.001, ge=0.0)
    """Staleness-adaptive RS: the bound on the mean log-ratio of fresh (staleness 0) sequences."""

    @model_serializer(mode="wrap")
    def _dump_preset_and_explicit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # With a preset, dumping every field would turn the preset's values into explicit
        # overrides on reload; keep the preset and what was set explicitly, nothing else.
        data = handler(self)
        if self.preset is None:
            return data
        keep = set(self.model_fields_set) | {"preset"}
        return {key: value for key, value in data.items() if key in keep}

    def explicit_fields(self) -> dict[str, Any]:
        """The mirrored fields that were set explicitly (not left at their default)."""
        names = set(self.model_fields_set) - {"preset"}
        return self.model_dump(mode="json", include=names)

    def to_correction_config(self) -> CorrectionConfig:
        """The `correction.CorrectionConfig` this section describes (imports torch lazily)."""
        import correction

        if self.preset is None:
            data = self.model_dump(mode="json", exclude={"preset"})
        else:
            data = correction.preset(self.preset).to_dict()
            data.update(self.explicit_fields())
        try:
            return correction.CorrectionConfig.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"algorithm.correction: {exc}") from exc


class VariantSection(BaseModel):
    """A choice among registered variants: ``name`` plus that variant's own knobs.

    Written ``{name: grpo, norm_adv_by_std_in_grpo: false}`` or just ``grpo``. The knobs are
    the keyword options of the registered function (its signature is their schema and holds
    their defaults); they are validated, with the key path in every error, by the run's
    resolution pass before any server starts (``agentrl.training.algorithm``), since knowing
    them needs the registry (torch). A ``module:function`` name is a custom variant.
    """

    model_config = ConfigDict(
        extra="allow", validate_assignment=True, use_attribute_docstrings=True
    )

    name: str
    """Registered name, or `module:function` / `path/file.py:function` for your own."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    def knobs(self) -> dict[str, Any]:
        """The variant's own options (everything but ``name``)."""
        return dict(self.model_extra or {})


class AdvantageSection(VariantSection):
    """Advantage estimator and its knobs, e.g. `{name: gae, gamma: 1.0, lam: 0.95}`."""

    name: str = "grpo"
    """Estimator: a registered name, e.g. grpo, gae, rloo (docs/algorithms.md lists every one and its knobs), or `module:function`."""


class LossSection(VariantSection):
    """Policy loss and its knobs, e.g. `{name: vanilla, clip_ratio_low: 0.2, clip_ratio_high: 0.28}`."""

    name: str = "vanilla"
    """Loss: a registered name, e.g. vanilla (PPO clip + dual clip), gspo, cispo (docs/algorithms.md lists every one and its knobs), or `module:function`."""


class AlgorithmConfig(Section):
    """Advantage estimator, policy loss, KL and off-policy correction."""

    advantage: AdvantageSection = Field(default_factory=AdvantageSection)
    """Advantage estimator (a name, or `{name: ..., <knob>: ...}`)."""
    loss: LossSection = Field(default_factory=LossSection)
    """Policy loss (a name, or `{name: ..., <knob>: ...}`)."""
    cliprange_value: float = Field(default=0.5, gt=0.0)
    """GAE critic: value-loss clip, V_clip = V_old + clip(V - V_old, ±cliprange_value)."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses are aggregated over the mini-batch."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (0 = off)."""
    use_kl_loss: bool = False
    """Add a KL(π_θ || π_ref) loss term (needs a reference model)."""
    kl_loss_coef: float = Field(default=0.001, ge=0.0)
    """Coefficient of the KL loss term."""
    kl_loss_type: Literal[
        "k1",
        "k2",
        "mse",
        "k3",
        "low_var_kl",
        "abs",
        "k1+",
        "k2+",
        "mse+",
        "k3+",
        "low_var_kl+",
        "abs+",
    ] = "low_var_kl"
    """KL estimator of the loss term (suffix `+`: k2 gradient, straight-through)."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty from the token-level rewards instead."""
    kl_penalty: Literal["k1", "k2", "mse", "k3", "low_var_kl", "abs"] = "k1"
    """KL estimator of the in-reward penalty."""
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    """Controller of the in-reward KL coefficient."""
    correction: CorrectionSection = Field(default_factory=CorrectionSection)
    """Off-policy correction (IS weights, RS masks, bypass)."""
    mask_truncated: bool = False
    """Drop the loss of episodes cut by a length budget (`stop_reason: length`); their rewards still count in their group (TRL's `mask_truncated_completions`)."""
