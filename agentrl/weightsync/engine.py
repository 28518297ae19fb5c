"""CheckpointEngine: push every new weight version to every inference server, verified.

Why it exists: a weight push is where RL stacks deadlock, leave servers paused forever (AReaL
#1160) or silently serve half-updated weights. Here a push is one short, always-terminating
procedure per server (DESIGN section 10, "Push protocol, revised"):

    pause (keep | wait | abort) -> transfer -> reset prefix cache -> set version
        -> verify while still paused -> resume

**Verification** runs a fixed probe (token ids) on the server at the training temperature and
compares the logprobs it returns with the trainer's own log-probs of the same tokens; the max
absolute difference is reported every push, and a value above ``verify_tolerance`` fails the
push loudly. The embedded server serves the probe ahead of its queue *while still paused*
(``POST /probe``), so no rollout is ever served by unverified weights and the probe never waits
behind generation. vLLM (0.32) schedules nothing while paused, so for vLLM the probe runs right
after the resume (``verified_while_paused`` is False in the report; docs/inference.md says why).

Invariants:

- A server that was paused by a push is resumed by the same push, whatever failed in between
  (the resume runs in a ``finally``; a failed resume is reported, never swallowed). After the
  resume the server's pause state is read back: a server still paused (e.g. a ``wait`` pause
  that landed late) is resumed again, and reported ``PAUSED`` if it stays so, never "serving".
  Every pause also carries a server-side deadline (``push_timeout_s`` + a margin), so even a
  trainer that dies mid-push cannot leave an embedded server paused.
- A push either succeeds on every server, or returns a :class:`PushReport` that names each
  server's state (version it is on, whether it is paused, the error) and
  :meth:`PushReport.raise_if_failed` raises :class:`WeightPushError` with that table.
- Weights are staged once per push (not once per server) and every transport moves the same
  safetensors bytes, under the Hugging Face parameter names. A tied ``lm_head.weight`` is sent
  explicitly to vLLM servers (vLLM 0.32's ``reload_weights`` does not re-tie it).

Transports live behind :class:`WeightTransport` (two methods, two optional hooks):
:class:`SharedDirTransport` (safetensors on a shared directory, tmpfs when local; works for the
embedded server and vLLM's ``reload_weights``), :class:`HttpStreamTransport` (the safetensors
bytes over HTTP straight from the tensors' memory, pulled by each server from a trainer-side
weight server, or pushed in the request body; no shared filesystem; embedded server) and
:class:`~agentrl.weightsync.collective.CollectiveTransport` (``collective``: bucketed
broadcasts over a ``torch.distributed`` weight group, gloo on CPUs, NCCL on GPUs, into embedded
servers; vLLM's native NCCL weight-transfer API on GPUs).

**LoRA** (:class:`~agentrl.inference.lora.LoraAdapter`): ``push(adapter, version)`` moves only
the adapter (peft's tensors + rank/alpha/targets); the embedded server merges it onto its base
weights (every transport), vLLM loads it as a LoRA adapter named :data:`VLLM_LORA_NAME`
(``shared_dir`` only; the vLLM probe then asks for that model name). Validation and
verification are the same as for full weights.

**Colocated mode** (``distributed.colocate``): :meth:`CheckpointEngine.sleep` puts every server to
sleep before the trainer updates; the next push wakes each one: the embedded server loads
into its released weights (re-allocated first), is verified while paused, then wakes; vLLM
wakes its weights (level 2) before the transfer and its KV cache after it. A push never leaves
a server asleep: the wake-up runs in the same ``finally`` as the resume (an embedded server
whose load failed wakes with its last verified weights). :meth:`CheckpointEngine.wake_up`
wakes them without a push (a step that pushes nothing).

Timing: :meth:`PushReport.metrics` reports ``timing_s/push/{stage,pause,transfer,verify,
resume}`` (the slowest server for the per-server stages) next to the ``weight_sync/*`` totals.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from agentrl.inference.client import (
    InferenceServerError,
    PauseMode,
    PolicyClient,
)
from agentrl.inference.lora import (
    VLLM_LORA_NAME,
    LoraAdapter,
)
from agentrl.types import Generation, SamplingParams
from agentrl.weightsync.transports import (
    HttpStreamTransport,
    SharedDirTransport,
    StagedWeights,
    WeightTransport,
    tied_aliases,
)

__all__ = [
    "VLLM_LORA_NAME",
    "CheckpointEngine",
    "HttpStreamTransport",
    "PushReport",
    "ServerPushStatus",
    "SharedDirTransport",
    "WeightPushError",
    "WeightTransport",
    "make_transport",
    "tied_aliases",
    "transport_from_config",
]

logger = logging.getLogger(__name__)

ScoreFn = Callable[[list[int], list[int]], Awaitable[list[float]] | list[float]]
"""``score(prompt_ids, token_ids) -> logprobs`` of ``token_ids`` under the trainer's weights."""

