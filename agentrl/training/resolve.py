"""The config-resolution pass: every name and file a config refers to, checked before any server
starts.

Why it exists: a misspelled choice (``advantage.name: grp``, ``tool_call_format: hermez``), an
agent nobody registered or a reward function that does not import used to fail ~25 s into a run,
after servers had started and validation had run, or worse, never: the run trained on empty or
zero-reward batches and exited 0. :func:`resolve_experiment` runs first, once per run, in the
driver, and turns each such mistake into one :class:`ResolutionError` whose lines name the key,
the bad value, the valid choices and the closest match — a user error, never a traceback.

Resolved once: the entry point (``agentrl train``, ``agentrl eval``, or ``Trainer`` /
``run_with_ray`` called with a plain config) resolves, and its :class:`Resolved` is handed down
(``Trainer(cfg, resolved=)``, ``build_run``, the Ray trainer actor: it pickles). A process that
receives one calls :func:`ensure_resolved`, which loads the user's ``imports:`` there (what
resolving would have registered) without resolving again.

What it resolves, in order: the ``imports:`` (the user's modules, by name or by path relative to
the config file), the algorithm (estimator, loss and their knobs, correction, KL), the tool-call
parser, the tools (built with their options), the environment (its class, kwargs and reward
arity), the reward function of every data source, the
tasks (files exist, every row validates) and every agent they or ``agent.default`` name, the
weight transport, and the python sandbox when the ``python`` tool is enabled.

Example::

    resolved = resolve_experiment(cfg)        # raises ResolutionError, listing every problem
    resolved.plan.needs_critic, len(resolved.train_tasks), resolved.val_tasks
    Trainer(cfg, resolved=resolved)           # the trainer (or a Ray actor) does not resolve again
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config import ExperimentConfig
from agentrl.registry import RegistryError
from agentrl.types import Task

__all__ = [
    "ResolutionError",
    "Resolved",
    "agent_kwargs",
    "build_rewards",
    "build_tasks",
    "build_toolset",
    "default_agent",
    "ensure_resolved",
    "environment_class",
    "resolve_experiment",
]

logger = logging.getLogger(__name__)


class ResolutionError(ValueError):
    """The config names something that does not resolve; one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(
            "the config does not resolve (nothing was started):\n  " + "\n  ".join(problems)
        )


@dataclass
class Resolved:
    """What the resolution pass produced, handed down so that nothing is resolved or loaded twice
    (the trainer, the builder, the Ray trainer actor). Plain data: it pickles (the plan's
    functions by reference, user ones by their project-namespace name, :mod:`agentrl.user_code`)."""

    plan: Any
    """The :class:`~agentrl.training.algorithm.AlgorithmPlan`."""
    train_tasks: list[Task] = field(default_factory=list)
    val_tasks: list[Task] = field(default_factory=list)
    agents: list[str] = field(default_factory=list)
    """Every agent name the run can dispatch to (resolved)."""
    seconds: float = 0.0
    """How long the resolution took: the start-up log's phase, wherever it ran (the CLI)."""


def base_dir(cfg: ExperimentConfig) -> str | None:
    """The folder relative paths of ``cfg`` resolve against (its file's folder)."""
    return cfg.base_dir


def build_toolset(cfg: ExperimentConfig) -> Any:
    """The ``tools`` section as a ToolSet (settings of disabled tools are ignored), with the
    tools of the ``tools.mcp`` servers."""
    from tools import ToolSet

    search = cfg.tools.search.model_dump()
    if search.get("corpus_path"):
        from agentrl.user_code import resolve_user_path

        search["corpus_path"] = str(
            resolve_user_path(search["corpus_path"], cfg.base_dir, key="tools.search.corpus_path")
        )
    extra = []
    if cfg.tools.mcp:  # listed once per process; a server that will not start fails here
        from tools.mcp import mcp_tools_from_config

        extra = mcp_tools_from_config(cfg.tools.mcp, cfg.base_dir)
    return ToolSet.from_names(
        cfg.tools.enabled,
        extra=extra,
        options={
            "python": cfg.tools.python.model_dump(),
            **({"search": search} if search.get("corpus_path") else {}),
        },
        base_dir=cfg.base_dir,
        timeout_s=cfg.tools.timeout_s,
        max_output_chars=cfg.tools.max_output_chars,
        max_output_tokens=cfg.tools.max_output_tokens,
        truncate_side=cfg.tools.truncate_side,
    )


