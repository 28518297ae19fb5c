"""verifiers (0.4) environments through the adapter (agentrl.rollout.verifiers_env): tasks from
the taskset, episodes run by verifiers' own Env against a scripted policy behind the recording
proxy, the rubric as reward; token-exact against the policy's request log; config mistakes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers.v1", reason="the verifiers extra (make setup installs it)")

from agentrl.config.verifiers import VerifiersConfig
from agentrl.rollout.verifiers_env import (
    VerifiersAgent,
    VerifiersError,
    generate_verifiers_tasks,
    verifiers_reward,
)
from agentrl.types import Generation
from agents import AgentContext

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ENVS = Path(__file__).resolve().parents[1] / "verifiers_envs"


class ScriptedPolicy:
    """Replays replies (text -> byte tokens + EOS) and logs every request and generation."""

    def __init__(self, tok: Any, replies: list[str]):
        self.tok, self.replies, self.log = tok, list(replies), []

    async def generate(self, prompt_ids, sampling, session_id=None) -> Generation:
        ids = self.tok.encode(self.replies.pop(0), add_special_tokens=False)
        ids += [self.tok.convert_tokens_to_ids(self.tok.eos_token)]
        self.log.append((list(prompt_ids), ids))
        return Generation(
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            finish_reason="stop",
            weight_version=1,
        )


@pytest.fixture(scope="module")
def tok():
    from agentrl.inference.tiny_model import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _assert_token_exact(traj, log) -> None:
    """Every request the policy got is the recorded context at that point, and what it
    generated is recorded right after, with mask 1 (the rest mask 0)."""
    full = traj.prompt_ids + traj.response_ids
    mask = [0] * len(traj.prompt_ids) + traj.loss_mask
    sampled = [0] * len(full)
    for prompt, gen in log:
        assert full[: len(prompt)] == prompt
        assert full[len(prompt) : len(prompt) + len(gen)] == gen
        for i in range(len(prompt), len(prompt) + len(gen)):
            sampled[i] = 1
    assert mask == sampled
    assert len(full) == len(log[-1][0]) + len(log[-1][1])


async def test_multi_turn_game_token_exact_and_scored(tok):
    cfg = VerifiersConfig(taskset=str(ENVS / "guess_game.py"), env_args={"guesses": 3})
    tasks = generate_verifiers_tasks(cfg, 2, offset=2)  # targets 3 and 4
    assert [t.extra["verifiers"]["idx"] for t in tasks] == [2, 3]
    assert tasks[0].messages == [{"role": "user", "content": "Guess my number (1-9)."}]
    # target 3: guesses 1 ("higher"), 3 (solved); target 4: 9, 2, 5 (out of guesses)
    for task, replies, solved in [(tasks[0], ["1", "3"], 1.0), (tasks[1], ["9", "2", "5"], 0.0)]:
        policy = ScriptedPolicy(tok, replies)
        ctx = AgentContext(policy=policy, tokenizer=tok)
        traj = await VerifiersAgent().run(task, ctx)
        assert len(policy.log) == len(replies)
        _assert_token_exact(traj, policy.log)
        assert "proxy_extra_segments" not in traj.metrics
        info = verifiers_reward(traj, task)
        assert info["score"] == solved
        assert info["reward/solved"] == solved
        assert info["reward/brevity"] == pytest.approx(1 / len(replies))
        # what the run logs for each reward function (the reward manager keeps info beside score)
        from agentrl.training.metrics import compute_reward_component_metrics

        traj.reward_info = {k: v for k, v in info.items() if k != "score"}
        logged = compute_reward_component_metrics([traj])
        assert logged["reward/guess_game/reward/solved/mean"] == solved
        assert "reward/guess_game/reward/brevity/mean" in logged


async def test_single_turn_taskset(tok):
    cfg = VerifiersConfig(taskset=str(ENVS / "single_qa.py"))
    tasks = generate_verifiers_tasks(cfg, 10)
    assert len(tasks) == 4 and tasks[1].data_source == "single_qa"
    policy = ScriptedPolicy(tok, ["beta"])
    traj = await VerifiersAgent().run(tasks[1], AgentContext(policy=policy, tokenizer=tok))
    _assert_token_exact(traj, policy.log)
    info = verifiers_reward(traj, tasks[1])
    assert info["score"] == 1.0 and info["metric/length"] == 4.0


def test_mistakes_name_the_key():
    with pytest.raises(
        VerifiersError,
        match=r"data.verifiers.taskset: taskset 'no_such_taskset' not found.*Install",
    ):
        generate_verifiers_tasks(VerifiersConfig(taskset="no_such_taskset"), 1)
    bad = VerifiersConfig(taskset=str(ENVS / "guess_game.py"), taskset_args={"sise": 3})
    with pytest.raises(
        VerifiersError, match=r"data.verifiers.taskset_args.sise: Extra inputs are not permitted"
    ):
        generate_verifiers_tasks(bad, 1)
    bad = VerifiersConfig(taskset=str(ENVS / "guess_game.py"), env_args={"guesses": "many"})
    with pytest.raises(
        VerifiersError, match=r"data.verifiers.env_args.guesses: Input should be a valid integer"
    ):
        generate_verifiers_tasks(bad, 1)
    with pytest.raises(VerifiersError, match=r"data.verifiers.taskset is empty"):
        generate_verifiers_tasks(VerifiersConfig(), 1)


async def test_multi_turn_game_on_a_real_server_equals_its_request_log(
    embedded_server, tiny_model_dir
):
    """The game through verifiers' Env, its interception and our proxy against the real
    embedded server: the trajectory is the server's request log, token for token."""
    from agentrl.inference.client import PolicyClient
    from agentrl.inference.tiny_model import tiny_tokenizer
    from agentrl.types import SamplingParams
    from tests.integration.test_agent_loop import RecordingClient, assert_token_exact, requests_of

    tok = tiny_tokenizer(tiny_model_dir)
    cfg = VerifiersConfig(taskset=str(ENVS / "guess_game.py"), env_args={"guesses": 3})
    tasks = generate_verifiers_tasks(cfg, 2)
    turns = 0
    async with PolicyClient(embedded_server.base_url) as client:
        for task in tasks:
            policy = RecordingClient(client)
            sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=1)
            ctx = AgentContext(policy=policy, tokenizer=tok, sampling=sampling)
            traj = await VerifiersAgent().run(task, ctx)
            [(sid, gens)] = policy.generations.items()
            assert sid is not None and len(gens) >= 1
            assert_token_exact(traj, requests_of(embedded_server, sid), gens)
            assert "verifiers/reward/solved" in traj.metrics
            turns += len(gens)
    assert turns > len(tasks)  # the env answered at least once: a multi-turn episode


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.verifiers.taskset=no_such_game", "data.verifiers.taskset: taskset 'no_such_game'"),
        ("data.verifiers.taskset=gmae.py", "data.verifiers.taskset: 'gmae.py' does not exist"),
        ("data.verifiers.taskset_args={sise: 3}", "data.verifiers.taskset_args.sise: Extra"),
        ("data.verifiers.env_args={guesses: many}", "data.verifiers.env_args.guesses: Input"),
    ],
    ids=["module", "file", "taskset_args", "env_args"],
)
def test_agentrl_train_mistakes_fail_before_any_server_starts(
    override: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentrl.cli import main

    config = _project(tmp_path) / "config.yaml"
    out = tmp_path / "run"
    rc = main(["train", str(config), override, f"trainer.output_dir={out}", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert "\nerror: " in "\n" + err and expected in err, err
    assert not (out / "logs").exists(), "a server was started"


def _project(tmp_path: Path) -> Path:
    """The verifiers project (tests/integration/verifiers_project) in ``tmp_path``, its
    ``game.py`` the adapter tests' own game (tests/verifiers_envs/guess_game.py)."""
    import shutil

    project = tmp_path / "project"
    shutil.copytree(Path(__file__).resolve().parent / "verifiers_project", project)
    shutil.copyfile(ENVS / "guess_game.py", project / "game.py")
    return project


@pytest.mark.slow
def test_agentrl_train_a_verifiers_game_from_another_cwd(tmp_path: Path) -> None:
    """`agentrl train` on a project whose environment is a verifiers Taskset + multi-turn Env
    (tests/integration/verifiers_project), from another working directory (~45 s)."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    project = _project(tmp_path)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    out = subprocess.run(
        [
            *(sys.executable, "-m", "agentrl", "train", str(project / "config.yaml"), "--quiet"),
            f"trainer.output_dir={tmp_path / 'out'}",
        ],
        cwd=cwd,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        },
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout[out.stdout.index("{") :])
    assert summary["steps"] == 2 and summary["weight_pushes"]["verified"] == 2
    assert summary["failed"] == {"rewards": 0, "agents": 0, "workers": 0}
    assert summary["val_after"]["val/game/num_turns/mean"] == 2.0  # the env answered: 2 turns


async def test_tool_taskset_calls_its_mcp_toolset(tok):
    """The task's Toolset is served by verifiers (an MCP server per rollout); the harness runs
    the policy's tool call on it and the answer reaches the rubric."""
    cfg = VerifiersConfig(taskset=str(ENVS / "tool_calc.py"))
    [task, _] = generate_verifiers_tasks(cfg, 2)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    policy = ScriptedPolicy(tok, [call, "5"])
    traj = await VerifiersAgent().run(task, AgentContext(policy=policy, tokenizer=tok))
    _assert_token_exact(traj, policy.log)
    assert tok.decode(traj.response_ids).count("<tool_response>") == 1
    assert "5" in tok.decode(traj.response_ids[len(policy.log[0][1]) :])
    assert verifiers_reward(traj, task)["score"] == 1.0