PAUSE_MARGIN_S = 60.0
"""The server-side pause deadline is ``push_timeout_s`` plus this (a safety net only)."""
STAGES = ("stage", "pause", "transfer", "verify", "resume")
"""The parts of a push that :meth:`PushReport.metrics` times."""


class WeightPushError(RuntimeError):
    """A push failed on at least one server; ``report`` says which and where each server is."""

    def __init__(self, report: PushReport) -> None:
        self.report = report
        super().__init__(report.describe())


def make_transport(
    name: str,
    shared_dir: str | Path | None = None,
    *,
    bucket_mb: float = 256,
    collective_backend: str = "auto",
    collective_timeout_s: float = 120.0,
    advertise_host: str | None = None,
) -> WeightTransport:
    """``checkpoint.transport``: ``shared_dir``, ``http`` or ``collective`` (the keyword
    arguments are the ``checkpoint`` section's knobs of the collective transport)."""
    if name == "shared_dir":
        return (
            SharedDirTransport(shared_dir)
            if shared_dir is None
            else SharedDirTransport.for_run(shared_dir)
        )
    if name == "http":
        return HttpStreamTransport(advertise_host=advertise_host)
    if name == "collective":
        from agentrl.weightsync.collective import CollectiveTransport

        return CollectiveTransport(
            bucket_mb=bucket_mb,
            backend=collective_backend,  # type: ignore[arg-type]  # checked by the transport
            timeout_s=collective_timeout_s,
            advertise_host=advertise_host,
        )
    if name == "nccl":
        raise ValueError(
            "checkpoint.transport='nccl' was renamed: use 'collective' (NCCL on GPUs, gloo on CPUs)"
        )
    raise ValueError(f"checkpoint.transport={name!r}; use 'shared_dir', 'http' or 'collective'")


def transport_from_config(ck: Any) -> WeightTransport:
    """The transport a :class:`~agentrl.config.CheckpointConfig` asks for."""
    return make_transport(
        ck.transport,
        ck.resolved_shared_dir(),
        bucket_mb=ck.bucket_mb,
        collective_backend=ck.collective_backend,
        collective_timeout_s=ck.collective_timeout_s,
        advertise_host=ck.advertise_host,
    )


