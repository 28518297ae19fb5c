"""The embedded inference engine: KV-cached generation with continuous batching, in torch.

Why it exists: tests, the quickstart and CPU-only users need a real inference server without
vLLM. This engine loads any local Hugging Face causal-LM directory and generates with the same
sampling semantics and logprob convention as vLLM with ``--logprobs-mode processed_logprobs``.

How it works. One engine thread owns the model. Callers (HTTP handlers, tests) submit requests
with :meth:`InferenceEngine.submit` / :meth:`InferenceEngine.generate`; each returns a future.
The engine loop repeats: run queued control operations (weight loads, abort, pause, probes),
expire requests past their deadline, admit waiting requests into the running batch (one prefill
each, up to ``max_batch_size``), then run one batched decode step over every running request.
The running batch keeps a left-padded per-layer KV cache ``[B, H_kv, T, D]`` with a 2-D
attention mask ``[B, T]`` and explicit per-row ``position_ids``, so a request joins between two
decode steps (its prefill cache is left-padded to the batch width) and leaves as soon as it is
done (its row is dropped and all-padding leading columns are trimmed).

Invariants:

- every submitted request resolves its future exactly once: with an :class:`EngineOutput`
  (finish reason ``stop``, ``length`` or ``abort``) or with the exception that broke it;
- **one bad request fails only itself**: sampling parameters are checked and normalised at the
  door (a temperature below :data:`MIN_TEMPERATURE` is greedy; seeds must fit in int64); a
  prefill that raises fails that request; a row whose logits are not finite fails that row; when
  a batched decode forward raises, every row of that batch re-prefills its prompt and output so
  far and decodes one step *alone* before anything joins it again, so the failure lands on the
  request that causes it and the others go on (token-exact: greedy outputs are unchanged);
- a request with a ``deadline`` that passes is finished with ``abort`` before its next step and
  is never reported ``stop``/``length`` after it (the client has given up; see the server's
  ``x-request-timeout-s``);
- control operations run only between decode steps, never during one, so a weight load never
  tears a forward pass; a paused engine runs control operations (including :meth:`probe`, which
  is how a weight push verifies before resuming) but no prefill or decode step;
- **a pause always ends**: every pause has a deadline (``max_pause_s``) after which the engine
  resumes by itself and counts ``pause_expired``; a ``wait`` pause stops admitting, lets the
  running batch finish, then pauses; a resume cancels it at any point;
- a weight load is checked completely (:func:`~agentrl.inference.weights.check_state_dict`:
  names, shapes, dtypes, finiteness) before anything is copied, and the weights and the version
  change in the same control operation: both or neither;
- ``EngineOutput.token_versions[i]`` is the weight version that sampled token ``i``;
  ``EngineOutput.weight_version`` is the oldest of them (the conservative value for staleness).
  A request parked by ``pause`` across a weight load finishes on the new weights with the KV
  cache of the old ones (vLLM's keep mode does the same); use ``abort_all`` for a clean cut.

Logprob convention (DESIGN section 3): the logprob of a sampled token is
``log_softmax(logits / temperature)`` after top-k and then top-p masking when those are on
(masked tokens get ``-inf`` and the rest are renormalised). With ``temperature == 0`` the engine
is greedy (argmax of the raw logits) and reports ``log_softmax(logits)``: the unscaled
distribution, as vLLM does.

Shutdown order: :meth:`InferenceEngine.close` (or :meth:`shutdown_nowait` from a signal
handler) stops admitting, aborts every pending request (futures resolve with finish reason
``abort``, paused or not), fails pending control operations, and joins the engine thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from agentrl.inference.collective import ALIGN, BucketLayout, WeightGroup, WeightGroupError
from agentrl.inference.lora import (
    ADAPTER_CONFIG,
    METADATA_KEY,
    LoraMerger,
    LoraSpec,
    check_adapter,
)
from agentrl.inference.weights import (
    MAX_HEADER_BYTES,
    WeightLoadError,
    check_state_dict,
    fetch_into,
    parse_safetensors,
    safetensors_metadata,
)
from agentrl.types import SamplingParams

__all__ = [
    "MAX_VERSION",
    "MIN_TEMPERATURE",
    "PROBE_MAX_TOKENS",
    "EngineOutput",
    "EngineRequestError",
    "EngineStepError",
    "InferenceEngine",
    "WeightLoadError",
    "process_logits",
    "sample_token",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["keep", "abort", "wait"]

MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): ``logits / 1e-50`` overflows."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_VERSION = INT64_MAX
"""Weight versions are integers in ``[0, 2**63 - 1]``."""
PROBE_MAX_TOKENS = 256
"""Most tokens one :meth:`InferenceEngine.probe` may generate or score."""


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
    """Processed logprob of each token (see the module docstring)."""
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
class _Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new: int
    stop_ids: frozenset[int]
    future: concurrent.futures.Future[EngineOutput]
    generator: torch.Generator | None
    submitted: float
    deadline: float | None = None
    started: float = 0.0
    num_top_logprobs: int = 0
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    aborted: bool = False
    finished: bool = False
    suspect: bool = False
    """Was in a batch whose forward failed: decodes alone until one step succeeds."""


# ---- sampling (pure functions; unit-tested on their own) ------------------------------------
def process_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Processed log-probabilities ``[..., V]`` of raw logits ``[..., V]`` (float32), per row.

    ``temperature == 0``: ``log_softmax(logits)`` (greedy; the unscaled distribution).
    Otherwise ``log_softmax`` of ``logits / temperature`` after top-k (keep the k largest;
    ``top_k <= 0`` is off) and top-p (drop the smallest tokens whose cumulative mass is at most
    ``1 - top_p``, always keeping the most likely one; vLLM's rule) masking. Every operation is
    along the last axis, so a row of NaNs spoils only itself.
    """
    x = logits.float()
    if temperature == 0.0:
        return torch.log_softmax(x, dim=-1)
    x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p)
        drop[..., -1] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return torch.log_softmax(x, dim=-1)


