"""Typed experiment configuration: YAML files, dotted overrides, one validated object.

Why it exists: every component reads its knobs from one :class:`ExperimentConfig` (or, for the
supervised warm start, one :class:`SFTConfig`), so a typo in a YAML file or on the command line
fails before any server starts, with the full key path and the closest valid key::

    cfg = load_config("configs/quickstart.yaml", ["trainer.max_staleness=2", "tracking.enabled=false"])
    cfg.trainer.max_staleness                       # 2
    cfg.algorithm.correction.to_correction_config()  # correction.CorrectionConfig (imports torch lazily)
    cfg.flatten()["algorithm.correction.preset"]     # "decoupled_token_is" (MLflow params)

Where things are: the schema is one module per top-level key (``model``, ``data``, ``agent``,
``environment``, ``tools``, ``reward``, ``inference``, ``rollout``, ``algorithm``, ``trainer``, ``checkpoint``,
``tracking``, ``distributed``, ``teacher``; the SFT sections sit beside their RL namesakes), on the
:class:`Section` base (``section``), assembled by ``experiment``; reading a config is
``yaml_io`` (YAML 1.2 scalars), ``overrides`` (``a.b.c=value``) and ``loading`` (validation with
readable errors, ``kind:`` dispatch); ``docs`` renders the reference and ``__main__`` is
``python -m agentrl.config``. Import names from this package, not from the modules.

Guarantees:

- every section forbids unknown keys; the error reads
  ``unknown key 'trainer.max_stalenes'; did you mean 'trainer.max_staleness'?``;
- type errors name the dotted path, the expected type and the value that was given;
- overrides ``a.b.c=value`` are parsed with YAML scalar rules (``2`` -> int, ``1e-6`` -> float,
  ``false`` -> bool, ``[a, b]`` -> list, ``null`` -> None) and applied before validation;
- every field has a one-line description (attribute docstring) and a default that runs on a CPU
  laptop; ``python -m agentrl.config --markdown`` renders them into ``docs/configuration.md``;
- a file's top-level ``kind:`` picks the schema: ``rl`` (default, :class:`ExperimentConfig`) or
  ``sft`` (:class:`SFTConfig`); :func:`load_any_config` dispatches on it.

This package imports pydantic and PyYAML only: no torch, Ray, vLLM or MLflow.
To add a field, add one annotated attribute with a default and a one-line docstring to its
section class, then regenerate the docs (a test fails until you do).
"""

from __future__ import annotations

from agentrl.config.agent import AgentConfig
from agentrl.config.algorithm import (
    AdvantageSection,
    AlgorithmConfig,
    CorrectionPresetName,
    CorrectionSection,
    KLControlConfig,
    LossSection,
    RejectionRuleConfig,
    RSOptionName,
    VariantSection,
)
from agentrl.config.checkpoint import CheckpointConfig
from agentrl.config.data import DataConfig, SFTDataConfig
from agentrl.config.distributed import DistributedConfig
from agentrl.config.docs import config_markdown
from agentrl.config.environment import EnvironmentConfig
from agentrl.config.experiment import KINDS, AnyConfig, ExperimentConfig, SFTConfig
from agentrl.config.inference import InferenceConfig
from agentrl.config.loading import (
    MOVED_KEYS,
    load_any_config,
    load_config,
    load_sft_config,
    validate_config,
)
from agentrl.config.model import (
    LoraSection,
    ModelConfig,
    PolicyModelConfig,
    SFTModelConfig,
    TinyModelConfig,
)
from agentrl.config.overrides import apply_overrides, parse_override
from agentrl.config.reward import (
    DEFAULT_JUDGE_PROMPT,
    JudgeConfig,
    ModelRewardSpec,
    RewardConfig,
    RewardMixConfig,
    RewardModelConfig,
)
from agentrl.config.rollout import RolloutConfig
from agentrl.config.section import ConfigError, Section
from agentrl.config.teacher import TeacherConfig
from agentrl.config.tools import PythonToolConfig, SearchToolConfig, ToolsConfig
from agentrl.config.tracking import TrackingConfig
from agentrl.config.trainer import OptimizerFields, SFTTrainerConfig, TrainerConfig

__all__ = [
    "DEFAULT_JUDGE_PROMPT",
    "KINDS",
    "MOVED_KEYS",
    "AdvantageSection",
    "AgentConfig",
    "AlgorithmConfig",
    "AnyConfig",
    "CheckpointConfig",
    "ConfigError",
    "CorrectionPresetName",
    "CorrectionSection",
    "DataConfig",
    "DistributedConfig",
    "EnvironmentConfig",
    "ExperimentConfig",
    "InferenceConfig",
    "JudgeConfig",
    "KLControlConfig",
    "LoraSection",
    "LossSection",
    "ModelConfig",
    "ModelRewardSpec",
    "OptimizerFields",
    "PolicyModelConfig",
    "PythonToolConfig",
    "RSOptionName",
    "RejectionRuleConfig",
    "RewardConfig",
    "RewardMixConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTModelConfig",
    "SFTTrainerConfig",
    "SearchToolConfig",
    "Section",
    "TeacherConfig",
    "TinyModelConfig",
    "ToolsConfig",
    "TrackingConfig",
    "TrainerConfig",
    "VariantSection",
    "apply_overrides",
    "config_markdown",
    "load_any_config",
    "load_config",
    "load_sft_config",
    "parse_override",
    "validate_config",
]
