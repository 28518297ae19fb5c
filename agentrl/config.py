"""Typed experiment configuration: YAML files, dotted overrides, one validated object.

Why it exists: every component reads its knobs from one :class:`ExperimentConfig` (or, for the
supervised warm start, one :class:`SFTConfig`), so a typo in a YAML file or on the command line
fails before any server starts, with the full key path and the closest valid key::

    cfg = load_config("configs/quickstart.yaml", ["trainer.max_staleness=2", "tracking.enabled=false"])
    cfg.trainer.max_staleness                       # 2
    cfg.algorithm.correction.to_correction_config()  # correction.CorrectionConfig (imports torch lazily)
    cfg.flatten()["algorithm.correction.preset"]     # "decoupled_token_is" (MLflow params)

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

This module imports pydantic and PyYAML only: no torch, Ray, vLLM or MLflow.
To add a field, add one annotated attribute with a default and a one-line docstring to its
section class, then regenerate the docs (a test fails until you do).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

if TYPE_CHECKING:
    from correction import CorrectionConfig

__all__ = [
    "AdvantageSection",
    "AgentConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "CorrectionSection",
    "DataConfig",
    "DistributedConfig",
    "ExperimentConfig",
    "InferenceConfig",
    "JudgeConfig",
    "KLControlConfig",
    "LoraSection",
    "LossSection",
    "ModelConfig",
    "ModelRewardSpec",
    "PolicyModelConfig",
    "PythonToolConfig",
    "RejectionRuleConfig",
    "RewardConfig",
    "RewardMixConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTTrainerConfig",
    "SearchToolConfig",
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


class ConfigError(ValueError):
    """A configuration file or override is wrong; the message names every bad key path."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=True,
    )


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


class LoraSection(Section):
    """LoRA adapters on the policy (peft): train and push only the adapter."""

    rank: int = Field(default=0, ge=0)
    """Adapter rank r; 0 = full fine-tuning (no LoRA)."""
    alpha: float = Field(default=16.0, gt=0)
    """Scaling numerator: the update is (alpha / r) · B A (alpha / sqrt(r) with `use_rslora`)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Names of the linear layers that get adapters (Qwen2/Llama names)."""
    use_rslora: bool = False
    """Rank-stabilized scaling alpha / sqrt(r)."""


class ModelConfig(Section):
    """The policy model."""

    path: str | None = None
    """HF model directory (or hub id); None = the tiny random test model (`agentrl tiny-model`)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Training/inference dtype; auto = float32 on CPU, bfloat16 on GPU."""
    trust_remote_code: bool = False
    """Allow model code from the model directory (needed by some HF architectures)."""


class PolicyModelConfig(ModelConfig):
    """The policy model of an RL run (its weights train; the servers get each version)."""

    lora: LoraSection = Field(default_factory=LoraSection)
    """LoRA adapters (rank 0 = off); the servers get adapter-only pushes."""


class DataConfig(Section):
    """Where tasks come from and how many are sampled per step."""

    train_files: list[str] = Field(default_factory=list)
    """Training task files (JSONL or Parquet, relative to the config file); empty = use `generator`."""
    val_files: list[str] = Field(default_factory=list)
    """Held-out task files; empty = `generator_val_size` generated tasks (0 or no generator = no validation)."""
    generator: str | None = "calculator"
    """Built-in task generator used when `train_files` is empty (e.g. `calculator`); None = off."""
    generator_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the task generator (e.g. `{max_digits: 4}`)."""
    generator_train_size: int = Field(default=512, ge=1)
    """Training tasks the generator makes (seeded by `seed`)."""
    generator_val_size: int = Field(default=64, ge=0)
    """Held-out tasks the generator makes when `val_files` is empty; 0 = no validation set."""
    generator_val_seed: int = 10000
    """Seed of the held-out generated tasks (another stream than the training tasks)."""
    batch_size: int = Field(default=8, ge=1)
    """Tasks per training step (each sampled `n_samples` times)."""
    n_samples: int = Field(default=4, ge=1)
    """Samples per task: the GRPO/RLOO group size."""
    shuffle: bool = True
    """Shuffle tasks each epoch (deterministically, from `seed`)."""
    seed: int = 0
    """Seed of the task order."""
    max_prompt_tokens: int = Field(default=1024, ge=1)
    """Longest rendered prompt (chat template and tools included) in tokens."""
    overlong_prompts: Literal["drop", "error"] = "drop"
    """A task whose prompt is longer than `max_prompt_tokens`: `drop` it (counted, logged) or stop with an `error` naming it."""


class AgentConfig(Section):
    """How the default agent runs an episode."""

    default: str = "tool_agent"
    """Registered agent used for tasks that do not name one."""
    max_turns: int = Field(default=4, ge=1)
    """Most model turns per episode."""
    max_response_tokens: int = Field(default=512, ge=1)
    """Token budget of the whole episode after the prompt (model and tool turns)."""
    max_parallel_calls: int = Field(default=1, ge=1)
    """Most tool calls executed from one model turn."""
    tool_call_format: str = "hermes"
    """Tool-call parser: hermes (`<tool_call>{...}</tool_call>`), json, mistral, or a registered name."""
    system_prompt: str | None = None
    """System prompt prepended to every task that has none; None = the agent's own default."""
    kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Agent name -> keyword arguments of its constructor (e.g. `{my_agent: {hint: true}}`)."""
    episode_timeout_s: float = Field(default=300.0, gt=0)
    """Wall-clock limit of one episode; past it the episode stops as `aborted`."""


class PythonToolConfig(Section):
    """Limits of the python sandbox tool."""

    wall_time_s: float = Field(default=5.0, gt=0)
    """Wall-clock limit of one python call."""
    memory_mb: int = Field(default=512, ge=32)
    """Address-space limit of each sandboxed process, in MiB."""
    cpu_time_s: float | None = Field(default=None, gt=0)
    """CPU seconds per sandboxed process; None = wall_time_s rounded up, plus 1."""
    max_processes: int = Field(default=16, ge=1)
    """Most processes the code of one call may run at once (itself included)."""
    disk_mb: int = Field(default=64, ge=1)
    """Size of the sandbox's private tmpfs (working directory, /tmp, /dev/shm), in MiB."""
    allow_unsandboxed: bool = False
    """Run model code without OS isolation when bubblewrap is unavailable (unsafe; else refuse)."""


