"""On-policy distillation: the per-token reverse KL to a teacher, as an advantage or a reward.

Why it exists: a teacher's logprobs on the student's own samples give a dense signal per token
(Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes"; Thinking Machines, "On-Policy Distillation", 2025; prime-rl and verl do the same).
With ``x_t`` sampled from the student, ``logp_student_t - logp_teacher_t`` is a one-sample
estimate of the reverse KL ``KL(student || teacher)`` at position ``t``; minimizing it with the
policy gradient means adding its negative to the advantage of that token::

    A_t  +=  -coef * (logp_student_t - logp_teacher_t)          (mode ``advantage``)
    R    +=  -coef * sum_t (logp_student_t - logp_teacher_t)    (mode ``reward``)

Only sampled tokens (``mask == 1``) count; tool and template tokens carry 0. Pure functions of
tensors (shapes ``[B, T]``), returning ``(result, metrics)``.
"""

from __future__ import annotations

import torch

__all__ = ["add_teacher_advantage", "teacher_reverse_kl"]


def teacher_reverse_kl(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token reverse KL estimate ``(logp_student - logp_teacher) * mask``: ``[B, T]``.

    Metrics: ``teacher/reverse_kl_mean`` (mean over sampled tokens; 0 with none).
    """
    if student_log_probs.shape != teacher_log_probs.shape or mask.shape != student_log_probs.shape:
        raise ValueError(
            f"student {tuple(student_log_probs.shape)}, teacher "
            f"{tuple(teacher_log_probs.shape)} and mask {tuple(mask.shape)} must be one [B, T] shape"
        )
    m = mask.to(student_log_probs.dtype)
    rkl = (student_log_probs - teacher_log_probs) * m
    mean = float(rkl.sum() / m.sum().clamp(min=1))
    return rkl, {"teacher/reverse_kl_mean": mean}


def add_teacher_advantage(
    advantages: torch.Tensor,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``advantages - coef * reverse_kl`` on sampled tokens (``[B, T]`` each); a new tensor.

    ``coef`` 0 leaves the advantages as they are (the metric is still computed).
    """
    rkl, metrics = teacher_reverse_kl(student_log_probs, teacher_log_probs, mask)
    return advantages - coef * rkl, metrics
