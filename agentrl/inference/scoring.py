"""The scoring engine: batched reward-model scores over a Hugging Face sequence classifier, or
a causal LM's logprobs of given tokens (a distillation teacher, ``task="logprobs"``).

Why it exists: a reward model (any local ``AutoModelForSequenceClassification`` directory) is
served like the policy, by the embedded server (``agentrl serve-model --task score``), so a run
needs no vLLM to score episodes with a model. Generation and scoring never share an engine: a
classifier has no KV cache, no sampling and no weight pushes; this engine is one forward pass
per batch.

How it works. One engine thread owns the model. :meth:`ScoringEngine.submit` queues one
sequence of token ids and returns a future; the thread takes every queued sequence (up to
``max_batch_size`` sequences and ``max_batch_tokens`` padded tokens), right-pads them with the
model's pad token and runs one forward pass. The score of a sequence is exactly what
``AutoModelForSequenceClassification`` gives for it alone: the head reads the last token that is
not the pad token (decoder classifiers) or the first token (encoder classifiers); right padding
is invisible to causal attention and masked for bidirectional attention. With
``task="logprobs"`` the model is an ``AutoModelForCausalLM`` and a sequence's answer is the
logprob of each of its tokens after the first given the ones before,
``log softmax(logits / temperature)`` (:func:`agentrl.algos.logits.logprobs_from_logits`, the
trainer's convention), ``len(ids) - 1`` floats.

Invariants:

- every submitted sequence resolves its future exactly once: with its ``num_labels`` raw
  logits (finite floats) or with the exception that broke it;
- **one bad sequence fails only itself**: inputs are checked at the door (non-empty, ids in the
  vocabulary, at most ``max_model_len`` tokens); when a batched forward raises, each sequence of
  that batch is re-run alone; a row whose logits are not finite fails that row;
- a model without a pad token is run one sequence at a time (Hugging Face cannot find the last
  real token of a padded row without one);
- :meth:`close` fails every queued sequence (``RuntimeError``) and joins the thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import torch

from agentrl.inference.engine import EngineRequestError, EngineStepError

__all__ = ["ScoringEngine", "is_classifier_dir"]

log = logging.getLogger(__name__)


def is_classifier_dir(model_dir: str | Path) -> bool:
    """True when ``model_dir/config.json`` names a ``*ForSequenceClassification`` architecture
    (what ``agentrl serve-model --task auto`` serves with :class:`ScoringEngine`)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = config.get("architectures") or []
    return any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs)


