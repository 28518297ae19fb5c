"""Every metric key that docs/tracking.md names is logged by a real run (issue 22).

The test reads every backticked metric key of docs/tracking.md (``response_length/{mean,max,min}``,
``timing_s/{phase}``, ``val/<data_source>/<var>/mean_at_N``, a family such as ``weight_sync/``),
runs the tiny model for two steps through :class:`Trainer` (an embedded server, a reward that
fails on every fourth task, micro-batches small enough for the gradient-noise probe, validation
with two samples per task) and checks that the run's metric history has a key for each.
A key that only a particular configuration logs is listed in :data:`CONDITIONAL` with that
condition; none is skipped silently. Every logged key must also be stored by MLflow unchanged.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from agentrl.config import ExperimentConfig, load_config
from agentrl.tracking import sanitize_key
from agentrl.training.trainer import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "tracking.md"

FAMILIES = [
    "actor",
    "async",
    "agent_loop",
    "critic",
    "grad_noise",
    "num_turns",
    "perf",
    "prompt_length",
    "response",
    "response_length",
    "response_length_non_aborted",
    "reward",
    "rollout",
    "rollout_corr",
    "timing_per_token_ms",
    "timing_s",
    "tool_call_counts",
    "teacher",
    "tools",
    "trainer",
    "val",
    "variance_proxy",
    "weight_sync",
    "servers",
    "model",
    "colocate",
]
"""First segments of metric keys (everything else in backticks is a path, a formula, prose)."""

CONDITIONAL = {
    "critic/values/mean": "a critic: algorithm.advantage gae",
    "critic/values/max": "a critic: algorithm.advantage gae",
    "critic/values/min": "a critic: algorithm.advantage gae",
    "critic/values/*": "a critic: algorithm.advantage gae",
    "critic/vf_explained_var": "a critic: algorithm.advantage gae",
    "actor/reward_kl_penalty": "KL in the reward: algorithm.use_kl_in_reward",
    "actor/old_log_prob_fused": "pi_old from the update's own forward (ppo_epochs 1, one mini-batch)",
    "variance_proxy/*": "never: the page says why verl's key is not logged",
    "reward/<source>/<component>/mean": "a reward returning numbers beside score (test_environment.py)",
    "reward/secret_number/probes/mean": "examples/secret_number (test_environment_example.py)",
    "reward/<source>/terms/<term>/mean": "a reward mix (tests/unit/agents/test_environment.py)",
    "teacher/reverse_kl_mean": "a distillation teacher: teacher.path (test_distill.py)",
    "teacher/score_seconds": "a distillation teacher: teacher.path (test_distill.py)",
    **{
        f"colocate/{k}": "distributed.colocate: true (tests/integration/test_colocate.py)"
        for k in (
            "sleep_level",
            "slept_servers",
            "woken_servers",
            "sleep_s",
            "wake_s",
            "freed_bytes",
            "server_rss_asleep_bytes",
            "trainer_rss_bytes",
        )
    },
    **{
        f"grad_noise/{k}": "trainer.log_grad_noise: true (tests/unit/training/test_actor.py)"
        for k in (
            "",
            "grad_sq_norm",
            "micro_grad_norm/mean",
            "micro_grad_norm/std",
            "noise_scale",
            "trace_cov",
        )
    },
}
"""Documented keys that this run's configuration cannot log, and the configuration that does."""

PLUGIN = '''
from agentrl.rollout.rewards.rules import calculator_reward


def flaky(traj, task):
    """The calculator reward, raising for every fourth task."""
    if int(task.id.rsplit("-", 1)[1]) % 4 == 0:
        raise ValueError(f"no reference answer for {task.id}")
    return calculator_reward(traj, task)
'''


def _doc_keys() -> list[str]:
    """Every backticked metric key (or key family ending in ``/``) of docs/tracking.md; keys of
    the per-source validation table get their ``val/<data_source>/`` prefix."""
    keys = []
    for token in re.findall(r"`([^`\s]+)`", DOC.read_text()):
        if token.startswith("<var>/") or token.startswith("pass_at_"):
            token = "val/<data_source>/" + token
        if token.split("/", 1)[0] in FAMILIES and "/" in token and not token.endswith(".py"):
            keys.extend(_expand(token))
    return sorted(set(keys))


