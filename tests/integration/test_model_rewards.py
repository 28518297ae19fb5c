"""Model rewards end to end: the run's builder starts a reward model and two judges (one that
answers a score, one that answers garbage) as real embedded servers beside the policy server;
episodes are scored over HTTP the moment they end, mixed with a function reward; the garbage
judge's episodes are counted drops, never zeros, and the run goes on. vLLM's pooling runner
serves the same reward model with the same scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from agentrl.config import load_config
from agentrl.types import Task, Trajectory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reward_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from agentrl.inference.tiny_model import build_scripted_model, build_tiny_reward_model

    tmp = tmp_path_factory.mktemp("reward_models")
    return {
        "rm": build_tiny_reward_model(tmp / "tiny-rm", seed=0),
        "judge": build_scripted_model(tmp / "judge-7", "\\boxed{7}"),
    }


def _config(tmp_path: Path, tiny_model_dir: Path, dirs: dict[str, Path]) -> Any:
    overlay = {
        "reward": {
            "models": {
                "rm": {"type": "reward_model", "path": str(dirs["rm"]), "max_concurrency": 4},
                "judge": {"type": "judge", "path": str(dirs["judge"]), "max_tokens": 16},
                # The random tiny LM as a judge: its replies hold no score.
                "garbage": {"type": "judge", "path": str(tiny_model_dir), "max_tokens": 8},
            },
            "sources": {
                "calculator": {"terms": {"calculator": 1.0, "rm": 0.5, "judge": 2.0}},
                "essay": {"terms": ["exact_match", "garbage"]},
            },
        }
    }
    path = tmp_path / "overlay.yaml"
    base = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    base["reward"].update(overlay["reward"])
    path.write_text(yaml.safe_dump(base))
    return load_config(
        path,
        [
            f"model.path={tiny_model_dir}",
            f"trainer.output_dir={tmp_path / 'run'}",
            "inference.num_servers=1",
            "inference.max_tokens_per_turn=8",
            "agent.max_turns=1",
            "tracking.enabled=false",
        ],
    )


def _hf_rm_logit(rm_dir: Path, messages: list[dict]) -> float:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    with torch.no_grad():
        return float(model(torch.tensor([ids])).logits[0, 0])


def _traj(answer: str) -> Trajectory:
    return Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3],
        loss_mask=[1],
        rollout_logprobs=[-0.1],
        policy_version=[0],
        uid="hand",
        num_turns=1,
        messages=[
            {"role": "user", "content": "What is 6 * 7?"},
            {"role": "assistant", "content": answer},
        ],
    )


async def test_reward_model_and_judges_served_beside_the_policy_score_as_episodes_end(
    tmp_path: Path, tiny_model_dir: Path, reward_dirs: dict[str, Path]
) -> None:
    from agentrl.rollout.rewards import RewardError
    from agentrl.training.build import build_serving

    cfg = _config(tmp_path, tiny_model_dir, reward_dirs)
    async with build_serving(cfg) as serving:
        plan = serving.threads
        assert [s.role for s in plan.reward_servers] == ["reward0", "reward1", "reward2"]
        rewards = serving.rewards
        rm_url = rewards.models["rm"].servers.urls[0]
        async with httpx.AsyncClient() as client:  # the run's key guards the reward servers too
            refused = await client.post(rm_url + "/pooling", json={"input": [1, 2]})
            assert refused.status_code == 401

        # A hand-made correct episode: every term is real (function, RM logit, judge's 7/10).
        traj = _traj("\\boxed{42}")
        task = Task(
            id="q",
            prompt="What is 6 * 7?",
            data_source="calculator",
            reward_spec={"ground_truth": "42"},
        )
        scored = await rewards.score(traj, task)
        rm_logit = _hf_rm_logit(reward_dirs["rm"], traj.messages)
        assert scored.reward_info["terms"]["rm"] == pytest.approx(rm_logit, abs=1e-4)
        assert scored.reward_info["judge"]["judge_score"] == 7.0
        assert scored.reward == pytest.approx(1.0 + 0.5 * rm_logit + 2.0 * 0.7, abs=1e-4)
        with pytest.raises(RewardError, match=r"garbage.*replied with no score"):
            await rewards.score(traj, task.model_copy(update={"data_source": "essay"}))

        # Real episodes from the policy server, streamed: scored as each ends; the garbage
        # judge's episodes are counted drops and the stream goes on.
        tasks = [
            Task(
                id=f"c{i}",
                prompt=f"What is {i} + 1?",
                data_source="calculator",
                reward_spec={"ground_truth": str(i + 1)},
            )
            for i in range(3)
        ] + [
            Task(
                id="e0",
                prompt="Write an essay.",
                data_source="essay",
                reward_spec={"ground_truth": "x"},
            )
        ]
        manager = serving.make_manager()
        got = [t async for t in manager.stream(tasks, n_samples=2)]
    assert sorted(t.task_id for t in got) == ["c0", "c0", "c1", "c1", "c2", "c2"]
    for t in got:
        assert t.reward_info["judge"]["judge_score"] == 7.0
        assert set(t.reward_info["terms"]) == {"calculator", "rm", "judge"}
        expected = sum(
            w * t.reward_info["terms"][n]
            for n, w in [("calculator", 1.0), ("rm", 0.5), ("judge", 2.0)]
        )
        assert t.reward == pytest.approx(expected)
        assert "reward" in t.timings
    m = rewards.metrics()
    assert m["reward/calculator/scored"] == 7.0  # 6 episodes + the hand-made one
    assert m["reward/essay/errors"] == 3.0 and m["reward/essay/scored"] == 0.0
    assert m["reward/models/garbage/unparsed"] == 3.0
    assert m["reward/models/rm/scored"] == 7.0 and m["reward/models/judge/scored"] == 7.0
    assert manager.stats()["rollout/reward_errors"] == 2.0


@pytest.mark.vllm
async def test_vllm_pooling_runner_serves_the_reward_model_with_the_same_scores(
    reward_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from agentrl.inference.vllm_backend import launch_vllm_server
    from agentrl.rollout.rewards import RewardManager
    from tests.integration.conftest import vllm_python_or_fail

    python = vllm_python_or_fail()
    handle = launch_vllm_server(
        reward_dirs["rm"],
        python=python,
        log_path=tmp_path / "vllm-rm.log",
        dtype="float32",
        max_model_len=1024,
        extra_args=["--runner", "pooling"],
        startup_timeout_s=900,
    )
    try:
        spec = {"type": "reward_model", "backend": "external", "urls": [handle.base_url]}
        manager = RewardManager(sources={"x": "rm"}, models={"rm": spec})
        manager.connect_models({"rm": [handle.base_url]})
        traj = _traj("\\boxed{42}")
        scored = await manager.score(traj, Task(id="q", prompt="q", data_source="x"))
        assert scored.reward == pytest.approx(
            _hf_rm_logit(reward_dirs["rm"], traj.messages), abs=1e-4
        )
        tokens = RewardManager(sources={"x": "rm"}, models={"rm": {**spec, "input": "tokens"}})
        tokens.connect_models({"rm": [handle.base_url]})
        by_ids = await tokens.score(traj, Task(id="q", prompt="q", data_source="x"))
        assert by_ids.reward_info["logits"] == pytest.approx(
            [_hf_logit_ids(reward_dirs["rm"], [1, 2, 3])], abs=1e-4
        )
        await manager.aclose()
        await tokens.aclose()
    finally:
        handle.stop()


def _hf_logit_ids(rm_dir: Path, ids: list[int]) -> float:
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    with torch.no_grad():
        return float(model(torch.tensor([ids])).logits[0, 0])