class SearchToolConfig(Section):
    """The local search tool."""

    corpus_path: str | None = None
    """JSONL corpus the search tool indexes; None = search tool unavailable."""


class ToolsConfig(Section):
    """Which tools agents may call and how their output is bounded."""

    enabled: list[str] = Field(default_factory=lambda: ["calculator"])
    """Names of the tools offered to the agent (built-ins: calculator, python, search)."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Wall-clock limit of one tool call; a timeout becomes an error message to the model."""
    max_output_chars: int = Field(default=2000, ge=1)
    """Longest tool output shown to the model; longer output is truncated with a marker."""
    truncate_side: Literal["left", "right", "middle"] = "right"
    """Which part of an over-long tool output is cut."""
    python: PythonToolConfig = Field(default_factory=PythonToolConfig)
    """The python sandbox tool."""
    search: SearchToolConfig = Field(default_factory=SearchToolConfig)
    """The search tool."""


DEFAULT_JUDGE_PROMPT = (
    "Grade the answer to the question.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{reference}\n\n"
    "Answer to grade:\n{answer}\n\n"
    "Reply with a score from 0 (wrong) to 10 (fully correct) as \\boxed{N}."
)
"""The judge's default rubric (`reward.models.<name>.prompt`)."""

_MODEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


class _ModelRewardBase(Section):
    """What every model reward has: its model, its servers and its concurrency limit."""

    path: str | None = None
    """Local Hugging Face model directory (relative to the config file); null only with backend `external`."""
    backend: Literal["embedded", "vllm", "external"] = "embedded"
    """`embedded` (our server), `vllm` (launched by the run) or `external` (`urls`)."""
    urls: list[str] = Field(default_factory=list)
    """Base URLs of running servers (backend `external`)."""
    num_servers: int = Field(default=1, ge=1)
    """Servers the run starts for this model (embedded/vllm), beside the policy servers."""
    max_concurrency: int = Field(default=8, ge=1)
    """Most requests to this model in flight at once (across its servers)."""
    model_name: str | None = None
    """Model name sent with each request; null = the server's only model."""
    vllm_extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for this model's vLLM servers."""
    api_key: str | None = Field(default=None, exclude=True, repr=False)
    """Bearer token of this model's servers; null = the run's inference key (never logged)."""

    @model_validator(mode="after")
    def _where(self) -> _ModelRewardBase:
        if self.backend == "external" and not self.urls:
            raise ValueError("backend 'external' needs `urls` (the servers' base URLs)")
        if self.backend != "external" and not self.path:
            raise ValueError(f"backend {self.backend!r} needs `path` (a local model directory)")
        return self


class RewardModelConfig(_ModelRewardBase):
    """A reward model (`type: reward_model`): a sequence classifier's logit is the score."""

    type: Literal["reward_model"]
    """A Hugging Face `AutoModelForSequenceClassification` served for scoring (embedded `--task score`, vLLM `--runner pooling`)."""
    input: Literal["messages", "tokens"] = "messages"
    """What is scored: the episode's `messages` (rendered by the reward model's chat template) or its `tokens` (prompt + response ids; the reward model must share the policy's tokenizer)."""
    label: int = Field(default=0, ge=0)
    """Which logit is the score (0 for a one-label reward model)."""
    use_activation: bool = False
    """Score the sigmoid (one label) / softmax (several) instead of the raw logit."""


class JudgeConfig(_ModelRewardBase):
    """An LLM judge (`type: judge`): a chat model grades the final answer with a rubric."""

    type: Literal["judge"]
    """A chat model served like the policy; its reply holds the score."""
    prompt: str = DEFAULT_JUDGE_PROMPT
    """Rubric sent as the user message; `{question}`, `{answer}` (the final answer) and `{reference}` (`reward_spec.ground_truth`) are filled in."""
    system_prompt: str | None = None
    """System message before the rubric; null = none."""
    parse: Literal["boxed", "number", "regex"] = "boxed"
    """How the score is read: the last `\\boxed{N}`, the whole reply as one number, or `pattern`'s first group."""
    pattern: str | None = None
    """Regular expression with one group holding the score (parse `regex`)."""
    min_score: float = 0.0
    """Lowest score the rubric gives (maps to reward 0); a reply below it is a failure."""
    max_score: float = 10.0
    """Highest score the rubric gives (maps to reward 1); a reply above it is a failure."""
    max_tokens: int = Field(default=256, ge=1)
    """Most tokens of the judge's reply."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Judge sampling temperature (0 = greedy, reproducible)."""

    @model_validator(mode="after")
    def _rubric(self) -> JudgeConfig:
        if "{answer}" not in self.prompt:
            raise ValueError(
                "`prompt` has no {answer} placeholder: the judge would not see the answer"
            )
        if self.parse == "regex":
            if not self.pattern:
                raise ValueError("parse 'regex' needs `pattern`, e.g. 'Score: ([0-9.]+)'")
            try:
                groups = re.compile(self.pattern).groups
            except re.error as exc:
                raise ValueError(f"`pattern` {self.pattern!r} is not a regex: {exc}") from None
            if groups < 1:
                raise ValueError(f"`pattern` {self.pattern!r} needs a group around the score")
        if not self.min_score < self.max_score:
            raise ValueError(f"min_score ({self.min_score}) must be < max_score ({self.max_score})")
        return self