def sample_tokens(
    logprobs: torch.Tensor,
    temperature: float,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row of processed logprobs ``[N, V]`` (CPU): ``[N]`` token ids.

    Greedy (``temperature == 0``): the argmax. Otherwise inverse-CDF sampling with one uniform
    draw per row from that row's generator (a request's own stream, so its tokens do not depend
    on what else is in the batch): the first token whose cumulative probability (float64)
    exceeds ``u`` times the row's total. A token with probability 0 is never picked.
    """
    if temperature == 0.0:
        return torch.argmax(logprobs, dim=-1)
    probs = torch.exp(logprobs.double())
    cum = probs.cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    picked = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0]
    picked = picked.clamp_(max=probs.shape[-1] - 1)
    # u * total rounds up to the total only at the very end: fall back to the last token that
    # has probability (a masked tail has none).
    last = probs.shape[-1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.where(probs.gather(1, picked[:, None])[:, 0] > 0, picked, last)


def sample_token(
    logprobs: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> int:
    """One token from processed logprobs ``[V]`` (CPU); :func:`sample_tokens` for one row."""
    return int(sample_tokens(logprobs[None], temperature, [generator])[0].item())


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


def check_version(version: Any, param: str = "version") -> int:
    """``version`` as an int in ``[0, MAX_VERSION]``, else :class:`EngineRequestError`."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise EngineRequestError(
            f"{param}={version!r:.60} is not an integer; versions are 0, 1, 2, ...", param
        )
    if not 0 <= version <= MAX_VERSION:
        raise EngineRequestError(
            f"{param}={str(version)[:40]} is outside [0, 2**63 - 1]; versions are 0, 1, 2, ...",
            param,
        )
    return version