@dataclass
class ServerPushStatus:
    """Where one server stands after a push."""

    url: str
    stage: str = "pending"
    """The last stage reached: pause, transfer, reset_prefix_cache, set_version, verify,
    resume, done."""
    paused: bool = False
    """True only if the server is still paused (a failed resume)."""
    version: int | None = None
    """The version the server reports after the push (None if it could not be asked)."""
    digest: str | None = None
    """The content digest the server reports with ``version`` (embedded server)."""
    rolled_back: bool = False
    """A failed verify restored the last verified weights (never serving the bad ones)."""
    error: str | None = None
    verify_max_abs_diff: float | None = None
    verified_while_paused: bool = False
    """The probe ran before the resume (embedded server); False for vLLM (after the resume)."""
    woken: bool = False
    """The push woke the server from a colocated sleep."""
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per stage on this server: pause, transfer, verify, resume."""

    @property
    def ok(self) -> bool:
        """True when this server reached ``done`` without an error."""
        return self.error is None and self.stage == "done"


@dataclass
class PushReport:
    """What one push did on every server (see the module docstring)."""

    version: int
    servers: dict[str, ServerPushStatus] = field(default_factory=dict)
    num_bytes: int = 0
    stage_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    transport: str = ""
    score_seconds: float = 0.0
    """The trainer's scoring of the paused probe (before any pause; counted in verify)."""
    kind: Literal["full", "lora"] = "full"
    """``lora``: the push carried a LoRA adapter only (``num_bytes`` are the adapter's)."""
    ejected: dict[str, str] = field(default_factory=dict)
    """``{url: reason}`` of the servers out of the pool (dead, restarting): not pushed to and
    not failures (:mod:`agentrl.serving.supervisor`)."""

    @property
    def ok(self) -> bool:
        """True when every server reached ``done`` without an error."""
        return bool(self.servers) and all(s.ok for s in self.servers.values())

    @property
    def max_abs_diff(self) -> float | None:
        """The largest verify difference over the servers (None when nothing was verified)."""
        diffs = [s.verify_max_abs_diff for s in self.servers.values()]
        known = [d for d in diffs if d is not None]
        return max(known) if known else None

    def stage_time(self, stage: str) -> float:
        """Seconds of one stage: staging itself, else the slowest server's (plus the trainer's
        scoring for ``verify``)."""
        if stage == "stage":
            return self.stage_seconds
        slowest = max((s.timings.get(stage, 0.0) for s in self.servers.values()), default=0.0)
        return slowest + (self.score_seconds if stage == "verify" else 0.0)

    def describe(self) -> str:
        """One line per server: version, serving/PAUSED/unreachable, ok or the failure."""
        what = self.transport + (", LoRA adapter" if self.kind == "lora" else "")
        lines = [f"weight push of version {self.version} ({what}):"]
        for s in self.servers.values():
            state = "ok" if s.ok else f"FAILED at {s.stage}: {s.error}"
            serving = "PAUSED" if s.paused else "unreachable" if s.version is None else "serving"
            serving += " (rolled back to the last verified weights)" if s.rolled_back else ""
            lines.append(f"  {s.url}: on version {s.version}, {serving}, {state}")
        lines += [f"  {url}: ejected ({why})" for url, why in self.ejected.items()]
        return "\n".join(lines)

    def metrics(self) -> dict[str, float]:
        """``timing_s/push/*`` and ``weight_sync/*`` for the tracker."""
        servers = self.servers.values()
        out = {
            "weight_sync/push_s": self.total_seconds,
            "weight_sync/stage_s": self.stage_seconds,
            "weight_sync/verify_s": self.verify_seconds,
            "weight_sync/bytes": float(self.num_bytes),
            "weight_sync/lora": float(self.kind == "lora"),
            "weight_sync/failed_servers": float(sum(not s.ok for s in servers)),
            # servers whose probe logprobs were compared with the trainer's (0 when verify is off)
            "weight_sync/verified_servers": float(
                sum(s.ok and s.verify_max_abs_diff is not None for s in servers)
            ),
            "weight_sync/verified_while_paused": float(
                sum(s.ok and s.verified_while_paused for s in servers)
            ),
        }
        if any(s.woken for s in servers):  # colocated mode
            out["colocate/woken_servers"] = float(sum(s.woken for s in servers))
            out["colocate/wake_s"] = max(s.timings.get("wake", 0.0) for s in servers)
        for stage in STAGES:
            out[f"timing_s/push/{stage}"] = self.stage_time(stage)
        if self.max_abs_diff is not None:
            out["weight_sync/verify_max_abs_diff"] = self.max_abs_diff
        return out

    def raise_if_failed(self) -> None:
        """Raise :class:`WeightPushError` (the :meth:`describe` table) unless :attr:`ok`."""
        if not self.ok:
            raise WeightPushError(self)


