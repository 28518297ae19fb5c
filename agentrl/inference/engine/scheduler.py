"""The scheduler: the engine thread, its queues and its step loop.

Why it exists: one thread owns the model, so that a forward pass, a weight swap and a probe never
overlap. Callers queue requests (:meth:`Scheduler.enqueue`) and control operations
(:meth:`Scheduler.control`: weight loads, pauses, aborts, probes); the loop repeats:

1. run the queued control operations;
2. end a pause past its deadline, abort requests whose caller left or whose deadline passed;
3. unless paused or asleep (:mod:`~agentrl.inference.engine.sleep`): admit waiting requests into the running batch (unless draining; those waiting
   are prefilled together in one left-padded forward), run one batched decode step, and sample
   every row at once.

Invariants:

- every submitted request resolves its future exactly once: with an
  :class:`~agentrl.inference.engine.request.EngineOutput` (finish reason ``stop``, ``length`` or
  ``abort``) or with the exception that broke it;
- **one bad request fails only itself**: a prefill forward of several requests that raises is
  redone one request at a time (the forward only: nothing was sampled yet), so the failure lands
  on its request; a row whose logits are not finite fails that row; when a batched decode
  forward raises, every row of that batch goes back to the head of the queue, re-prefills its
  prompt and output so far and decodes one step *alone* before anything joins it again, so the
  failure lands on the request that causes it and the others finish token-exact;
- a request whose caller cancelled it or whose ``deadline`` passed is finished with ``abort``
  before its next step, parked or not, and is never reported ``stop``/``length`` after it;
- control operations run only between decode steps, never during one, so a weight load never
  tears a forward pass; a paused engine runs control operations but no prefill or decode step;
- each sampled token is labelled with the weight version that produced it
  (``EngineRequest.versions``). A request parked by a ``keep`` pause across a weight load
  finishes on the new weights with the KV cache of the old ones (vLLM's keep mode does the
  same); abort it for a clean cut.

Shutdown order: :meth:`Scheduler.close` (or :meth:`Scheduler.shutdown_nowait` from a signal
handler) stops admitting; the loop then fails every pending control operation, aborts every
running, parked or queued request (futures resolve with finish reason ``abort``), and the thread
ends; ``close`` joins it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from agentrl.inference.engine.batch import Prefill, RunningBatch, prefill_forward
from agentrl.inference.engine.forward import make_forward
from agentrl.inference.engine.pause import PauseState
from agentrl.inference.engine.prefix_cache import BLOCK, PrefixCache
from agentrl.inference.engine.request import (
    EngineOutput,
    EngineRequest,
    EngineStepError,
    FinishReason,
)
from agentrl.inference.engine.sampling import sample_group
from agentrl.inference.engine.weight_store import WeightStore

__all__ = ["Scheduler"]

log = logging.getLogger(__name__)
T = TypeVar("T")
Control = tuple[Callable[[], Any], concurrent.futures.Future[Any]]


class Scheduler:
    """The engine thread: queues, the step loop, and how each request ends.

    Args:
        model: the served model (used by this thread only).
        device: the model's device.
        weights: the served weights; their version labels every sampled token.
        max_batch_size: most requests decoded together; the rest wait in FIFO order.
        max_pause_s: the longest any pause lasts.
        prefix_cache_bytes: most bytes of KV the prefix cache keeps (0: no prefix cache).
    """

    def __init__(
        self,
        model: Any,
        device: torch.device,
        weights: WeightStore,
        *,
        max_batch_size: int,
        max_pause_s: float,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.model = model  # also picks the forward (the setter)
        self.device = device
        self.weights = weights
        self.max_batch_size = max_batch_size
        self.cond = threading.Condition()
        """The one lock: guards the queues, ``closing`` and pause transitions."""
        self.pause = PauseState(self.cond, max_pause_s)
        self.batch = RunningBatch(device)
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.controls: collections.deque[Control] = collections.deque()
        self.closing = False
        self.sleep_level = 0
        """0 awake; 1 or 2 asleep (no prefill, no decode; requests are held in the queue)."""
        self.stats: dict[str, int] = collections.defaultdict(int)
        """Counters (read by ``/metrics``)."""
        self.prefix_cache = PrefixCache(prefix_cache_bytes, self.stats)
        """KV of prompt prefixes computed before (:mod:`~agentrl.inference.engine.prefix_cache`)."""
        self._thread = threading.Thread(target=self._loop, name="agentrl-engine", daemon=True)

    @property
    def model(self) -> Any:
        """The served model (used by this thread only)."""
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        self._model = model
        self.forward = make_forward(model)
        """The forward pass over ``model`` (:mod:`~agentrl.inference.engine.forward`)."""

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    # ---- called from any thread -----------------------------------------------------------
    def enqueue(self, req: EngineRequest) -> None:
        """Queue a checked request for admission (``RuntimeError`` once closed)."""
        with self.cond:
            if self.closing:
                raise RuntimeError("the engine is closed; create a new InferenceEngine")
            self.waiting.append(req)
            self.stats["requests_submitted"] += 1
            self.cond.notify_all()

    def control(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between two steps (also while paused); its result.
        Raises what ``fn`` raised, or ``RuntimeError`` once the engine is closed."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self.cond:
            if self.closing:
                raise RuntimeError("the engine is closed")
            self.controls.append((fn, fut))
            self.cond.notify_all()
        return fut.result()

    def post(self, fn: Callable[[], Any]) -> None:
        """Queue ``fn`` as a control operation without waiting for it (no-op once closed)."""
        with self.cond:
            if not self.closing:
                self.controls.append((fn, concurrent.futures.Future()))
                self.cond.notify_all()

    def shutdown_nowait(self) -> None:
        """Ask the loop to stop (safe from a signal handler: takes no lock, never blocks)."""
        self.closing = True

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (it aborts everything pending) and join the thread (idempotent)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)

    def park_running(self) -> int:
        """Move the running batch back to the head of the queue, dropping its KV cache (engine
        thread; a sleep): each row keeps its tokens and re-prefills them when admitted again.
        How many rows moved."""
        rows = list(self.batch.rows)
        self.batch.reset()
        with self.cond:
            self.waiting.extendleft(reversed(rows))
        return len(rows)

    # ---- ending requests (engine thread) ----------------------------------------------------
    def abort_all_now(self) -> int:
        """Finish every running and waiting request with ``abort``; how many."""
        with self.cond:
            waiting = list(self.waiting)
            self.waiting.clear()
        rows = list(self.batch.rows)
        self.batch.reset()
        for r in rows + waiting:
            self.finish(r, "abort")
        return len(rows) + len(waiting)

    def drop(self, doomed: Callable[[EngineRequest], bool]) -> None:
        """Finish every waiting or running request for which ``doomed(r)`` with ``abort`` now
        (also while paused: a parked request a client gave up on does not wait for a resume)."""
        with self.cond:
            gone = [r for r in self.waiting if doomed(r)]
            for r in gone:
                self.waiting.remove(r)
        rows = self.batch.rows
        keep = [i for i, r in enumerate(rows) if not doomed(r)]
        gone += [r for r in rows if doomed(r)]
        if len(keep) < len(rows):
            self.batch.keep(keep)
        for r in gone:
            self.finish(r, "abort")

    def fail(self, req: EngineRequest, error: Exception) -> None:
        """End ``req`` with ``error`` (once)."""
        if req.finished:
            return
        req.finished = True
        req.failed = True
        self.stats["requests_failed"] += 1
        if not req.future.done():
            req.future.set_exception(error)

    def finish(self, req: EngineRequest, reason: FinishReason) -> None:
        """End ``req`` with ``reason`` (once); ``abort`` when its caller has given up."""
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
        output: EngineOutput = req.output(reason, self.weights.version, now)
        req.future.set_result(output)

    # ---- the loop ---------------------------------------------------------------------------
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
                if not self.pause.paused and not self.sleep_level:
                    self._step()
                elif self.pause.draining and not self.batch.rows:
                    self.pause.drained()  # asleep: the batch was parked, nothing to drain
        except BaseException:  # the thread must never die silently: callers would hang
            log.exception("engine loop crashed; aborting every request")
            raise
        finally:
            with self.cond:
                self.closing = True
                controls = list(self.controls)
                self.controls.clear()
            for _, fut in controls:
                if not fut.done():
                    fut.set_exception(RuntimeError("the engine is closed"))
            self.abort_all_now()

    def _next_controls(self) -> list[Control] | None:
        """Wait for work; the queued control operations, or None when closing."""
        pause = self.pause
        with self.cond:
            while (
                not self.closing
                and not self.controls
                and (
                    pause.paused
                    or self.sleep_level
                    or (not self.batch.rows and (pause.draining or not self.waiting))
                )
            ):
                self.cond.wait(timeout=0.25)
                if pause.active or self.waiting:
                    break  # deadlines (of the pause, of waiting requests) are checked each time
            if self.closing:
                return None
            controls = list(self.controls)
            self.controls.clear()
            return controls

    def _expire(self, now: float) -> None:
        """End the pause past its deadline and abort requests past theirs."""
        if self.pause.expired(now):
            log.warning("pause deadline passed with no resume; resuming by itself")
            self.stats["pause_expired"] += 1
        # A request whose caller cancelled its future (an HTTP client that went away) or whose
        # deadline passed ends now, parked or not.
        self.drop(lambda r: r.future.cancelled() or (r.deadline is not None and now > r.deadline))

    def _step(self) -> None:
        if not self.pause.draining:
            self._admit()
        if self.batch.rows:
            self._decode_step()
        if self.pause.draining and not self.batch.rows:
            self.pause.drained()

    # ---- admission and prefill ----------------------------------------------------------------
    def _admit(self) -> None:
        while len(self.batch.rows) < self.max_batch_size:
            if any(r.suspect for r in self.batch.rows):
                return  # a suspect decodes alone until it has done one step
            reqs = self._take_waiting(self.max_batch_size - len(self.batch.rows))
            if not reqs:
                return
            self._prefill(reqs)

    def _take_waiting(self, room: int) -> list[EngineRequest]:
        """Up to ``room`` waiting requests, in order, to prefill together. A suspect goes
        alone, and only into an empty batch."""
        out: list[EngineRequest] = []
        with self.cond:
            while self.waiting and len(out) < room:
                head = self.waiting[0]
                if head.suspect and (self.batch.rows or out):
                    break
                out.append(self.waiting.popleft())
                if head.suspect:
                    break
        return out

    def _prefill(self, reqs: list[EngineRequest]) -> None:
        """Prefill ``reqs`` in one left-padded forward and join them to the running batch. If
        that forward raises, each request is prefilled alone, so a failure fails only the
        request that causes it. Requests that share a prefix the cache lacks wait for the first
        of them to put it there (:meth:`_lead`)."""
        live: list[EngineRequest] = []
        now = time.monotonic()
        for req in reqs:
            req.started = req.started or now
            if req.max_new <= 0:
                self.finish(req, "length")
            else:
                live.append(req)
        if self._lead(live):
            self._prefill_alone(live[0])
            live = live[1:]
        if len(live) > 1:
            try:
                together = self._prefill_forward(live)
            except Exception as e:
                log.warning("prefill of %d requests together failed (%s); one by one", len(live), e)
                self.stats["prefill_batch_failures"] += 1
            else:  # outside the try: the join samples tokens, a retry would sample them again
                self._join_prefilled(live, together)
                return
        for req in live:
            self._prefill_alone(req)

    def _prefill_alone(self, req: EngineRequest) -> None:
        try:
            self._join_prefilled([req], self._prefill_forward([req]))
        except Exception as e:  # this request's prefill failed: it alone fails
            log.exception("prefill of %s failed", req.request_id)
            self.fail(req, EngineStepError(f"prefill failed: {type(e).__name__}: {e}"))

    def _lead(self, live: list[EngineRequest]) -> bool:
        """True when the first request should be prefilled alone first: another one shares at
        least two full blocks of its prompt that the cache does not hold yet, so it reuses
        that KV instead of computing the same prefix again (the samples of one task, the tasks
        of one system prompt)."""
        if len(live) < 2 or not self.prefix_cache.enabled:
            return False
        head = live[0].prompt_ids
        shared = max(_common_prefix(head, r.prompt_ids) for r in live[1:])
        have = self.prefix_cache.peek(head, self.weights.generation)
        return shared - have >= 2 * BLOCK

    def _prefill_forward(self, reqs: list[EngineRequest]) -> Prefill:
        generation = self.weights.generation
        cache = self.prefix_cache if self.prefix_cache.enabled else None
        pre = prefill_forward(self.forward, self.device, reqs, cache, generation)
        self.stats["prompt_tokens"] += sum(pre.lens) - sum(pre.cached)  # computed, not cached
        self.stats["prefill_forwards"] += 1
        for i, req in enumerate(reqs):
            req.kv_generation = generation
            if cache is not None:
                cache.insert(pre.seqs[i], pre.row_kv(i), generation)
        return pre

    def _join_prefilled(self, reqs: list[EngineRequest], pre: Prefill) -> None:
        """Sample the first token of each new request and add the unfinished ones to the
        running batch (a recomputed row already has its tokens: it only rejoins)."""
        done = [False] * len(reqs)
        fresh = [i for i, req in enumerate(reqs) if not req.output_ids]
        if fresh:
            accepted = self._accept([reqs[i] for i in fresh], pre.logits[fresh])
            for i, d in zip(fresh, accepted, strict=True):
                done[i] = d
        keep = [i for i, d in enumerate(done) if not d]
        if keep:
            self.batch.join(reqs, pre, keep)

    # ---- decoding -----------------------------------------------------------------------------
    def _decode_step(self) -> None:
        try:
            logits = self.batch.decode(self.forward)
        except Exception as e:  # recompute each row alone: the failure finds its request
            self._recompute_rows(e)
            return
        self.stats["decode_steps"] += 1
        rows = self.batch.rows
        for r in rows:
            r.suspect = False
        done = self._accept(rows, logits)
        if any(done):
            self._cache_finished([i for i, d in enumerate(done) if d])
            self.batch.keep([i for i, d in enumerate(done) if not d])

    def _cache_finished(self, idx: list[int]) -> None:
        """Put the KV of the rows ``idx`` that finished well (prompt + output) in the prefix
        cache: the next turn of an episode starts with them. Rows whose KV saw a weight change
        (a ``keep`` pause across a load) are left out."""
        cache, generation = self.prefix_cache, self.weights.generation
        if not cache.enabled:
            return
        for i in idx:
            req = self.batch.rows[i]
            if req.failed or req.kv_generation != generation:
                continue
            kv = self.batch.row_kv(i)
            if kv is not None:
                n = kv[0][0].shape[1]
                cache.insert((req.prompt_ids + req.output_ids)[:n], kv, generation)

    def _recompute_rows(self, error: Exception) -> None:
        """The batched forward raised. A batch of one: that request is the cause, it fails.
        Otherwise every row goes back to the head of the queue, marked suspect: each
        re-prefills and decodes alone once, so the next failure names its request."""
        log.warning("batched decode step failed (%s); isolating its rows", error)
        self.stats["decode_step_failures"] += 1
        rows = list(self.batch.rows)
        self.batch.reset()
        if len(rows) == 1:
            self.fail(rows[0], EngineStepError(f"decode failed: {type(error).__name__}: {error}"))
            return
        for r in rows:
            r.suspect = True
        with self.cond:
            self.waiting.extendleft(reversed(rows))

    def _accept(self, rows: Sequence[EngineRequest], logits: torch.Tensor) -> list[bool]:
        """Sample the next token of every request in ``rows`` from its raw logits (row ``i`` of
        ``[N, V]``); per row, True if that request is done (finished, past its deadline, or
        failed because its logits are not finite). Rows that share sampling parameters are
        processed and sampled together."""
        done = [True] * len(rows)
        groups: dict[tuple[float, int, float], list[int]] = {}
        for i, req in enumerate(rows):
            sp = req.sampling
            groups.setdefault((sp.temperature, sp.top_k, sp.top_p), []).append(i)
        cpu = logits.float().cpu()
        version = self.weights.version
        for (temperature, top_k, top_p), idx in groups.items():
            members = [rows[i] for i in idx]
            sub = cpu if len(idx) == len(rows) else cpu[idx]
            errors = sample_group(members, sub, temperature, top_k, top_p, version)
            for req, error in zip(members, errors, strict=True):
                if error is not None:
                    self.fail(req, error)
            self.stats["generation_tokens"] += errors.count(None)
            for i, req, error in zip(idx, members, errors, strict=True):
                done[i] = error is not None or self._done_after_token(req)
        return done

    def _done_after_token(self, req: EngineRequest) -> bool:
        """Finish ``req`` if its last token stops it or it reached its length; True if done."""
        if req.output_ids[-1] in req.stop_ids:
            self.finish(req, "stop")
            return True
        if len(req.output_ids) >= req.max_new:
            self.finish(req, "length")
            return True
        return False


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