ModelRewardSpec = typing.Annotated[
    Union[RewardModelConfig, JudgeConfig],  # noqa: UP007 (a discriminated union needs the Union form in Annotated)
    Field(discriminator="type"),
]
"""One entry of `reward.models`: a reward model or a judge, told apart by `type`."""


class RewardMixConfig(Section):
    """A data source scored by several rewards, e.g. `{terms: {calculator: 1.0, judge: 0.5}}`."""

    terms: dict[str, float] | list[str]
    """Reward names (functions, `module:function` or `reward.models` names) -> weight; a list = weight 1 each."""
    combine: str | None = None
    """`module:function` `(scores: dict[str, float], traj, task) -> float | dict` over the terms' raw scores; null = the weighted sum (list `terms` then)."""

    @model_validator(mode="after")
    def _terms(self) -> RewardMixConfig:
        if not self.terms:
            raise ValueError("`terms` is empty; name at least one reward")
        if self.combine and isinstance(self.terms, dict) and set(self.terms.values()) != {1.0}:
            raise ValueError(
                f"`combine` gets the terms' raw scores and does its own weighting; list the "
                f"names instead of weights (`terms: {list(self.terms)}`)"
            )
        return self

    def weights(self) -> dict[str, float]:
        """Term name -> weight."""
        return dict(self.terms) if isinstance(self.terms, dict) else dict.fromkeys(self.terms, 1.0)


class RewardConfig(Section):
    """How finished episodes are scored."""

    sources: dict[str, str | RewardMixConfig] = Field(
        default_factory=lambda: {"calculator": "calculator", "gsm8k": "numeric_match"}
    )
    """Task data_source -> reward: a function (built-in name or `module:function`), a `models` name, or a mix `{terms: {...}, combine: ...}`."""
    default: str | None = "exact_match"
    """Reward (function or `models` name) for data sources not in `sources`; None = such a task is an error."""
    models: dict[str, ModelRewardSpec] = Field(default_factory=dict)
    """Named model rewards, each with its own servers: `{name: {type: reward_model | judge, path: ..., ...}}` (see docs/rewards.md)."""
    executor: Literal["async", "thread", "process"] = "async"
    """Where reward functions run: the event loop, a thread pool or a process pool."""
    max_workers: int = Field(default=4, ge=1)
    """Most reward computations at once."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Deadline of one reward call; past it the call is abandoned (or its worker killed) and counted."""
    format_weight: float = 0.0
    """Weight of the tool-format reward added to the task reward (0 = off)."""

    @model_validator(mode="after")
    def _models_used(self) -> RewardConfig:
        used = {self.default} if self.default else set()
        for spec in self.sources.values():
            used.update([spec] if isinstance(spec, str) else spec.weights())
        for name in self.models:
            if not _MODEL_NAME.match(name):
                raise ValueError(
                    f"reward.models: name {name!r} must start with a letter or _ and hold only "
                    "letters, digits, _ . - (it is how sources refer to it)"
                )
            if name not in used:
                raise ValueError(
                    f"reward.models.{name} is not used by reward.sources or reward.default; "
                    "name it there (its servers would start for nothing) or remove it"
                )
        return self


class InferenceConfig(Section):
    """Inference servers and sampling."""

    backend: Literal["embedded", "vllm", "external"] = "embedded"
    """`embedded` (our server, CPU-friendly), `vllm` (launched by us) or `external` (`urls`)."""
    num_servers: int = Field(default=1, ge=1)
    """Inference servers to launch (embedded/vllm)."""
    urls: list[str] = Field(default_factory=list)
    """Base URLs of already-running servers (backend `external`)."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature (the trainer recomputes logprobs with the same temperature)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass; keep 1.0 for RL (the trainer does not apply top-p)."""
    top_k: int = -1
    """Top-k filter, -1 = off; keep off for RL (the trainer does not apply top-k)."""
    max_tokens_per_turn: int = Field(default=256, ge=1)
    """Most tokens one model turn may generate."""
    request_timeout_s: float = Field(default=120.0, gt=0)
    """HTTP timeout of one generation request."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of a failed request on another healthy server."""
    max_batch_size: int = Field(default=32, ge=1)
    """Most sequences a server decodes at once (embedded: batch slots; vLLM: --max-num-seqs)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the embedded servers (auto = cuda when available); their dtype is `model.dtype`."""
    api_key: str | None = Field(default=None, exclude=True, repr=False)
    """Bearer token of the inference servers; null = $AGENTRL_API_KEY, else a random key per run for the servers it launches (never logged or written)."""
    vllm_python: str | None = None
    """Python interpreter that has vLLM; None = $AGENTRL_VLLM_PYTHON or `.venv-vllm/bin/python`."""
    vllm_extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for the vLLM server."""
    health_check_interval_s: float = Field(default=10.0, gt=0)
    """Seconds between health checks of each server."""


class RolloutConfig(Section):
    """Agent-loop workers and admission."""

    num_workers: int = Field(default=1, ge=1)
    """Agent-loop workers (asyncio in-process, or Ray actors)."""
    max_concurrency: int = Field(default=32, ge=1)
    """Most episodes running at once over all workers."""
    partial_rollout: Literal["keep", "abort"] = "keep"
    """On a weight push: `keep` in-flight episodes (they continue on new weights) or `abort` them."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no GRPO signal) and sample more (DAPO)."""
    max_sampling_rounds: int = Field(default=3, ge=1)
    """Most extra sampling rounds to fill a batch when `dynamic_sampling` drops groups."""


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
    """Estimator: gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, opo, gpg (+ the knobs of the one chosen, see docs/algorithms.md), or `module:function`."""


