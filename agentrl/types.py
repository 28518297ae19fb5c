"""The shared vocabulary of agentrl: tasks, sampling, generations and trajectories.

Read this module first. Every component speaks these types:

- a :class:`Task` is one row of a dataset (a prompt, which agent runs it, how it is scored);
- a :class:`SamplingParams` says how to sample; a :class:`Generation` is what an inference
  server returned for one request (token ids, their logprobs, and the weight version that
  produced them);
- a :class:`Trajectory` is one finished episode, exactly as the inference server saw it,
  ready to be scored and trained on.

Invariants a :class:`Trajectory` always satisfies (checked at construction):

- ``response_ids``, ``loss_mask``, ``rollout_logprobs`` and ``policy_version`` have one
  entry per response token;
- ``loss_mask[t]`` is 1 only for tokens the policy sampled; there the logprob is finite and
  ``<= 0`` and the version is ``>= 0``; where the mask is 0 the logprob is ``0.0`` and the
  version is ``-1``.

Example::

    traj = Trajectory(
        prompt_ids=[1, 2, 3],
        response_ids=[7, 8, 9],
        loss_mask=[1, 1, 0],
        rollout_logprobs=[-0.1, -2.3, 0.0],
        policy_version=[4, 4, -1],
        uid="task-0",
        stop_reason=StopReason.EOS,
    )
    assert traj.staleness(current_version=5) == 1
    assert Trajectory.from_json(traj.to_json()) == traj

Everything here is plain data (pydantic): it pickles, crosses Ray and round-trips JSON.
Nothing here imports torch, servers or trackers.
"""

from __future__ import annotations

import itertools
import math
import operator
import uuid
from enum import StrEnum
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "EpisodeDropped",
    "Generation",
    "Message",
    "Policy",
    "SamplingParams",
    "StopReason",
    "Task",
    "Trajectory",
    "TrajectoryError",
    "TurnRecord",
    "TurnSample",
]


class TrajectoryError(ValueError):
    """A trajectory broke one of its invariants; the message names the field and position."""


class EpisodeDropped(Exception):
    """An episode that ends as a counted drop instead of a trajectory (never trained on).

    ``reason`` is a short key (``reward_error``, ``prompt_too_long``, ...) counted under
    ``rollout/dropped/<reason>``; the message says what happened.
    """

    def __init__(self, reason: str, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.fatal = fatal
        """True when the run must stop with this message (a setting says so, e.g.
        ``data.overlong_prompts: error``)."""

    def __reduce__(self) -> Any:
        return (_rebuild_drop, (self.reason, str(self), self.fatal))


def _rebuild_drop(reason: str, message: str, fatal: bool) -> EpisodeDropped:
    return EpisodeDropped(reason, message, fatal=fatal)


class StopReason(StrEnum):
    """Why an episode ended."""

    EOS = "eos"
    """The model emitted an end-of-sequence / stop token and made no further tool call."""
    LENGTH = "length"
    """A token budget was reached (response budget, max_tokens or the context limit)."""
    MAX_TURNS = "max_turns"
    """The agent used all of its turns."""
    TOOL_STOP = "tool_stop"
    """A tool asked the episode to stop (e.g. a `submit` tool)."""
    ABORTED = "aborted"
    """The episode was cancelled (shutdown, timeout, weight push in abort mode)."""
    ERROR = "error"
    """The agent raised; the trajectory carries what was generated before the error."""


Message = dict[str, Any]
"""An OpenAI-style chat message (``role``, ``content``, optional ``tool_calls``, ...)."""


class Task(BaseModel):
    """One dataset row: what to ask, which agent runs it and how it is scored.

    Exactly one of ``prompt`` (a user message) or ``messages`` (a full conversation) is set.
    """

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Stable id of the task (its row index in the dataset when loaded from a file)."""
    prompt: str | None = None
    """A single user message. Mutually exclusive with ``messages``."""
    messages: list[Message] | None = None
    """A full chat history to start from. Mutually exclusive with ``prompt``."""
    agent: str | None = None
    """Registered agent (or `module:Class`) that runs this task; None = the run's `agent.default`."""
    data_source: str = "default"
    """Picks the reward function (``reward.sources`` maps data sources to functions)."""
    reward_spec: dict[str, Any] = Field(default_factory=dict)
    """What the reward function needs (e.g. ``{"ground_truth": "42"}``)."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Anything else the agent or the reward may use."""

    @model_validator(mode="after")
    def _one_of_prompt_or_messages(self) -> Task:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a task needs exactly one of 'prompt' or 'messages'")
        return self

    def initial_messages(self, system_prompt: str | None = None) -> list[Message]:
        """The conversation an episode starts from (a copy; safe to mutate)."""
        if self.messages is not None:
            msgs = [dict(m) for m in self.messages]
        else:
            msgs = [{"role": "user", "content": self.prompt}]
        if system_prompt and (not msgs or msgs[0].get("role") != "system"):
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return msgs


class SamplingParams(BaseModel):
    """How to sample one generation request.

    RL defaults: ``top_p=1`` and ``top_k=-1`` (off), because the trainer recomputes logprobs
    with temperature but without top-k/top-p masking; anything else is a policy mismatch that
    the ``rollout_corr/`` diagnostics will show.
    """

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=256, ge=0)
    """Most tokens to generate in this request."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Softmax temperature; 0 means greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = -1
    """Keep only the k most likely tokens (-1 = off)."""
    seed: int | None = None
    """Per-request sampling seed, for reproducible samples."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end the generation (included in the output, like EOS)."""