def environment_class(cfg: ExperimentConfig) -> Any:
    """The class ``environment.name`` names (checked: kwargs, reward arity), or None."""
    if not cfg.environment.name:
        return None
    from agents.environment import check_environment

    return check_environment(cfg.environment.name, cfg.environment.kwargs, base_dir=cfg.base_dir)


def default_agent(cfg: ExperimentConfig) -> str:
    """The agent of tasks that name none: ``environment`` when the config names one."""
    return "environment" if cfg.environment.name else cfg.agent.default


def agent_kwargs(cfg: ExperimentConfig) -> dict[str, dict[str, Any]]:
    """``agent.kwargs``, plus the environment agent's (which environment, its kwargs)."""
    out = dict(cfg.agent.kwargs)
    if cfg.environment.name:
        out["environment"] = {
            "name": cfg.environment.name,
            "kwargs": dict(cfg.environment.kwargs),
            "base_dir": cfg.base_dir,
        }
    return out


def environment_rewards(cfg: ExperimentConfig) -> dict[str, Any]:
    """``{environment name: its reward}`` when the environment defines ``reward``."""
    cls = environment_class(cfg)
    if cls is None or getattr(cls, "reward", None) is None:
        return {}
    from agents.environment import EnvironmentReward, environment_label

    assert cfg.environment.name is not None
    return {environment_label(cls): EnvironmentReward(cfg.environment.name, cfg.base_dir)}


def build_rewards(cfg: ExperimentConfig) -> Any:
    """The run's ``RewardManager``: the ``reward`` section, plus the environment's reward for
    its data source (``reward.sources`` wins where it names the same source)."""
    from agentrl.rollout.rewards import RewardManager

    return RewardManager.from_config(
        cfg.reward, base_dir=cfg.base_dir, extra_sources=environment_rewards(cfg)
    )


def build_tasks(cfg: ExperimentConfig, *, split: str) -> list[Task]:
    """Tasks of ``split`` (``train`` or ``val``) from files, or from the configured generator.

    Files resolve relative to the config file. Tasks without an ``agent`` get ``agent.default``.
    The generator's held-out tasks come from ``data.generator_val_seed``, another stream than the
    training tasks (``data.seed``); ``data.generator_val_size: 0`` means no validation set.
    """
    from agentrl.rollout.datasets import load_tasks
    from agentrl.user_code import resolve_user_path

    d = cfg.data
    files = d.train_files if split == "train" else d.val_files
    tasks: list[Task] = []
    if files:
        for i, f in enumerate(files):
            key = f"data.{split}_files[{i}]"
            tasks.extend(load_tasks(resolve_user_path(f, cfg.base_dir, key=key)))
    elif d.generator is not None:
        n = d.generator_train_size if split == "train" else d.generator_val_size
        if n:
            tasks = _generate(
                cfg, n, seed=d.seed if split == "train" else d.generator_val_seed, split=split
            )
    elif split == "train":
        raise RegistryError("data.train_files is empty and data.generator is null: no tasks")
    agent = default_agent(cfg)
    tasks = [t if t.agent else t.model_copy(update={"agent": agent}) for t in tasks]
    env = environment_class(cfg)
    if env is None:
        return tasks
    from agents.environment import environment_label

    source = environment_label(env)
    return [
        t.model_copy(update={"data_source": source}) if t.data_source == "default" else t
        for t in tasks
    ]


