"""Partial credit: 1 within 0.1 %, 0.5 within 5 %, 0.1 for a well-formed answer, else 0."""

from __future__ import annotations

from agentrl.rollout.rewards import extract_answer, final_answer_text, parse_number


def score(traj, task) -> dict:
    answer = extract_answer(final_answer_text(traj))
    value = parse_number(answer) if answer is not None else None
    truth = float(task.reward_spec["ground_truth"])
    if value is None:
        return {"score": 0.0, "correct": False, "answer": answer}
    error = abs(float(value) - truth) / max(abs(truth), 1e-9)
    credit = 1.0 if error <= 1e-3 else 0.5 if error <= 0.05 else 0.1
    return {"score": credit, "correct": credit == 1.0, "answer": answer}