class Generation(BaseModel):
    """What an inference server returned for one request.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` after temperature (and after
    top-k/top-p masking when those are on); :meth:`versions` is the version of the weights that
    produced each token (a ``keep``-mode push may change them in the middle of a request).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "abort"]
    """``stop``: EOS or a stop token; ``length``: max_tokens; ``abort``: aborted by the server."""
    weight_version: int
    """The oldest version among the tokens (all of them when ``token_versions`` is None)."""
    server: str = ""
    """Which server answered (its base URL), for routing diagnostics."""
    token_versions: list[int] | None = None
    """The version that sampled each token, when the server says (the embedded server does: a
    request carried across a weight push spans two); None = ``weight_version`` for every token."""

    @model_validator(mode="after")
    def _aligned(self) -> Generation:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"generation has {len(self.token_ids)} token_ids but {len(self.logprobs)} logprobs"
            )
        if self.token_versions is not None and len(self.token_versions) != len(self.token_ids):
            raise ValueError(
                f"generation has {len(self.token_ids)} token_ids but "
                f"{len(self.token_versions)} token_versions"
            )
        return self

    def versions(self) -> list[int]:
        """The weight version of each token (``token_versions``, else ``weight_version``)."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.weight_version] * len(self.token_ids)


@runtime_checkable
class Policy(Protocol):
    """Anything that generates tokens: a PolicyClient, a ServerPool, a scripted fake in tests."""

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        session_id: str | None = None,
    ) -> Generation:
        """Sample a continuation of ``prompt_ids`` (``session_id``: one episode, one server)."""
        ...


class TurnSample(BaseModel):
    """One model turn as its own training sample (``agent.history: per_turn``): the prompt the
    server was sent for that turn, rendered by the chat template from the conversation so far
    (a Qwen3-style template strips earlier turns' thinking), and the tokens it sampled."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    teacher_logprobs: list[float] = Field(default_factory=list)
    """With a teacher: its logprob of each of ``token_ids``; empty without one."""

    @model_validator(mode="after")
    def _aligned(self) -> TurnSample:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"turn sample has {n} token_ids, {len(self.logprobs)} logprobs and "
                f"{len(self.versions)} versions; they must be equal"
            )
        if self.teacher_logprobs and len(self.teacher_logprobs) != n:
            raise ValueError(
                f"turn sample has {n} token_ids but {len(self.teacher_logprobs)} teacher_logprobs"
            )
        return self


class TurnRecord(BaseModel):
    """One step of an episode as it happened: a model turn or the environment's answer (tool
    results, a user or game message). For traces and display only; never trained on."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["model", "environment"]
    """``model``: tokens the policy sampled; ``environment``: tokens appended for it."""
    start: float
    """Wall-clock time (``time.time()``) the step began: when the previous one ended."""
    end: float
    """Wall-clock time its tokens were recorded."""
    tokens: int
    """Tokens it added to the response (after any budget cut)."""
    version: int = -1
    """Weight version of the model turn's last generation; -1 for the environment."""
    finish_reason: str | None = None
    """The server's ``finish_reason`` of a model turn's last generation."""