def _generate(cfg: ExperimentConfig, n: int, *, seed: int, split: str = "train") -> list[Task]:
    if cfg.data.generator == "verifiers":
        from agentrl.rollout.verifiers_env import generate_verifiers_tasks

        # The taskset's own rows, in its order: training takes the first
        # generator_train_size, validation the generator_val_size after them.
        offset = 0 if split == "train" else cfg.data.generator_train_size
        return generate_verifiers_tasks(
            cfg.data.verifiers, n, offset=offset, split=split, base_dir=cfg.base_dir
        )
    if cfg.data.generator == "reasoning_gym":
        from agentrl.rollout.reasoning_gym import generate_reasoning_gym_tasks

        return generate_reasoning_gym_tasks(cfg.data.reasoning_gym, n, seed=seed)
    if cfg.data.generator != "calculator":
        raise RegistryError(
            f"data.generator: unknown generator {cfg.data.generator!r}; the built-ins are "
            "'calculator', 'reasoning_gym' and 'verifiers' (or give data.train_files)"
        )
    from agentrl.rollout.calculator_task import generate_calculator_tasks

    kwargs = dict(cfg.data.generator_kwargs)
    try:
        return generate_calculator_tasks(n, seed=seed, **kwargs)
    except TypeError as exc:
        raise RegistryError(
            f"data.generator_kwargs {kwargs!r} do not fit the calculator generator ({exc})"
        ) from None


def _check(problems: list[str], fn: Callable[[], Any]) -> Any:
    """Run one resolution step; a user error becomes a line of the report."""
    from agentrl.rollout.datasets import DatasetError
    from agentrl.rollout.rewards import RewardConfigError

    try:
        return fn()
    except (RegistryError, RewardConfigError, DatasetError, TypeError) as exc:
        problems.append(str(exc))
    except ValueError as exc:  # pydantic or a constructor's own check, with its message
        problems.append(str(exc))
    return None


def resolve_experiment(cfg: ExperimentConfig, *, require_train: bool = True) -> Resolved:
    """Resolve every name and file of ``cfg`` (see the module docstring); raise
    :class:`ResolutionError` listing every problem found. ``require_train=False`` (the rollout
    service: tasks come with each job) accepts a config without a training set."""
    from agentrl.user_code import import_user_modules

    t0 = time.perf_counter()
    problems: list[str] = []
    if (
        _check(problems, lambda: import_user_modules(cfg.imports, cfg.base_dir)) is None
        and cfg.imports
    ):
        raise ResolutionError(problems)  # nothing else can resolve without the user's code
    plan = _check(problems, lambda: _algorithm(cfg))
    _check(problems, lambda: _parser(cfg))
    _check(problems, lambda: build_toolset(cfg))
    env = _check(problems, lambda: environment_class(cfg))
    if cfg.environment.name and env is None:
        raise ResolutionError(problems)  # its tasks, agent and reward all depend on it
    rewards = _check(problems, lambda: _rewards(cfg))
    train = (
        _check(problems, lambda: build_tasks(cfg, split="train")) or []
        if require_train or cfg.data.train_files
        else []
    )
    val = _check(problems, lambda: build_tasks(cfg, split="val")) or []
    agents = _agents(cfg, [*train, *val], problems)
    if rewards is not None:
        _check_sources(rewards, [*train, *val], problems)
        _check_reasoning_gym_rewards(cfg, rewards, problems)
    _check(problems, lambda: _transport(cfg))
    _check(problems, lambda: _teacher(cfg))
    _check(problems, lambda: _lora(cfg))
    _check(problems, lambda: _grad_noise(cfg))
    _check(problems, lambda: _sandbox(cfg))
    if not problems and train:
        _check(problems, lambda: _prompt_lengths(cfg, train))
    if problems:
        raise ResolutionError(problems)
    if require_train and not train:
        raise ResolutionError(["the training set is empty (data.train_files / data.generator)"])
    took = time.perf_counter() - t0
    return Resolved(plan=plan, train_tasks=train, val_tasks=val, agents=agents, seconds=took)


def ensure_resolved(cfg: ExperimentConfig, resolved: Resolved | None) -> Resolved:
    """``resolved`` made ready for this process, or ``cfg`` resolved now when there is none.

    A resolution handed over (by the CLI, or the Ray driver to the trainer actor) is not redone;
    only its side effect on the process is: the user's ``imports:`` are loaded here (idempotent,
    cheap after the first time), so the agents, tools and parsers they register exist.
    """
    if resolved is None:
        return resolve_experiment(cfg)
    from agentrl.user_code import import_user_modules

    import_user_modules(cfg.imports, cfg.base_dir)
    return resolved


