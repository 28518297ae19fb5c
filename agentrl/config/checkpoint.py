"""The ``checkpoint`` section: how new weights reach the inference servers (transport, verify,
pause, push cadence and retries)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from agentrl.config.section import Section

__all__ = ["CheckpointConfig"]


class CheckpointConfig(Section):
    """How new weights reach the inference servers."""

    transport: Literal["shared_dir", "http", "collective"] = "shared_dir"
    """`shared_dir` (safetensors in a shared directory), `http` (streamed) or `collective` (torch.distributed broadcasts: gloo on CPU, NCCL on GPU; vLLM's NCCL weight transfer)."""
    shared_dir: str | None = None
    """Directory for `shared_dir` (each run stages in a `run-*` directory of its own inside, removed at the end); None = /dev/shm/agentrl when writable, else the system temp dir."""
    bucket_mb: float = Field(default=256.0, gt=0)
    """`collective`: the largest packed broadcast (MiB); bigger buckets mean fewer collectives."""
    collective_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """`collective`: `auto` (NCCL when the trainer sees a GPU, else gloo), `gloo` or `nccl`."""
    collective_timeout_s: float = Field(default=120.0, gt=0)
    """`collective`: bound on joining the weight group and on every broadcast (a dead server fails the push, never hangs it)."""
    advertise_host: str | None = None
    """Address the servers reach the trainer at (`http` pull, `collective` rendezvous); None = the local interface that routes to each server."""
    verify: bool = True
    """After each push, compare probe logprobs of every server with the trainer's."""
    verify_tolerance: float = Field(default=1e-3, gt=0.0)
    """Max abs logprob difference accepted by `verify` (raise above it)."""
    probe_tokens: int = Field(default=16, ge=1)
    """Length of the fixed probe sequence used by `verify`."""
    push_timeout_s: float = Field(default=300.0, gt=0)
    """Time limit of one push on one server (pause, transfer, verify, resume)."""
    pause_mode: Literal["keep", "abort"] = "keep"
    """On pause: `keep` in-flight requests (they finish on new weights) or `abort` them."""
    push_every: int = Field(default=1, ge=1)
    """Push to the servers every N steps (1 = every step); > 1 makes rollouts lag the trainer on purpose (staleness experiments, or amortizing slow pushes); staler trajectories than `trainer.max_staleness` are still dropped."""
    push_retries: int = Field(default=1, ge=0)
    """Extra attempts of a failed push before training stops with the push report as error."""

    @field_validator("transport", mode="before")
    @classmethod
    def _renamed_transport(cls, value: Any) -> Any:
        if value == "nccl":
            raise ValueError(
                "'nccl' was renamed: write 'collective' (NCCL on GPUs, gloo on CPUs; "
                "vLLM's NCCL weight transfer)"
            )
        return value

    def resolved_shared_dir(self) -> Path:
        """`shared_dir`, or tmpfs `/dev/shm` when it exists, else the system temp dir."""
        if self.shared_dir is not None:
            return Path(self.shared_dir)
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            return shm / "agentrl"
        return Path(tempfile.gettempdir()) / "agentrl"
