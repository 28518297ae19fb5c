"""The teacher role of on-policy distillation: a teacher model scores each finished episode's
sampled tokens, and the reverse KL to it becomes an advantage or a reward term.

Why it exists: the teacher is served like a reward model (``teacher`` config section; its own
embedded or vLLM servers, started by the run's builder next to the policy servers with the same
serving layer as ``reward.models``: :func:`agentrl.serving.start_teacher_servers`) and is asked, the moment an episode is scored, for its logprob of
every token of the episode (prompt + response, one request):

- embedded (``agentrl serve-model --task logprobs``): ``POST /pooling`` with ``task:
  "logprobs"`` and the sampling temperature (:mod:`agentrl.inference.routes.scoring`);
- vLLM: ``POST /v1/completions`` with ``prompt_logprobs: 0`` and ``max_tokens: 1`` (vLLM
  computes prompt logprobs from the raw logits: temperature 1, which the config enforces).

Only the response's sampled tokens (``loss_mask == 1``) keep their teacher logprob
(:attr:`~agentrl.types.Trajectory.teacher_logprobs`, 0.0 elsewhere). The student's logprobs are
the rollout logprobs: the tokens were sampled from π_rollout, so ``logp_rollout - logp_teacher``
is the one-sample estimate of ``KL(π_rollout || π_teacher)`` at each token, known the moment the
episode ends (mode ``reward`` needs it then) and the same in both modes. Mode ``reward`` subtracts
``coef * sum`` from the episode reward here; mode ``advantage`` leaves the reward alone and the
train step adds the per-token term to the advantages (:mod:`agentrl.algos.distill`).

Guarantees: :func:`check_teacher` fails before any server starts when ``teacher.path`` is not a
model directory or its tokenizer is not the policy's, naming the key, the value and the fix; a
teacher that cannot score an episode (every server failed, a malformed answer) raises
:class:`TeacherError` and the episode is a counted drop (``reward_error``), never trained on
without its term; the teacher pickles (URLs and key, no connections).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.rollout.model_rewards import ModelRewardError, ModelServers
from agentrl.types import Trajectory

__all__ = [
    "Teacher",
    "TeacherError",
    "check_teacher",
    "local_teacher_servers",
    "teacher_path",
]


class TeacherError(RuntimeError):
    """The teacher could not score an episode."""


def teacher_path(cfg: Any) -> Path:
    """``teacher.path`` resolved against the config file's folder; raises ``FileNotFoundError``
    naming the key and the value when it is not a Hugging Face model directory."""
    raw = cfg.teacher.path
    path = Path(raw).expanduser()
    if not path.is_absolute() and cfg.base_dir is not None:
        path = Path(cfg.base_dir) / path
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"teacher.path = {raw!r}: {path} is not a Hugging Face model directory (no "
            "config.json); point it at a local causal-LM folder, relative to the config file, "
            "or set teacher.path: null to train without a teacher"
        )
    return path


def check_teacher(cfg: Any, student_dir: Path) -> None:
    """Fail before any server starts when the teacher cannot score the student's tokens: its
    directory is missing, or its tokenizer's vocabulary is not the policy's (``student_dir``)."""
    from transformers import AutoTokenizer

    path = teacher_path(cfg)
    trust = cfg.model.trust_remote_code
    teacher = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust)
    student = AutoTokenizer.from_pretrained(str(student_dir), trust_remote_code=trust)
    tv, sv = teacher.get_vocab(), student.get_vocab()
    if tv != sv:
        only = sorted(set(tv) - set(sv))[:3] or sorted(set(sv) - set(tv))[:3]
        raise ValueError(
            f"teacher.path = {cfg.teacher.path!r}: its tokenizer differs from the policy's "
            f"({len(tv)} vs {len(sv)} tokens; e.g. {only or 'same tokens, other ids'}); the "
            "teacher scores the student's token ids, so it must share the policy's tokenizer: "
            "pick a teacher of the same model family (same tokenizer files)"
        )


class Teacher:
    """Scores episodes with the teacher's servers (see the module docstring).

    Args:
        backend: ``embedded`` or ``vllm`` (which route to ask).
        mode: ``advantage`` or ``reward``; ``coef``: the term's weight.
        temperature: the sampling temperature the student's rollout logprobs use.
        timeout_s, max_concurrency: per request, and in flight at once.
    """

    def __init__(
        self,
        *,
        backend: str,
        mode: str,
        coef: float,
        temperature: float,
        timeout_s: float,
        max_concurrency: int,
    ) -> None:
        self.backend = backend
        self.mode = mode
        self.coef = coef
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.servers: ModelServers | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> Teacher:
        """The teacher of an experiment config (``teacher`` and ``inference.temperature``)."""
        t = cfg.teacher
        return cls(
            backend=t.backend,
            mode=t.mode,
            coef=t.coef,
            temperature=cfg.inference.temperature or 1.0,
            timeout_s=t.timeout_s,
            max_concurrency=t.max_concurrency,
        )

    def connect(self, urls: Sequence[str], api_key: str | None = None, **kwargs: Any) -> None:
        """Point the teacher at its servers (``transport=`` for in-process tests)."""
        self.servers = ModelServers(
            "teacher",
            urls,
            api_key=api_key,
            timeout_s=self.timeout_s,
            max_concurrency=self.max_concurrency,
            **kwargs,
        )

    async def aclose(self) -> None:
        """Close the HTTP clients."""
        if self.servers is not None:
            await self.servers.aclose()

    async def sequence_logprobs(self, ids: list[int]) -> list[float]:
        """The teacher's logprob of ``ids[1:]``, each given the tokens before it."""
        if self.servers is None:
            raise TeacherError("the teacher is not connected; build the run with build_serving")
        try:
            if self.backend == "embedded":
                payload = {"input": ids, "task": "logprobs", "temperature": self.temperature}
                body = await self.servers.post("/pooling", payload)
                out = [float(v) for v in body["data"][0]["data"]]
            else:
                payload = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
                body = await self.servers.post("/v1/completions", payload)
                rows = body["choices"][0]["prompt_logprobs"][1:]
                out = [float(row[str(t)]["logprob"]) for row, t in zip(rows, ids[1:], strict=True)]
        except ModelRewardError as exc:
            raise TeacherError(f"teacher ({self.backend}): {exc}") from exc
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TeacherError(f"teacher: malformed answer ({type(exc).__name__}: {exc})") from exc
        if len(out) != len(ids) - 1 or not all(math.isfinite(v) for v in out):
            raise TeacherError(f"teacher: {len(out)} logprobs for {len(ids)} tokens, or not finite")
        return out

    async def response_logprobs(
        self, prompt: list[int], response: list[int], mask: list[int]
    ) -> list[float]:
        """The teacher's logprob of each ``response`` token after ``prompt``; 0.0 where
        ``mask`` is 0 (tokens the student did not sample)."""
        full = await self.sequence_logprobs([*prompt, *response])
        return [lp if m else 0.0 for lp, m in zip(full[len(prompt) - 1 :], mask, strict=True)]

    async def apply(self, traj: Trajectory) -> Trajectory:
        """A copy of ``traj`` with ``teacher_logprobs``, ``timings["teacher"]`` and
        ``reward_info["teacher_reverse_kl"]`` (the sum over sampled tokens) set; in mode
        ``reward`` its reward is lowered by ``coef`` times that sum. With ``turn_samples``
        (``agent.history: per_turn``) each turn is scored as the server saw it, and carries its
        own ``teacher_logprobs``."""
        start = time.perf_counter()
        update: dict[str, Any] = {}
        if traj.turn_samples:
            samples = [
                s.model_copy(
                    update={
                        "teacher_logprobs": await self.response_logprobs(
                            s.prompt_ids, s.token_ids, [1] * len(s.token_ids)
                        )
                    }
                )
                for s in traj.turn_samples
            ]
            update["turn_samples"] = samples
            rkl = sum(
                a - b for s in samples for a, b in zip(s.logprobs, s.teacher_logprobs, strict=True)
            )
        else:
            lps = await self.response_logprobs(traj.prompt_ids, traj.response_ids, traj.loss_mask)
            update["teacher_logprobs"] = lps
            pairs = zip(traj.rollout_logprobs, lps, traj.loss_mask, strict=True)
            rkl = sum(a - b for a, b, m in pairs if m)
        update["timings"] = {**traj.timings, "teacher": time.perf_counter() - start}
        update["reward_info"] = {**traj.reward_info, "teacher_reverse_kl": rkl}
        if self.mode == "reward":
            update["reward"] = traj.reward - self.coef * rkl
        return traj.model_copy(update=update)


# ---- servers -----------------------------------------------------------------------------------
def local_teacher_servers(cfg: Any) -> int:
    """How many embedded teacher servers ``cfg`` starts on this machine (thread plan)."""
    t = cfg.teacher
    return t.num_servers if t.enabled and t.backend == "embedded" else 0