def _expand(token: str) -> list[str]:
    """``critic/{score,rewards}/{mean,max}`` -> its four keys (placeholders stay as they are)."""
    parts = re.split(r"(\{[^}]*,[^}]*\})", token)
    options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(combo) for combo in itertools.product(*options)]


def _pattern(key: str) -> re.Pattern[str]:
    """A documented key (alternatives expanded) as a regex: ``{phase}`` / ``<name>`` one
    segment, ``*`` one or more, ``_at_N`` / ``_at_k`` a number, a trailing ``/`` any key of the
    family."""
    out = ""
    for part in re.split(r"(\{[^}]*\}|<[^>]*>|\*)", key):
        if part.startswith("{") and "," in part:
            out += "(" + "|".join(map(re.escape, part[1:-1].split(","))) + ")"
        elif part.startswith(("{", "<")) or part == "*":
            out += r"[^/]+(/[^/]+)*" if part == "*" else r"[^/]+"
        else:
            out += re.sub(r"_at_(N|k)\b", r"_at_\\d+", re.escape(part))
    return re.compile(out + (".+" if key.endswith("/") else ""))


def _config(tmp_path: Path) -> ExperimentConfig:
    (tmp_path / "plugin.py").write_text(PLUGIN)
    config = tmp_path / "config.yaml"
    config.write_text((ROOT / "configs" / "quickstart.yaml").read_text())
    return load_config(
        config,
        [
            "imports=[plugin.py]",
            "reward.sources={calculator: 'plugin:flaky'}",
            f"trainer.output_dir={tmp_path / 'out'}",
            "trainer.total_steps=2",
            "trainer.mini_batch_size=null",
            "trainer.micro_batch_max_tokens=600",  # several micro-batches per update
            "trainer.val_n=2",
            "trainer.val_temperature=1.0",
            "data.batch_size=4",
            "data.n_samples=2",
            "data.shuffle=false",
            "data.generator_val_size=8",
            "inference.num_servers=1",
            "agent.max_turns=2",
            "tracking.enabled=false",
        ],
    )


def test_every_metric_key_in_the_docs_is_logged_by_a_real_run(tmp_path: Path) -> None:
    keys = _doc_keys()
    assert len(keys) > 60, keys  # the parser still finds the page's keys
    assert set(CONDITIONAL) <= set(keys), set(CONDITIONAL) - set(keys)
    result = Trainer(_config(tmp_path), progress=False).run_sync()
    logged = set(result.history)
    missing = [
        k
        for k in keys
        if k not in CONDITIONAL and not any(_pattern(k).fullmatch(m) for m in logged)
    ]
    assert not missing, f"documented in docs/tracking.md but not logged: {missing}"
    assert all(sanitize_key(k) == k for k in logged), [k for k in logged if sanitize_key(k) != k]
    assert not any(_pattern(k).fullmatch(m) for k in ("variance_proxy/*",) for m in logged)
    assert result.history["rollout/dropped/reward_error"][-1][1] > 0
    assert any(v > 0 for _, v in result.history["val/reward_errors"])


def test_the_key_patterns() -> None:
    assert _expand("critic/{score,rewards}/{mean,max}") == [
        "critic/score/mean",
        "critic/score/max",
        "critic/rewards/mean",
        "critic/rewards/max",
    ]
    assert _expand("timing_s/{phase}") == ["timing_s/{phase}"]
    assert _pattern("timing_s/{phase}").fullmatch("timing_s/update_actor")
    assert _pattern("weight_sync/").fullmatch("weight_sync/bytes")
    key = "val/<data_source>/<var>/best_at_k/std"
    assert _pattern(key).fullmatch("val/calculator/acc/best_at_2/std")
    assert not _pattern("reward/accuracy").fullmatch("reward/accuracy/x")