def _algorithm(cfg: ExperimentConfig) -> Any:
    from agentrl.config import ConfigError
    from agentrl.training.algorithm import build_algorithm

    try:
        plan = build_algorithm(cfg.algorithm, base_dir=cfg.base_dir)
    except ConfigError as exc:
        raise RegistryError(str(exc)) from None
    t = cfg.teacher
    if t.enabled and t.mode == "advantage":
        import dataclasses

        plan = dataclasses.replace(plan, teacher_coef=t.coef)
    return plan


def _teacher(cfg: ExperimentConfig) -> None:
    """The teacher's directory exists and its tokenizer is the policy's (before any server)."""
    if cfg.teacher.enabled:
        from agentrl.rollout.teacher import check_teacher

        try:
            check_teacher(cfg, model_dir(cfg))
        except FileNotFoundError as exc:
            raise RegistryError(str(exc)) from None


def _parser(cfg: ExperimentConfig) -> Any:
    from agents.parsers import PARSERS

    return PARSERS.get(cfg.agent.tool_call_format, base_dir=cfg.base_dir)


def _rewards(cfg: ExperimentConfig) -> Any:
    return build_rewards(cfg)


def _check_sources(rewards: Any, tasks: list[Task], problems: list[str]) -> None:
    from agentrl.rollout.rewards import RewardConfigError

    for source in sorted({t.data_source for t in tasks}):
        try:
            rewards.reward_fn_for(source)
        except RewardConfigError as exc:
            problems.append(f"reward: {exc}")


def _check_reasoning_gym_rewards(cfg: ExperimentConfig, rewards: Any, problems: list[str]) -> None:
    """Tasks of ``data.generator: reasoning_gym`` must be scored by its scorer, not by a default
    that would silently compare strings."""
    if cfg.data.generator != "reasoning_gym" or cfg.data.train_files:
        return
    from agentrl.rollout.reasoning_gym import reasoning_gym_reward

    for spec in cfg.data.reasoning_gym.tasks:
        try:
            fn = rewards.reward_fn_for(spec.name)
        except Exception:  # reported by _check_sources
            continue
        if fn is not reasoning_gym_reward:
            problems.append(
                f"reward: data source {spec.name!r} (a reasoning-gym task) is not scored by the "
                "`reasoning_gym` reward; set reward.default: reasoning_gym (or "
                f"reward.sources.{spec.name}: reasoning_gym)"
            )


def _agents(cfg: ExperimentConfig, tasks: list[Task], problems: list[str]) -> list[str]:
    from agents import AGENTS

    names: dict[str, str] = {
        default_agent(cfg): "environment.name" if cfg.environment.name else "agent.default"
    }
    kwargs = agent_kwargs(cfg)
    for t in tasks:
        if t.agent and t.agent not in names:
            names[t.agent] = f"the 'agent' column of task {t.id!r}"
    for name, where in names.items():
        try:
            cls = AGENTS.get(name, key=where, base_dir=cfg.base_dir)
        except RegistryError as exc:
            problems.append(str(exc))
            continue
        try:
            cls(**kwargs.get(name, {}))  # agents are cheap; a bad kwarg fails here
        except TypeError as exc:
            problems.append(f"agent.kwargs.{name}: {exc}")
    unknown_kwargs = set(cfg.agent.kwargs) - set(names)
    for name in sorted(unknown_kwargs):
        problems.append(
            f"agent.kwargs.{name}: no task runs agent {name!r}; the run's agents: {', '.join(names)}"
        )
    return list(names)


PROMPT_CHECK_TASKS = 64
"""How many training tasks the resolution pass renders to check ``data.max_prompt_tokens``."""


