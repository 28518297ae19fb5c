"""CheckpointEngine: push every new weight version to every inference server, verified.

Why it exists: a weight push is where RL stacks deadlock, leave servers paused forever (AReaL
#1160) or silently serve half-updated weights. Here a push is one short, always-terminating
procedure per server:

    pause (keep | wait | abort) -> transfer -> reset prefix cache -> set version -> resume

followed by **verification**: a fixed probe (token ids) is generated on each server at the
training temperature, and the logprobs it returns are compared with the trainer's own
log-probs of the same tokens; the max absolute difference is reported every push, and a value
above ``verify_tolerance`` fails the push loudly.

Invariants:

- A server that was paused by a push is resumed by the same push, whatever failed in between
  (the resume runs in a ``finally``; a failed resume is reported, never swallowed).
- A push either succeeds on every server, or returns a :class:`PushReport` that names each
  server's state (version it is on, whether it is paused, the error) and
  :meth:`PushReport.raise_if_failed` raises :class:`WeightPushError` with that table.
- Weights are serialized once per push (not once per server) and every transport moves the
  same safetensors bytes, under the Hugging Face parameter names.

Transports live behind :class:`WeightTransport` (two methods): :class:`SharedDirTransport`
(safetensors on a shared directory, tmpfs when local; works for the embedded server and vLLM's
``reload_weights``) and :class:`HttpStreamTransport` (the safetensors bytes in the request body;
no shared filesystem; embedded server). The GPU path (vLLM's NCCL weight-transfer API) plugs in
as a third transport (see docs/training.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentrl.inference.client import InferenceServerError, PauseMode, PolicyClient
from agentrl.types import SamplingParams

__all__ = [
    "CheckpointEngine",
    "HttpStreamTransport",
    "PushReport",
    "ServerPushStatus",
    "SharedDirTransport",
    "WeightPushError",
    "WeightTransport",
    "make_transport",
]

logger = logging.getLogger(__name__)

ScoreFn = Callable[[list[int], list[int]], Awaitable[list[float]] | list[float]]
"""``score(prompt_ids, token_ids) -> logprobs`` of ``token_ids`` under the trainer's weights."""


class WeightPushError(RuntimeError):
    """A push failed on at least one server; ``report`` says which and where each server is."""

    def __init__(self, report: PushReport) -> None:
        self.report = report
        super().__init__(report.describe())


@dataclass
class StagedWeights:
    """One version's weights, serialized once for every server."""

    version: int
    num_bytes: int
    path: Path | None = None
    data: bytes | None = None


class WeightTransport(ABC):
    """How serialized weights reach a server."""

    name: str = "abstract"

    @abstractmethod
    def stage(self, state_dict: dict[str, torch.Tensor], version: int) -> StagedWeights:
        """Serialize the weights once (before any server is paused)."""

    @abstractmethod
    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        """Make one (paused) server load the staged weights."""

    def cleanup(self, keep_version: int) -> None:  # noqa: B027 - optional hook
        """Free staged data of versions other than ``keep_version``."""


