"""The :class:`InferenceEngine`: the one object callers hold, assembled from the engine's parts.

Why it exists: the HTTP routes, the tests and the trainer's in-process use need one handle with
one API (submit, pause, probe, load weights, close). This module loads the model and wires the
parts behind that API; each part keeps its own invariants:

- :mod:`~agentrl.inference.engine.scheduler`: the engine thread, its queues and step loop
  (every request ends exactly once; one bad request fails only itself);
- :mod:`~agentrl.inference.engine.batch`: the running batch and its left-padded KV cache;
- :mod:`~agentrl.inference.engine.sampling`: processed logprobs, one seeded stream per request;
- :mod:`~agentrl.inference.engine.pause`: ``keep``/``abort``/``wait`` pauses that always end;
- :mod:`~agentrl.inference.engine.probe`: the verification probe, served while paused;
- :mod:`~agentrl.inference.engine.sleep`: memory given back while a colocated trainer updates;
- :mod:`~agentrl.inference.engine.weight_store` and :mod:`~agentrl.inference.engine.loaders`:
  weights and version, checked completely, swapped together between decode steps.

Invariants of the API: every public method may be called from any thread; those that change
the engine (pause, loads, probes, ``set_weight_version``, ``weight_info``) run as control
operations on the engine thread and return once done; ``submit`` returns at once with a future.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from agentrl.inference.collective import BucketLayout, WeightGroup
from agentrl.inference.engine.loaders import WeightLoader
from agentrl.inference.engine.pause import PauseMode
from agentrl.inference.engine.probe import Probe, run_probe
from agentrl.inference.engine.request import (
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    check_request,
    normalize_sampling,
)
from agentrl.inference.engine.scheduler import Scheduler
from agentrl.inference.engine.sleep import SLEEP_LEVELS, resident_bytes, trim_host_memory
from agentrl.inference.engine.weight_store import (
    VersionConflict,
    WeightStore,
    WeightUpdate,
    check_version,
)
from agentrl.inference.lora import LoraMerger, LoraSpec
from agentrl.types import SamplingParams

__all__ = ["InferenceEngine"]


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
        prefix_cache_mb: most MiB of KV kept for prompt prefixes computed before
            (:mod:`~agentrl.inference.engine.prefix_cache`); 0 (the default here; the server
            and a run's config turn it on) keeps none.
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
        prefix_cache_mb: float = 0.0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}; it must be >= 1")
        if not max_pause_s > 0:
            raise ValueError(f"max_pause_s={max_pause_s}; it must be > 0")
        if not prefix_cache_mb >= 0:
            raise ValueError(f"prefix_cache_mb={prefix_cache_mb}; it must be >= 0 (0 = off)")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        model: Any = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dtype)
        model.to(self.device)
        model.eval()
        cfg = model.config
        self.vocab_size: int = int(model.get_input_embeddings().weight.shape[0])
        limit = getattr(cfg, "max_position_embeddings", None) or 4096
        self.max_model_len: int = int(max_model_len or limit)
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len}; it must be >= 2")
        self.eos_token_ids: frozenset[int] = _eos_ids(self.model_dir, cfg)
        self.weights = WeightStore(model, weight_version)
        """The served weights, their version and the staging buffer."""
        self._sched = Scheduler(
            model,
            self.device,
            self.weights,
            max_batch_size=max_batch_size,
            max_pause_s=float(max_pause_s),
            prefix_cache_bytes=int(prefix_cache_mb * 2**20),
        )
        self._loader = WeightLoader(self.weights, self.device, self._apply_weights)
        self.weights.before_check = lambda: self._sched.control(self.weights.restore)
        self.stats: dict[str, int] = self._sched.stats
        """Counters (read by ``/metrics``)."""
        self._seed_gen = torch.Generator().manual_seed(seed)
        self._seed_lock = threading.Lock()
        self._ids = itertools.count()
        self._sched.start()

    # ---- state (thread-safe reads) -------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The served model (run by the engine thread only)."""
        return self._sched.model

    @model.setter
    def model(self, model: Any) -> None:
        self._sched.model = model
        self.weights.generation += 1  # the prefix cache's KV came from the old model

    @property
    def max_batch_size(self) -> int:
        """Most requests decoded together; the rest wait in FIFO order."""
        return self._sched.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, value: int) -> None:
        self._sched.max_batch_size = value

    @property
    def max_pause_s(self) -> float:
        """The longest any pause lasts; then the engine resumes by itself."""
        return self._sched.pause.max_pause_s

    @max_pause_s.setter
    def max_pause_s(self, value: float) -> None:
        self._sched.pause.max_pause_s = float(value)

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine holds now."""
        return self.weights.version

    @property
    def is_paused(self) -> bool:
        """True while paused or draining toward a pause (vLLM reports both as paused)."""
        return self._sched.pause.active

    @property
    def pause_state(self) -> Literal["running", "draining", "paused"]:
        """``running``, ``draining`` (a ``wait`` pause) or ``paused``."""
        return self._sched.pause.state

    @property
    def resume_epoch(self) -> int:
        """Incremented by every resume (manual or by deadline); a pending pause compares it."""
        return self._sched.pause.epoch

    @property
    def num_running(self) -> int:
        """Unfinished requests in the running batch (a row whose future has resolved is not
        counted, even in the moment before the engine drops it)."""
        return sum(1 for r in list(self._sched.batch.rows) if not r.finished)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission."""
        return len(self._sched.waiting)

    @property
    def is_closed(self) -> bool:
        """True once the engine stops (``close`` or ``shutdown_nowait``)."""
        return self._sched.closing

    @property
    def state_bytes(self) -> int:
        """Bytes of the model's state dict (tied copies counted once per name)."""
        return self.weights.state_bytes

    @property
    def last_load_casts(self) -> dict[str, int]:
        """Dtype widenings of the last weight load (``{"float16->float32": n}``), reported."""
        return self.weights.last_load_casts

    @property
    def staging_lock(self) -> threading.Lock:
        """Held by whoever fills :meth:`staging_buffer` until the load that reads it is done."""
        return self.weights.staging_lock

    @property
    def lora(self) -> LoraMerger:
        """The merged LoRA adapter (if any) and the base weights it was merged onto."""
        return self.weights.lora

    @property
    def weight_group(self) -> WeightGroup | None:
        """The :class:`~agentrl.inference.collective.WeightGroup` this server joined, if any."""
        return self._loader.group

    @property
    def group_lock(self) -> threading.Lock:
        """Serializes joining the weight group and receiving on it."""
        return self._loader.group_lock

    # ---- requests -------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raise :class:`EngineRequestError` (with ``param``) if the request cannot be served."""
        check_request(
            prompt_ids, sampling, vocab_size=self.vocab_size, max_model_len=self.max_model_len
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
                with self._seed_lock:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen).item())
            gen = torch.Generator().manual_seed(int(seed))
        now = time.monotonic()
        req = EngineRequest(
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
        self._sched.enqueue(req)
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
        self._sched.post(lambda: self._sched.drop(lambda r: r.future is fut))

    # ---- pause / resume (agentrl.inference.engine.pause) -----------------------------------------
    def pause(self, mode: PauseMode = "keep", *, max_pause_s: float | None = None) -> int:
        """Pause now (``keep``: running requests stay parked; ``abort``: they end first).

        Blocks until paused; returns how many requests were aborted. The pause ends by itself
        after ``max_pause_s`` (capped by the engine's own). For ``wait`` use
        :meth:`start_drain`.
        """
        if mode not in ("keep", "abort"):
            raise ValueError(f"pause mode {mode!r}: use 'keep' or 'abort' (or start_drain)")
        limit = self._sched.pause.limit(max_pause_s)

        def _pause() -> int:
            aborted = self._sched.abort_all_now() if mode == "abort" else 0
            self._sched.pause.enter(time.monotonic(), limit)
            return aborted

        return self._sched.control(_pause)

    def start_drain(self, *, max_pause_s: float | None = None) -> int:
        """Begin a ``wait`` pause: admit nothing new, pause once the running batch is empty.

        Returns the resume epoch; the drain (and the pause it becomes) is cancelled by any
        resume, or by :meth:`cancel_pause` with this epoch.
        """
        limit = self._sched.pause.limit(max_pause_s)
        return self._sched.control(lambda: self._sched.pause.drain(time.monotonic(), limit))

    def resume(self) -> None:
        """End any pause or drain now (and cancel a pending ``wait`` pause)."""
        self._sched.pause.resume()

    def cancel_pause(self, epoch: int) -> bool:
        """Resume only if no resume happened since ``epoch`` (a pause whose requester left)."""
        return self._sched.pause.cancel(epoch)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (a weight change drops them by itself); True when the
        engine has a prefix cache."""
        cache = self._sched.prefix_cache
        self._sched.control(cache.clear)
        return cache.enabled

    def abort_all(self) -> int:
        """Finish every running and waiting request now (finish reason ``abort``); returns how many."""
        return self._sched.control(self._sched.abort_all_now)

    # ---- sleep / wake up (agentrl.inference.engine.sleep) ------------------------------------------
    @property
    def sleep_level(self) -> int:
        """0 awake; 1 (KV cache and staging buffer released) or 2 (the weights too) asleep."""
        return self._sched.sleep_level

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Stop generating and give memory back (see :mod:`~agentrl.inference.engine.sleep`).

        Running requests are parked (they keep their tokens and re-prefill after
        :meth:`wake_up`); new ones are held. Level 2 also frees the weights; it is refused
        (:class:`~agentrl.inference.engine.weight_store.VersionConflict`) while a LoRA adapter
        is merged or the served version is unverified. Returns ``{"level", "parked",
        "freed_bytes", "rss_before", "rss_after"}`` (the resident bytes of this process before
        and after, the C allocator trimmed).
        """
        if level not in SLEEP_LEVELS:
            raise EngineRequestError(
                f"level={level!r}; use 1 (KV cache) or 2 (weights too)", "level"
            )
        rss_before = resident_bytes()

        def _sleep() -> dict[str, Any]:
            freed = self.weights.release() if level == 2 else 0
            parked = self._sched.park_running()
            self._sched.prefix_cache.clear()
            freed += self.weights.release_staging()
            self._sched.sleep_level = max(self._sched.sleep_level, level)
            self.stats["sleeps"] += 1
            return {"level": self._sched.sleep_level, "parked": parked, "freed_bytes": freed}

        out = self._sched.control(_sleep)
        trim_host_memory()
        out.update(rss_before=rss_before, rss_after=resident_bytes())
        return out

    def wake_up(self, *, weights_only: bool = False) -> dict[str, Any]:
        """Re-allocate what :meth:`sleep` released (released weights come back as the last
        verified ones, unless a load already brought new ones) and generate again; returns
        ``{"was_sleeping", "sleeping", "weight_version"}``. ``weights_only`` (vLLM's
        ``tags=weights``) re-allocates the weights and stays asleep."""

        def _wake() -> dict[str, Any]:
            was = self._sched.sleep_level
            self.weights.restore()
            if was and not weights_only:
                self._sched.sleep_level = 0
                self.stats["wakes"] += 1
            return {
                "was_sleeping": was,
                "sleeping": self._sched.sleep_level,
                "weight_version": self.weights.version,
            }

        return self._sched.control(_wake)

    # ---- probe: served between steps, even while paused (agentrl.inference.engine.probe) -----
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
        probe = Probe.make(
            prompt_ids,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
            token_ids=token_ids,
            validate=self.validate,
        )
        return self._sched.control(lambda: self._serve_probe(probe))

    def _serve_probe(self, probe: Probe) -> EngineOutput:
        if self.weights.released:
            raise VersionConflict(
                "the server sleeps at level 2 with its weights released; push weights or "
                "POST /wake_up before probing",
                "sleep",
            )
        out = run_probe(
            self.model,
            self.device,
            probe,
            version=self.weights.version,
            request_id=lambda: f"probe-{next(self._ids)}",
        )
        self.stats["probes"] += 1
        return out

    # ---- weights (agentrl.inference.engine.loaders, .weight_store) ----------------------------
    def staging_buffer(self, num_bytes: int) -> memoryview:
        """A reusable buffer of ``num_bytes`` for receiving weights (hold :attr:`staging_lock`)."""
        return self.weights.staging_buffer(num_bytes)

    def load_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], version: int | None = None
    ) -> int:
        """Swap weights between decode steps; returns the new version (``version`` or current + 1).

        Checked completely first (names, shapes, dtype equal or losslessly widened, finite
        values, every parameter given except tied copies, a valid version; a lossless widening
        such as float16 -> float32 is applied and reported in :attr:`last_load_casts`, anything
        else that differs in dtype is refused); on any problem nothing changes and
        :class:`WeightLoadError` (or :class:`EngineRequestError` for the version) is raised.
        The check runs in the caller's thread, so decoding goes on.
        """
        return self._loader.load_state_dict(state_dict, version)

    def load_lora(
        self, adapter: Mapping[str, torch.Tensor], spec: LoraSpec, version: int | None = None
    ) -> int:
        """Merge a LoRA adapter (peft naming; :mod:`agentrl.inference.lora`) onto the base weights,
        between decode steps; returns the new version. Checked completely first (names, shapes,
        rank, targets, dtypes, finiteness, the version); on any problem nothing changes. Each
        adapter is merged onto the kept base weights, never onto the previous merge."""
        return self._loader.load_lora(adapter, spec, version)

    def load_update(
        self,
        state: Mapping[str, torch.Tensor],
        version: int | None = None,
        lora: LoraSpec | None = None,
    ) -> int:
        """:meth:`load_lora` when ``lora`` is given, else :meth:`load_state_dict`."""
        return self._loader.load_update(state, version, lora)

    def load_safetensors(
        self, buf: bytearray | memoryview, version: int | None = None, *, what: str = "the body"
    ) -> int:
        """Load a safetensors file held in ``buf`` (hold :attr:`staging_lock` when it is the
        staging buffer): a LoRA adapter when its metadata carries one
        (:data:`~agentrl.inference.lora.METADATA_KEY`), else full weights."""
        return self._loader.load_safetensors(buf, version, what=what)

    def load_weights_from_path(self, path: str | Path, version: int | None = None) -> int:
        """Load every ``*.safetensors`` file of a directory (or one file); see :meth:`load_state_dict`.
        A directory with peft's ``adapter_config.json`` is a LoRA adapter (:meth:`load_lora`)."""
        return self._loader.load_weights_from_path(path, version)

    def load_weights_from_url(
        self, url: str, version: int | None = None, *, timeout_s: float = 60.0
    ) -> int:
        """Pull a safetensors file over plain HTTP straight into the staging buffer, then load
        it; see :meth:`load_state_dict`."""
        return self._loader.load_weights_from_url(url, version, timeout_s=timeout_s)

    def load_weights_from_bytes(self, data: bytes | bytearray, version: int | None = None) -> int:
        """Load a serialized safetensors blob (an HTTP body); see :meth:`load_state_dict`."""
        return self._loader.load_weights_from_bytes(data, version)

    def join_weight_group(self, group: WeightGroup, local_address: str | None = None) -> None:
        """Join ``group`` (blocks until every rank is in, at most its timeout), leaving any group
        joined before. Raises :class:`~agentrl.inference.collective.WeightGroupError`."""
        self._loader.join_weight_group(group, local_address)

    def leave_weight_group(self) -> bool:
        """Leave the weight group (True when there was one)."""
        return self._loader.leave_weight_group()

    def receive_weights(
        self,
        group_id: str,
        layout: BucketLayout,
        version: int | None = None,
        lora: LoraSpec | None = None,
    ) -> int:
        """Receive one version's buckets broadcast on the weight group ``group_id``, then load
        them (checked before anything is swapped); returns the new version. A wrong
        ``group_id`` is an :class:`EngineRequestError`; a failed broadcast leaves the group
        (:class:`~agentrl.inference.collective.WeightGroupError`) and changes nothing."""
        return self._loader.receive_weights(group_id, layout, version, lora)

    def _apply_weights(self, update: WeightUpdate) -> int:
        """Swap a checked update in as one control operation (weights and version together)."""

        def _apply() -> int:
            new = self.weights.apply(update)
            self.stats["weight_updates"] += 1
            if update.spec is not None:
                self.stats["lora_updates"] += 1
            return new

        return self._sched.control(_apply)

    def set_weight_version(self, version: int, *, rollback: bool = False) -> int:
        """Label the current weights ``version`` (an int in ``[0, 2**63 - 1]``); a lower version
        than the served one needs ``rollback`` (else :class:`VersionConflict`)."""
        v = check_version(version)
        return self._sched.control(lambda: self.weights.relabel(v, rollback))

    def mark_verified(self, version: int) -> str:
        """Keep the served weights (which must be ``version``) as the last verified ones, to
        roll back to; returns their digest."""
        v = check_version(version)
        return self._sched.control(lambda: self.weights.mark_verified(v))

    def rollback_weights(self) -> int:
        """Restore the last verified weights and their version, between decode steps."""

        def _rollback() -> int:
            self.stats["weight_rollbacks"] += 1
            return self.weights.rollback()

        return self._sched.control(_rollback)

    def weight_info(self, checksum: bool = False) -> dict[str, Any]:
        """``{"version", "digest", "verified_version", "writer", "num_params"}`` read in one control
        operation (so version and digest always belong together; the digest is a sha256 over
        name + bytes of the state dict, cached until the weights change), plus ``"checksum"``
        (the same digest, the older name) when asked."""

        def _info() -> dict[str, Any]:
            n = sum(p.numel() for p in self.model.parameters())
            if self.weights.released:
                n = sum(t.numel() for t in self.weights.released_shapes().values())
            info: dict[str, Any] = {
                "sleeping": self._sched.sleep_level,
                "weights_released": self.weights.released,
                "version": self.weights.version,
                "digest": self.weights.digest(),
                "verified_version": self.weights.verified_version,
                "writer": self.weights.lease.writer,
                "num_params": int(n),
            }
            lease = self.weights.lease.describe()
            if lease is not None:
                info["push_lease"] = lease
            if self.weights.lora.spec is not None:
                info["lora"] = self.weights.lora.info()
            if self._loader.group is not None:
                info["weight_group"] = self._loader.group.describe()
            if checksum:
                info["checksum"] = self.weights.checksum()
            return info

        return self._sched.control(_info)

    # ---- shutdown ---------------------------------------------------------------------------------
    def shutdown_nowait(self) -> None:
        """Ask the engine to stop (safe from a signal handler: takes no lock, never blocks)."""
        self._sched.shutdown_nowait()

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort everything pending and stop the engine thread (idempotent)."""
        self._sched.close(timeout_s)


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
