"""The ``teacher`` section: on-policy distillation from a teacher model served beside the policy.

Why it exists: a teacher's logprobs on the student's own samples are a dense, per-token signal
(prime-rl, Thinking Machines' on-policy distillation, verl, slime). The teacher is served like a
reward model (embedded or vLLM, its own servers); each finished episode's sampled tokens are
scored by it, and the reverse KL ``logp_student - logp_teacher`` enters the advantages (mode
``advantage``) or the reward (mode ``reward``). ``path: null`` (the default) turns it off.

Guarantees: a vLLM teacher only with temperature 1 (its prompt logprobs are raw); the path and
the tokenizer are checked before any server starts (:func:`agentrl.rollout.teacher.check_teacher`).
With ``agent.history: per_turn`` each turn is scored as the server saw it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agentrl.config.section import Section

__all__ = ["TeacherConfig"]


class TeacherConfig(Section):
    """On-policy distillation: a teacher scores the student's sampled tokens (docs/training.md)."""

    path: str | None = None
    """Local Hugging Face causal-LM directory of the teacher (relative to the config file); it must share the policy's tokenizer. null = no teacher."""
    backend: Literal["embedded", "vllm"] = "embedded"
    """`embedded` (our server, `--task logprobs`: the scoring route) or `vllm` (`/v1/completions` with `prompt_logprobs`), launched by the run."""
    num_servers: int = Field(default=1, ge=1)
    """Teacher servers the run starts, beside the policy servers."""
    max_concurrency: int = Field(default=8, ge=1)
    """Most scoring requests to the teacher in flight at once (across its servers)."""
    timeout_s: float = Field(default=120.0, gt=0)
    """HTTP deadline of one scoring request; past it (on every server) the episode is a counted drop."""
    mode: Literal["advantage", "reward"] = "advantage"
    """`advantage`: A_t += -coef * (logp_student_t - logp_teacher_t) on every sampled token; `reward`: the episode reward gets -coef * the sum of that reverse KL over its sampled tokens."""
    coef: float = Field(default=1.0, ge=0.0)
    """Weight of the reverse-KL term (0 = score and log it, but do not train on it)."""
    vllm_extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for the teacher's vLLM servers."""

    @property
    def enabled(self) -> bool:
        """A teacher is configured (``path`` is set)."""
        return self.path is not None