def _safetensors_bytes(state_dict: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(state_dict, metadata={"format": "pt"})


class SharedDirTransport(WeightTransport):
    """Write ``model.safetensors`` under ``root/v{version}``; servers load that directory.

    ``root`` must be visible to every server at the same path (tmpfs ``/dev/shm`` on one
    machine, a shared filesystem across machines). Only the latest version is kept.
    """

    name = "shared_dir"

    def __init__(self, root: str | Path | None = None) -> None:
        if root is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            root = tempfile.mkdtemp(prefix="agentrl-weights-", dir=base)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def stage(self, state_dict: dict[str, torch.Tensor], version: int) -> StagedWeights:
        from safetensors.torch import save_file

        out = self.root / f"v{version}"
        tmp = self.root / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(state_dict, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)  # atomic: a server never sees a half-written version directory
        size = (out / "model.safetensors").stat().st_size
        return StagedWeights(version=version, num_bytes=size, path=out)

    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        assert staged.path is not None
        await client.update_weights_from_path(staged.path, staged.version)

    def cleanup(self, keep_version: int) -> None:
        for child in self.root.glob("v*"):
            if child.name != f"v{keep_version}":
                shutil.rmtree(child, ignore_errors=True)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class HttpStreamTransport(WeightTransport):
    """POST the safetensors bytes to each server (no shared filesystem needed)."""

    name = "http"

    def stage(self, state_dict: dict[str, torch.Tensor], version: int) -> StagedWeights:
        data = _safetensors_bytes(state_dict)
        return StagedWeights(version=version, num_bytes=len(data), data=data)

    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        assert staged.data is not None
        await client.update_weights_from_bytes(staged.data, staged.version)


def make_transport(name: str, shared_dir: str | Path | None = None) -> WeightTransport:
    """``checkpoint.transport``: ``shared_dir`` or ``http`` (``nccl`` needs GPUs; see docs)."""
    if name == "shared_dir":
        return SharedDirTransport(shared_dir)
    if name == "http":
        return HttpStreamTransport()
    if name == "nccl":
        raise NotImplementedError(
            "checkpoint.transport='nccl' (vLLM's native NCCL weight transfer) needs GPUs and is "
            "not implemented yet; use 'shared_dir' (same machine or shared filesystem) or 'http'"
        )
    raise ValueError(f"checkpoint.transport={name!r}; use 'shared_dir', 'http' or 'nccl'")


@dataclass
class ServerPushStatus:
    """Where one server stands after a push."""

    url: str
    stage: str = "pending"
    """The last stage reached: pause, transfer, reset_prefix_cache, set_version, resume, done."""
    paused: bool = False
    """True only if the server is still paused (a failed resume)."""
    version: int | None = None
    """The version the server reports after the push (None if it could not be asked)."""
    error: str | None = None
    verify_max_abs_diff: float | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.stage == "done"


@dataclass
class PushReport:
    version: int
    servers: dict[str, ServerPushStatus] = field(default_factory=dict)
    num_bytes: int = 0
    stage_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    transport: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.servers) and all(s.ok for s in self.servers.values())

    @property
    def max_abs_diff(self) -> float | None:
        diffs = [s.verify_max_abs_diff for s in self.servers.values()]
        known = [d for d in diffs if d is not None]
        return max(known) if known else None

    def describe(self) -> str:
        lines = [f"weight push of version {self.version} ({self.transport}):"]
        for s in self.servers.values():
            state = "ok" if s.ok else f"FAILED at {s.stage}: {s.error}"
            serving = "PAUSED" if s.paused else "unreachable" if s.version is None else "serving"
            lines.append(f"  {s.url}: on version {s.version}, {serving}, {state}")
        return "\n".join(lines)

    def metrics(self) -> dict[str, float]:
        out = {
            "weight_sync/push_s": self.total_seconds,
            "weight_sync/stage_s": self.stage_seconds,
            "weight_sync/verify_s": self.verify_seconds,
            "weight_sync/bytes": float(self.num_bytes),
            "weight_sync/failed_servers": float(sum(not s.ok for s in self.servers.values())),
            # servers whose probe logprobs were compared with the trainer's (0 when verify is off)
            "weight_sync/verified_servers": float(
                sum(s.ok and s.verify_max_abs_diff is not None for s in self.servers.values())
            ),
        }
        if self.max_abs_diff is not None:
            out["weight_sync/verify_max_abs_diff"] = self.max_abs_diff
        return out

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise WeightPushError(self)