class LossSection(VariantSection):
    """Policy loss and its knobs, e.g. `{name: vanilla, clip_ratio_low: 0.2, clip_ratio_high: 0.28}`."""

    name: str = "vanilla"
    """Loss: vanilla (PPO clip + dual clip; alias ppo_clip), gspo, cispo, reinforce (+ its knobs, see docs/algorithms.md), or `module:function`."""


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


class OptimizerFields(Section):
    """Optimizer and schedule fields shared by the RL and SFT trainers."""

    total_steps: int = Field(default=20, ge=1)
    """Optimizer steps to train for."""
    lr: float = Field(default=1e-5, gt=0.0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(default=1.0, gt=0.0)
    """Max global gradient norm."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""
    micro_batch_max_tokens: int = Field(default=4096, ge=1)
    """Token budget of one forward/backward micro-batch (dynamic batch size)."""
    seed: int = 0
    """Seed of model init, dropout and sampling on the trainer side."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Trainer device; auto = cuda when available, else cpu."""
    output_dir: str = "outputs/run"
    """Directory for checkpoints, the resolved config and local artifacts."""


class TrainerConfig(OptimizerFields):
    """The RL trainer loop."""

    val_every: int = Field(default=0, ge=0)
    """Also validate every N steps during training (0 = only before and after training)."""
    val_before_train: bool = True
    """Validate once before the first step (the baseline of the run)."""
    val_n: int = Field(default=1, ge=1)
    """Samples per validation task (the N of mean@N, best/worst/maj@k, pass@k)."""
    val_temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature of validation episodes (0 = greedy; use > 0 with val_n > 1)."""
    val_k: list[int] | None = None
    """pass@k sizes (null = 1, 2, 4, ..., val_n); each in 1..val_n."""
    val_bootstrap_samples: int = Field(default=1000, ge=1)
    """Bootstrap subsets per task and subset size (best/worst/maj@k) and task resamples of the CI."""
    val_seed: int = 0
    """Seed of the validation bootstrap."""
    val_at_end: bool = True
    """Validate once after the last step."""
    save_every: int = Field(default=0, ge=0)
    """Save a checkpoint every N steps (0 = only at the end)."""
    max_staleness: int = Field(default=1, ge=0)
    """η: rollouts may run this many versions ahead of the trainer (0 = synchronous on-policy)."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each batch."""
    mini_batch_size: int = Field(default=8, ge=1)
    """Tasks per optimizer step within a batch (batch_size / mini_batch_size updates per batch)."""
    critic_lr: float = Field(default=1e-5, gt=0.0)
    """Critic learning rate (GAE only)."""
    critic_warmup_steps: int = Field(default=0, ge=0)
    """Steps that train only the critic before the actor starts (GAE only)."""
    critic_micro_batch_max_tokens: int | None = Field(default=None, ge=1)
    """Critic token budget per micro-batch (GAE only; null = trainer.micro_batch_max_tokens)."""
    world_size: int = Field(default=1, ge=1)
    """Data-parallel trainer ranks (FSDP2 shards actor, reference and critic; rank 0 runs the loop); see docs/distributed.md."""


class CheckpointConfig(Section):
    """How new weights reach the inference servers."""

    transport: Literal["shared_dir", "http", "collective"] = "shared_dir"
    """`shared_dir` (safetensors in a shared directory), `http` (streamed) or `collective` (torch.distributed broadcasts: gloo on CPU, NCCL on GPU; vLLM's NCCL weight transfer)."""
    shared_dir: str | None = None
    """Directory for `shared_dir`; None = /dev/shm when it exists, else the system temp dir."""
    bucket_mb: float = Field(default=256.0, gt=0)
    """`collective`: the largest packed broadcast (MiB); bigger buckets mean fewer collectives."""
    collective_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """`collective`: `auto` (NCCL when the trainer sees a GPU, else gloo), `gloo` or `nccl`."""
    collective_timeout_s: float = Field(default=120.0, gt=0)
    """`collective`: bound on joining the weight group and on every broadcast (a dead server fails the push, never hangs it)."""
    advertise_host: str | None = None
    """Address the servers reach the trainer at (`http` pull, `collective` rendezvous); None = the local interface that routes to each server."""
    verify: bool = True
    """After each push, compare probe logprobs of every server with the trainer's."""
    verify_tolerance: float = Field(default=1e-3, gt=0.0)
    """Max abs logprob difference accepted by `verify` (raise above it)."""
    probe_tokens: int = Field(default=16, ge=1)
    """Length of the fixed probe sequence used by `verify`."""
    push_timeout_s: float = Field(default=300.0, gt=0)
    """Time limit of one push on one server (pause, transfer, verify, resume)."""
    pause_mode: Literal["keep", "abort"] = "keep"
    """On pause: `keep` in-flight requests (they finish on new weights) or `abort` them."""
    push_every: int = Field(default=1, ge=1)
    """Push to the servers every N steps (1 = every step); > 1 makes rollouts lag the trainer on purpose (staleness experiments, or amortizing slow pushes); staler trajectories than `trainer.max_staleness` are still dropped."""
    push_retries: int = Field(default=1, ge=0)
    """Extra attempts of a failed push before training stops with the push report as error."""

    @field_validator("transport", mode="before")
    @classmethod
    def _renamed_transport(cls, value: Any) -> Any:
        if value == "nccl":
            raise ValueError(
                "'nccl' was renamed: write 'collective' (NCCL on GPUs, gloo on CPUs; "
                "vLLM's NCCL weight transfer)"
            )
        return value

    def resolved_shared_dir(self) -> Path:
        """`shared_dir`, or tmpfs `/dev/shm` when it exists, else the system temp dir."""
        if self.shared_dir is not None:
            return Path(self.shared_dir)
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            return shm / "agentrl"
        return Path(tempfile.gettempdir()) / "agentrl"


class TrackingConfig(Section):
    """Experiment tracking (MLflow)."""

    enabled: bool = True
    """Track the run (params, metrics, artifacts)."""
    backend: Literal["mlflow", "none"] = "mlflow"
    """Tracking backend."""
    tracking_uri: str | None = None
    """MLflow tracking URI; None = $MLFLOW_TRACKING_URI, else a local store under ./mlruns."""
    experiment: str = "agentrl"
    """MLflow experiment name."""
    run_name: str | None = None
    """MLflow run name; None = generated."""
    log_every: int = Field(default=1, ge=1)
    """Log metrics every N steps."""
    num_sample_trajectories: int = Field(default=4, ge=0)
    """Trajectories logged as a sample table per logged step."""


class DistributedConfig(Section):
    """Placement of servers, workers and the trainer."""

    backend: Literal["local", "ray"] = "local"
    """`local` (one process, asyncio + server subprocesses) or `ray` (actors)."""
    ray_address: str | None = None
    """Ray cluster address; None = start or join a local cluster."""
    num_gpus_per_server: float = Field(default=0.0, ge=0.0)
    """GPUs per inference server (Ray placement)."""
    num_trainer_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs for the trainer (Ray placement)."""
    max_actor_restarts: int = Field(default=3, ge=-1)
    """Ray restarts of each server, worker and reward actor that dies (-1 = no limit, 0 = none); see docs/distributed.md."""
    cpus: list[int] | int | None = None
    """CPUs this run may use: a list of CPU ids, a count, or null for the process's affinity set."""
    trainer_threads: int | None = Field(default=None, ge=1)
    """Torch threads of the trainer process; null = its share of `cpus` (see docs/training.md)."""
    server_threads: int | None = Field(default=None, ge=1)
    """Torch threads of each embedded server; null = its share of `cpus`."""
    pin_cpus: bool = False
    """Pin the trainer and each embedded server to disjoint CPUs (when there are enough)."""
    server_nice: int | None = Field(default=None, ge=0, le=19)
    """Niceness added to each local embedded server (0-19); null = 10 when the plan has more threads than CPUs and nothing is pinned (the trainer, the critical path, wins contention), else 0."""


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
        if self.data.batch_size % self.trainer.mini_batch_size != 0:
            raise ValueError(
                f"data.batch_size ({self.data.batch_size}) must be a multiple of "
                f"trainer.mini_batch_size ({self.trainer.mini_batch_size})"
            )
        return self

    def flatten(self) -> dict[str, str]:
        """Dotted keys -> string values (e.g. for MLflow params)."""
        return _flatten(self.model_dump(mode="json"))

    def to_yaml(self) -> str:
        """The full resolved config as YAML (loads back to an equal config)."""
        return _to_yaml(self)


class TinyModelConfig(Section):
    """Shape of the tiny model built when `model.path` is null (`agentrl tiny-model`)."""

    num_layers: int = Field(default=2, ge=1)
    """Decoder layers."""
    hidden_size: int = Field(default=128, ge=32)
    """Model width (hidden_size / num_heads >= 32 for vLLM's CPU attention)."""
    num_heads: int = Field(default=4, ge=1)
    """Attention heads."""
    num_kv_heads: int = Field(default=2, ge=1)
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = Field(default=256, ge=1)
    """MLP width."""
    seed: int = 0
    """Weight-init seed (the built model is deterministic for it)."""
    bpe_merges: int = Field(default=0, ge=0)
    """BPE merges learned from the SFT conversations (digits never merge); 0 = one token per byte."""
    bpe_max_token_bytes: int = Field(default=16, ge=2)
    """Longest token, in bytes, that a learned merge may make."""
    bpe_corpus_size: int = Field(default=1000, ge=1)
    """How many of the SFT conversations (the first ones) the merges are learned from."""


class SFTModelConfig(ModelConfig):
    """The model to fine-tune: an HF directory, or the tiny model built from `tiny`."""

    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Shape of the tiny model used when `path` is null."""


class SFTDataConfig(Section):
    """Supervised data: chat conversations."""

    train_files: list[str] = Field(default_factory=list)
    """Training conversation files (JSONL/Parquet rows with `messages`); empty = `generator`."""
    val_files: list[str] = Field(default_factory=list)
    """Validation conversation files; empty = no validation."""
    generator: str | None = "calculator"
    """Built-in conversation generator used when `train_files` is empty; None = off."""
    generator_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the generator (e.g. `{n: 512, tool_fraction: 0.8}`)."""
    batch_size: int = Field(default=8, ge=1)
    """Conversations per optimizer step."""
    shuffle: bool = True
    """Shuffle conversations each epoch (deterministically, from `seed`)."""
    seed: int = 0
    """Seed of the conversation order."""
    max_seq_len: int = Field(default=1024, ge=1)
    """Longest tokenized conversation; longer ones are truncated on the right."""
    train_on: Literal["assistant", "all"] = "assistant"
    """Tokens that carry loss: assistant turns only, or every token."""


class SFTTrainerConfig(OptimizerFields):
    """The supervised trainer loop."""

    epochs: int | None = None
    """Passes over the data; None = stop after `total_steps`."""
    share_prefix: bool = False
    """Run each batch's common loss-free prefix (e.g. a long tools prompt) once, without gradient."""


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
        return _flatten(self.model_dump(mode="json"))

    def to_yaml(self) -> str:
        """The full resolved config as YAML (loads back to an equal config)."""
        return _to_yaml(self)


KINDS: dict[str, type[ExperimentConfig] | type[SFTConfig]] = {
    "rl": ExperimentConfig,
    "sft": SFTConfig,
}
"""Top-level `kind:` -> schema."""

AnyConfig = Union[ExperimentConfig, SFTConfig]  # noqa: UP007 - a runtime alias, used in isinstance
ConfigT = TypeVar("ConfigT", bound=BaseModel)


# ---------------------------------------------------------------------------------------------
# YAML: scalars by YAML 1.2 rules (`1e-6` is a float, unlike PyYAML's 1.1 default)
# ---------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    pass


_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_Loader.yaml_implicit_resolvers = {
    key: list(resolvers) for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _first in "-+0123456789.":
    _Loader.yaml_implicit_resolvers[_first] = [
        (tag, rx)
        for tag, rx in _Loader.yaml_implicit_resolvers.get(_first, [])
        if tag != "tag:yaml.org,2002:float"
    ]
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _to_yaml(cfg: BaseModel) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(_flatten(value, dotted + "."))
        elif isinstance(value, str):
            out[dotted] = value
        elif value is None or isinstance(value, bool | int | float):
            out[dotted] = "null" if value is None else json.dumps(value)
        else:
            out[dotted] = json.dumps(value, sort_keys=True)
    return out


# ---------------------------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into (``["a", "b", "c"]``, value parsed with YAML scalar rules)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form 'section.key=value'")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"override {text!r}: empty component in key {key!r}")
    try:
        value = _yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: cannot parse value {raw!r}: {exc}") from exc
    return parts, value


def _default_mapping(model: Any, key: str) -> tuple[Any, dict[str, Any]]:
    """(annotation of ``model.key`` or None, its default when that is a mapping, else {})."""
    if not _is_model(model) or key not in model.model_fields:
        return None, {}
    field = model.model_fields[key]
    ann = _strip_optional(field.annotation)
    if typing.get_origin(ann) is dict:
        default = field.default_factory() if field.default_factory is not None else field.default
        return ann, copy.deepcopy(default) if isinstance(default, dict) else {}
    return ann, {}


def apply_overrides(
    data: dict[str, Any],
    overrides: typing.Iterable[str],
    schema: type[BaseModel] | None = None,
) -> dict[str, Any]:
    """Apply dotted overrides to a raw config mapping (a new mapping; the input is unchanged).

    With ``schema``, an override into a mapping-valued field the file does not set (e.g.
    ``reward.sources.mydata=fn``) adds to that field's default mapping instead of replacing it.
    """
    out = copy.deepcopy(data) if data else {}
    for text in overrides:
        parts, value = parse_override(text)
        node: dict[str, Any] = out
        model: Any = schema
        for i, part in enumerate(parts[:-1]):
            ann, default = _default_mapping(model, part)
            if _is_model(model) and part in model.model_fields and ann is None:
                ann = _strip_optional(model.model_fields[part].annotation)
            model = ann if _is_model(ann) else None
            child: Any = node.get(part)
            if isinstance(child, str) and isinstance(ann, type) and issubclass(ann, VariantSection):
                child = node[part] = {"name": child}  # `loss: vanilla` shorthand, then a knob
            if child is None:
                child = node[part] = default
            elif not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(
                    f"override {text!r}: '{where}' is a value ({child!r}), not a section"
                )
            node = child
        node[parts[-1]] = value
    return out


# ---------------------------------------------------------------------------------------------
# Validation with readable errors
# ---------------------------------------------------------------------------------------------


def _strip_optional(ann: Any) -> Any:
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    origin = typing.get_origin(ann)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _type_name(ann: Any) -> str:
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if ann is None:
        return "?"
    if ann is type(None):
        return "null"
    origin = typing.get_origin(ann)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(ann))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(ann))
    if _is_model(ann):
        tag = ann.model_fields.get("type")
        kinds = typing.get_args(tag.annotation) if tag is not None else ()
        return f"mapping with type: {kinds[0]!r}" if len(kinds) == 1 else "mapping"
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(ann))
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{args}]"
    return getattr(ann, "__name__", str(ann))