class _Verifier:
    """Runs the probe on one server and compares it with the trainer's score (scored once per
    distinct token sequence, however many servers return it).

    While paused (embedded server) the probe is teacher-forced: the server scores the fixed
    ``probe_token_ids`` in one forward pass, and the trainer's side is computed before any
    server is paused (:meth:`prepare`), so the pause lasts one short forward longer, no more.
    After a resume (vLLM) the probe is a seeded generation, scored when it returns."""

    def __init__(self, engine: CheckpointEngine, score: ScoreFn) -> None:
        self.engine = engine
        self.score = score
        self._scored: dict[tuple[int, ...], asyncio.Future[list[float]]] = {}

    async def prepare(self) -> None:
        """Score the teacher-forced probe now, before anything is paused."""
        forced = tuple(self.engine.probe_token_ids)
        self._scored[forced] = asyncio.ensure_future(self._trainer_logprobs(forced))
        await self._scored[forced]

    async def _trainer_logprobs(self, tokens: tuple[int, ...]) -> list[float]:
        result = self.score(self.engine.probe_prompt_ids, list(tokens))
        if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
            result = await result
        assert isinstance(result, list)
        return [float(x) for x in result]

    async def check(self, status: ServerPushStatus, gen: Generation, version: int) -> None:
        """Fill ``status.verify_max_abs_diff``; set ``status.error`` on a mismatch."""
        if gen.weight_version != version:
            status.error = (
                f"verify probe was served by version {gen.weight_version}, expected {version}"
            )
            return
        if not gen.token_ids:
            status.verify_max_abs_diff = 0.0
            return
        key = tuple(gen.token_ids)
        if key not in self._scored:
            self._scored[key] = asyncio.ensure_future(self._trainer_logprobs(key))
        expected = await self._scored[key]
        diffs = [abs(a - b) for a, b in zip(expected, gen.logprobs, strict=True)]
        # A NaN or inf logprob (finite but huge weights overflow) is a failure, never a pass.
        diff = max(diffs) if all(math.isfinite(d) for d in diffs) else math.inf
        status.verify_max_abs_diff = diff
        tolerance = self.engine.verify_tolerance
        if not diff <= tolerance:
            status.error = (
                f"verify: server logprobs differ from the trainer's by {diff:.3g} > "
                f"checkpoint.verify_tolerance={tolerance:g} (weights not loaded, a different "
                "temperature/logprob mode, a dtype mismatch, or an untied lm_head)"
            )

    async def probe_paused(self, client: PolicyClient) -> Generation:
        """The teacher-forced probe, served while the (embedded) server is paused."""
        e = self.engine
        return await client.probe(
            e.probe_prompt_ids, temperature=e.temperature, token_ids=list(e.probe_token_ids)
        )

    async def probe_serving(self, client: PolicyClient, model: str | None = None) -> Generation:
        """The seeded-generation probe, after the resume (vLLM; ``model`` names a LoRA adapter)."""
        sampling = SamplingParams(
            max_tokens=self.engine.probe_tokens, temperature=self.engine.temperature, seed=1234
        )
        return await client.generate(self.engine.probe_prompt_ids, sampling, model=model)