class CheckpointEngine:
    """Push weights to servers and verify them; see the module docstring for the invariants."""

    def __init__(
        self,
        clients: Sequence[PolicyClient],
        transport: WeightTransport,
        *,
        pause_mode: PauseMode = "keep",
        verify: bool = True,
        verify_tolerance: float = 1e-3,
        probe_prompt_ids: Sequence[int] = (1, 2, 3, 4, 5, 6, 7, 8),
        probe_tokens: int = 8,
        temperature: float = 1.0,
        push_timeout_s: float = 300.0,
    ) -> None:
        if not clients:
            raise ValueError("CheckpointEngine needs at least one server client")
        self.clients = list(clients)
        self.transport = transport
        self.pause_mode: PauseMode = pause_mode
        self.verify = verify
        self.verify_tolerance = verify_tolerance
        self.probe_prompt_ids = list(probe_prompt_ids)
        self.probe_tokens = probe_tokens
        self.temperature = temperature
        self.push_timeout_s = push_timeout_s

    async def push(
        self,
        state_dict: dict[str, torch.Tensor],
        version: int,
        score: ScoreFn | None = None,
    ) -> PushReport:
        """Push ``state_dict`` as ``version`` to every server; verify with ``score`` if given.

        Never raises for a server-side failure (it is in the report; call
        :meth:`PushReport.raise_if_failed`); raises only for bad arguments or if serializing
        the weights fails (before any server is touched).
        """
        t0 = time.perf_counter()
        report = PushReport(version=version, transport=self.transport.name)
        # Serialized in a thread: a 100M-parameter model takes about a second, and the event
        # loop (agent loops, other servers' requests) keeps running meanwhile.
        staged = await asyncio.to_thread(self.transport.stage, state_dict, version)
        report.num_bytes = staged.num_bytes
        report.stage_seconds = time.perf_counter() - t0
        statuses = await asyncio.gather(*(self._push_one(c, staged) for c in self.clients))
        report.servers = {s.url: s for s in statuses}
        if self.verify and score is not None:
            t_verify = time.perf_counter()
            await self._verify(report, score)
            report.verify_seconds = time.perf_counter() - t_verify
        self.transport.cleanup(keep_version=version)
        report.total_seconds = time.perf_counter() - t0
        if not report.ok:
            logger.error("%s", report.describe())
        return report

    async def _push_one(self, client: PolicyClient, staged: StagedWeights) -> ServerPushStatus:
        status = ServerPushStatus(url=client.base_url)
        t0 = time.perf_counter()
        pause_sent = False
        paused = False
        try:
            async with asyncio.timeout(self.push_timeout_s):
                status.stage = "pause"
                # A pause whose answer is lost (timeout, dropped connection) may still take
                # effect on the server, so the resume below runs once the pause was sent.
                pause_sent = True
                await client.pause(self.pause_mode)
                paused = True
                status.stage = "transfer"
                await self.transport.load(client, staged)
                status.stage = "reset_prefix_cache"
                await client.reset_prefix_cache()
                status.stage = "set_version"
                await client.set_weight_version(staged.version)
        except BaseException as exc:  # recorded per server; the resume below still runs
            status.error = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, Exception):
                raise
        finally:
            if pause_sent:
                try:
                    await asyncio.wait_for(client.resume(), timeout=30.0)
                except Exception as exc:
                    # An unreachable server (dead, or never reached by the pause) is reported
                    # as unreachable below (version None), not as paused.
                    gone = isinstance(exc, InferenceServerError) and exc.connection_failed
                    status.paused = paused and not gone
                    if paused:
                        status.error = (status.error + "; " if status.error else "") + (
                            f"resume failed: {type(exc).__name__}: {exc}"
                        )
            try:
                # Generous: the embedded server checksums its weights for /weight_info
                # (about a second per 100M parameters on a busy CPU).
                status.version = await asyncio.wait_for(client.weight_version(), timeout=60.0)
            except Exception:
                status.version = None
            if status.error is None:
                if status.version != staged.version:
                    status.error = (
                        f"server reports version {status.version} after the push, "
                        f"expected {staged.version}"
                    )
                else:
                    status.stage = "done"
            status.seconds = time.perf_counter() - t0
        return status

    async def _verify(self, report: PushReport, score: ScoreFn) -> None:
        sampling = SamplingParams(
            max_tokens=self.probe_tokens, temperature=self.temperature, seed=1234
        )
        by_url = {c.base_url: c for c in self.clients}
        # Servers on the same weights usually sample the same probe tokens (fixed seed): the
        # trainer scores each distinct token sequence once per push.
        scored: dict[tuple[int, ...], list[float]] = {}

        async def one(status: ServerPushStatus) -> None:
            if not status.ok:
                return
            client = by_url[status.url]
            try:
                gen = await client.generate(self.probe_prompt_ids, sampling)
            except Exception as exc:
                status.error = f"verify probe failed: {type(exc).__name__}: {exc}"
                status.stage = "verify"
                return
            if gen.weight_version != report.version:
                status.error = (
                    f"verify probe was served by version {gen.weight_version}, "
                    f"expected {report.version}"
                )
                status.stage = "verify"
                return
            if not gen.token_ids:
                status.verify_max_abs_diff = 0.0
                return
            key = tuple(gen.token_ids)
            if key not in scored:
                result = score(self.probe_prompt_ids, list(gen.token_ids))
                if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
                    result = await result
                assert isinstance(result, list)
                scored[key] = result
            expected = scored[key]
            diff = max(abs(a - b) for a, b in zip(expected, gen.logprobs, strict=True))
            status.verify_max_abs_diff = diff
            if diff > self.verify_tolerance:
                status.error = (
                    f"verify: server logprobs differ from the trainer's by {diff:.3g} > "
                    f"checkpoint.verify_tolerance={self.verify_tolerance:g} (weights not loaded, "
                    "a different temperature/logprob mode, or a dtype mismatch)"
                )
                status.stage = "verify"

        await asyncio.gather(*(one(s) for s in report.servers.values()))


def describe_versions(report: PushReport) -> dict[str, Any]:
    """``{url: version}`` for logs and error messages."""
    return {url: s.version for url, s in report.servers.items()}
