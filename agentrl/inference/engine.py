"""The embedded inference engine: KV-cached generation with continuous batching, in torch.

Why it exists: tests, the quickstart and CPU-only users need a real inference server without
vLLM. This engine loads any local Hugging Face causal-LM directory and generates with the same
sampling semantics and logprob convention as vLLM with ``--logprobs-mode processed_logprobs``.

How it works. One engine thread owns the model. Callers (HTTP handlers, tests) submit requests
with :meth:`InferenceEngine.submit` / :meth:`InferenceEngine.generate`; each returns a future.
The engine loop repeats: run queued control operations (weight loads, abort, pause), admit
waiting requests into the running batch (one prefill each, up to ``max_batch_size``), then run
one batched decode step over every running request. The running batch keeps a left-padded
per-layer KV cache ``[B, H_kv, T, D]`` with a 2-D attention mask ``[B, T]`` and explicit
per-row ``position_ids``, so a request joins between two decode steps (its prefill cache is
left-padded to the batch width) and leaves as soon as it is done (its row is dropped and
all-padding leading columns are trimmed).

Invariants:

- every submitted request resolves its future exactly once: with an :class:`EngineOutput`
  (finish reason ``stop``, ``length`` or ``abort``) or with the exception that broke it;
- control operations run only between decode steps, never during one, so a weight load never
  tears a forward pass; a paused engine runs control operations but no prefill or decode step;
- ``EngineOutput.token_versions[i]`` is the weight version that sampled token ``i``;
  ``EngineOutput.weight_version`` is the oldest of them (the conservative value for staleness).
  A request parked by ``pause`` across a weight load finishes on the new weights with the KV
  cache of the old ones (vLLM's keep mode does the same); use ``abort_all`` for a clean cut.

Logprob convention (DESIGN section 3): the logprob of a sampled token is
``log_softmax(logits / temperature)`` after top-k and then top-p masking when those are on
(masked tokens get ``-inf`` and the rest are renormalised). With ``temperature == 0`` the engine
is greedy (argmax of the raw logits) and reports ``log_softmax(logits)``: the unscaled
distribution, as vLLM does.

Shutdown order: :meth:`InferenceEngine.close` stops admitting, aborts every pending request
(futures resolve with finish reason ``abort``), and joins the engine thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from agentrl.types import SamplingParams

__all__ = [
    "EngineOutput",
    "EngineRequestError",
    "InferenceEngine",
    "WeightLoadError",
    "process_logits",
    "sample_token",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
FinishReason = Literal["stop", "length", "abort"]


class EngineRequestError(ValueError):
    """A request the engine cannot serve; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class WeightLoadError(ValueError):
    """A state dict that does not fit the model; nothing was changed."""


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
    """Per token, the ``num_top_logprobs`` most likely ``(token_id, logprob)`` (processed)."""
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
    started: float = 0.0
    num_top_logprobs: int = 0
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    aborted: bool = False