def _resolve_loc(root: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[str, Any, Any]:
    """Dotted path, the annotation at the path, and the model class holding the last key."""
    ann: Any = root
    parent: Any = root
    path = ""
    for item in loc:
        ann = _strip_optional(ann)
        origin = typing.get_origin(ann)
        if _is_model(ann):
            parent = ann
            path = f"{path}.{item}" if path else str(item)
            field = ann.model_fields.get(str(item))
            ann = field.annotation if field is not None else None
        elif isinstance(item, int) and origin in (list, tuple):
            path = f"{path}[{item}]"
            args = typing.get_args(ann)
            ann = args[0] if args else None
        elif origin is dict:
            path = f"{path}.{item}" if path else str(item)
            args = typing.get_args(ann)
            ann = args[1] if len(args) == 2 else None
        elif origin in (Union, types.UnionType):
            # A union-member tag (class name, or a discriminator value): not part of the path.
            ann = next((a for a in typing.get_args(ann) if _union_tag_matches(a, item)), None)
        # otherwise the item is a validator tag: not part of the user's path
    return path, ann, parent


def _union_tag_matches(member: Any, tag: int | str) -> bool:
    """Whether pydantic's loc item ``tag`` names union ``member`` (its class or type name, or
    the value of its ``type`` discriminator)."""
    name = getattr(member, "__name__", None)
    if name is not None and (tag == name or str(tag).endswith(f", {name}]")):
        return True  # a plain member, or one with validators ('function-after[_check(), Cls]')
    field = member.model_fields.get("type") if _is_model(member) else None
    return field is not None and tag in typing.get_args(field.annotation)


def _closest(word: str, candidates: typing.Iterable[str]) -> str | None:
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


def _error_lines(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    lines: list[str] = []
    errors = exc.errors()
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if err["type"] == "string_type" and isinstance(err.get("input"), dict) and len(errors) > 1:
            continue  # a mapping given where `str | Section` is accepted: the Section's errors say it
        path, ann, parent = _resolve_loc(root, loc)
        if err["type"] == "extra_forbidden":
            key = str(loc[-1])
            section = path.rpartition(".")[0]
            valid = list(parent.model_fields) if _is_model(parent) else []
            guess = _closest(key, valid)
            if guess is not None:
                hint = f"did you mean '{section + '.' if section else ''}{guess}'?"
            else:
                hint = f"valid keys{' in ' + repr(section) if section else ''}: {', '.join(valid)}"
            lines.append(f"unknown key '{path}'; {hint}")
            continue
        if not path:
            lines.append(str(err["msg"]).removeprefix("Value error, "))
            continue
        if err["type"] == "value_error":  # a validator's own message names the problem
            lines.append(f"'{path}': {str(err['msg']).removeprefix('Value error, ')}")
            continue
        given = err.get("input")
        line = f"'{path}': expected {_type_name(ann)}, got {given!r}"
        if err["type"] == "literal_error":
            literal_args = typing.get_args(_strip_optional(ann))
            guess = _closest(str(given), [str(a) for a in literal_args])
            if guess is not None:
                line += f"; did you mean {guess!r}?"
        else:
            line += f" ({err['msg']})"
        lines.append(line)
    return lines


MOVED_KEYS: dict[str, str] = {
    "algorithm.adv_estimator": "algorithm.advantage: {name: <estimator>}",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.advantage: {name: grpo, norm_adv_by_std_in_grpo: <bool>}",
    "algorithm.gamma": "algorithm.advantage: {name: <gae|reinforce_plus_plus>, gamma: <float>}",
    "algorithm.lam": "algorithm.advantage: {name: gae, lam: <float>}",
    "algorithm.policy_loss": "algorithm.loss: {name: <loss>}",
    "algorithm.clip_ratio_low": "algorithm.loss: {name: vanilla, clip_ratio_low: <float>}",
    "algorithm.clip_ratio_high": "algorithm.loss: {name: vanilla, clip_ratio_high: <float>}",
    "algorithm.clip_ratio_c": "algorithm.loss: {name: vanilla, clip_ratio_c: <float>}",
}
"""Keys of earlier versions -> where they live now (a clear migration error, not a silent drop)."""


_MOVED_GENERATOR_KWARGS = {
    "n": "data.generator_train_size",
    "n_train": "data.generator_train_size",
    "n_val": "data.generator_val_size",
    "seed": "data.seed (training tasks) and data.generator_val_seed (held-out tasks)",
}


def _moved_key_errors(data: dict[str, Any]) -> list[str]:
    lines = []
    gen = (
        (data.get("data") or {}).get("generator_kwargs")
        if isinstance(data.get("data"), dict)
        else None
    )
    if isinstance(gen, dict):
        for key, new in _MOVED_GENERATOR_KWARGS.items():
            if key in gen:
                lines.append(f"'data.generator_kwargs.{key}' moved: set {new}")
    for old, new in MOVED_KEYS.items():
        section, _, key = old.partition(".")
        node = data.get(section)
        if isinstance(node, dict) and key in node:
            lines.append(f"'{old}' moved: write `{new}` (see docs/configuration.md)")
    return lines


def validate_config(data: dict[str, Any], schema: type[ConfigT], source: str = "") -> ConfigT:
    """Validate a raw mapping against ``schema``; raise :class:`ConfigError` with dotted paths."""
    where = f" in {source}" if source else ""
    if not isinstance(data, dict):
        raise ConfigError(f"config{where} must be a mapping of sections, got {type(data).__name__}")
    moved = _moved_key_errors(data) if schema is ExperimentConfig else []
    if moved:
        raise ConfigError(f"invalid {schema.__name__}{where}:\n  " + "\n  ".join(moved))
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        lines = _error_lines(exc, schema)
        raise ConfigError(f"invalid {schema.__name__}{where}:\n  " + "\n  ".join(lines)) from None


def _read_yaml(path: str | Path | None) -> tuple[dict[str, Any], str]:
    if path is None:
        return {}, "<defaults>"
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc.strerror}") from exc
    try:
        data = _yaml_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(p)!r} must hold a mapping of sections, got {type(data).__name__}"
        )
    return data, str(p)


