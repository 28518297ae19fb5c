"""The teacher role: the embedded server's logprobs task equals a lone transformers forward at
the sampling temperature, and a Teacher scores an episode's sampled tokens only, adding its
reverse KL to the reward in mode ``reward`` (hand-computed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from agentrl.inference.scoring import ScoringEngine
from agentrl.inference.server import create_app
from agentrl.rollout.teacher import Teacher, TeacherError
from agentrl.types import Trajectory


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentrl.inference.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "t", seed=3)


def _reference(model_dir: Path, ids: list[int], temperature: float) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


async def test_logprobs_route_equals_a_lone_forward(teacher_dir: Path):
    engine = ScoringEngine(teacher_dir, task="logprobs", max_batch_size=4)
    try:
        transport = httpx.ASGITransport(create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            seqs = [[5, 9, 200, 17, 3], [40, 41]]
            body = {"input": seqs, "task": "logprobs", "temperature": 0.7}
            r = await client.post("/pooling", json=body)
            assert r.status_code == 200, r.text
            for s, row in zip(seqs, r.json()["data"], strict=True):
                assert row["data"] == pytest.approx(_reference(teacher_dir, s, 0.7), abs=1e-5)
            bad = await client.post("/pooling", json={"input": [1, 2], "task": "classify"})
            assert bad.status_code == 400 and "logprobs" in bad.json()["error"]["message"]
    finally:
        engine.close()


def _traj(prompt: list[int], response: list[int], mask: list[int], lps: list[float]) -> Trajectory:
    return Trajectory(
        prompt_ids=prompt,
        response_ids=response,
        loss_mask=mask,
        rollout_logprobs=lps,
        policy_version=[0 if m else -1 for m in mask],
        uid="u",
        reward=1.0,
    )


def _scripted(logprobs: list[float], seen: list[Any]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        import json

        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"data": [{"index": 0, "data": logprobs}]})

    return httpx.MockTransport(handler)


async def test_reward_mode_subtracts_coef_times_the_sum_over_sampled_tokens():
    seen: list[Any] = []
    # prompt [1, 2], response [3, 4, 5]: the server gives logprobs of tokens 2, 3, 4, 5
    teacher = Teacher(
        backend="embedded", mode="reward", coef=0.5, temperature=0.7, timeout_s=5, max_concurrency=2
    )
    teacher.connect(["http://t"], transport=_scripted([-9.0, -1.0, -8.0, -0.5], seen))
    traj = _traj([1, 2], [3, 4, 5], [1, 0, 1], [-2.0, 0.0, -0.25])
    out = await teacher.apply(traj)
    assert seen[0] == {"input": [1, 2, 3, 4, 5], "task": "logprobs", "temperature": 0.7}
    assert out.teacher_logprobs == [-1.0, 0.0, -0.5]  # the tool token (mask 0) gets 0.0
    rkl = (-2.0 - -1.0) + (-0.25 - -0.5)  # -1.0 + 0.25 = -0.75
    assert out.reward_info["teacher_reverse_kl"] == pytest.approx(rkl)
    assert out.reward == pytest.approx(1.0 - 0.5 * rkl)
    assert out.timings["teacher"] >= 0.0


async def test_advantage_mode_keeps_the_reward_and_a_bad_answer_raises():
    teacher = Teacher(
        backend="embedded",
        mode="advantage",
        coef=1.0,
        temperature=1,
        timeout_s=5,
        max_concurrency=2,
    )
    teacher.connect(["http://t"], transport=_scripted([-1.0, -1.0, -1.0, -1.0], []))
    out = await teacher.apply(_traj([1, 2], [3, 4, 5], [1, 1, 1], [-2.0, -0.1, -0.25]))
    assert out.reward == 1.0 and out.teacher_logprobs == [-1.0, -1.0, -1.0]
    teacher.connect(["http://t"], transport=_scripted([-1.0], []))  # too few logprobs
    with pytest.raises(TeacherError, match="1 logprobs for 5 tokens"):
        await teacher.apply(_traj([1, 2], [3, 4, 5], [1, 1, 1], [-2.0, -0.1, -0.25]))


async def test_vllm_prompt_logprobs_are_read_per_token():
    def handler(request: httpx.Request) -> httpx.Response:
        rows = [None, {"2": {"logprob": -0.1}}, {"3": {"logprob": -0.2}, "9": {"logprob": -0.01}}]
        return httpx.Response(200, json={"choices": [{"prompt_logprobs": rows}]})

    teacher = Teacher(
        backend="vllm", mode="advantage", coef=1.0, temperature=1, timeout_s=5, max_concurrency=1
    )
    teacher.connect(["http://v"], transport=httpx.MockTransport(handler))
    assert await teacher.sequence_logprobs([1, 2, 3]) == [-0.1, -0.2]


def test_a_connected_teacher_pickles_without_its_connections():
    import pickle

    teacher = Teacher(
        backend="embedded", mode="reward", coef=0.5, temperature=1, timeout_s=5, max_concurrency=2
    )
    teacher.connect(["http://t"], "key", transport=_scripted([], []))
    back = pickle.loads(pickle.dumps(teacher))
    assert back.servers is not None and back.servers.urls == ["http://t"]
    assert back.servers.api_key == "key" and back.servers.transport is None
    assert (back.mode, back.coef) == ("reward", 0.5)


async def test_per_turn_samples_are_scored_each_as_the_server_saw_it():
    from agentrl.types import TurnSample

    seen: list[Any] = []
    teacher = Teacher(
        backend="embedded", mode="reward", coef=1.0, temperature=1, timeout_s=5, max_concurrency=2
    )

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        ids = json.loads(request.content)["input"]
        seen.append(ids)
        return httpx.Response(200, json={"data": [{"data": [-1.0] * (len(ids) - 1)}]})

    teacher.connect(["http://t"], transport=httpx.MockTransport(handler))
    turns = [
        TurnSample(prompt_ids=[1, 2], token_ids=[3, 4], logprobs=[-0.5, -2.0], versions=[0, 0]),
        TurnSample(prompt_ids=[1, 2, 3, 9], token_ids=[5], logprobs=[-0.25], versions=[1]),
    ]
    traj = _traj([1, 2], [3, 4, 7, 5], [1, 1, 0, 1], [-0.5, -2.0, 0.0, -0.25])
    out = await teacher.apply(traj.model_copy(update={"turn_samples": turns}))
    assert seen == [[1, 2, 3, 4], [1, 2, 3, 9, 5]]  # each turn's own (re-rendered) prompt
    assert [s.teacher_logprobs for s in out.turn_samples] == [[-1.0, -1.0], [-1.0]]
    rkl = (-0.5 + 1.0) + (-2.0 + 1.0) + (-0.25 + 1.0)  # 0.25
    assert out.reward_info["teacher_reverse_kl"] == pytest.approx(rkl)
    assert out.reward == pytest.approx(1.0 - rkl)
    rows = out.per_turn_samples()  # the rows the trainer trains carry them
    assert [r.teacher_logprobs for r in rows] == [[-1.0, -1.0], [-1.0]]
