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
  diff, error); a push that failed on any server is answered 502 with that report, and the
  service's version moves only when every server took it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from agentrl.service.models import ServerPush, WeightPushResponse, WeightsInfo
from agentrl.training.checkpoint_engine import PushReport

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
            from agentrl.training.actor import load_causal_lm

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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _finite_or_none(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


class WeightService:
    """Owns the service's weight version and serializes pushes (module docstring)."""

    def __init__(
        self,
        serving: Any,
        *,
        temperature: float,
        weights_dirs: list[Path] | None = None,
        spool_dir: Path | None = None,
    ) -> None:
        self.serving = serving
        self.version = int(serving.version)
        self.weights_dirs = [Path(d).resolve() for d in (weights_dirs or [])]
        self.spool_dir = spool_dir
        self.last_push: WeightPushResponse | None = None
        self.pushes = {"ok": 0, "failed": 0, "refused": 0}
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
        if version is None:
            return self.version + 1
        if version <= self.version:
            raise WeightError(
                409,
                f"version {version} is not above the current version {self.version}; versions "
                "only move forward (omit 'version' to use current + 1)",
                "version",
            )
        return version

    async def push_file(self, path: Path, version: int | None) -> tuple[WeightPushResponse, bool]:
        """Validate the safetensors file at ``path`` and push it as ``version``."""
        async with self._lock:
            try:
                target = self._check_version(version)
                tensors = await asyncio.to_thread(_read_safetensors, path)
                await asyncio.to_thread(self._scorer.validate, tensors)
                digest = await asyncio.to_thread(_sha256, path)
            except WeightError:
                self.pushes["refused"] += 1
                raise
            await asyncio.to_thread(self._scorer.load, tensors)

            async def score(prompt_ids: list[int], token_ids: list[int]) -> list[float]:
                """:meth:`score` of the scoring model, off the event loop."""
                return await asyncio.to_thread(self._scorer.score, prompt_ids, token_ids)

            report = await self.serving.engine.push(tensors, target, score=score)
            response = self._response(report, digest)
            if report.ok:
                self.version = target
                self.pushes["ok"] += 1
            else:
                self.pushes["failed"] += 1
            self.last_push = response
            return response, report.ok

    def _response(self, report: PushReport, digest: str) -> WeightPushResponse:
        servers = {
            url: ServerPush(
                version=s.version,
                paused=s.paused,
                stage=s.stage,
                error=s.error,
                verify_max_abs_diff=_finite_or_none(s.verify_max_abs_diff),
                seconds=s.seconds,
            )
            for url, s in report.servers.items()
        }
        verify_on = bool(getattr(self.serving.engine, "verify", True))
        return WeightPushResponse(
            version=report.version,
            ok=report.ok,
            verified=report.ok
            and verify_on
            and all(s.verify_max_abs_diff is not None for s in servers.values()),
            servers=servers,
            num_bytes=report.num_bytes,
            sha256=digest,
            max_abs_diff=_finite_or_none(report.max_abs_diff),
            stage_seconds=report.stage_seconds,
            verify_seconds=report.verify_seconds,
            total_seconds=report.total_seconds,
            transport=report.transport,
        )

    async def info(self) -> WeightsInfo:
        """The service's version and each server's (None when a server cannot be asked)."""

        async def one(client: Any) -> int | None:
            """A server's weight version, or None when it cannot be asked within 30 s."""
            try:
                return await asyncio.wait_for(client.weight_version(), timeout=30.0)
            except Exception:  # an unreachable server is reported as None, never raised
                return None

        clients = list(self.serving.engine.clients)
        versions = await asyncio.gather(*(one(c) for c in clients))
        return WeightsInfo(
            version=self.version,
            servers={c.base_url: v for c, v in zip(clients, versions, strict=True)},
            last_push=self.last_push,
        )
