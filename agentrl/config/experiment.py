"""The top level of a config file: :class:`ExperimentConfig` (``kind: rl``) and
:class:`SFTConfig` (``kind: sft``), each a mapping of the sections defined beside this module.

Guarantees: the cross-section checks (external servers have URLs, validation sampling is not
identical greedy copies, the batch splits into mini-batches) run on every validation;
``flatten()`` and ``to_yaml()`` give the whole resolved config (MLflow params, the saved run
config). :data:`KINDS` maps the top-level ``kind:`` to its schema.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import Field, model_validator

from agentrl.config.agent import AgentConfig
from agentrl.config.algorithm import AlgorithmConfig
from agentrl.config.checkpoint import CheckpointConfig
from agentrl.config.data import DataConfig, SFTDataConfig
from agentrl.config.distributed import DistributedConfig
from agentrl.config.environment import EnvironmentConfig
from agentrl.config.inference import InferenceConfig
from agentrl.config.model import PolicyModelConfig, SFTModelConfig
from agentrl.config.reward import RewardConfig
from agentrl.config.rollout import RolloutConfig
from agentrl.config.section import Section
from agentrl.config.teacher import TeacherConfig
from agentrl.config.tools import ToolsConfig
from agentrl.config.tracking import TrackingConfig
from agentrl.config.trainer import SFTTrainerConfig, TrainerConfig
from agentrl.config.yaml_io import dump_yaml, flatten_params

__all__ = ["KINDS", "AnyConfig", "ExperimentConfig", "SFTConfig"]


class ExperimentConfig(Section):
    """An RL experiment (`kind: rl`)."""

    kind: Literal["rl"] = "rl"
    """Schema of this file: `rl` (this one) or `sft`."""
    imports: list[str] = Field(default_factory=list)
    """Your code, imported before anything is built (driver, Ray actors, subprocesses): module names, or `.py` files / package folders relative to this file."""
    base_dir: str | None = None
    """Folder that relative paths in this config resolve against; null = the config file's folder (set when the file is loaded)."""
    model: PolicyModelConfig = Field(default_factory=PolicyModelConfig)
    """The policy model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Tasks."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """The agent loop."""
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    """The environment tasks run in (state, tools, protocol, reward); see docs/environments.md."""
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    """Tools."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward functions."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """Inference servers and sampling."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Agent-loop workers."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Estimator, loss, KL, correction."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The trainer loop."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Weight sync to the servers."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment tracking."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Placement."""
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    """On-policy distillation from a teacher model (off unless `teacher.path` is set)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> ExperimentConfig:
        if self.inference.backend == "external" and not self.inference.urls:
            raise ValueError(
                "inference.backend is 'external' but inference.urls is empty; "
                "list the servers' base URLs or use backend 'embedded' or 'vllm'"
            )
        t = self.trainer
        if t.val_n > 1 and t.val_temperature == 0.0:
            raise ValueError(
                f"trainer.val_n={t.val_n} with trainer.val_temperature=0: greedy samples are "
                "identical; set val_temperature > 0 (e.g. 1.0) or val_n: 1"
            )
        if t.val_k is not None and any(k < 1 or k > t.val_n for k in t.val_k):
            raise ValueError(
                f"trainer.val_k={t.val_k}: every k must be in 1..trainer.val_n ({t.val_n})"
            )
        buf, budget = self.reward.overlong_buffer_len, self.agent.max_response_tokens
        if buf > budget:
            raise ValueError(
                f"reward.overlong_buffer_len={buf} is over agent.max_response_tokens={budget}; "
                "the penalty starts at max_response_tokens - overlong_buffer_len: lower it"
            )
        if (
            self.teacher.enabled
            and self.teacher.backend == "vllm"
            and (self.inference.temperature not in (0.0, 1.0))
        ):
            raise ValueError(
                f"teacher.backend 'vllm' with inference.temperature={self.inference.temperature}: "
                "vLLM's prompt_logprobs are temperature-1 logprobs, not comparable with the "
                "student's; use teacher.backend: embedded (any temperature) or temperature 1"
            )
        self._check_colocate()
        mini = self.trainer.mini_batch_size  # None follows data.batch_size
        if mini is not None and self.data.batch_size % mini != 0:
            raise ValueError(
                f"data.batch_size ({self.data.batch_size}) must be a multiple of "
                f"trainer.mini_batch_size ({self.trainer.mini_batch_size})"
            )
        return self

    def _check_colocate(self) -> None:
        """``distributed.colocate`` only where servers and trainer can share a device."""
        if not self.distributed.colocate:
            return
        if self.distributed.backend == "ray":
            raise ValueError(
                "distributed.colocate=true with distributed.backend='ray': Ray places servers "
                "and trainer side by side (each its own GPUs); use distributed.backend: local "
                "for colocated mode, or colocate: false on Ray"
            )
        inf = self.inference
        # A CPU asked for by name is refused here; with device auto it is known only at run
        # time (agentrl.training.trainer.check_colocate refuses it then, before any server).
        on_cpu = "cpu" in (inf.device, self.trainer.device) and "cuda" not in (
            inf.device,
            self.trainer.device,
        )
        if inf.backend == "vllm" and on_cpu:
            raise ValueError(VLLM_CPU_COLOCATE)

    def flatten(self) -> dict[str, str]:
        """Dotted keys -> string values (e.g. for MLflow params)."""
        return flatten_params(self.model_dump(mode="json"))

    def to_yaml(self) -> str:
        """The full resolved config as YAML (loads back to an equal config)."""
        return dump_yaml(self)


VLLM_CPU_COLOCATE = (
    "distributed.colocate=true with inference.backend='vllm' on the CPU: vLLM's sleep mode "
    "(/sleep, /wake_up) needs CUDA's memory allocator and the CPU build refuses "
    "--enable-sleep-mode; use inference.backend: embedded for colocated mode on a CPU, or "
    "colocate: false"
)
"""Why colocated mode with vLLM is refused on a CPU (also raised at run time for device auto)."""


class SFTConfig(Section):
    """A supervised fine-tuning run (`kind: sft`), e.g. the warm start before RL."""

    kind: Literal["sft"] = "sft"
    """Schema of this file: `sft` (this one) or `rl`."""
    model: SFTModelConfig = Field(default_factory=SFTModelConfig)
    """The model to fine-tune."""
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    """Conversations."""
    trainer: SFTTrainerConfig = Field(default_factory=SFTTrainerConfig)
    """The trainer loop."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment tracking."""

    def flatten(self) -> dict[str, str]:
        """Dotted keys -> string values (e.g. for MLflow params)."""
        return flatten_params(self.model_dump(mode="json"))

    def to_yaml(self) -> str:
        """The full resolved config as YAML (loads back to an equal config)."""
        return dump_yaml(self)


KINDS: dict[str, type[ExperimentConfig] | type[SFTConfig]] = {
    "rl": ExperimentConfig,
    "sft": SFTConfig,
}
"""Top-level `kind:` -> schema."""

AnyConfig = Union[ExperimentConfig, SFTConfig]  # noqa: UP007 - a runtime alias, used in isinstance
