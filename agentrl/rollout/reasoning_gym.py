"""Tasks from reasoning-gym: a seeded mixture of its procedural tasks, scored by its own scorers.

Why it exists: `reasoning-gym` generates verifiable tasks of over a hundred kinds (arithmetic,
counting, puzzles, logic, graphs...) offline, each with a scorer of its own. This module turns a
weighted mixture of them (``data.generator: reasoning_gym``, ``data.reasoning_gym.tasks``) into
our :class:`~agentrl.types.Task` rows and registers the ``reasoning_gym`` reward, which scores an
answer with the scorer of the task that asked it.

What it guarantees:

- :func:`generate_reasoning_gym_tasks` is a pure function of (config, n, seed): the same
  arguments give the same tasks in the same order, on any machine (each task draws from its own
  seed derived from ``seed`` and its name; nothing depends on global random state);
- each task's share is its weight's share of ``n`` (largest remainders; every task with
  ``n >= number of tasks`` gets at least one row);
- a task's ``data_source`` is its reasoning-gym name, so validation reports it as
  ``val/<name>/...``; its ``extra["reasoning_gym"]`` holds the generated entry (question,
  answer, metadata) the scorer needs, so scoring never regenerates anything;
- nothing is downloaded: reasoning-gym's data files ship inside the package (a test generates
  and scores with sockets disabled);
- a task name reasoning-gym does not know, or options its config does not take, raise
  :class:`ReasoningGymError` naming ``data.reasoning_gym.tasks[i]``, the value and the fix.

Example::

    cfg = ReasoningGymConfig(tasks=["leg_counting", "basic_arithmetic"])
    tasks = generate_reasoning_gym_tasks(cfg, 8, seed=0)
    tasks[0].data_source            # "leg_counting" or "basic_arithmetic"
"""

from __future__ import annotations

import difflib
import functools
import random
from typing import Any

from agentrl.config.reasoning_gym import ReasoningGymConfig
from agentrl.registry import RegistryError
from agentrl.rollout.answers import final_answer_text
from agentrl.types import Task, Trajectory

__all__ = [
    "ReasoningGymError",
    "generate_reasoning_gym_tasks",
    "reasoning_gym_reward",
    "reasoning_gym_task_names",
    "task_counts",
]

EXTRA_KEY = "reasoning_gym"
"""Key of ``Task.extra`` that holds the task's name, answer tag and generated entry."""


class ReasoningGymError(RegistryError):
    """``data.reasoning_gym`` names a task or an option reasoning-gym does not have."""


def _rg() -> Any:
    """The ``reasoning_gym`` package, or an error saying how to install it."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ReasoningGymError(
            "data.generator: 'reasoning_gym' needs the reasoning-gym package; install it with "
            "`pip install -e '.[environments]'` (or `make setup`)"
        ) from exc
    return reasoning_gym


def reasoning_gym_task_names() -> list[str]:
    """Every task name reasoning-gym knows, sorted."""
    from reasoning_gym.factory import DATASETS

    _rg()
    return sorted(DATASETS)


def task_counts(weights: list[float], n: int) -> list[int]:
    """``n`` split by ``weights`` (largest remainders; ties to the earlier task), summing to ``n``.

    When ``n`` is at least the number of tasks, every task gets at least one.
    """
    total = sum(weights)
    exact = [w / total * n for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    if n >= len(weights):
        for i, c in enumerate(counts):
            if c == 0:  # take one from the largest share
                j = max(range(len(counts)), key=lambda k: (counts[k], -k))
                counts[j] -= 1
                counts[i] = 1
    return counts


def _task_seed(seed: int, name: str) -> int:
    """The seed of task ``name`` in the stream ``seed`` (stable across runs and machines)."""
    return random.Random(f"agentrl/reasoning_gym/{seed}/{name}").randrange(2**31)


def _system_prompt(cfg: ReasoningGymConfig) -> str | None:
    """The configured system prompt: a reasoning-gym preset's text, or the text as given."""
    if cfg.system_prompt is None:
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(cfg.system_prompt, cfg.system_prompt)


def _entries(index: int, name: str, options: dict[str, Any], size: int, seed: int) -> list[Any]:
    """``size`` entries of task ``name`` generated from ``seed``; bad names/options raise."""
    rg = _rg()
    key = f"data.reasoning_gym.tasks[{index}]"
    names = reasoning_gym_task_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ReasoningGymError(
            f"{key}.name: reasoning-gym has no task {name!r}{hint} ({len(names)} tasks; "
            'list them with `python -c "import reasoning_gym.factory as f; '
            'print(sorted(f.DATASETS))"`)'
        )
    clash = {"seed", "size"} & set(options)
    if clash:
        raise ReasoningGymError(
            f"{key}.config: {sorted(clash)} are set by the run (data.seed / "
            "data.generator_train_size); remove them"
        )
    try:
        dataset = rg.create_dataset(name, seed=seed, size=size, **options)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ReasoningGymError(
            f"{key}.config {options!r}: reasoning-gym task {name!r} rejects it ({exc}); see "
            f"its config dataclass for the options it takes"
        ) from None
    return [dataset[i] for i in range(size)]


def generate_reasoning_gym_tasks(cfg: ReasoningGymConfig, n: int, *, seed: int) -> list[Task]:
    """``n`` tasks of the configured mixture, reproducibly from ``seed`` (see the module doc)."""
    if not cfg.tasks:
        raise ReasoningGymError(
            "data.reasoning_gym.tasks is empty; name at least one reasoning-gym task, e.g. "
            "[leg_counting, basic_arithmetic, letter_counting]"
        )
    counts = task_counts([t.weight for t in cfg.tasks], n)
    system = _system_prompt(cfg)
    tasks: list[Task] = []
    for i, (spec, count) in enumerate(zip(cfg.tasks, counts, strict=True)):
        if count == 0:
            continue
        task_seed = _task_seed(seed, spec.name)
        for j, entry in enumerate(_entries(i, spec.name, spec.config, count, task_seed)):
            messages = [{"role": "user", "content": str(entry["question"])}]
            if system:
                messages.insert(0, {"role": "system", "content": system})
            tasks.append(
                Task(
                    id=f"{spec.name}-{seed}-{j}",
                    messages=messages,
                    data_source=spec.name,
                    reward_spec={"ground_truth": str(entry["answer"])},
                    extra={EXTRA_KEY: {"task": spec.name, "tag": cfg.answer_tag, "entry": entry}},
                )
            )
    random.Random(seed).shuffle(tasks)
    return tasks


@functools.cache
def _scorer(name: str) -> Any:
    """reasoning-gym's ``score_answer`` of task ``name`` (built once per process)."""
    return _rg().get_score_answer_fn(name)


def reasoning_gym_reward(traj: Trajectory, task: Task) -> dict[str, Any]:
    """The score reasoning-gym's own scorer gives the episode's answer (0..1).

    The answer is the text of the last ``<answer>...</answer>`` (the configured tag) of the final
    assistant message; without one the answer is ``None``, which every scorer scores 0.
    """
    info = task.extra.get(EXTRA_KEY)
    if not isinstance(info, dict) or "entry" not in info:
        raise ValueError(
            f"task {task.id!r} (data_source {task.data_source!r}) has no "
            f"extra[{EXTRA_KEY!r}]: the `reasoning_gym` reward scores only tasks made by "
            "data.generator: reasoning_gym"
        )
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(final_answer_text(traj), tag_name=str(info.get("tag", "answer")))
    score = float(_scorer(str(info["task"]))(answer, info["entry"]))
    return {"score": score, "answer": answer, "correct": score >= 1.0}
