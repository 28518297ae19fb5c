"""Weight pushes for the rollout service: validate, push through the CheckpointEngine, verify.

Why verification is computed here, from the pushed weights: the CheckpointEngine's probe is a
short generation *sampled by each server after the load* (fixed prompt and seed, the training
temperature), and its logprobs are compared with the trainer's logprobs of the same tokens. An
external trainer cannot supply those numbers in the push request, because the probe tokens do
not exist until the servers have loaded the new weights; a second round trip would hold every
server paused while the trainer computes (the promise is that a push never leaves a server
paused). So the service keeps one CPU copy of the model, loads the pushed tensors into it and
scores the probe itself with the trainer's convention
(:func:`agentrl.algos.logits.logprobs_from_logits`: log-softmax of logits / temperature). That checks the part of the chain the service owns
(every server serves exactly the bytes it received, at the training temperature); the response
carries the SHA-256 of the received bytes so the trainer can check its part (the bytes it sent
are the bytes that arrived).

Guarantees:

- a push is validated completely before any server is touched: readable safetensors, every
  name known to the model, shapes and dtypes equal to the model's, all values finite, every
  parameter present (tied aliases may be left out); a violation is a 400 naming the tensor;
- versions only move forward: a version not above the current one is a 409; pushes are
  serialized (one at a time);
- the response is the CheckpointEngine's report per server (version, paused, stage, verify
  diff, error); a push that failed on any live server is answered 502 with that report, and
  the service's version moves only when every live server took it. Servers the
  :class:`~agentrl.serving.supervisor.ServerSupervisor` ejected (dead, or dead after failing
  this push) are listed under ``ejected`` with their reason, not as failures; with no live
  server at all a push is a 503 and nothing moves;
- the latest verified push is durable (:mod:`agentrl.service.weight_state`): saved atomically
  with its version and digests before the response, reloaded and pushed to every server by
  :meth:`WeightService.restore` when the service starts, and pushed to a server that rejoins
  (:meth:`WeightService.catch_up`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from agentrl.service.models import ServerPush, WeightPushResponse, WeightsInfo
from agentrl.service.weight_state import (
    SavedWeights,
    WeightStateError,
    load_latest,
    save_latest,
    sha256_of,
)
from agentrl.weightsync.engine import PushReport

__all__ = ["WeightError", "WeightService"]

logger = logging.getLogger(__name__)


class WeightError(Exception):
    """A push the service refuses; carries the HTTP status (400, 403, 409) and the message."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class _ProbeScorer:
    """A CPU copy of the served model: validates pushed tensors and scores the probe."""

    def __init__(self, model_dir: Path, temperature: float) -> None:
        self.model_dir = model_dir
        self.temperature = temperature
        self._model: Any = None
        self._expected: dict[str, tuple[tuple[int, ...], Any]] = {}
        self._aliases: list[set[str]] = []
        self._lock = threading.Lock()

    def _ensure(self) -> Any:
        if self._model is None:
            import torch

            from agentrl.inference.vllm_backend import checkpoint_dtype
            from agentrl.training import load_causal_lm

            # The checkpoint's own dtype: pushes must match what the servers hold, exactly.
            declared = checkpoint_dtype(self.model_dir)
            dtype = getattr(torch, declared) if declared != "auto" else torch.float32
            model = load_causal_lm(
                self.model_dir,
                device=torch.device("cpu"),
                dtype=dtype,
                trust_remote_code=False,
            )
            model.eval()
            by_ptr: dict[int, set[str]] = {}
            for name, t in model.state_dict().items():
                self._expected[name] = (tuple(t.shape), t.dtype)
                by_ptr.setdefault(t.data_ptr(), set()).add(name)
            self._aliases = list(by_ptr.values())
            self._model = model
        return self._model

    def validate(self, tensors: dict[str, Any]) -> None:
        """Raise :class:`WeightError` (400) naming the first bad tensor; see the module doc."""
        import torch

        self._ensure()
        for name, t in tensors.items():
            if name not in self._expected:
                raise WeightError(
                    400,
                    f"tensor {name[:200]!r} is not a parameter of the served model "
                    f"({len(self._expected)} parameters, e.g. {next(iter(self._expected))!r})",
                    "weights",
                )
            shape, dtype = self._expected[name]
            if tuple(t.shape) != shape:
                raise WeightError(
                    400, f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}"
                )
            if t.dtype != dtype:
                raise WeightError(400, f"tensor {name!r} has dtype {t.dtype}, expected {dtype}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise WeightError(400, f"tensor {name!r} holds NaN or infinite values")
        missing = [sorted(group)[0] for group in self._aliases if not group & tensors.keys()]
        if missing:
            raise WeightError(
                400,
                f"{len(missing)} parameter(s) missing from the push, e.g. {missing[:3]}; push the "
                "full state dict (tied weights may appear once)",
            )

    def load(self, tensors: dict[str, Any]) -> None:
        """Load pushed tensors into the scoring model."""
        model = self._ensure()
        with self._lock:
            model.load_state_dict(tensors, strict=False)

    def score(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """Log-probs of ``token_ids`` after ``prompt_ids`` under the loaded weights."""
        import torch

        from agentrl.algos.logits import logprobs_from_logits

        model = self._ensure()
        with self._lock, torch.no_grad():
            ids = torch.tensor([list(prompt_ids) + list(token_ids)])
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            p = len(prompt_ids)
            logits = logits[p - 1 : p - 1 + len(token_ids)]
            target = torch.tensor(token_ids)
            logp = logprobs_from_logits(logits[None], target[None], temperature=self.temperature)
        return [float(x) for x in logp[0]]


def _read_safetensors(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise WeightError(400, f"not a readable safetensors file: {exc}", "weights") from None


def _finite_or_none(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


class WeightService:
    """Owns the service's weight version and serializes pushes (module docstring).

    ``servers`` is the service's :class:`~agentrl.serving.supervisor.ServerSupervisor` (None:
    every server of the engine, none ever ejected); ``state_dir`` where the latest verified
    push is saved (None: not durable)."""

    def __init__(
        self,
        serving: Any,
        *,
        temperature: float,
        weights_dirs: list[Path] | None = None,
        spool_dir: Path | None = None,
        servers: Any = None,
        state_dir: Path | None = None,
    ) -> None:
        self.serving = serving
        self.version = int(serving.version)
        self.weights_dirs = [Path(d).resolve() for d in (weights_dirs or [])]
        self.spool_dir = spool_dir
        self.servers = servers
        self.state_dir = state_dir
        self.saved: SavedWeights | None = None
        """The persisted latest verified push (None: the launch weights of ``model.path``)."""
        self.last_push: WeightPushResponse | None = None
        self.tried = self.version
        """The highest version a push sent to the servers (ok or not)."""
        self.pushes = {"ok": 0, "failed": 0, "refused": 0, "catch_ups": 0}
        self.persist_error: str | None = None
        """Why the last verified push could not be saved (None when it was)."""
        self._scorer = _ProbeScorer(Path(serving.model_dir), temperature)
        self._lock = asyncio.Lock()

    # ---- inputs ---------------------------------------------------------------------------
    def spool_file(self) -> tuple[int, str]:
        """A private temporary file for an uploaded body (``mkstemp``: fd and path)."""
        base = self.spool_dir
        if base is None:
            base = Path("/dev/shm") if os.path.isdir("/dev/shm") else None
        return tempfile.mkstemp(prefix="agentrl-push-", suffix=".safetensors", dir=base)

    def resolve_path(self, raw: str) -> Path:
        """The safetensors file a path push names; 403 outside the ``--weights-dir`` roots."""
        if not self.weights_dirs:
            raise WeightError(
                403,
                "pushing weights by path is off: start the service with --weights-dir DIR "
                "(a directory on the shared filesystem) or upload the safetensors bytes",
                "path",
            )
        path = Path(raw).resolve()
        if not any(path == root or root in path.parents for root in self.weights_dirs):
            raise WeightError(
                403,
                f"path is outside the allowed --weights-dir roots "
                f"({', '.join(map(str, self.weights_dirs))})",
                "path",
            )
        if path.is_dir():
            path = path / "model.safetensors"
        if path.suffix != ".safetensors" or not path.is_file():
            raise WeightError(
                400,
                "path must be a .safetensors file or a directory holding model.safetensors",
                "path",
            )
        return path

    # ---- push -----------------------------------------------------------------------------
    def _check_version(self, version: int | None) -> int:
        """The version of the next push: above the current one and above every version a push
        already sent to the servers (a failed push may have left some of them on it, and they
        refuse it again: versions only grow on a server)."""
        floor = max(self.version, self.tried)
        if version is None:
            return floor + 1
        if version <= floor:
            tried = (
                f", and version {self.tried} was tried already" if self.tried > self.version else ""
            )
            raise WeightError(
                409,
                f"version {version} is not above the current version {self.version}{tried}; "
                f"versions only move forward (omit 'version' to use {floor + 1})",
                "version",
            )
        return version

    async def _score(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """:meth:`_ProbeScorer.score` of the scoring model, off the event loop."""
        return await asyncio.to_thread(self._scorer.score, prompt_ids, token_ids)

    async def _live_engine(self) -> Any:
        """The engine, reaching the live servers only (hold the lock); 503 when none is."""
        engine = self.serving.engine
        if self.servers is None:
            return engine
        await self.servers.before_push()
        engine.clients = self.servers.live_clients()
        if not engine.clients:
            raise WeightError(
                503,
                "no live inference server to push to (every one is ejected: "
                f"{self.servers.ejected()}); retry when GET /v1/status reports one serving",
            )
        return engine

    async def push_file(self, path: Path, version: int | None) -> tuple[WeightPushResponse, bool]:
        """Validate the safetensors file at ``path`` and push it as ``version``."""
        async with self._lock:
            try:
                target = self._check_version(version)
                tensors = await asyncio.to_thread(_read_safetensors, path)
                await asyncio.to_thread(self._scorer.validate, tensors)
                digest = await asyncio.to_thread(sha256_of, path)
                engine = await self._live_engine()
            except WeightError:
                self.pushes["refused"] += 1
                raise
            await asyncio.to_thread(self._scorer.load, tensors)
            self.tried = target
            report = await engine.push(tensors, target, score=self._score)
            ejected = await self._settle(report)
            response = self._response(report, digest, ejected)
            if response.ok:
                self.version = target
                self.pushes["ok"] += 1
                response.persisted = await self._persist(path, target, digest, response)
            else:
                self.pushes["failed"] += 1
            self.last_push = response
            return response, response.ok

    async def _settle(self, report: PushReport) -> dict[str, str]:
        """Eject the servers that failed and are dead now; ``{url: reason}`` of every ejected."""
        if self.servers is None:
            return {}
        failed = {u: s.error or s.stage for u, s in report.servers.items() if not s.ok}
        await self.servers.after_push(failed)
        return self.servers.ejected()

    async def _persist(
        self, path: Path, version: int, sha256: str, response: WeightPushResponse
    ) -> bool:
        """Save a verified push as the latest (False, logged and reported, when it fails)."""
        if self.state_dir is None:
            return False
        digests = {s.digest for s in response.servers.values()}
        content = digests.pop() if len(digests) == 1 else None
        try:
            self.saved = await asyncio.to_thread(
                save_latest, self.state_dir, path, version, sha256, content
            )
        except OSError as exc:
            self.persist_error = f"saving version {version} under {self.state_dir}: {exc}"
            logger.error("weights are not durable: %s", self.persist_error)
            return False
        self.persist_error = None
        return True

    def _response(
        self, report: PushReport, digest: str, ejected: dict[str, str]
    ) -> WeightPushResponse:
        servers = {
            url: ServerPush(
                version=s.version,
                paused=s.paused,
                stage=s.stage,
                error=s.error,
                verify_max_abs_diff=_finite_or_none(s.verify_max_abs_diff),
                seconds=s.seconds,
                digest=s.digest,
            )
            for url, s in report.servers.items()
            if url not in ejected
        }
        verify_on = bool(getattr(self.serving.engine, "verify", True))
        ok = bool(servers) and all(s.ok for u, s in report.servers.items() if u not in ejected)
        return WeightPushResponse(
            version=report.version,
            ok=ok,
            verified=ok
            and verify_on
            and all(s.verify_max_abs_diff is not None for s in servers.values()),
            servers=servers,
            ejected=ejected,
            num_bytes=report.num_bytes,
            sha256=digest,
            max_abs_diff=_finite_or_none(report.max_abs_diff),
            stage_seconds=report.stage_seconds,
            verify_seconds=report.verify_seconds,
            total_seconds=report.total_seconds,
            transport=report.transport,
        )

    # ---- durability -------------------------------------------------------------------------
    async def restore(self) -> None:
        """Reload the latest saved push (if any) and push it to every live server at its
        version; a server that fails that push is ejected (it must not serve other weights).
        Raises :class:`WeightStateError` when the saved weights cannot be trusted."""
        if self.state_dir is None:
            return
        saved = await asyncio.to_thread(load_latest, self.state_dir)
        if saved is None:
            return
        try:
            tensors = await self._load_saved(saved)
        except WeightError as exc:
            raise WeightStateError(
                f"{saved.path} does not fit model.path ({exc.message}); serve the model it was "
                f"pushed for, or delete {self.state_dir} to start from model.path"
            ) from None
        async with self._lock:
            self.version, self.saved = saved.version, saved
            self.tried = max(self.tried, saved.version)
            await self._push_restored(tensors, saved.version)
        logger.info(
            "restored weight version %d (sha256 %s) from %s",
            saved.version,
            saved.sha256[:12],
            saved.path,
        )

    async def _push_restored(self, tensors: dict[str, Any], version: int) -> None:
        """Push the restored weights to every live server (hold the lock); eject the servers
        that did not take them (each catches up later, or says why not)."""
        try:
            engine = await self._live_engine()
        except WeightError as exc:  # no live server: each one catches up when it rejoins
            logger.warning("restored version %d reached no server yet: %s", version, exc.message)
            return
        report = await engine.push(tensors, version, score=self._score)
        for url, s in report.servers.items():
            if not s.ok and self.servers is not None:
                await self.servers.eject_now(url, f"restoring version {version}: {s.error}")

    async def _load_saved(self, saved: SavedWeights) -> dict[str, Any]:
        """The saved tensors, validated and loaded into the scoring model."""
        tensors = await asyncio.to_thread(_read_safetensors, saved.path)
        await asyncio.to_thread(self._scorer.validate, tensors)
        await asyncio.to_thread(self._scorer.load, tensors)
        return tensors

    async def catch_up(self, client: Any, join: Any) -> str | None:
        """Bring ``client``'s server to the current version and call ``join()``, both under the
        push lock; None on success, else why not (:data:`~agentrl.serving.supervisor.CatchUp`)."""
        async with self._lock:
            try:
                info = await asyncio.wait_for(client.weight_info(), timeout=30.0)
            except Exception as exc:  # reported to the supervisor, which tries again
                return f"weight_info failed: {type(exc).__name__}: {exc}"
            at_version = info.get("weight_version") == self.version
            same = self.saved is None or self.saved.digest in (None, info.get("digest"))
            if at_version and same:
                join()
                return None
            if self.saved is None:
                return (
                    f"it serves version {info.get('weight_version')}, the service "
                    f"{self.version}, and no pushed weights are saved to bring it there"
                )
            tensors = await self._load_saved(self.saved)
            one = copy.copy(self.serving.engine)  # the same writer, transport and settings
            one.clients = [client]
            report = await one.push(tensors, self.version, score=self._score)
            if not report.ok:
                return report.describe()
            self.pushes["catch_ups"] += 1
            join()
            return None

    # ---- reporting ------------------------------------------------------------------------
    async def info(self) -> WeightsInfo:
        """The service's version and digests, each server's version (None when it cannot be
        asked) and the ejected servers."""

        ejected = {} if self.servers is None else self.servers.ejected()

        async def one(client: Any) -> int | None:
            """A server's weight version; None when it is ejected (not asked: it may hang) or
            cannot be asked within 30 s."""
            if client.base_url in ejected:
                return None
            try:
                return await asyncio.wait_for(client.weight_version(), timeout=30.0)
            except Exception:  # an unreachable server is reported as None, never raised
                return None

        clients = (
            list(self.serving.engine.clients)
            if self.servers is None
            else [s.client for s in self.servers.slots]
        )
        versions = await asyncio.gather(*(one(c) for c in clients))
        return WeightsInfo(
            version=self.version,
            sha256=self.saved.sha256 if self.saved else None,
            digest=self.saved.digest if self.saved else None,
            servers={c.base_url: v for c, v in zip(clients, versions, strict=True)},
            ejected=ejected,
            last_push=self.last_push,
        )

    def describe(self) -> dict[str, Any]:
        """The weights part of ``/v1/status``: version, digests, push counts, durability."""
        saved = self.saved
        return {
            **self.pushes,
            "version": self.version,
            "sha256": saved.sha256 if saved else None,
            "digest": saved.digest if saved else None,
            "saved_at": saved.saved_at if saved else None,
            "persisted": saved is not None and saved.version == self.version,
            "persist_error": self.persist_error,
            "last_push_ok": None if self.last_push is None else self.last_push.ok,
        }