# ---- sampling (pure functions; unit-tested on their own) ------------------------------------
def process_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Processed log-probabilities ``[V]`` of one row of raw logits ``[V]`` (float32).

    ``temperature == 0``: ``log_softmax(logits)`` (greedy; the unscaled distribution).
    Otherwise ``log_softmax`` of ``logits / temperature`` after top-k (keep the k largest;
    ``top_k <= 0`` is off) and top-p (drop the smallest tokens whose cumulative mass is at most
    ``1 - top_p``, always keeping the most likely one; vLLM's rule) masking.
    """
    x = logits.float()
    if temperature == 0.0:
        return torch.log_softmax(x, dim=-1)
    x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=False)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p)
        drop[-1] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return torch.log_softmax(x, dim=-1)


def sample_token(
    logprobs: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> int:
    """Pick a token from processed logprobs ``[V]`` (CPU): argmax when greedy, else sample."""
    if temperature == 0.0:
        return int(torch.argmax(logprobs).item())
    probs = torch.exp(logprobs)
    return int(torch.multinomial(probs, 1, generator=generator).item())


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
    ) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}; it must be >= 1")
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
        eos: Any = None
        with contextlib.suppress(OSError, ValueError):
            eos = GenerationConfig.from_pretrained(str(self.model_dir)).eos_token_id
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        eos_list = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_ids: frozenset[int] = frozenset(int(e) for e in eos_list)

        self._version = weight_version
        self._seed_gen = torch.Generator().manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._controls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._controls = collections.deque()
        self._paused = False
        self._closing = False
        self._ids = itertools.count()
        # Running batch (touched only by the engine thread).
        self._rows: list[_Request] = []
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._cache: Any = None
        self._next_pos: list[int] = []
        # Counters (read by /metrics).
        self.stats: dict[str, int] = collections.defaultdict(int)
        self._thread = threading.Thread(target=self._loop, name="agentrl-engine", daemon=True)
        self._thread.start()

    # ---- public API (thread-safe) -----------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def num_running(self) -> int:
        return len(self._rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raise :class:`EngineRequestError` (with ``param``) if the request cannot be served."""
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
    ) -> concurrent.futures.Future[EngineOutput]:
        """Queue a request; the future resolves with its :class:`EngineOutput`.

        ``num_top_logprobs > 0`` also records that many top alternatives per token;
        ``ignore_eos`` keeps generating past EOS (only ``stop_token_ids`` stop; benchmarks).
        Raises :class:`EngineRequestError` if the request cannot be served.
        """
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, sampling)
        gen: torch.Generator | None = None
        if sampling.temperature > 0.0:
            seed = sampling.seed
            if seed is None:
                with self._cond:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen).item())
            gen = torch.Generator().manual_seed(int(seed))
        req = _Request(
            request_id=request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            prompt_ids=prompt_ids,
            sampling=sampling,
            max_new=min(sampling.max_tokens, self.max_model_len - len(prompt_ids)),
            stop_ids=frozenset(sampling.stop_token_ids)
            | (frozenset() if ignore_eos else self.eos_token_ids),
            future=concurrent.futures.Future(),
            generator=gen,
            submitted=time.monotonic(),
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

    def pause(self) -> None:
        """Stop decoding after the current step; in-flight requests stay parked. Blocks until then."""
        self._control(lambda: setattr(self, "_paused", True))

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def abort_all(self) -> int:
        """Finish every running and waiting request now (finish reason ``abort``); returns how many."""
        return self._control(self._abort_all_now)

    def load_state_dict(
        self, state_dict: dict[str, torch.Tensor], version: int | None = None
    ) -> int:
        """Swap weights between decode steps; returns the new version (``version`` or current + 1).

        Every tensor must name a model parameter with the same shape; every parameter must be
        given (tied copies excepted). On any mismatch nothing changes (:class:`WeightLoadError`).
        """
        return self._control(lambda: self._apply_state_dict(state_dict, version))

    def load_weights_from_path(self, path: str | Path, version: int | None = None) -> int:
        """Load every ``*.safetensors`` file of a directory (or one file); see :meth:`load_state_dict`."""
        from safetensors.torch import load_file

        p = Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files or not all(f.is_file() for f in files):
            raise WeightLoadError(
                f"no safetensors weights at {str(p)!r}; pass a directory holding *.safetensors "
                "files (e.g. one written by save_pretrained) or a .safetensors file"
            )
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return self.load_state_dict(state, version)

    def load_weights_from_bytes(self, data: bytes, version: int | None = None) -> int:
        """Load a serialized safetensors blob (an HTTP body); see :meth:`load_state_dict`."""
        from safetensors.torch import load

        try:
            state = load(data)
        except Exception as e:  # safetensors raises its own error types for malformed blobs
            raise WeightLoadError(f"the body is not a valid safetensors blob: {e}") from e
        return self.load_state_dict(state, version)

    def set_weight_version(self, version: int) -> int:
        def _set() -> int:
            self._version = int(version)
            return self._version

        return self._control(_set)

    def weight_info(self) -> dict[str, Any]:
        """``{"version", "checksum" (sha256 over name+bytes of the state dict), "num_params"}``."""

        def _info() -> dict[str, Any]:
            h = hashlib.sha256()
            for name, t in sorted(self.model.state_dict().items()):
                h.update(name.encode())
                h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
            n = sum(p.numel() for p in self.model.parameters())
            return {"version": self._version, "checksum": h.hexdigest(), "num_params": int(n)}

        return self._control(_info)

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort everything pending and stop the engine thread (idempotent)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
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

    def cancel(self, fut: concurrent.futures.Future[EngineOutput]) -> None:
        """Abort the request behind ``fut`` (from :meth:`submit`) at the next step; no-op if done."""

        def _mark() -> None:
            for r in itertools.chain(self._rows, self._waiting):
                if r.future is fut:
                    r.aborted = True

        with self._cond:
            if not self._closing:
                self._controls.append((_mark, concurrent.futures.Future()))
                self._cond.notify_all()

    def _abort_all_now(self) -> int:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        rows = list(self._rows)
        self._reset_batch()
        for r in rows + waiting:
            self._finish(r, "abort")
        return len(rows) + len(waiting)

    def _apply_state_dict(self, state: dict[str, torch.Tensor], version: int | None) -> int:
        params = self.model.state_dict()
        unknown = sorted(k for k in state if k not in params)
        if unknown:
            raise WeightLoadError(
                f"{len(unknown)} tensor(s) do not name a parameter of this model, e.g. "
                f"{unknown[:3]}; send the names of model.state_dict()"
            )
        for k, v in state.items():
            if tuple(v.shape) != tuple(params[k].shape):
                raise WeightLoadError(
                    f"tensor {k!r} has shape {tuple(v.shape)} but the model expects "
                    f"{tuple(params[k].shape)}"
                )
        given_ptrs = {params[k].data_ptr() for k in state}
        missing = sorted(
            k for k in params if k not in state and params[k].data_ptr() not in given_ptrs
        )
        if missing:
            raise WeightLoadError(
                f"{len(missing)} parameter(s) are missing from the update, e.g. {missing[:3]}; "
                "send the full state dict"
            )
        with torch.no_grad():
            for k, v in state.items():
                params[k].copy_(v.to(device=params[k].device, dtype=params[k].dtype))
        self._version = self._version + 1 if version is None else int(version)
        self.stats["weight_updates"] += 1
        return self._version

    # ---- the engine loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while (
                        not self._closing
                        and not self._controls
                        and (self._paused or (not self._rows and not self._waiting))
                    ):
                        self._cond.wait(timeout=0.5)
                    if self._closing:
                        break
                    controls = list(self._controls)
                    self._controls.clear()
                for fn, fut in controls:
                    try:
                        fut.set_result(fn())
                    except Exception as e:  # reported to the caller, the engine goes on
                        fut.set_exception(e)
                if self._paused:
                    continue
                try:
                    self._admit()
                    if self._rows:
                        self._decode_step()
                except Exception as e:  # fail the affected requests, keep serving others
                    log.exception("engine step failed")
                    rows = list(self._rows)
                    self._reset_batch()
                    for r in rows:
                        if not r.future.done():
                            r.future.set_exception(e)
        finally:
            with self._cond:
                self._closing = True
                controls = list(self._controls)
                self._controls.clear()
            for _, fut in controls:
                fut.set_exception(RuntimeError("the engine is closed"))
            self._abort_all_now()

    def _admit(self) -> None:
        while len(self._rows) < self.max_batch_size:
            with self._cond:
                if not self._waiting:
                    return
                req = self._waiting.popleft()
            if req.aborted:
                self._finish(req, "abort")
                continue
            self._prefill(req)

    @torch.no_grad()
    def _prefill(self, req: _Request) -> None:
        from transformers import DynamicCache

        req.started = time.monotonic()
        if req.max_new <= 0:
            self._finish(req, "length")
            return
        n = len(req.prompt_ids)
        ids = torch.tensor([req.prompt_ids], dtype=torch.long, device=self.device)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(n, device=self.device)[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats["prompt_tokens"] += n
        if self._accept(req, out.logits[0, -1]):
            return
        new_kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        self._join(req, new_kv, n)

    def _join(self, req: _Request, new_kv: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        from transformers import DynamicCache

        width = self._mask.shape[1] if self._rows else 0
        new_width = max(width, n)
        new_mask = torch.ones(1, n, dtype=torch.long, device=self.device)
        if not self._rows:
            kv = new_kv
            mask = new_mask
        else:
            old_kv = [(layer.keys, layer.values) for layer in self._cache.layers]
            kv = [
                (
                    torch.cat([_left_pad(k0, new_width), _left_pad(k1, new_width)], dim=0),
                    torch.cat([_left_pad(v0, new_width), _left_pad(v1, new_width)], dim=0),
                )
                for (k0, v0), (k1, v1) in zip(old_kv, new_kv, strict=True)
            ]
            mask = torch.cat(
                [_left_pad(self._mask, new_width, dim=1), _left_pad(new_mask, new_width, dim=1)],
                dim=0,
            )
        self._rows.append(req)
        self._next_pos.append(n)
        self._mask = mask
        self._cache = DynamicCache(ddp_cache_data=kv)

    @torch.no_grad()
    def _decode_step(self) -> None:
        from transformers import DynamicCache

        rows = self._rows
        b = len(rows)
        ids = torch.tensor([[r.output_ids[-1]] for r in rows], dtype=torch.long, device=self.device)
        mask = torch.cat([self._mask, torch.ones(b, 1, dtype=torch.long, device=self.device)], 1)
        pos = torch.tensor(self._next_pos, dtype=torch.long, device=self.device)[:, None]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=self._cache,
            use_cache=True,
        )
        self._mask = mask
        self._cache = out.past_key_values
        logits = out.logits[:, -1].float().cpu()
        self.stats["decode_steps"] += 1
        keep: list[int] = []
        for i, r in enumerate(rows):
            self._next_pos[i] += 1
            if r.aborted:
                self._finish(r, "abort")
            elif not self._accept(r, logits[i]):
                keep.append(i)
        if len(keep) == b:
            return
        if not keep:
            self._reset_batch()
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, idx)
        first = int(mask.any(dim=0).long().argmax().item())  # leading all-padding columns
        kv = [
            (
                layer.keys.index_select(0, idx)[:, :, first:],
                layer.values.index_select(0, idx)[:, :, first:],
            )
            for layer in self._cache.layers
        ]
        self._rows = [rows[i] for i in keep]
        self._next_pos = [self._next_pos[i] for i in keep]
        self._mask = mask[:, first:]
        self._cache = DynamicCache(ddp_cache_data=kv)

    def _accept(self, req: _Request, logits: torch.Tensor) -> bool:
        """Sample the next token of ``req`` from raw logits ``[V]``; True if the request is done."""
        sp = req.sampling
        lp = process_logits(logits.float().cpu(), sp.temperature, sp.top_k, sp.top_p)
        tok = sample_token(lp, sp.temperature, req.generator)
        req.output_ids.append(tok)
        req.logprobs.append(float(lp[tok].item()))
        req.versions.append(self._version)
        if req.num_top_logprobs:
            top = torch.topk(lp, min(req.num_top_logprobs, lp.shape[-1]))
            req.top_logprobs.append(
                [
                    (int(i), float(v))
                    for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
                ]
            )
        self.stats["generation_tokens"] += 1
        if tok in req.stop_ids:
            self._finish(req, "stop")
            return True
        if len(req.output_ids) >= req.max_new:
            self._finish(req, "length")
            return True
        return False

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        if req.future.done():
            return
        now = time.monotonic()
        self.stats["requests_finished"] += 1
        self.stats[f"finish_{reason}"] += 1
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


def _left_pad(x: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Left-pad ``x`` with zeros along ``dim`` to ``width`` (KV ``[B, H, T, D]``: dim 2)."""
    short = width - x.shape[dim]
    if short <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x.new_zeros(shape), x], dim=dim)