def load_any_config(
    path: str | Path | None, overrides: typing.Iterable[str] = ()
) -> ExperimentConfig | SFTConfig:
    """Load a YAML file (or defaults when ``path`` is None), apply overrides, dispatch on ``kind``."""
    data, source = _read_yaml(path)
    overrides = list(overrides)
    kind = apply_overrides(
        {"kind": data.get("kind", "rl")}, [o for o in overrides if o.strip().startswith("kind=")]
    )["kind"]
    schema = KINDS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        guess = _closest(str(kind), KINDS)
        hint = f"; did you mean {guess!r}?" if guess else ""
        raise ConfigError(f"'kind' in {source} is {kind!r}; valid kinds: {', '.join(KINDS)}{hint}")
    cfg = validate_config(apply_overrides(data, overrides, schema), schema, source)
    if isinstance(cfg, ExperimentConfig) and cfg.base_dir is None and path is not None:
        cfg.base_dir = str(Path(path).resolve().parent)
    return cfg


def load_config(path: str | Path | None, overrides: typing.Iterable[str] = ()) -> ExperimentConfig:
    """Load an RL experiment config (``kind: rl``): YAML file, then dotted overrides."""
    cfg = load_any_config(path, overrides)
    if not isinstance(cfg, ExperimentConfig):
        raise ConfigError(f"{path} is a '{cfg.kind}' config; load it with load_sft_config")
    return cfg


