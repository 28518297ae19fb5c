"""The ``reward`` section: which reward scores each data source, mixes of rewards, and the
model rewards (reward models and LLM judges) with their own servers.

Guarantees: a model reward names its servers (a local ``path`` or ``urls``), a judge's rubric
shows it the answer and its score parser is valid, and every model reward is used by a source
(its servers would start for nothing otherwise).
"""

from __future__ import annotations

import re
import typing
from typing import Literal, Union

from pydantic import Field, model_validator

from agentrl.config.section import Section

__all__ = [
    "DEFAULT_JUDGE_PROMPT",
    "JudgeConfig",
    "ModelRewardSpec",
    "RewardConfig",
    "RewardMixConfig",
    "RewardModelConfig",
]


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
    overlong_buffer_len: int = Field(default=0, ge=0)
    """DAPO soft overlong penalty: 0 up to `agent.max_response_tokens` minus this many tokens, then linear to -`overlong_penalty_factor` at the budget (0 = off)."""
    overlong_penalty_factor: float = Field(default=1.0, ge=0.0)
    """The overlong penalty at the response budget is minus this (with `overlong_buffer_len` > 0)."""

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
