"""What one server is: :class:`ServerSpec`, plain data that pickles (it crosses Ray).

Why it exists: the trainer's policy servers, the model rewards' servers (reward models, judges)
and the Ray server actors used to build their launch arguments each in their own copy, and the
copies drifted (the Ray copy started vLLM without ``--enable-lora``). Now each of them describes
its server as a ``ServerSpec`` (:func:`agentrl.serving.spec_for` builds it from the run's
config) and :func:`agentrl.serving.launch` is the only code that turns a spec into a command
line.

Example::

    spec = ServerSpec(backend="embedded", model=Path("models/tiny"), device="cpu",
                      dtype="float32", max_batch_size=8)
    with launch(spec) as handle:
        print(handle.base_url)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agentrl.threads import ProcessThreads

__all__ = ["BACKENDS", "ROLES", "Backend", "Role", "ServerSpec"]

Backend = Literal["embedded", "vllm"]
"""Servers this project starts (``external`` servers are URLs: nothing to launch)."""
Role = Literal["policy", "reward_model", "judge", "teacher"]
"""What the server is for: the policy being trained, a reward model (scores), an LLM judge, a
distillation teacher (its logprobs of given tokens)."""
BACKENDS: tuple[str, ...] = ("embedded", "vllm")
ROLES: tuple[str, ...] = ("policy", "reward_model", "judge", "teacher")


@dataclass(frozen=True)
class ServerSpec:
    """One server to launch: everything that decides its command line and environment.

    A spec holds no process and no connection; :func:`agentrl.serving.launch` starts it.
    """

    backend: Backend
    """``embedded`` (``agentrl serve-model``) or ``vllm`` (vLLM's OpenAI server)."""
    model: Path
    """The Hugging Face model directory served."""
    role: Role = "policy"
    """``policy``, ``reward_model`` (embedded ``--task score``; vLLM ``--runner pooling``),
    ``judge`` (embedded ``--task generate``) or ``teacher`` (embedded ``--task logprobs``; vLLM
    serves it as a generator and is asked for ``prompt_logprobs``)."""
    device: str | None = None
    """Embedded: the torch device (``cpu``, ``cuda``); None = the server's default (cpu).
    vLLM places itself."""
    dtype: str | None = None
    """Weight dtype; None = the embedded server's default (float32), the checkpoint's own dtype
    for vLLM."""
    seed: int = 0
    """Seed for requests that carry none."""
    max_batch_size: int | None = None
    """Most requests decoded together (embedded ``--max-batch-size``, vLLM ``--max-num-seqs``);
    None = the server's default."""
    prefix_cache_mb: float | None = None
    """MiB of KV kept for prompt prefixes (embedded ``--prefix-cache-mb``; vLLM: 0 turns its
    prefix caching off, ``--no-enable-prefix-caching``); None = the server's default."""
    lora: bool = False
    """vLLM: serve LoRA adapters (``--enable-lora``, runtime adapter loading); the embedded
    server merges pushed adapters and needs no flag."""
    max_lora_rank: int = 8
    """vLLM ``--max-lora-rank`` when ``lora`` is on."""
    trust_remote_code: bool = False
    """vLLM ``--trust-remote-code``."""
    threads: ProcessThreads | None = None
    """The server's share of the run's CPU-thread plan (its environment); None = the server
    sizes itself."""
    max_model_len: int | None = None
    """Context limit (prompt + output); None = the model's."""
    startup_timeout_s: float = 300.0
    """How long the server may take to answer ``/health``."""
    log_path: Path | None = None
    """Where the server's output goes; None = a temporary file."""
    host: str = "127.0.0.1"
    """Bind address."""
    python: str | None = None
    """vLLM's interpreter (``inference.vllm_python``); None = found as the launcher documents."""
    extra_args: tuple[str, ...] = ()
    """Appended to the command line last (``inference.vllm_extra_args`` and the like)."""
    env: Mapping[str, str] | None = None
    """Added to the server's environment."""
    api_key: str | None = field(default=None, repr=False)
    """The bearer token clients must send (handed over in the environment; never logged)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"inference.backend={self.backend!r} cannot be launched; use 'embedded' or "
                "'vllm' (an 'external' server is given by its URLs)"
            )
        if self.role not in ROLES:
            raise ValueError(f"ServerSpec.role={self.role!r}; use one of {', '.join(ROLES)}")