# ---- the engine -------------------------------------------------------------------------------
class InferenceEngine:
    """Continuous-batching generation over a Hugging Face causal LM, owned by one thread.

    Args:
        model_dir: a local directory that ``AutoModelForCausalLM.from_pretrained`` loads.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
        dtype: torch dtype for the weights (float32 gives logprobs that match a trainer's
            float32 forward to ~1e-6).
        max_batch_size: most requests decoded together; the rest wait in FIFO order.
        max_model_len: context limit (prompt + output); defaults to the model's
            ``max_position_embeddings``.
        seed: seeds the per-request generators of requests that carry no ``seed``.
        weight_version: the version number of the weights loaded from ``model_dir``.
        max_pause_s: the longest any pause lasts; then the engine resumes by itself.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        seed: int = 0,
        weight_version: int = 0,
        max_pause_s: float = 300.0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}; it must be >= 1")
        if not max_pause_s > 0:
            raise ValueError(f"max_pause_s={max_pause_s}; it must be > 0")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.model: Any = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dtype)
        self.model.to(self.device)
        self.model.eval()
        cfg = self.model.config
        self.vocab_size: int = int(self.model.get_input_embeddings().weight.shape[0])
        limit = getattr(cfg, "max_position_embeddings", None) or 4096
        self.max_model_len: int = int(max_model_len or limit)
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len}; it must be >= 2")
        self.max_batch_size = max_batch_size
        self.max_pause_s = float(max_pause_s)
        self.eos_token_ids: frozenset[int] = _eos_ids(self.model_dir, cfg)
        self._params: dict[str, torch.Tensor] = dict(self.model.state_dict())
        self._version = check_version(weight_version, "weight_version")
        self._checksum: str | None = None
        self._seed_gen = torch.Generator().manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._controls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._controls = collections.deque()
        self._paused = False
        self._draining = False
        self._pause_deadline = 0.0
        self._epoch = 0
        self._closing = False
        self._ids = itertools.count()
        self._staging = bytearray()
        self.last_load_casts: dict[str, int] = {}
        """Dtype widenings of the last weight load (``{"float16->float32": n}``), reported."""
        self.staging_lock = threading.Lock()
        """Held by whoever fills :meth:`staging_buffer` until the load that reads it is done."""
        self.lora = LoraMerger(self._params)
        """The merged LoRA adapter (if any) and the base weights it was merged onto."""
        self.weight_group: WeightGroup | None = None
        """The :class:`~agentrl.inference.collective.WeightGroup` this server joined, if any."""
        self.group_lock = threading.Lock()
        """Serializes joining the weight group and receiving on it."""
        # Running batch (touched only by the engine thread).
        self._rows: list[_Request] = []
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._cache: Any = None
        self._next_pos: list[int] = []
        # Counters (read by /metrics).
        self.stats: dict[str, int] = collections.defaultdict(int)
        self._thread = threading.Thread(target=self._loop, name="agentrl-engine", daemon=True)
        self._thread.start()

    # ---- state (thread-safe reads) -------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The version of the weights the engine holds now."""
        return self._version

    @property
    def is_paused(self) -> bool:
        """True while paused or draining toward a pause (vLLM reports both as paused)."""
        return self._paused or self._draining

    @property
    def pause_state(self) -> Literal["running", "draining", "paused"]:
        """``running``, ``draining`` (a ``wait`` pause) or ``paused``."""
        return "paused" if self._paused else "draining" if self._draining else "running"

    @property
    def resume_epoch(self) -> int:
        """Incremented by every resume (manual or by deadline); a pending pause compares it."""
        return self._epoch

    @property
    def num_running(self) -> int:
        """Unfinished requests in the running batch (a row whose future has resolved is not
        counted, even in the moment before the engine drops it)."""
        return sum(1 for r in list(self._rows) if not r.finished)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission."""
        return len(self._waiting)

    @property
    def is_closed(self) -> bool:
        """True once the engine stops (``close`` or ``shutdown_nowait``)."""
        return self._closing

    @property
    def state_bytes(self) -> int:
        """Bytes of the model's state dict (tied copies counted once per name)."""
        return sum(t.numel() * t.element_size() for t in self._params.values())

    # ---- requests -------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raise :class:`EngineRequestError` (with ``param``) if the request cannot be served."""
        normalize_sampling(sampling)
        if not prompt_ids:
            raise EngineRequestError("prompt is empty; send at least one token", "prompt")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise EngineRequestError(
                f"prompt token id {bad[0]} is out of vocabulary; ids must be in "
                f"[0, {self.vocab_size})",
                "prompt",
            )
        if len(prompt_ids) >= self.max_model_len:
            raise EngineRequestError(
                f"prompt has {len(prompt_ids)} tokens but this model's maximum context length "
                f"is {self.max_model_len} tokens; shorten the prompt",
                "prompt",
            )
        if len(prompt_ids) + sampling.max_tokens > self.max_model_len:
            raise EngineRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(prompt_ids)} prompt tokens + max_tokens={sampling.max_tokens} exceed it; "
                "lower max_tokens",
                "max_tokens",
            )
        bad_stop = [t for t in sampling.stop_token_ids if not 0 <= int(t) < self.vocab_size]
        if bad_stop:
            raise EngineRequestError(
                f"stop token id {bad_stop[0]} is out of vocabulary [0, {self.vocab_size})",
                "stop_token_ids",
            )

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        *,
        num_top_logprobs: int = 0,
        ignore_eos: bool = False,
        timeout_s: float | None = None,
    ) -> concurrent.futures.Future[EngineOutput]:
        """Queue a request; the future resolves with its :class:`EngineOutput`.

        ``num_top_logprobs > 0`` also records that many top alternatives per token;
        ``ignore_eos`` keeps generating past EOS (only ``stop_token_ids`` stop; benchmarks);
        ``timeout_s`` is the request's deadline from now (then it finishes with ``abort``).
        Raises :class:`EngineRequestError` if the request cannot be served.
        """
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, sampling)
        sampling = normalize_sampling(sampling)
        gen: torch.Generator | None = None
        if sampling.temperature > 0.0:
            seed = sampling.seed
            if seed is None:
                with self._cond:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen).item())
            gen = torch.Generator().manual_seed(int(seed))
        now = time.monotonic()
        req = _Request(
            request_id=request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            prompt_ids=prompt_ids,
            sampling=sampling,
            max_new=min(sampling.max_tokens, self.max_model_len - len(prompt_ids)),
            stop_ids=frozenset(sampling.stop_token_ids)
            | (frozenset() if ignore_eos else self.eos_token_ids),
            future=concurrent.futures.Future(),
            generator=gen,
            submitted=now,
            deadline=None if timeout_s is None else now + max(0.0, timeout_s),
            num_top_logprobs=max(0, int(num_top_logprobs)),
        )
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is closed; create a new InferenceEngine")
            self._waiting.append(req)
            self.stats["requests_submitted"] += 1
            self._cond.notify_all()
        return req.future

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        *,
        num_top_logprobs: int = 0,
    ) -> EngineOutput:
        """Async wrapper of :meth:`submit`; cancelling the await aborts the request."""
        fut = self.submit(prompt_ids, sampling, request_id, num_top_logprobs=num_top_logprobs)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.cancel(fut)
            raise

    def cancel(self, fut: concurrent.futures.Future[EngineOutput]) -> None:
        """Abort the request behind ``fut`` (from :meth:`submit`) at the next step; no-op if done."""

        def _mark() -> None:
            self._drop(lambda r: r.future is fut)

        with self._cond:
            if not self._closing:
                self._controls.append((_mark, concurrent.futures.Future()))
                self._cond.notify_all()

    # ---- pause / resume -------------------------------------------------------------------------
    def pause(self, mode: PauseMode = "keep", *, max_pause_s: float | None = None) -> int:
        """Pause now (``keep``: running requests stay parked; ``abort``: they end first).

        Blocks until paused; returns how many requests were aborted. The pause ends by itself
        after ``max_pause_s`` (capped by the engine's own). For ``wait`` use
        :meth:`start_drain`.
        """
        if mode not in ("keep", "abort"):
            raise ValueError(f"pause mode {mode!r}: use 'keep' or 'abort' (or start_drain)")
        limit = self._pause_limit(max_pause_s)

        def _pause() -> int:
            aborted = self._abort_all_now() if mode == "abort" else 0
            with self._cond:
                self._paused, self._draining = True, False
                self._pause_deadline = time.monotonic() + limit
            return aborted

        return self._control(_pause)

    def start_drain(self, *, max_pause_s: float | None = None) -> int:
        """Begin a ``wait`` pause: admit nothing new, pause once the running batch is empty.

        Returns the resume epoch; the drain (and the pause it becomes) is cancelled by any
        resume, or by :meth:`cancel_pause` with this epoch.
        """
        limit = self._pause_limit(max_pause_s)

        def _drain() -> int:
            with self._cond:
                if not self._paused:
                    self._draining = True
                self._pause_deadline = time.monotonic() + limit
                return self._epoch

        return self._control(_drain)

    def resume(self) -> None:
        """End any pause or drain now (and cancel a pending ``wait`` pause)."""
        with self._cond:
            self._resume_locked()

    def cancel_pause(self, epoch: int) -> bool:
        """Resume only if no resume happened since ``epoch`` (a pause whose requester left)."""
        with self._cond:
            if self._epoch != epoch or not (self._paused or self._draining):
                return False
            self._resume_locked()
            return True

    def _resume_locked(self) -> None:
        self._paused = self._draining = False
        self._epoch += 1
        self._cond.notify_all()

    def _pause_limit(self, max_pause_s: float | None) -> float:
        if max_pause_s is None:
            return self.max_pause_s
        if not (math.isfinite(max_pause_s) and max_pause_s > 0):
            raise EngineRequestError(f"timeout_s={max_pause_s!r}; use a value > 0", "timeout_s")
        return min(float(max_pause_s), self.max_pause_s)

    def abort_all(self) -> int:
        """Finish every running and waiting request now (finish reason ``abort``); returns how many."""
        return self._control(self._abort_all_now)

    # ---- probe: served between steps, even while paused -------------------------------------
    def probe(
        self,
        prompt_ids: list[int],
        *,
        temperature: float = 1.0,
        max_tokens: int = 8,
        seed: int = 0,
        token_ids: list[int] | None = None,
    ) -> EngineOutput:
        """Generate (or, with ``token_ids``, score) a short sequence *ahead of the queue*.

        Runs as a control operation: between two decode steps, and also while the engine is
        paused, so a weight push can check the new weights before anything else is served.
        With ``token_ids`` the output holds those tokens and their processed logprobs under
        the current weights (teacher forcing); without, ``max_tokens`` sampled tokens
        (``seed``; greedy below :data:`MIN_TEMPERATURE`). No top-k/top-p, no EOS stop.
        """
        prompt = [int(t) for t in prompt_ids]
        forced = None if token_ids is None else [int(t) for t in token_ids]
        n = len(forced) if forced is not None else int(max_tokens)
        sampling = SamplingParams(max_tokens=n, temperature=temperature, seed=seed)
        if n > PROBE_MAX_TOKENS:
            raise EngineRequestError(
                f"a probe makes at most {PROBE_MAX_TOKENS} tokens, got {n}", "max_tokens"
            )
        self.validate(prompt + (forced or []), sampling.model_copy(update={"max_tokens": 0}))
        self.validate(prompt, sampling)
        sampling = normalize_sampling(sampling)
        return self._control(lambda: self._run_probe(prompt, sampling, forced))

    @torch.no_grad()
    def _run_probe(
        self, prompt: list[int], sampling: SamplingParams, forced: list[int] | None
    ) -> EngineOutput:
        t0 = time.monotonic()
        gen = torch.Generator().manual_seed(int(sampling.seed or 0))
        ids = prompt + (forced or [])
        out_ids: list[int] = []
        logprobs: list[float] = []
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, use_cache=forced is None)
        cache = out.past_key_values if forced is None else None
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
                step = self.model(
                    input_ids=torch.tensor([[tok]], device=self.device),
                    past_key_values=cache,
                    use_cache=True,
                )
                cache, rows = step.past_key_values, step.logits[0].float().cpu()
        self.stats["probes"] += 1
        return EngineOutput(
            request_id=f"probe-{next(self._ids)}",
            prompt_ids=prompt,
            token_ids=out_ids,
            logprobs=logprobs,
            finish_reason="length",
            weight_version=self._version,
            token_versions=[self._version] * len(out_ids),
            total_s=time.monotonic() - t0,
        )

    # ---- weights ----------------------------------------------------------------------------
    def staging_buffer(self, num_bytes: int) -> memoryview:
        """A reusable buffer of ``num_bytes`` for receiving weights (hold :attr:`staging_lock`).

        Reused across pushes, so its pages are already mapped: writing into fresh memory costs
        more than the copy itself (page faults).
        """
        if len(self._staging) < num_bytes:
            self._staging = bytearray(num_bytes)
        return memoryview(self._staging)[:num_bytes]

    def load_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], version: int | None = None
    ) -> int:
        """Swap weights between decode steps; returns the new version (``version`` or current + 1).

        Checked completely first (names, shapes, dtype equal or losslessly widened, finite
        values, every parameter given except tied copies, a valid version; a lossless widening
        such as float16 -> float32 is applied and reported in :attr:`last_load_casts`, anything
        else that differs in dtype is refused); on any problem nothing changes and :class:`WeightLoadError` (or :class:`EngineRequestError` for the
        version) is raised. The check runs in the caller's thread, so decoding goes on.
        """
        if version is not None:
            check_version(version)
        casts = check_state_dict(state_dict, self._params)
        if casts:
            log.warning("weight update widened dtypes losslessly: %s", casts)

        def _apply() -> int:
            new = self._version + 1 if version is None else int(version)
            check_version(new)
            with torch.no_grad():
                for k, v in state_dict.items():
                    self._params[k].copy_(v)
            self.lora.forget()  # the full weights are the new base
            self._version = new
            self._checksum = None
            self.last_load_casts = casts
            self.stats["weight_updates"] += 1
            return new

        return self._control(_apply)

    def load_lora(
        self, adapter: Mapping[str, torch.Tensor], spec: LoraSpec, version: int | None = None
    ) -> int:
        """Merge a LoRA adapter (peft naming; :mod:`agentrl.inference.lora`) onto the base weights,
        between decode steps; returns the new version. Checked completely first (names, shapes,
        rank, targets, dtypes, finiteness, the version); on any problem nothing changes. Each
        adapter is merged onto the kept base weights, never onto the previous merge."""
        if version is not None:
            check_version(version)
        plan = check_adapter(adapter, spec, self._params)

        def _apply() -> int:
            new = self._version + 1 if version is None else int(version)
            check_version(new)
            self.lora.apply(plan, spec)
            self._version = new
            self._checksum = None
            self.last_load_casts = {}
            self.stats["weight_updates"] += 1
            self.stats["lora_updates"] += 1
            return new

        return self._control(_apply)

    def load_update(
        self,
        state: Mapping[str, torch.Tensor],
        version: int | None = None,
        lora: LoraSpec | None = None,
    ) -> int:
        """:meth:`load_lora` when ``lora`` is given, else :meth:`load_state_dict`."""
        if lora is not None:
            return self.load_lora(state, lora, version)
        return self.load_state_dict(state, version)

    def load_safetensors(
        self, buf: bytearray | memoryview, version: int | None = None, *, what: str = "the body"
    ) -> int:
        """Load a safetensors file held in ``buf`` (hold :attr:`staging_lock` when it is the
        staging buffer): a LoRA adapter when its metadata carries one
        (:data:`~agentrl.inference.lora.METADATA_KEY`), else full weights."""
        try:
            state = parse_safetensors(buf)
            raw = safetensors_metadata(buf).get(METADATA_KEY)
        except WeightLoadError as e:
            raise WeightLoadError(f"{what} is not a valid safetensors file: {e}") from e
        lora = LoraSpec.from_json(raw, f"{what}: {METADATA_KEY}") if raw is not None else None
        return self.load_update(state, version, lora)

    def load_weights_from_path(self, path: str | Path, version: int | None = None) -> int:
        """Load every ``*.safetensors`` file of a directory (or one file); see :meth:`load_state_dict`.
        A directory with peft's ``adapter_config.json`` is a LoRA adapter (:meth:`load_lora`)."""
        if version is not None:
            check_version(version)
        p = Path(path)
        lora = _adapter_spec(p)
        try:
            files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
            sizes = [f.stat().st_size for f in files if f.is_file()]
        except OSError as e:
            raise WeightLoadError(f"cannot read weights at {str(p)!r}: {e.strerror}") from e
        if not files or len(sizes) != len(files):
            raise WeightLoadError(
                f"no safetensors weights at {str(p)!r}; pass a directory holding *.safetensors "
                "files (e.g. one written by save_pretrained) or a .safetensors file"
            )
        with self.staging_lock:
            buf = self.staging_buffer(sum(sizes))
            state: dict[str, torch.Tensor] = {}
            offset = 0
            for f, size in zip(files, sizes, strict=True):
                part = buf[offset : offset + size]
                try:
                    with f.open("rb") as fh:
                        got = fh.readinto(part)
                except OSError as e:
                    raise WeightLoadError(f"cannot read {f.name!r}: {e.strerror}") from e
                if got != size:
                    raise WeightLoadError(f"{f.name!r} changed while being read; push again")
                try:
                    state.update(parse_safetensors(part))
                    raw = safetensors_metadata(part).get(METADATA_KEY)
                except WeightLoadError as e:
                    raise WeightLoadError(f"{f.name!r} is not a valid safetensors file: {e}") from e
                if lora is None and raw is not None:
                    lora = LoraSpec.from_json(raw, f"{f.name!r}: {METADATA_KEY}")
                offset += size
            return self.load_update(state, version, lora)

    def load_weights_from_url(
        self, url: str, version: int | None = None, *, timeout_s: float = 60.0
    ) -> int:
        """Pull a safetensors file over plain HTTP straight into the staging buffer (one
        ``readinto``, no per-chunk work; see :class:`~agentrl.inference.weights.WeightServer`),
        then load it; see :meth:`load_state_dict`."""
        if version is not None:
            check_version(version)
        with self.staging_lock:
            buf = fetch_into(
                url,
                self.staging_buffer,
                max_bytes=self.state_bytes + MAX_HEADER_BYTES,
                timeout_s=timeout_s,
            )
            return self.load_safetensors(buf, version, what="the fetched weights")

    def load_weights_from_bytes(self, data: bytes | bytearray, version: int | None = None) -> int:
        """Load a serialized safetensors blob (an HTTP body); see :meth:`load_state_dict`."""
        with self.staging_lock:
            buf = self.staging_buffer(len(data))
            buf[:] = data
            return self.load_safetensors(buf, version, what="the body")

    # ---- the collective transport (a weight group) --------------------------------------------
    def join_weight_group(self, group: WeightGroup, local_address: str | None = None) -> None:
        """Join ``group`` (blocks until every rank is in, at most its timeout), leaving any group
        joined before. Raises :class:`~agentrl.inference.collective.WeightGroupError`."""
        if group.backend == "nccl" and self.device.type != "cuda":
            raise WeightLoadError(
                f"backend 'nccl' needs the server's weights on a GPU; this server runs on "
                f"{self.device}: use backend 'gloo' (checkpoint.collective_backend: gloo)"
            )
        with self.group_lock:
            old, self.weight_group = self.weight_group, None
            if old is not None:
                old.close()
            group.connect(local_address)
            self.weight_group = group

    def leave_weight_group(self) -> bool:
        """Leave the weight group (True when there was one)."""
        with self.group_lock:
            old, self.weight_group = self.weight_group, None
        if old is not None:
            old.close()
        return old is not None

    def receive_weights(
        self,
        group_id: str,
        layout: BucketLayout,
        version: int | None = None,
        lora: LoraSpec | None = None,
    ) -> int:
        """Receive every bucket of ``layout`` broadcast on the weight group ``group_id``, then load
        them (:meth:`load_update`: checked before anything is swapped); returns the new version.

        A wrong ``group_id`` is an :class:`EngineRequestError` (``param="group_id"``); a failed
        broadcast breaks and leaves the group (:class:`~agentrl.inference.collective.WeightGroupError`;
        the trainer rebuilds it at the next push) and changes nothing."""
        if version is not None:
            check_version(version)
        starts = [0]
        for i in range(len(layout.buckets)):
            starts.append(-(-(starts[-1] + layout.bucket_bytes(i)) // ALIGN) * ALIGN)
        if starts[-1] > self.state_bytes + MAX_HEADER_BYTES:
            raise WeightLoadError(
                f"{starts[-1]} bytes cannot be this model's weights (<= {self.state_bytes})"
            )
        with self.group_lock, self.staging_lock:
            group = self.weight_group
            if group is None or group.group_id != group_id:
                have = None if group is None else group.group_id
                raise EngineRequestError(
                    f"this server is in weight group {have!r}, not {group_id!r}; join it first",
                    "group_id",
                )
            if self.device.type == "cpu":
                flat = torch.frombuffer(self.staging_buffer(starts[-1]), dtype=torch.uint8)
            else:
                flat = torch.empty(starts[-1], dtype=torch.uint8, device=self.device)
            state: dict[str, torch.Tensor] = {}
            try:
                for i in range(len(layout.buckets)):
                    bucket = flat[starts[i] : starts[i] + layout.bucket_bytes(i)]
                    group.wait(group.broadcast(bucket))
                    state.update(layout.unpack(i, bucket))
            except WeightGroupError:
                self.weight_group = None
                group.close()
                raise
            return self.load_update(state, version, lora)

    def set_weight_version(self, version: int) -> int:
        """Label the current weights ``version`` (an int in ``[0, 2**63 - 1]``)."""
        v = check_version(version)

        def _set() -> int:
            self._version = v
            return v

        return self._control(_set)

    def weight_info(self, checksum: bool = False) -> dict[str, Any]:
        """``{"version", "num_params"}``, plus ``"checksum"`` (sha256 over name + bytes of the
        state dict, cached until the weights change) when asked: it reads every weight."""

        def _info() -> dict[str, Any]:
            n = sum(p.numel() for p in self.model.parameters())
            info: dict[str, Any] = {"version": self._version, "num_params": int(n)}
            if self.lora.spec is not None:
                info["lora"] = self.lora.info()
            if self.weight_group is not None:
                info["weight_group"] = self.weight_group.describe()
            if checksum:
                if self._checksum is None:
                    h = hashlib.sha256()
                    for name, t in sorted(self._params.items()):
                        h.update(name.encode())
                        h.update(
                            t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().data
                        )
                    self._checksum = h.hexdigest()
                info["checksum"] = self._checksum
            return info

        return self._control(_info)

    # ---- shutdown ---------------------------------------------------------------------------------
    def shutdown_nowait(self) -> None:
        """Ask the engine to stop (safe from a signal handler: takes no lock, never blocks)."""
        self._closing = True

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort everything pending and stop the engine thread (idempotent)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)

    # ---- control plumbing ------------------------------------------------------------------
    def _control(self, fn: Callable[[], T]) -> T:
        if threading.current_thread() is self._thread:
            return fn()
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is closed")
            self._controls.append((fn, fut))
            self._cond.notify_all()
        return fut.result()

    def _abort_all_now(self) -> int:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        rows = list(self._rows)
        self._reset_batch()
        for r in rows + waiting:
            self._finish(r, "abort")
        return len(rows) + len(waiting)

    # ---- the engine loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                controls = self._next_controls()
                if controls is None:
                    break
                for fn, fut in controls:
                    try:
                        fut.set_result(fn())
                    except Exception as e:  # reported to the caller, the engine goes on
                        fut.set_exception(e)
                self._expire(time.monotonic())
                if not self._paused:
                    self._step()
        except BaseException:  # the thread must never die silently: callers would hang
            log.exception("engine loop crashed; aborting every request")
            raise
        finally:
            with self._cond:
                self._closing = True
                controls = list(self._controls)
                self._controls.clear()
            for _, fut in controls:
                if not fut.done():
                    fut.set_exception(RuntimeError("the engine is closed"))
            self._abort_all_now()

    def _next_controls(
        self,
    ) -> list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] | None:
        """Wait for work; the queued control operations, or None when closing."""
        with self._cond:
            while (
                not self._closing
                and not self._controls
                and (self._paused or (not self._rows and (self._draining or not self._waiting)))
            ):
                self._cond.wait(timeout=0.25)
                if self._paused or self._draining or self._waiting:
                    break  # deadlines (of the pause, of waiting requests) are checked each time
            if self._closing:
                return None
            controls = list(self._controls)
            self._controls.clear()
            return controls

    def _expire(self, now: float) -> None:
        """End the pause past its deadline and abort requests past theirs."""
        if (self._paused or self._draining) and now > self._pause_deadline:
            log.warning("pause deadline passed with no resume; resuming by itself")
            self.stats["pause_expired"] += 1
            with self._cond:
                self._resume_locked()
        # A request whose caller cancelled its future (an HTTP client that went away) or whose
        # deadline passed ends now, parked or not.
        self._drop(lambda r: r.future.cancelled() or (r.deadline is not None and now > r.deadline))

    def _drop(self, doomed: Callable[[_Request], bool]) -> None:
        """Finish every waiting or running request for which ``doomed(r)`` with ``abort`` now
        (also while paused: a parked request a client gave up on does not wait for a resume)."""
        with self._cond:
            gone = [r for r in self._waiting if doomed(r)]
            for r in gone:
                self._waiting.remove(r)
        keep = [i for i, r in enumerate(self._rows) if not doomed(r)]
        gone += [r for r in self._rows if doomed(r)]
        if len(keep) < len(self._rows):
            self._keep_rows(keep)
        for r in gone:
            self._finish(r, "abort")

    def _step(self) -> None:
        if not self._draining:
            self._admit()
        if self._rows:
            self._decode_step()
        if self._draining and not self._rows:
            self._paused, self._draining = True, False

    def _admit(self) -> None:
        while len(self._rows) < self.max_batch_size:
            if any(r.suspect for r in self._rows):
                return  # a suspect decodes alone until it has done one step
            reqs = self._take_waiting(self.max_batch_size - len(self._rows))
            if not reqs:
                return
            self._prefill(reqs)

    def _take_waiting(self, room: int) -> list[_Request]:
        """Up to ``room`` waiting requests, in order, to prefill together. A suspect goes
        alone, and only into an empty batch."""
        out: list[_Request] = []
        with self._cond:
            while self._waiting and len(out) < room:
                head = self._waiting[0]
                if head.suspect and (self._rows or out):
                    break
                out.append(self._waiting.popleft())
                if head.suspect:
                    break
        return out

    def _prefill(self, reqs: list[_Request]) -> None:
        """Prefill ``reqs`` in one left-padded forward and join them to the running batch. If
        that forward raises, each request is prefilled alone, so a failure fails only the
        request that causes it."""
        live: list[_Request] = []
        now = time.monotonic()
        for req in reqs:
            req.started = req.started or now
            if req.aborted:
                self._finish(req, "abort")
            elif req.max_new <= 0:
                self._finish(req, "length")
            else:
                live.append(req)
        if len(live) > 1:
            try:
                together = self._prefill_forward(live)
            except Exception as e:
                log.warning("prefill of %d requests together failed (%s); one by one", len(live), e)
                self.stats["prefill_batch_failures"] += 1
            else:  # outside the try: the join samples tokens, a retry would sample them again
                self._join_prefilled(live, *together)
                return
        for req in live:
            try:
                self._join_prefilled([req], *self._prefill_forward([req]))
            except Exception as e:  # this request's prefill failed: it alone fails
                log.exception("prefill of %s failed", req.request_id)
                self._fail(req, EngineStepError(f"prefill failed: {type(e).__name__}: {e}"))

    @torch.no_grad()
    def _prefill_forward(self, reqs: list[_Request]) -> tuple[Any, torch.Tensor, list[int]]:
        """The forward over ``reqs`` left-padded to one width: (output, mask ``[N, T]``, the
        length of each row). A recomputed row (its batch's forward failed) re-prefills prompt +
        output so far, without the last output token, which the next decode step feeds."""
        from transformers import DynamicCache

        seqs = [req.prompt_ids + req.output_ids[:-1] for req in reqs]
        lens = [len(x) for x in seqs]
        width = max(lens)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
            mask[i, width - len(x) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp_(min=0),
            past_key_values=DynamicCache(),
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats["prompt_tokens"] += sum(lens)
        self.stats["prefill_forwards"] += 1
        return out, mask, lens

    def _join_prefilled(
        self, reqs: list[_Request], out: Any, mask: torch.Tensor, lens: list[int]
    ) -> None:
        """Sample the first token of each new request and add the unfinished ones to the
        running batch (their KV cache left-padded to the batch's width)."""
        from transformers import DynamicCache

        done = [False] * len(reqs)
        fresh = [i for i, req in enumerate(reqs) if not req.output_ids]
        if fresh:
            accepted = self._accept([reqs[i] for i in fresh], out.logits[fresh, -1])
            for i, d in zip(fresh, accepted, strict=True):
                done[i] = d
        keep = [i for i, d in enumerate(done) if not d]
        if not keep:
            return
        pad = (mask == 0)[:, None, :, None]
        new_kv = [
            (layer.keys.masked_fill(pad, 0.0), layer.values.masked_fill(pad, 0.0))
            for layer in out.past_key_values.layers
        ]  # padded positions hold zeros, as the running batch's left padding does
        if len(keep) < len(reqs):
            new_kv, mask = _select_rows(new_kv, mask, keep)
        if self._rows:
            old_kv = [(layer.keys, layer.values) for layer in self._cache.layers]
            width = max(self._mask.shape[1], mask.shape[1])
            new_kv = [
                (
                    torch.cat([_left_pad(k0, width), _left_pad(k1, width)], dim=0),
                    torch.cat([_left_pad(v0, width), _left_pad(v1, width)], dim=0),
                )
                for (k0, v0), (k1, v1) in zip(old_kv, new_kv, strict=True)
            ]
            mask = torch.cat(
                [_left_pad(self._mask, width, dim=1), _left_pad(mask, width, dim=1)], dim=0
            )
        self._cache = DynamicCache(ddp_cache_data=new_kv)
        self._mask = mask
        self._rows.extend(reqs[i] for i in keep)
        self._next_pos.extend(lens[i] for i in keep)

    @torch.no_grad()
    def _decode_step(self) -> None:
        rows = self._rows
        live = [i for i, r in enumerate(rows) if not r.aborted]
        if len(live) < len(rows):
            for r in rows:
                if r.aborted:
                    self._finish(r, "abort")
            self._keep_rows(live)
            if not self._rows:
                return
            rows = self._rows
        b = len(rows)
        ids = torch.tensor([[r.output_ids[-1]] for r in rows], dtype=torch.long, device=self.device)
        mask = torch.cat([self._mask, torch.ones(b, 1, dtype=torch.long, device=self.device)], 1)
        pos = torch.tensor(self._next_pos, dtype=torch.long, device=self.device)[:, None]
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=self._cache,
                use_cache=True,
            )
        except Exception as e:  # recompute each row alone: the failure finds its request
            self._recompute_rows(e)
            return
        self._mask = mask
        self._cache = out.past_key_values
        self.stats["decode_steps"] += 1
        for r in rows:
            r.suspect = False
        self._next_pos = [p + 1 for p in self._next_pos]
        done = self._accept(rows, out.logits[:, -1])
        if any(done):
            self._keep_rows([i for i, d in enumerate(done) if not d])

    def _recompute_rows(self, error: Exception) -> None:
        """The batched forward raised. A batch of one: that request is the cause, it fails.
        Otherwise every row goes back to the head of the queue, marked suspect: each
        re-prefills and decodes alone once, so the next failure names its request."""
        log.warning("batched decode step failed (%s); isolating its rows", error)
        self.stats["decode_step_failures"] += 1
        rows = list(self._rows)
        self._reset_batch()
        if len(rows) == 1:
            self._fail(rows[0], EngineStepError(f"decode failed: {type(error).__name__}: {error}"))
            return
        for r in rows:
            r.suspect = True
        with self._cond:
            self._waiting.extendleft(reversed(rows))

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the batch (trimming all-padding leading columns)."""
        from transformers import DynamicCache

        if not keep:
            self._reset_batch()
            return
        kv = [(layer.keys, layer.values) for layer in self._cache.layers]
        kv, self._mask = _select_rows(kv, self._mask, keep)
        self._rows = [self._rows[i] for i in keep]
        self._next_pos = [self._next_pos[i] for i in keep]
        self._cache = DynamicCache(ddp_cache_data=kv)

    def _accept(self, rows: Sequence[_Request], logits: torch.Tensor) -> list[bool]:
        """Sample the next token of every request in ``rows`` from its raw logits (row ``i`` of
        ``[N, V]``); per row, True if that request is done (finished, aborted, past its
        deadline, or failed because its logits are not finite). Rows that share sampling
        parameters are processed and sampled together."""
        done = [True] * len(rows)
        groups: dict[tuple[float, int, float], list[int]] = {}
        for i, req in enumerate(rows):
            if req.aborted:
                self._finish(req, "abort")
                continue
            sp = req.sampling
            groups.setdefault((sp.temperature, sp.top_k, sp.top_p), []).append(i)
        cpu = logits.float().cpu()
        for (temperature, top_k, top_p), idx in groups.items():
            members = [rows[i] for i in idx]
            sub = cpu if len(idx) == len(rows) else cpu[idx]
            sampled = self._sample_group(members, sub, temperature, top_k, top_p)
            for i, ok in zip(idx, sampled, strict=True):
                done[i] = not ok or self._done_after_token(rows[i])
        return done

    def _sample_group(
        self,
        members: list[_Request],
        logits: torch.Tensor,
        temperature: float,
        top_k: int,
        top_p: float,
    ) -> list[bool]:
        """Append one sampled token to each member; False for a member that failed instead."""
        try:
            lp = process_logits(logits, temperature, top_k, top_p)
            finite = torch.isfinite(lp).any(dim=-1).tolist()
            toks = sample_tokens(lp, temperature, [r.generator for r in members])
            values = lp.gather(1, toks[:, None])[:, 0].tolist()
            toks_list = toks.tolist()
        except Exception as e:  # the group's numbers broke the sampler: its members fail
            for req in members:
                self._fail(req, EngineStepError(f"sampling failed: {type(e).__name__}: {e}"))
            return [False] * len(members)
        ok = []
        for j, req in enumerate(members):
            if not finite[j] or not math.isfinite(values[j]):
                why = (
                    "every logit is NaN or -inf"
                    if not finite[j]
                    else (f"the sampled token {toks_list[j]} has logprob {values[j]}")
                )
                self._fail(req, EngineStepError(f"sampling failed (non-finite logits?): {why}"))
                ok.append(False)
                continue
            req.output_ids.append(toks_list[j])
            req.logprobs.append(values[j])
            req.versions.append(self._version)
            if req.num_top_logprobs:
                top = torch.topk(lp[j], min(req.num_top_logprobs, lp.shape[-1]))
                req.top_logprobs.append(
                    [
                        (int(t), float(v))
                        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
                        if math.isfinite(v)
                    ]
                )
            ok.append(True)
        self.stats["generation_tokens"] += sum(ok)
        return ok

    def _done_after_token(self, req: _Request) -> bool:
        """Finish ``req`` if its last token stops it or it reached its length; True if done."""
        if req.output_ids[-1] in req.stop_ids:
            self._finish(req, "stop")
            return True
        if len(req.output_ids) >= req.max_new:
            self._finish(req, "length")
            return True
        return False

    def _fail(self, req: _Request, error: Exception) -> None:
        if req.finished:
            return
        req.finished = True
        self.stats["requests_failed"] += 1
        if not req.future.done():
            req.future.set_exception(error)

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        if req.finished:
            return
        req.finished = True
        now = time.monotonic()
        if req.future.done() or (req.deadline is not None and now > req.deadline):
            reason = "abort"  # the client has given up: never report it served
        self.stats["requests_finished"] += 1
        self.stats[f"finish_{reason}"] += 1
        if req.future.done():  # cancelled by its caller: nobody to tell
            return
        req.future.set_result(
            EngineOutput(
                request_id=req.request_id,
                prompt_ids=req.prompt_ids,
                token_ids=list(req.output_ids),
                logprobs=list(req.logprobs),
                finish_reason=reason,
                weight_version=min(req.versions) if req.versions else self._version,
                token_versions=list(req.versions),
                top_logprobs=list(req.top_logprobs) if req.num_top_logprobs else None,
                queued_s=(req.started or now) - req.submitted,
                total_s=now - req.submitted,
            )
        )

    def _reset_batch(self) -> None:
        self._rows = []
        self._next_pos = []
        self._cache = None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)


def _adapter_spec(path: Path) -> LoraSpec | None:
    """The :class:`LoraSpec` of a peft adapter directory (``adapter_config.json``), else None."""
    cfg = path / ADAPTER_CONFIG if path.is_dir() else None
    if cfg is None or not cfg.is_file():
        return None
    try:
        raw = cfg.read_text()
    except OSError as e:
        raise WeightLoadError(f"cannot read {str(cfg)!r}: {e.strerror}") from e
    return LoraSpec.from_json(raw, f"{str(cfg)!r}")


def _eos_ids(model_dir: Path, cfg: Any) -> frozenset[int]:
    """EOS ids from the generation config, else the model config (both may hold a list)."""
    from transformers import GenerationConfig

    eos: Any = None
    with contextlib.suppress(OSError, ValueError):
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    if eos is None:
        eos = getattr(cfg, "eos_token_id", None)
    eos_list = [eos] if isinstance(eos, int) else list(eos or [])
    return frozenset(int(e) for e in eos_list)


def _select_rows(
    kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, keep: list[int]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Rows ``keep`` of a left-padded KV cache and its mask, without all-padding leading
    columns."""
    idx = torch.tensor(keep, dtype=torch.long, device=mask.device)
    mask = mask.index_select(0, idx)
    first = int(mask.any(dim=0).long().argmax().item())
    kv = [
        (k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:]) for k, v in kv
    ]
    return kv, mask[:, first:]


def _left_pad(x: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Left-pad ``x`` with zeros along ``dim`` to ``width`` (KV ``[B, H, T, D]``: dim 2)."""
    short = width - x.shape[dim]
    if short <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x.new_zeros(shape), x], dim=dim)
