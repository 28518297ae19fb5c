"""On-policy distillation through ``agentrl train`` (issue 25): a teacher served by the run
(embedded, ``--task logprobs``) scores the student's samples; its reverse KL reaches the
advantages and the logs. And the mistakes: a teacher path that is not a model, or a teacher
whose tokenizer is not the student's, fail before any server starts, naming the key, the value
and the fix.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_multiturn_train import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

AGENTRL = Path(sys.executable).parent / "agentrl"


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with the student's tokenizer but other weights (seed 7), 3 layers."""
    from agentrl.inference.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "t", seed=7, num_layers=3)


def test_teacher_reverse_kl_reaches_the_advantages_through_agentrl_train(
    tmp_path: Path, other_teacher: Path
) -> None:
    metrics = train(
        tmp_path / "run",
        f"teacher.path={other_teacher}",
        "teacher.mode=advantage",
        "teacher.coef=0.5",
        "inference.max_tokens_per_turn=16",
        "data.generator_val_size=4",  # validation runs without the teacher (measured, not taught)
    )
    rkl, seconds = metrics["teacher/reverse_kl_mean"], metrics["teacher/score_seconds"]
    assert len(rkl) == 2 and len(seconds) == 2
    # the student is another random model: it disagrees with the teacher on its own samples
    assert all(math.isfinite(x) and x > 0.1 for x in rkl)
    assert all(s > 0 for s in seconds)
    assert (tmp_path / "run" / "logs" / "teacher-0.log").exists()


def _refused(tmp_path: Path, teacher: str) -> str:
    out = tmp_path / "run"
    done = subprocess.run(
        [
            str(AGENTRL),
            "train",
            "configs/quickstart.yaml",
            f"trainer.output_dir={out}",
            f"teacher.path={teacher}",
            "tracking.enabled=false",
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert not (out / "logs").exists() or not any((out / "logs").glob("*.log*"))  # no server
    return done.stderr


def test_a_teacher_path_that_is_not_a_model_is_a_resolution_error(tmp_path: Path) -> None:
    from agentrl.config import load_config
    from agentrl.training.resolve import ResolutionError, resolve_experiment

    cfg = load_config(
        Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml",
        [f"trainer.output_dir={tmp_path}", f"teacher.path={tmp_path / 'nowhere'}"],
    )
    with pytest.raises(ResolutionError) as info:
        resolve_experiment(cfg)
    err = str(info.value)
    assert "teacher.path" in err and "nowhere" in err and "config.json" in err
    assert "teacher.path: null" in err  # the fix


def test_a_teacher_with_another_tokenizer_fails_before_any_server_starts(tmp_path: Path) -> None:
    from agentrl.inference.tiny_model import build_tiny_model, learn_bpe_merges

    merges = learn_bpe_merges(["the teacher speaks another tokenizer " * 20], 8)
    other = build_tiny_model(tmp_path / "bpe", merges=merges)
    err = _refused(tmp_path / "b", str(other))
    assert "teacher.path" in err and str(other) in err
    assert "tokenizer differs from the policy's" in err and "same tokenizer" in err


async def test_a_vllm_teacher_gives_the_logprobs_of_a_lone_forward(
    vllm_server, tiny_model_dir: Path
) -> None:
    """The vLLM route (/v1/completions with prompt_logprobs) of the same Teacher client: the
    teacher's logprob of each token equals transformers' at temperature 1."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.rollout.teacher import Teacher

    ids = [5, 9, 200, 17, 3, 88, 41]
    teacher = Teacher(
        backend="vllm", mode="advantage", coef=1.0, temperature=1.0, timeout_s=60, max_concurrency=2
    )
    teacher.connect([vllm_server.base_url], getattr(vllm_server, "api_key", None))
    try:
        got = await teacher.sequence_logprobs(ids)
    finally:
        await teacher.aclose()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert got == pytest.approx(want.tolist(), abs=1e-3)