class Trajectory(BaseModel):
    """One finished episode, token-exact, with everything the trainer needs.

    ``response_ids`` holds every token after the prompt in order: the model's turns *and* the
    tool/user turns, exactly as the inference server saw them (later turns are appended as
    token deltas; earlier turns are never re-tokenized).
    """

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int]
    """Tokens the episode started from (chat template applied)."""
    response_ids: list[int]
    """Every token after the prompt, model and environment turns, in order."""
    loss_mask: list[int]
    """1 for tokens the policy sampled, 0 for tool/user/template tokens."""
    rollout_logprobs: list[float]
    """log π_rollout of each sampled token; 0.0 where the mask is 0."""
    policy_version: list[int]
    """Weight version that sampled each token; -1 where the mask is 0."""
    reward: float = 0.0
    """Episode reward (set by the reward function when the episode ends)."""
    turn_rewards: list[float] = Field(default_factory=list)
    """Optional per-turn rewards, one per model turn."""
    reward_info: dict[str, Any] = Field(default_factory=dict)
    """Whatever the reward function reported besides the score."""
    uid: str
    """Prompt-group id: all samples of one task share it (GRPO/RLOO baselines)."""
    index: int = 0
    """Sample index within its group."""
    task_id: str = ""
    """Id of the task this episode ran."""
    agent: str = "tool_agent"
    """Name of the agent that produced it."""
    data_source: str = "default"
    """The task's data source (chooses the reward function)."""
    num_turns: int = 0
    """Number of model turns (generate calls that produced tokens)."""
    tool_calls: dict[str, int] = Field(default_factory=dict)
    """Tool name -> number of calls (``<invalid>`` counts malformed calls)."""
    stop_reason: StopReason = StopReason.EOS
    """Why the episode ended."""
    error: str | None = None
    """The error message when ``stop_reason`` is ``error``."""
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds spent per phase (``generate``, ``tools``, ``reward``, ``total``)."""
    tool_stats: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Tool name -> this episode's ``calls``, ``errors``, ``timeouts``, ``latency_s`` (summed)
    and ``latency_max_s``; each step logs them per batch as ``tools/<name>/...``."""
    env_state: dict[str, Any] = Field(default_factory=dict)
    """The environment's final state (plain data), what its reward reads; empty without one."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Agent-reported numbers, aggregated into ``rollout/`` metrics."""
    messages: list[Message] = Field(default_factory=list)
    """The conversation, for display only; never used for training."""
    turn_samples: list[TurnSample] = Field(default_factory=list)
    """With ``agent.history: per_turn``: each model turn as the server saw it; the trainer
    trains these (:meth:`per_turn_samples`) instead of the concatenated response."""
    teacher_logprobs: list[float] = Field(default_factory=list)
    """With a teacher (``teacher.path``): log π_teacher of each response token, at the sampling
    temperature; 0.0 where the mask is 0; empty without a teacher (and with ``turn_samples``,
    whose entries carry their own)."""
    turns: list[TurnRecord] = Field(default_factory=list)
    """Each model turn and environment answer with its timing, tokens and weight version
    (MLflow traces are built from it); display only."""

    @model_validator(mode="after")
    def _check_invariants(self) -> Trajectory:
        n = len(self.response_ids)
        for name in ("loss_mask", "rollout_logprobs", "policy_version"):
            got = len(getattr(self, name))
            if got != n:
                raise TrajectoryError(
                    f"trajectory {self.uid!r}: {name} has {got} entries but response_ids has {n}; "
                    "every response token needs exactly one entry in each per-token list"
                )
        if self.teacher_logprobs and len(self.teacher_logprobs) != n:
            raise TrajectoryError(
                f"trajectory {self.uid!r}: teacher_logprobs has {len(self.teacher_logprobs)} "
                f"entries but response_ids has {n}; give one per response token (or none)"
            )
        if not self._per_token_fields_ok():
            self._raise_first_per_token_error()
        if not self.prompt_ids:
            raise TrajectoryError(f"trajectory {self.uid!r}: prompt_ids is empty")
        return self

    def _per_token_fields_ok(self) -> bool:
        """The per-token invariants, checked with C-level builtins (no Python loop per token).

        Validation runs for every episode, so it must stay cheap; when this says no,
        :meth:`_raise_first_per_token_error` finds and names the first bad position.
        """
        mask = self.loss_mask
        if not set(mask) <= {0, 1}:
            return False
        unmasked = list(map(operator.not_, mask))
        sampled_lp = list(itertools.compress(self.rollout_logprobs, mask))
        if sampled_lp:
            try:
                total = math.fsum(sampled_lp)
            except (OverflowError, ValueError):  # +inf and -inf together
                return False
            if not math.isfinite(total) or max(sampled_lp) > 0.0:
                return False
            if min(itertools.compress(self.policy_version, mask)) < 0:
                return False
        if not set(itertools.compress(self.rollout_logprobs, unmasked)) <= {0.0}:
            return False
        return set(itertools.compress(self.policy_version, unmasked)) <= {-1}

    def _raise_first_per_token_error(self) -> None:
        for t, (m, lp, v) in enumerate(
            zip(self.loss_mask, self.rollout_logprobs, self.policy_version, strict=True)
        ):
            if m == 1:
                if not math.isfinite(lp) or lp > 0.0:
                    raise TrajectoryError(
                        f"trajectory {self.uid!r}: rollout_logprobs[{t}] = {lp!r} for a sampled "
                        "token; a logprob must be finite and <= 0"
                    )
                if v < 0:
                    raise TrajectoryError(
                        f"trajectory {self.uid!r}: policy_version[{t}] = {v} for a sampled token; "
                        "sampled tokens need the weight version (>= 0) that produced them"
                    )
            elif m == 0:
                if lp != 0.0 or v != -1:
                    raise TrajectoryError(
                        f"trajectory {self.uid!r}: position {t} has loss_mask 0 but "
                        f"rollout_logprobs={lp!r}, policy_version={v}; use 0.0 and -1 there"
                    )
            else:
                raise TrajectoryError(
                    f"trajectory {self.uid!r}: loss_mask[{t}] = {m!r}; the mask holds only 0 and 1"
                )
        raise TrajectoryError(f"trajectory {self.uid!r}: per-token fields are inconsistent")

    # ---- derived quantities -------------------------------------------------------------
    @property
    def response_length(self) -> int:
        """Tokens after the prompt (model turns and environment turns)."""
        return len(self.response_ids)

    @property
    def num_sampled_tokens(self) -> int:
        """Tokens the policy sampled (``loss_mask == 1``)."""
        return sum(self.loss_mask)

    @property
    def min_version(self) -> int | None:
        """Oldest weight version among sampled tokens (None if nothing was sampled)."""
        versions = [v for v, m in zip(self.policy_version, self.loss_mask, strict=True) if m]
        return min(versions) if versions else None

    @property
    def max_version(self) -> int | None:
        """Newest weight version among sampled tokens (None if nothing was sampled)."""
        versions = [v for v, m in zip(self.policy_version, self.loss_mask, strict=True) if m]
        return max(versions) if versions else None

    def per_turn_samples(self) -> list[Trajectory]:
        """The trajectories the trainer trains on: ``[self]`` (exact concatenation), or one per
        :attr:`turn_samples` entry, each the turn's prompt and sampled tokens, sharing this
        episode's ``reward``, ``uid`` (group) and ``index`` (turn ``k`` adds ``turn_rewards[k]``
        when there are turn rewards)."""
        if not self.turn_samples:
            return [self]
        out = []
        for k, s in enumerate(self.turn_samples):
            extra = self.turn_rewards[k] if k < len(self.turn_rewards) else 0.0
            out.append(
                self.model_copy(
                    update={
                        "prompt_ids": list(s.prompt_ids),
                        "response_ids": list(s.token_ids),
                        "loss_mask": [1] * len(s.token_ids),
                        "rollout_logprobs": list(s.logprobs),
                        "policy_version": list(s.versions),
                        "teacher_logprobs": list(s.teacher_logprobs),
                        "reward": self.reward + extra,
                        "turn_rewards": [],
                        "turn_samples": [],
                        "num_turns": 1,
                    }
                )
            )
        return out

    def staleness(self, current_version: int) -> int:
        """``current_version - min(policy_version over sampled tokens)``; 0 if nothing sampled."""
        oldest = self.min_version
        return 0 if oldest is None else current_version - oldest

    # ---- serialization ------------------------------------------------------------------
    def to_json(self) -> str:
        """The trajectory as JSON (:meth:`from_json` reads it back)."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> Trajectory:
        """A trajectory from :meth:`to_json` output (validated)."""
        return cls.model_validate_json(data)
