"""1 for the right \\boxed{} answer, else 0."""

from __future__ import annotations

from agentrl.rollout.rewards import extract_answer, final_answer_text


def score(traj, task) -> dict:
    answer = extract_answer(final_answer_text(traj))
    correct = answer is not None and answer.strip() == task.reward_spec["ground_truth"]
    return {"score": float(correct), "correct": correct, "answer": answer}