class CheckpointEngine:
    """Push weights to servers and verify them; see the module docstring for the invariants.

    ``clients`` are :class:`PolicyClient` objects (or base URLs, for which a client with
    ``api_key`` and ``push_timeout_s`` is built). ``tied_weights`` maps a name to send
    explicitly to vLLM servers onto the tensor that holds its bytes; None detects a tied
    ``lm_head.weight`` (:func:`tied_aliases`). The probe is ``probe_prompt_ids`` followed by
    ``probe_token_ids`` (default ``9 .. 8 + probe_tokens``) scored while paused, or by
    ``probe_tokens`` sampled tokens (seed 1234) after a resume (vLLM).
    """

    def __init__(
        self,
        clients: Sequence[PolicyClient | str],
        transport: WeightTransport,
        *,
        pause_mode: PauseMode = "keep",
        verify: bool = True,
        verify_tolerance: float = 1e-3,
        probe_prompt_ids: Sequence[int] = (1, 2, 3, 4, 5, 6, 7, 8),
        probe_tokens: int = 8,
        temperature: float = 1.0,
        push_timeout_s: float = 300.0,
        api_key: str | None = None,
        tied_weights: Mapping[str, str] | None = None,
        probe_token_ids: Sequence[int] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not clients:
            raise ValueError("CheckpointEngine needs at least one server client")
        self.clock = clock
        """Where the report's timings come from (tests inject a counting clock)."""
        self.clients = [
            c
            if isinstance(c, PolicyClient)
            else PolicyClient(c, timeout_s=push_timeout_s, api_key=api_key)
            for c in clients
        ]
        self.transport = transport
        self.pause_mode: PauseMode = pause_mode
        self.verify = verify
        self.verify_tolerance = verify_tolerance
        self.probe_prompt_ids = list(probe_prompt_ids)
        self.probe_tokens = probe_tokens
        self.probe_token_ids = (
            list(probe_token_ids)
            if probe_token_ids is not None
            else list(range(9, 9 + probe_tokens))
        )
        """What the paused probe scores (teacher forcing) after ``probe_prompt_ids``."""
        self.temperature = temperature
        self.push_timeout_s = push_timeout_s
        self.tied_weights = None if tied_weights is None else dict(tied_weights)
        self.writer = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        """This engine's writer id, sent with each push lease: the servers' version checks are
        per writer, so a new or resumed run may start below the versions an earlier one left."""
        self.sleeping = 0
        """The level :meth:`sleep` put the servers to (0: awake); the next push wakes them."""

    async def sleep(self, level: int) -> dict[str, dict[str, Any]]:
        """Put every server to sleep at ``level`` (colocated mode; 2 only when the next push
        carries full weights); what each answered, by URL. A server that fails to sleep is
        woken again and the error raised (the trainer must not update beside it); one that
        cannot be reached is left out (it is dead: its memory is gone, and a local run's
        supervisor restarts it)."""
        answers = await asyncio.gather(
            *(c.sleep(level) for c in self.clients), return_exceptions=True
        )
        self.sleeping = level
        failed = [
            (c, a)
            for c, a in zip(self.clients, answers, strict=True)
            if isinstance(a, BaseException)
            and not (isinstance(a, InferenceServerError) and a.connection_failed)
        ]
        if failed:
            await self.wake_up()
            client, exc = failed[0]
            raise RuntimeError(f"{client.base_url}: sleep at level {level} failed: {exc}") from exc
        return {
            c.base_url: dict(a)  # type: ignore[arg-type]  # exceptions filtered out
            for c, a in zip(self.clients, answers, strict=True)
            if not isinstance(a, BaseException)
        }

    async def wake_up(self) -> int:
        """Wake every server that :meth:`sleep` put to sleep, without a push; how many."""
        if not self.sleeping:
            return 0
        await asyncio.gather(*(c.wake_up() for c in self.clients))
        self.sleeping = 0
        return len(self.clients)

    async def aclose(self) -> None:
        """Close the clients and the transport's weight server (the shared directory stays;
        ``SharedDirTransport.remove()`` deletes it)."""
        await asyncio.gather(*(c.aclose() for c in self.clients))
        close = getattr(self.transport, "close", None)
        if callable(close):
            close()

    async def push(
        self,
        weights: dict[str, torch.Tensor] | LoraAdapter,
        version: int,
        score: ScoreFn | None = None,
    ) -> PushReport:
        """Push ``weights`` as ``version`` to every server; verify with ``score`` if given.

        ``weights`` is a full state dict (Hugging Face names) or a
        :class:`~agentrl.inference.lora.LoraAdapter` (only the adapter moves; ``score`` must
        then score with the adapted model, e.g. the peft model). Never raises for a server-side
        failure (it is in the report; call :meth:`PushReport.raise_if_failed`); raises only for
        bad arguments or if staging the weights fails (before any server is touched).
        """
        t0 = self.clock()
        report = PushReport(version=version, transport=self.transport.name)
        staged = await self._stage(weights, version, report)
        report.num_bytes = staged.num_bytes
        report.stage_seconds = self.clock() - t0
        verifier = _Verifier(self, score) if self.verify and score is not None else None
        if verifier is not None:
            t_score = self.clock()
            await verifier.prepare()
            report.score_seconds = self.clock() - t_score
        try:
            await self.transport.prepare(self.clients)
        except Exception as exc:  # no server was paused: every one keeps its version
            return await self._prepare_failed(report, exc, t0)
        statuses = await asyncio.gather(
            *(self._push_one(c, staged, verifier) for c in self.clients)
        )
        self.sleeping = 0
        report.servers = {s.url: s for s in statuses}
        report.verify_seconds = report.stage_time("verify")
        self.transport.cleanup(keep_version=version)
        report.total_seconds = self.clock() - t0
        if not report.ok:
            logger.error("%s", report.describe())
        return report

    async def _stage(
        self, weights: dict[str, torch.Tensor] | LoraAdapter, version: int, report: PushReport
    ) -> StagedWeights:
        # Staged in a thread: writing a file (shared_dir) takes a while for a big model, and
        # the event loop (agent loops, other servers' requests) keeps running meanwhile.
        if isinstance(weights, LoraAdapter):
            report.kind = "lora"
            stage = functools.partial(self.transport.stage, lora=weights.spec)  # type: ignore[call-arg]
            return await asyncio.to_thread(stage, dict(weights.state), version)
        state = await self._with_tied_copies(weights)
        return await asyncio.to_thread(self.transport.stage, state, version)

    async def _prepare_failed(self, report: PushReport, exc: Exception, t0: float) -> PushReport:
        """The transport could not prepare (e.g. no weight group): every server failed at
        ``prepare``, none was paused, each keeps (and reports) its version."""
        error = f"{type(exc).__name__}: {exc}"
        for c in self.clients:
            status = ServerPushStatus(url=c.base_url, stage="prepare", error=error)
            await self._read_version(c, status, report.version)
            report.servers[c.base_url] = status
        report.total_seconds = self.clock() - t0
        logger.error("%s", report.describe())
        return report

    async def _with_tied_copies(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        aliases = tied_aliases(state) if self.tied_weights is None else self.tied_weights
        if not aliases:
            return state
        backends = await asyncio.gather(
            *(c.resolve_backend() for c in self.clients), return_exceptions=True
        )
        if "vllm" not in backends:
            return state
        extra = {name: state[source] for name, source in aliases.items() if name not in state}
        return {**state, **extra}

    async def _push_one(
        self, client: PolicyClient, staged: StagedWeights, verifier: _Verifier | None
    ) -> ServerPushStatus:
        status = ServerPushStatus(url=client.base_url)
        t0 = self.clock()
        pause_sent = False
        try:
            async with asyncio.timeout(self.push_timeout_s):
                # One writer per server: a second push is refused here, before any pause.
                status.stage = "lease"
                ttl = self.push_timeout_s + PAUSE_MARGIN_S
                await client.take_push_lease(f"push of version {staged.version}", ttl, self.writer)
                status.stage = "pause"
                # A pause whose answer is lost (timeout, dropped connection) may still take
                # effect on the server, so the resume below runs once the pause was sent.
                pause_sent = True
                await self._timed(
                    status,
                    "pause",
                    client.pause(self.pause_mode, timeout_s=self.push_timeout_s + PAUSE_MARGIN_S),
                )
                embedded = await client.resolve_backend() == "embedded"
                if self.sleeping == 2 and not embedded:  # vLLM: weights memory before the load
                    await self._timed(status, "wake", client.wake_up(["weights"]))
                await self._transfer(client, staged, status)
                if verifier is not None and embedded:
                    status.stage = "verify"
                    gen = await self._timed(status, "verify", verifier.probe_paused(client))
                    await self._timed(status, "verify", verifier.check(status, gen, staged.version))
                    status.verified_while_paused = status.error is None
                if status.error is None and embedded:
                    await client.mark_verified(staged.version)
        except BaseException as exc:  # recorded per server; the resume below still runs
            status.error = status.error or f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, Exception):
                raise
        finally:
            if pause_sent:
                await self._rollback_if_failed(client, status)
            if self.sleeping:  # colocated: awake before the resume, whatever failed
                await self._wake(client, status)
            if pause_sent:
                await self._resume(client, status)
            await self._release_lease(client)
            await self._read_version(client, status, staged.version)
        if verifier is not None and status.ok and not status.verified_while_paused:
            model = VLLM_LORA_NAME if staged.lora is not None else None
            await self._verify_serving(client, status, verifier, staged.version, model)
        status.seconds = self.clock() - t0
        return status

    @staticmethod
    async def _rollback_if_failed(client: PolicyClient, status: ServerPushStatus) -> None:
        """Still paused after a failed transfer or verify (embedded server): when the server
        holds weights other than its last verified ones, restore those, so the resume never
        serves the bad ones (a load the server refused changed nothing: no rollback)."""
        if status.error is None or status.stage not in (
            "transfer",
            "reset_prefix_cache",
            "set_version",
            "verify",
        ):
            return
        try:
            if await client.resolve_backend() != "embedded":
                return
            info = await asyncio.wait_for(client.weight_info(), timeout=60.0)
            verified = info.get("verified_version")
            if verified is not None and verified != info["weight_version"]:
                await asyncio.wait_for(client.rollback_weights(), timeout=60.0)
                status.rolled_back = True
        except Exception as exc:
            status.error += f"; rollback failed: {type(exc).__name__}: {exc}"

    async def _wake(self, client: PolicyClient, status: ServerPushStatus) -> None:
        """Wake a server from a colocated sleep (before its resume); a failure is reported."""
        t0 = self.clock()
        try:
            await asyncio.wait_for(client.wake_up(), timeout=60.0)
            status.woken = True
        except Exception as exc:
            status.error = (status.error + "; " if status.error else "") + (
                f"wake_up failed: {type(exc).__name__}: {exc}"
            )
        status.timings["wake"] = status.timings.get("wake", 0.0) + self.clock() - t0

    @staticmethod
    async def _release_lease(client: PolicyClient) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.release_push_lease(), timeout=30.0)

    async def _transfer(
        self, client: PolicyClient, staged: StagedWeights, status: ServerPushStatus
    ) -> None:
        status.stage = "transfer"
        await self._timed(status, "transfer", self.transport.load(client, staged))
        status.stage = "reset_prefix_cache"
        await self._timed(status, "transfer", client.reset_prefix_cache())
        status.stage = "set_version"
        await self._timed(status, "transfer", client.set_weight_version(staged.version))

    async def _timed(self, status: ServerPushStatus, stage: str, work: Awaitable[Any]) -> Any:
        t0 = self.clock()
        try:
            return await work
        finally:
            status.timings[stage] = status.timings.get(stage, 0.0) + self.clock() - t0

    async def _resume(self, client: PolicyClient, status: ServerPushStatus) -> None:
        """Resume, then read the pause state back: a server still paused (a ``wait`` pause that
        landed after the first resume) is resumed once more, and reported paused if it stays."""
        t0 = self.clock()
        try:
            for _attempt in range(2):
                await asyncio.wait_for(client.resume(), timeout=30.0)
                if not await asyncio.wait_for(client.is_paused(), timeout=30.0):
                    break
            else:
                status.paused = True
                status.error = (status.error + "; " if status.error else "") + (
                    "the server is still paused after two resumes"
                )
        except Exception as exc:
            # An unreachable server (dead, or never reached by the pause) is reported as
            # unreachable below (version None), not as paused.
            gone = isinstance(exc, InferenceServerError) and exc.connection_failed
            status.paused = not gone
            status.error = (status.error + "; " if status.error else "") + (
                f"resume failed: {type(exc).__name__}: {exc}"
            )
        status.timings["resume"] = self.clock() - t0

    @staticmethod
    async def _read_version(client: PolicyClient, status: ServerPushStatus, expected: int) -> None:
        try:
            info = await asyncio.wait_for(client.weight_info(), timeout=60.0)
            status.version = info["weight_version"]
            status.digest = info.get("digest")
        except Exception:
            status.version = None
        if status.error is None:
            if status.version != expected:
                status.error = (
                    f"server reports version {status.version} after the push, expected {expected}"
                )
            else:
                status.stage = "done"

    async def _verify_serving(
        self,
        client: PolicyClient,
        status: ServerPushStatus,
        verifier: _Verifier,
        version: int,
        model: str | None = None,
    ) -> None:
        """vLLM: nothing is served while paused, so the probe runs right after the resume
        (``model``: the LoRA adapter's name for an adapter push)."""
        t0 = self.clock()
        try:
            gen = await verifier.probe_serving(client, model)
            await verifier.check(status, gen, version)
        except Exception as exc:
            status.error = f"verify probe failed: {type(exc).__name__}: {exc}"
        if status.error is not None:
            status.stage = "verify"
        status.timings["verify"] = self.clock() - t0

    def replace_client(
        self, old_url: str | None, client: PolicyClient | None
    ) -> PolicyClient | None:
        """Change which servers the next :meth:`push` reaches (a server replaced at run time,
        e.g. a restarted Ray server actor on a new URL): remove the client of ``old_url`` (if
        any; it is returned, open, for the caller to close) and add ``client`` (if given).
        Call it between pushes, never while one runs."""
        removed = None
        if old_url is not None:
            for c in self.clients:
                if c.base_url == old_url.rstrip("/"):
                    removed = c
            self.clients = [c for c in self.clients if c is not removed]
        if client is not None:
            self.clients.append(client)
        return removed


def describe_versions(report: PushReport) -> dict[str, Any]:
    """``{url: version}`` for logs and error messages."""
    return {url: s.version for url, s in report.servers.items()}
