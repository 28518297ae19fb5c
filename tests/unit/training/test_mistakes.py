"""Every obvious mistake fails before any server starts, naming the key, the value and the fix.

Each case runs ``agentrl train examples/units/config.yaml <one bad override>`` through the CLI:
exit status 2, an ``error:`` message (no traceback), and no server ever launched (the run's
``logs/`` folder, where server logs go, is never created).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.cli import main

UNITS = Path(__file__).resolve().parents[3] / "examples" / "units" / "config.yaml"

CASES = [
    # (override, what the message must say)
    (
        "tools.enabled=[convert, notebok]",
        ["tools.enabled: unknown tool 'notebok'", "did you mean 'notebook'?"],
    ),
    (
        "agent.default=unit_agent",
        ["agent.default: unknown agent 'unit_agent'", "did you mean 'units_agent'?"],
    ),
    (
        "algorithm.advantage=grp",
        ["algorithm.advantage.name: unknown advantage estimator 'grp'", "did you mean 'grpo'?"],
    ),
    (
        "agent.tool_call_format=hermez",
        ["agent.tool_call_format: unknown tool-call format 'hermez'", "did you mean 'hermes'?"],
    ),
    (
        "algorithm.loss={name: vanilla, clip_ratio_hihg: 0.3}",
        ["algorithm.loss.clip_ratio_hihg: unknown knob", "did you mean 'clip_ratio_high'?"],
    ),
    (
        "reward.sources={}",
        ["no reward function for data_source 'units'", "add it to reward sources"],
    ),
    (
        "reward.sources.units=reward.py:scroe",
        ["reward.sources.units", "has no attribute 'scroe'", "did you mean 'score'?"],
    ),
    (
        "data.train_files=[data/trian.jsonl]",
        ["data.train_files[0]: 'data/trian.jsonl' does not exist", "relative to the config file"],
    ),
    ("imports=[agnet.py]", ["imports[0]: 'agnet.py' does not exist"]),
    (
        "checkpoint.transport=nccl",
        ["checkpoint.transport", "'nccl' was renamed: write 'collective'"],
    ),
    ("data.max_prompt_tokens=64", ["data.max_prompt_tokens=64", "raise data.max_prompt_tokens"]),
    (
        "algorithm.adv_estimator=grpo",
        ["'algorithm.adv_estimator' moved", "algorithm.advantage: {name: <estimator>}"],
    ),
    (
        "trainer.max_stalenes=2",
        ["unknown key 'trainer.max_stalenes'", "did you mean 'trainer.max_staleness'?"],
    ),
    (
        "agent.kwargs={units_agent: {hint: true}}",
        ["agent.kwargs.units_agent", "takes no arguments"],
    ),
    ("inference.prefix_cache_mb=-64", ["inference.prefix_cache_mb", "-64"]),
]


@pytest.mark.parametrize(("override", "expected"), CASES, ids=[c[0].split("=")[0] for c in CASES])
def test_a_mistake_fails_before_any_server_starts(
    override: str, expected: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc = main(["train", str(UNITS), override, f"trainer.output_dir={out}", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "\nerror: " in "\n" + err and "Traceback" not in err
    for text in expected:
        assert text in err, f"{text!r} not in:\n{err}"
    assert not (out / "logs").exists(), "a server was started"


def test_every_problem_is_reported_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "train",
            str(UNITS),
            "algorithm.advantage=grp",
            "agent.tool_call_format=hermez",
            f"trainer.output_dir={tmp_path}",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "advantage estimator 'grp'" in err and "tool-call format 'hermez'" in err


SECRET = UNITS.parents[1] / "secret_number" / "config.yaml"

BAD_CODE = {
    # file name -> (its code, the overrides that use it, what the message must say)
    "untyped.py": (
        "from agents import Environment\nfrom tools import tool\n\n"
        "class Game(Environment):\n"
        "    @tool\n"
        "    def probe(self, x) -> str:\n"
        "        return str(x)\n",
        ["environment=untyped.py:Game"],
        ["parameter 'x' has no type annotation", "annotate it (e.g. `x: int`"],
    ),
    "env_reward.py": (
        "from agents import Environment\n\n"
        "class Game(Environment):\n"
        "    @staticmethod\n"
        "    def reward(state):\n"
        "        return 1.0\n",
        ["environment=env_reward.py:Game"],
        ["Game.reward(state) must take (state, task)", "@staticmethod def reward(state, task)"],
    ),
    "reward_fn.py": (
        "def score(traj):\n    return 1.0\n",
        ["reward.sources={secret_number: reward_fn.py:score}"],
        ["reward.sources.secret_number", "signature (traj)", "fn(traj, task)"],
    ),
}


def test_an_unknown_environment_fails_before_any_server_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc = main(["train", str(SECRET), "environment=secret_numbr", f"trainer.output_dir={out}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "environment.name: unknown environment 'secret_numbr'" in err
    assert "did you mean 'secret_number'?" in err and "@register_environment" in err
    assert not (out / "logs").exists(), "a server was started"


@pytest.mark.parametrize("name", sorted(BAD_CODE))
def test_bad_environment_code_fails_before_any_server_starts(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, overrides, expected = BAD_CODE[name]
    (tmp_path / name).write_text(code)
    out = tmp_path / "run"
    args = [f"imports=[game.py, {tmp_path / name}]", f"trainer.output_dir={out}"]
    args += [o.replace(f"{name}:", f"{tmp_path / name}:") for o in overrides]
    rc = main(["train", str(SECRET), *args, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    for text in expected:
        assert text in err, f"{text!r} not in:\n{err}"
    assert not (out / "logs").exists(), "a server was started"