def _prompt_lengths(cfg: ExperimentConfig, tasks: list[Task]) -> None:
    """Render the first tasks' prompts as an episode would (system prompt, tools block) and
    fail now when ``data.max_prompt_tokens`` would drop all of them (or, with
    ``overlong_prompts: error``, any of them) — not minutes later, after servers started."""
    from agentrl.episode import render_prompt_ids

    path = model_dir(cfg)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=cfg.model.trust_remote_code)
    schemas = build_toolset(cfg).schemas() or None
    limit = cfg.data.max_prompt_tokens
    sample = tasks[:PROMPT_CHECK_TASKS]
    lengths = [
        len(render_prompt_ids(tok, t.initial_messages(cfg.agent.system_prompt), schemas))
        for t in sample
    ]
    over = [(t.id, n) for t, n in zip(sample, lengths, strict=True) if n > limit]
    fix = f"raise data.max_prompt_tokens (longest: {max(lengths)} tokens) or shorten the prompts"
    if over and (cfg.data.overlong_prompts == "error" or len(over) == len(sample)):
        task_id, n = over[0]
        which = "every one" if len(over) == len(sample) else f"{len(over)}"
        raise RegistryError(
            f"data.max_prompt_tokens={limit}: {which} of the first {len(sample)} training "
            f"prompts is longer (task {task_id!r}: {n} tokens, tools block and system prompt "
            f"included); {fix}"
        )


def _lora(cfg: ExperimentConfig) -> None:
    if cfg.model.lora.rank > 0 and cfg.trainer.world_size > 1:
        raise RegistryError(
            f"model.lora.rank={cfg.model.lora.rank} with trainer.world_size="
            f"{cfg.trainer.world_size}: LoRA is trained on one rank in this version; use "
            "trainer.world_size: 1 (LoRA's memory saving is the point) or full fine-tuning"
        )


def _grad_noise(cfg: ExperimentConfig) -> None:
    t = cfg.trainer
    if t.log_grad_noise and (t.world_size > 1 or t.cpu_offload):
        raise RegistryError(
            f"trainer.log_grad_noise=true with trainer.world_size={t.world_size}, "
            f"trainer.cpu_offload={str(t.cpu_offload).lower()}: the gradient-noise probe reads "
            "local, unsharded gradients; use it with world_size 1 and cpu_offload false"
        )


def _transport(cfg: ExperimentConfig) -> None:
    """What `checkpoint.transport: collective` needs and this machine lacks, said up front."""
    ck = cfg.checkpoint
    if ck.transport != "collective":
        return
    import torch

    gpu = torch.cuda.is_available()
    if ck.collective_backend == "nccl" and not gpu:
        raise RegistryError(
            "checkpoint.collective_backend: 'nccl' needs GPUs and this machine has none; use "
            "'gloo' (or 'auto') to broadcast the weights on CPUs"
        )
    if cfg.inference.backend == "vllm" and not gpu:
        raise RegistryError(
            "checkpoint.transport: 'collective' drives vLLM's NCCL weight-transfer API, which "
            "needs GPUs (and this machine has none); use 'shared_dir' for vLLM on CPUs"
        )


def _sandbox(cfg: ExperimentConfig) -> None:
    if "python" not in cfg.tools.enabled:
        return
    from tools.python_sandbox import SandboxUnavailableError, check_python_sandbox_available

    try:
        check_python_sandbox_available(cfg.tools.python)
    except SandboxUnavailableError as exc:
        raise RegistryError(f"tools.enabled: 'python': {exc}") from None


def model_dir(cfg: ExperimentConfig) -> Path:
    """``model.path`` (relative to the config file), or the tiny test model built under the
    output directory when it is null."""
    if cfg.model.path:
        from agentrl.user_code import resolve_user_path

        p = Path(cfg.model.path)
        if p.is_absolute() or (Path(cfg.base_dir or ".") / p).exists() or p.exists():
            return resolve_user_path(cfg.model.path, cfg.base_dir, key="model.path")
        return p  # a hub id; loading it says what is wrong
    from agentrl.inference.tiny_model import build_tiny_model

    target = Path(cfg.trainer.output_dir) / "tiny-model"
    if not (target / "config.json").exists():
        build_tiny_model(target, seed=cfg.trainer.seed)
    return target
