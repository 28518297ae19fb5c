"""The ``inference`` section: the policy's inference servers and the sampling settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agentrl.config.section import Section

__all__ = ["InferenceConfig"]


class InferenceConfig(Section):
    """Inference servers and sampling."""

    backend: Literal["embedded", "vllm", "external"] = "embedded"
    """`embedded` (our server, CPU-friendly), `vllm` (launched by us) or `external` (`urls`)."""
    num_servers: int = Field(default=1, ge=1)
    """Inference servers to launch (embedded/vllm)."""
    urls: list[str] = Field(default_factory=list)
    """Base URLs of already-running servers (backend `external`)."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature (the trainer recomputes logprobs with the same temperature)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass; keep 1.0 for RL (the trainer does not apply top-p)."""
    top_k: int = -1
    """Top-k filter, -1 = off; keep off for RL (the trainer does not apply top-k)."""
    max_tokens_per_turn: int = Field(default=256, ge=1)
    """Most tokens one model turn may generate."""
    request_timeout_s: float = Field(default=120.0, gt=0)
    """HTTP timeout of one generation request."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of a failed request on another healthy server."""
    max_batch_size: int = Field(default=32, ge=1)
    """Most sequences a server decodes at once (embedded: batch slots; vLLM: --max-num-seqs)."""
    prefix_cache_mb: float = Field(default=256.0, ge=0, allow_inf_nan=False)
    """MiB of KV an embedded server keeps for prompt prefixes it computed before (the system prompt and tools every sample shares, the earlier turns of an episode), so they are not prefilled again; emptied at every weight change; 0 = off. vLLM sizes its own cache: 0 passes `--no-enable-prefix-caching`, any other value leaves vLLM's prefix caching on."""
    startup_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a launched server may take to answer `/health` (raise it on a loaded machine)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the embedded servers (auto = cuda when available); their dtype is `model.dtype`."""
    api_key: str | None = Field(default=None, exclude=True, repr=False)
    """Bearer token of the inference servers; null = $AGENTRL_API_KEY, else a random key per run for the servers it launches (never logged or written)."""
    vllm_python: str | None = None
    """Python interpreter that has vLLM; None = $AGENTRL_VLLM_PYTHON or `.venv-vllm/bin/python`."""
    vllm_extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for the vLLM server."""
    health_check_interval_s: float = Field(default=10.0, gt=0)
    """Seconds between health checks of each server."""
    max_server_restarts: int = Field(default=3, ge=0)
    """Restarts of each server this run (or `agentrl serve`) launched, once it dies; it rejoins at the current weight version (0 = never; the run goes on without it)."""
    wait_for_server_s: float = Field(default=60.0, ge=0)
    """How long a request waits for a live server when every server is down (restarting, its node lost) before it fails; 0 = fail at once."""