def load_sft_config(path: str | Path | None, overrides: typing.Iterable[str] = ()) -> SFTConfig:
    """Load a supervised fine-tuning config (``kind: sft``); ``kind`` defaults to ``sft`` here."""
    data, source = _read_yaml(path)
    data = apply_overrides(data, overrides, SFTConfig)
    kind = data.setdefault("kind", "sft")
    if kind != "sft":
        raise ConfigError(f"{source} is a {kind!r} config; load it with load_config")
    return validate_config(data, SFTConfig, source)


# ---------------------------------------------------------------------------------------------
# Docs
# ---------------------------------------------------------------------------------------------


def _default_repr(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return "`" + json.dumps(value if not isinstance(value, tuple) else list(value)) + "`"


def _section_markdown(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    rows: list[str] = []
    subsections: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        ann = _strip_optional(field.annotation)
        if _is_model(ann):
            subsections.append((name, ann))
            continue
        item = typing.get_args(ann)[0] if typing.get_origin(ann) is list else None
        if isinstance(item, type) and issubclass(item, BaseModel):
            subsections.append((f"{name}[]", item))
        if typing.get_origin(ann) is dict:  # a mapping of sections: document each kind
            value = _strip_optional(typing.get_args(ann)[1])
            union = typing.get_origin(value) in (Union, types.UnionType)
            members = typing.get_args(value) if union else (value,)
            for member in (m for m in members if _is_model(m)):
                tag = _type_name(member).removeprefix("mapping").removeprefix(" with ")
                subsections.append((f"{name}.<name>" + (f" ({tag})" if tag else ""), member))
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        type_name = _type_name(field.annotation).replace("|", "\\|")
        rows.append(f"| `{name}` | {type_name} | {_default_repr(field)} | {desc} |")
    if rows:
        doc = (model.__doc__ or "").strip().splitlines()[0]
        out.append(f"### `{prefix or '(top level)'}`\n")
        out.append(f"{doc}\n")
        out.append("| key | type | default | description |")
        out.append("|---|---|---|---|")
        out.extend(rows)
        out.append("")
    for name, sub in subsections:
        _section_markdown(sub, f"{prefix}.{name}" if prefix else name, out)


def config_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from the field docstrings."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m agentrl.config --markdown > docs/configuration.md`; "
        "do not edit by hand. -->",
        "",
        "Experiments are YAML files in `configs/`, validated by `agentrl.config`. Unknown keys are",
        "errors (with the closest valid key); any key can be overridden from the command line as",
        "`section.key=value`, parsed with YAML rules (`trainer.lr=1e-6`, `tracking.enabled=false`,",
        "`data.train_files=[a.jsonl,b.jsonl]`, `model.path=null`). A file's top-level `kind:` picks",
        "the schema: `rl` (default) or `sft`.",
        "",
        "RL sampling keeps `top_p: 1` and `top_k: -1`: the trainer recomputes logprobs with the",
        "sampling temperature but without top-k/top-p masking, so anything else is a policy",
        "mismatch that the `rollout_corr/` diagnostics will show.",
        "",
        "`algorithm.correction.preset` fills every correction field that the file or the overrides",
        "do not set explicitly; explicitly set fields win (see docs/correction.md).",
        "",
    ]
    for kind, schema in KINDS.items():
        out.append(f"## `kind: {kind}` ({schema.__name__})\n")
        _section_markdown(schema, "", out)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m agentrl.config --markdown`` or ``python -m agentrl.config FILE [k=v ...]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m agentrl.config",
        description="Print the configuration reference, or a resolved config as YAML.",
    )
    parser.add_argument("--markdown", action="store_true", help="print docs/configuration.md")
    parser.add_argument("file", nargs="?", help="YAML config file (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6")
    args = parser.parse_args(argv)
    if args.file is not None and "=" in args.file and not Path(args.file).exists():
        args.overrides.insert(0, args.file)
        args.file = None
    if args.markdown:
        sys.stdout.write(config_markdown())
        return 0
    try:
        cfg = load_any_config(args.file, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(cfg.to_yaml())
    return 0


if __name__ == "__main__":
    sys.exit(main())
