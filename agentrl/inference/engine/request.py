"""One generation request: what the engine accepts at the door, what it tracks, what it returns.

Why it exists: the scheduler, the running batch, the sampler and the server's routes all speak
about the same request; this module is that vocabulary, plus the checks made at the door.

Invariants:

- a request that passed :func:`check_request` can be served: its prompt is non-empty, in
  vocabulary and shorter than the context limit, prompt + ``max_tokens`` fit in it, its stop ids
  are in vocabulary, its sampling numbers are finite and its seed fits in int64;
- after :func:`normalize_sampling` a temperature below :data:`MIN_TEMPERATURE` is exactly 0
  (greedy; ``logits / 1e-50`` would overflow);
- an :class:`EngineRequest` is written by the engine thread only, once it was queued;
  ``finished`` turns True exactly once, when its future is resolved (or found cancelled);
- ``EngineOutput.token_versions[i]`` is the weight version that sampled token ``i``;
  ``EngineOutput.weight_version`` is the oldest of them (the conservative value for staleness),
  or the engine's version when no token was made.
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from agentrl.types import SamplingParams

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MIN_TEMPERATURE",
    "EngineOutput",
    "EngineRequest",
    "EngineRequestError",
    "EngineStepError",
    "FinishReason",
    "check_request",
    "normalize_sampling",
]

FinishReason = Literal["stop", "length", "abort"]

MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): ``logits / 1e-50`` overflows."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class EngineRequestError(ValueError):
    """A request the engine cannot serve; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineStepError(RuntimeError):
    """A step failed for one request (its prefill, its sampling, or its recomputation)."""


@dataclass(frozen=True)
class EngineOutput:
    """The result of one generation request."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Processed logprob of each token (see :mod:`agentrl.inference.engine.sampling`)."""
    finish_reason: FinishReason
    weight_version: int
    """Oldest weight version among the tokens (the engine's version if no token was made)."""
    token_versions: list[int]
    """Weight version that sampled each token."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token, the ``num_top_logprobs`` most likely ``(token_id, logprob)`` (processed;
    tokens masked by top-k/top-p, whose logprob is ``-inf``, are left out)."""
    queued_s: float = 0.0
    """Seconds from submit to the start of the prefill."""
    total_s: float = 0.0
    """Seconds from submit to the end."""


@dataclass(eq=False)
class EngineRequest:
    """A request as the engine holds it from submit to its answer."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new: int
    """Most tokens it may make: ``max_tokens``, capped by the context left after the prompt."""
    stop_ids: frozenset[int]
    future: concurrent.futures.Future[EngineOutput]
    generator: torch.Generator | None
    """Its own seeded stream (None when greedy): its tokens never depend on its batch."""
    submitted: float
    deadline: float | None = None
    started: float = 0.0
    num_top_logprobs: int = 0
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    failed: bool = False
    """Ended with an error (its KV is not worth keeping)."""
    kv_generation: int = -1
    """The weight generation its KV was computed with (its last prefill; -1: none yet)."""
    suspect: bool = False
    """Was in a batch whose forward failed: decodes alone until one step succeeds."""

    def output(self, reason: FinishReason, version: int, now: float) -> EngineOutput:
        """Its :class:`EngineOutput` at ``now``; ``version`` is the engine's, used when no token
        was made."""
        return EngineOutput(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            logprobs=list(self.logprobs),
            finish_reason=reason,
            weight_version=min(self.versions) if self.versions else version,
            token_versions=list(self.versions),
            top_logprobs=list(self.top_logprobs) if self.num_top_logprobs else None,
            queued_s=(self.started or now) - self.submitted,
            total_s=now - self.submitted,
        )


def normalize_sampling(sampling: SamplingParams) -> SamplingParams:
    """``sampling`` with a temperature below :data:`MIN_TEMPERATURE` made greedy (exactly 0).

    Raises :class:`EngineRequestError` naming the field for values no engine can use:
    non-finite temperature/top_p, a seed outside int64.
    """
    t = sampling.temperature
    if not math.isfinite(t) or t < 0:
        raise EngineRequestError(f"temperature={t!r}; use a finite value >= 0", "temperature")
    if not (math.isfinite(sampling.top_p) and 0 < sampling.top_p <= 1):
        raise EngineRequestError(f"top_p={sampling.top_p!r}; use a value in (0, 1]", "top_p")
    if sampling.seed is not None and not INT64_MIN <= sampling.seed <= INT64_MAX:
        raise EngineRequestError(
            f"seed={sampling.seed} does not fit in a signed 64-bit integer; use "
            f"[{INT64_MIN}, {INT64_MAX}]",
            "seed",
        )
    if 0 < t < MIN_TEMPERATURE:
        return sampling.model_copy(update={"temperature": 0.0})
    return sampling


def check_request(
    prompt_ids: list[int], sampling: SamplingParams, *, vocab_size: int, max_model_len: int
) -> None:
    """Raise :class:`EngineRequestError` (with ``param``) if the request cannot be served by a
    model of ``vocab_size`` tokens and a context of ``max_model_len``."""
    normalize_sampling(sampling)
    if not prompt_ids:
        raise EngineRequestError("prompt is empty; send at least one token", "prompt")
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise EngineRequestError(
            f"prompt token id {bad[0]} is out of vocabulary; ids must be in [0, {vocab_size})",
            "prompt",
        )
    if len(prompt_ids) >= max_model_len:
        raise EngineRequestError(
            f"prompt has {len(prompt_ids)} tokens but this model's maximum context length "
            f"is {max_model_len} tokens; shorten the prompt",
            "prompt",
        )
    if len(prompt_ids) + sampling.max_tokens > max_model_len:
        raise EngineRequestError(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{len(prompt_ids)} prompt tokens + max_tokens={sampling.max_tokens} exceed it; "
            "lower max_tokens",
            "max_tokens",
        )
    bad_stop = [t for t in sampling.stop_token_ids if not 0 <= int(t) < vocab_size]
    if bad_stop:
        raise EngineRequestError(
            f"stop token id {bad_stop[0]} is out of vocabulary [0, {vocab_size})",
            "stop_token_ids",
        )
