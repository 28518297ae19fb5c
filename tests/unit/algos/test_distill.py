"""On-policy distillation math (agentrl.algos.distill) against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from agentrl.algos.distill import add_teacher_advantage, teacher_reverse_kl


def test_reverse_kl_is_student_minus_teacher_on_sampled_tokens_only():
    student = torch.tensor([[-0.5, -1.0, 0.0, -2.0]])
    teacher = torch.tensor([[-1.5, -0.25, -9.0, -2.0]])
    mask = torch.tensor([[1, 1, 0, 1]])  # position 2 is a tool token
    rkl, m = teacher_reverse_kl(student, teacher, mask)
    # (-0.5 - -1.5) = 1.0, (-1.0 - -0.25) = -0.75, tool token 0, (-2 - -2) = 0
    assert rkl.tolist() == [[1.0, -0.75, 0.0, 0.0]]
    assert m["teacher/reverse_kl_mean"] == pytest.approx((1.0 - 0.75 + 0.0) / 3)


def test_teacher_advantage_adds_minus_coef_times_reverse_kl():
    adv = torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]])
    student = torch.tensor([[-0.5, -1.0, -0.1], [-2.0, -0.2, 0.0]])
    teacher = torch.tensor([[-1.5, -0.25, -0.1], [-1.0, -3.2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out, m = add_teacher_advantage(adv, student, teacher, mask, coef=0.5)
    # row 0: 0.5 - 0.5*1.0 = 0.0; 0.5 - 0.5*(-0.75) = 0.875; 0.5 - 0 = 0.5
    # row 1: -1 - 0.5*(-1.0) = -0.5; -1 - 0.5*(3.0) = -2.5; padding untouched: 0.0
    assert out.flatten().tolist() == pytest.approx([0.0, 0.875, 0.5, -0.5, -2.5, 0.0])
    assert m["teacher/reverse_kl_mean"] == pytest.approx((1.0 - 0.75 + 0.0 - 1.0 + 3.0) / 5)
    assert torch.equal(add_teacher_advantage(adv, student, teacher, mask, coef=0.0)[0], adv)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        teacher_reverse_kl(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