class ScoringEngine:
    """Batched scoring over a Hugging Face sequence classifier, owned by one thread.

    Args:
        model_dir: a directory that ``AutoModelForSequenceClassification`` loads.
        device: ``"cpu"``, ``"cuda"``, ...
        dtype: weight dtype (float32 reproduces a trainer-side forward to ~1e-6).
        max_batch_size: most sequences in one forward pass.
        max_batch_tokens: most padded tokens (sequences x longest) in one forward pass; a
            longer sequence alone is still run.
        max_model_len: longest accepted sequence; defaults to ``max_position_embeddings``.
        task: ``classify`` (a sequence classifier's logits) or ``logprobs`` (a causal LM's
            per-token logprobs of the sequence itself).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 32,
        max_batch_tokens: int = 32768,
        max_model_len: int | None = None,
        task: str = "classify",
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        if task not in ("classify", "logprobs"):
            raise ValueError(f"task={task!r}; use 'classify' or 'logprobs'")
        self.task = task
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}; it must be >= 1")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        auto = AutoModelForCausalLM if task == "logprobs" else AutoModelForSequenceClassification
        self.model: Any = auto.from_pretrained(str(self.model_dir), dtype=dtype)
        self.model.to(self.device)
        self.model.eval()
        text_cfg = self.model.config.get_text_config()
        self.num_labels: int = int(self.model.config.num_labels)
        self.vocab_size: int = int(self.model.get_input_embeddings().weight.shape[0])
        limit = getattr(text_cfg, "max_position_embeddings", None) or 4096
        self.max_model_len: int = int(max_model_len or limit)
        pad = getattr(text_cfg, "pad_token_id", None)
        self.pad_token_id: int | None = None if pad is None else int(pad)
        # logprobs read only real positions of right-padded rows: any pad id will do
        batched = self.pad_token_id is not None or task == "logprobs"
        self.max_batch_size = max_batch_size if batched else 1
        self.max_batch_tokens = max_batch_tokens
        self.weight_version = 0
        """Reward models are frozen: the version is always 0 (``/health`` reports it)."""
        self.is_paused = False
        self.sleep_level = 0
        """Reward models never sleep (colocated mode puts only the policy servers to sleep)."""
        self.stats: collections.defaultdict[str, int] = collections.defaultdict(int)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Item]
        self._queue = collections.deque()
        self._running = 0
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="agentrl-scoring", daemon=True)
        self._thread.start()

    # ---- state ------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Sequences in the forward pass now."""
        return self._running

    @property
    def num_waiting(self) -> int:
        """Sequences queued for the next forward pass."""
        return len(self._queue)

    @property
    def is_closed(self) -> bool:
        """True once :meth:`close` (or :meth:`shutdown_nowait`) was called."""
        return self._closing

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, ids: list[int], param: str = "input") -> None:
        """Raise :class:`EngineRequestError` naming ``param`` when ``ids`` cannot be scored."""
        if not ids:
            raise EngineRequestError(f"{param} is empty; send at least one token", param)
        if len(ids) > self.max_model_len:
            raise EngineRequestError(
                f"{param} has {len(ids)} tokens; this model's context limit is "
                f"{self.max_model_len}",
                param,
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise EngineRequestError(
                f"{param} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                param,
            )

    def submit(
        self, ids: list[int], temperature: float = 1.0
    ) -> concurrent.futures.Future[list[float]]:
        """Queue one sequence; its future resolves to its ``num_labels`` raw logits (task
        ``classify``) or its ``len(ids) - 1`` token logprobs at ``temperature`` (``logprobs``)."""
        self.validate(ids)
        if not temperature > 0:
            raise EngineRequestError(f"temperature={temperature}; it must be > 0", "temperature")
        fut: concurrent.futures.Future[list[float]] = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                raise RuntimeError("the scoring engine is closed")
            self._queue.append((list(ids), fut, float(temperature)))
            self._cond.notify_all()
        return fut

    async def score(self, batch: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """The answer of every sequence of ``batch`` (one bad sequence fails the call)."""
        futures = [self.submit(ids, temperature) for ids in batch]
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    # ---- shutdown ---------------------------------------------------------------------------
    def shutdown_nowait(self) -> None:
        """Ask the engine to stop (safe from a signal handler)."""
        self._closing = True

    def close(self, timeout_s: float = 30.0) -> None:
        """Fail everything queued and stop the engine thread (idempotent)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)

    # ---- the engine loop --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    break
                self._running = len(batch)
                try:
                    self._run(batch)
                finally:
                    self._running = 0
        except BaseException:  # never die silently: callers would hang
            log.exception("scoring loop crashed; failing every queued sequence")
            raise
        finally:
            with self._cond:
                self._closing = True
                left = list(self._queue)
                self._queue.clear()
            for _, fut, _ in left:
                if not fut.done():
                    fut.set_exception(RuntimeError("the scoring engine is closed"))

    def _next_batch(self) -> list[_Item] | None:
        """The next batch to run (live futures only), or None when closing."""
        with self._cond:
            while not self._closing and not self._queue:
                self._cond.wait(timeout=0.25)
            if self._closing:
                return None
            batch: list[_Item] = []
            longest = 0
            while self._queue and len(batch) < self.max_batch_size:
                ids, fut, temperature = self._queue[0]
                width = max(longest, len(ids))
                if batch and width * (len(batch) + 1) > self.max_batch_tokens:
                    break
                self._queue.popleft()
                if fut.set_running_or_notify_cancel():  # False: its caller gave up
                    batch.append((ids, fut, temperature))
                    longest = width
            return batch

    def _run(self, batch: list[_Item]) -> None:
        """Score ``batch`` in one forward pass; on failure, each sequence alone."""
        if not batch:
            return
        try:
            rows = self._forward([ids for ids, _, _ in batch], [t for _, _, t in batch])
        except Exception as exc:
            if len(batch) == 1:
                self.stats["requests_failed"] += 1
                batch[0][1].set_exception(EngineStepError(f"scoring failed: {exc}"))
                return
            log.warning("a batched scoring pass failed (%s); scoring its rows alone", exc)
            for item in batch:
                self._run([item])
            return
        for (_, fut, _), logits in zip(batch, rows, strict=True):
            if all(math.isfinite(v) for v in logits):
                fut.set_result(logits)
            else:
                self.stats["requests_failed"] += 1
                fut.set_exception(EngineStepError(f"the model gave non-finite logits {logits}"))

    @torch.inference_mode()
    def _forward(self, seqs: list[list[int]], temperatures: list[float]) -> list[list[float]]:
        """Raw logits ``[B, num_labels]`` of right-padded ``seqs`` (or each row's token
        logprobs, task ``logprobs``), as Python lists."""
        width = max(len(s) for s in seqs)
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        start = time.perf_counter()
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        self.stats["forward_passes"] += 1
        self.stats["forward_ms"] += int((time.perf_counter() - start) * 1000)
        self.stats["sequences_scored"] += len(seqs)
        if self.task == "logprobs":
            return _token_logprobs(out.logits, ids.to(self.device), seqs, temperatures)
        return out.logits.float().cpu().tolist()


_Item = tuple[list[int], concurrent.futures.Future[Any], float]
"""A queued sequence: its token ids, its future and its temperature (task ``logprobs``)."""


def _token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, seqs: list[list[int]], temperatures: list[float]
) -> list[list[float]]:
    """Per row, ``log softmax(logits[t] / temperature)`` at ``ids[t + 1]`` over the row's real
    tokens (``[B, W, V]`` logits of right-padded ``[B, W]`` ids): ``len(seq) - 1`` floats each."""
    from agentrl.algos.logits import logprobs_from_logits

    rows = []
    for i, (seq, temperature) in enumerate(zip(seqs, temperatures, strict=True)):
        n = len(seq)
        lp = logprobs_from_logits(logits[i, : n - 1], ids[i, 1:n], temperature=temperature)
        rows.append(lp.cpu().tolist())
    return rows
