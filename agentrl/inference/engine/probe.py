"""The probe: a short scoring or seeded generation served ahead of the queue, also while paused.

Why it exists: a weight push verifies the new weights before anything else is served by them. It
pauses the engine, loads, then asks for a probe: with ``token_ids``, their processed logprobs
after ``prompt`` under the current weights (teacher forcing, one forward); without, a short
seeded generation. The trainer compares the numbers with its own forward and resumes only when
they agree.

Invariants:

- a probe runs as a control operation: on the engine thread, between two decode steps or while
  paused, never inside a step, and ahead of every queued request;
- it reads the weights and the version of one moment: the ``weight_version`` it reports is the
  one that produced every number in it;
- it is checked at the door like a request (vocabulary, context, sampling), makes at most
  :data:`PROBE_MAX_TOKENS` tokens, uses no top-k/top-p and no EOS stop, and touches neither the
  running batch nor the queue;
- a non-finite logprob fails the probe (:class:`EngineStepError`) instead of being reported.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agentrl.inference.engine.request import (
    EngineOutput,
    EngineRequestError,
    EngineStepError,
    normalize_sampling,
)
from agentrl.inference.engine.sampling import process_logits, sample_token
from agentrl.kv_cache import cache_kwargs, output_cache
from agentrl.types import SamplingParams

__all__ = ["PROBE_MAX_TOKENS", "Probe", "run_probe"]

PROBE_MAX_TOKENS = 256
"""Most tokens one probe may generate or score."""


@dataclass(frozen=True)
class Probe:
    """A checked probe: its prompt, the tokens to score (None: generate) and its sampling."""

    prompt: list[int]
    forced: list[int] | None
    sampling: SamplingParams

    @classmethod
    def make(
        cls,
        prompt_ids: list[int],
        *,
        temperature: float,
        max_tokens: int,
        seed: int,
        token_ids: list[int] | None,
        validate: Callable[[list[int], SamplingParams], None],
    ) -> Probe:
        """The probe of these arguments, checked with ``validate`` (the engine's door check);
        :class:`EngineRequestError` naming the field when it cannot run."""
        prompt = [int(t) for t in prompt_ids]
        forced = None if token_ids is None else [int(t) for t in token_ids]
        n = len(forced) if forced is not None else int(max_tokens)
        sampling = SamplingParams(max_tokens=n, temperature=temperature, seed=seed)
        if n > PROBE_MAX_TOKENS:
            raise EngineRequestError(
                f"a probe makes at most {PROBE_MAX_TOKENS} tokens, got {n}", "max_tokens"
            )
        validate(prompt + (forced or []), sampling.model_copy(update={"max_tokens": 0}))
        validate(prompt, sampling)
        return cls(prompt, forced, normalize_sampling(sampling))


@torch.no_grad()
def run_probe(
    model: Any,
    device: torch.device,
    probe: Probe,
    *,
    version: int,
    request_id: Callable[[], str],
) -> EngineOutput:
    """Run ``probe`` on ``model`` (engine thread); its output is labelled ``version`` and named
    by ``request_id()``, called once the probe succeeded."""
    t0 = time.monotonic()
    prompt, forced, sampling = probe.prompt, probe.forced, probe.sampling
    gen = torch.Generator().manual_seed(int(sampling.seed or 0))
    ids = prompt + (forced or [])
    out_ids: list[int] = []
    logprobs: list[float] = []
    x = torch.tensor([ids], dtype=torch.long, device=device)
    out = model(input_ids=x, use_cache=forced is None)
    cache = output_cache(out) if forced is None else None
    rows = out.logits[0, len(prompt) - 1 :].float().cpu()
    for i in range(sampling.max_tokens):
        lp = process_logits(
            rows[i] if forced is not None else rows[-1], sampling.temperature, -1, 1.0
        )
        tok = forced[i] if forced is not None else sample_token(lp, sampling.temperature, gen)
        value = float(lp[tok])
        if not math.isfinite(value):
            raise EngineStepError(
                f"probe: the logprob of token {tok} at position {i} is {value}: the weights "
                "give non-finite logits"
            )
        out_ids.append(tok)
        logprobs.append(value)
        if forced is None and i + 1 < sampling.max_tokens:
            step = model(
                input_ids=torch.tensor([[tok]], device=device),
                use_cache=True,
                **cache_kwargs(model, cache),
            )
            cache, rows = output_cache(step), step.logits[0].float().cpu()
    return EngineOutput(
        request_id=request_id(),
        prompt_ids=prompt,
        token_ids=out_ids,
        logprobs=logprobs,
        finish_reason="length",
        weight_version=version,
        token_versions=[version] * len(out_ids),
        total_s=time.monotonic() - t0,
    )
