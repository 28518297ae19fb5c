"""Streaming rewards: score each episode the moment it ends, on a bounded pool.

A reward function is plain Python, sync or async::

    def my_reward(traj: Trajectory, task: Task) -> float | dict: ...
    async def my_judge(traj: Trajectory, task: Task) -> float | dict: ...

It returns a score, or a dict with a required ``score``, an optional ``turn_rewards`` (one
float per model turn) and anything else, which lands in ``Trajectory.reward_info``. The
answer a function grades is the content of the last assistant message in ``traj.messages``
(:func:`final_answer_text`).

:class:`RewardManager` picks the function per task by ``task.data_source`` and guarantees:

- every call to :meth:`RewardManager.score` returns a scored copy of the trajectory; a reward
  function that raises, times out or returns something malformed gives reward ``0.0`` with
  ``reward_info["error"]``, is logged and counted in ``reward/errors`` — a trajectory is never
  lost to a broken reward;
- at most ``max_workers`` reward calls run at once (a semaphore), whatever the executor;
- ``executor="async"`` awaits async functions on the event loop and calls sync ones inline
  (for cheap rule-based rewards); ``"thread"`` runs sync functions in a thread pool (I/O that
  is not async); ``"process"`` runs them in a process pool (CPU-bound graders), which needs
  functions that pickle (module-level, importable) — checked when the manager is built.

Built-ins, by name: ``exact_match``, ``numeric_match`` (GSM8K ``#### 42``, ``\\boxed{42}``,
else the last number; tolerant numeric compare), ``calculator`` (the calculator task's
reward) and ``tool_format`` (well-formed tool calls). Anything else is a ``module:function``
path or a callable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import multiprocessing
import pickle
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from fractions import Fraction
from typing import Any, Literal, TypeAlias

from agentrl.registry import Registry, RegistryError
from agentrl.types import Task, Trajectory

__all__ = [
    "BUILTIN_REWARDS",
    "REWARDS",
    "RewardConfigError",
    "RewardFn",
    "RewardManager",
    "calculator_reward",
    "exact_match",
    "extract_answer",
    "final_answer_text",
    "numeric_match",
    "parse_number",
    "register_reward",
    "resolve_reward_fn",
    "tool_format",
]

logger = logging.getLogger(__name__)

RewardResult: TypeAlias = float | int | bool | dict[str, Any]
RewardFn: TypeAlias = Callable[[Trajectory, Task], RewardResult | Awaitable[RewardResult]]
"""``fn(traj, task) -> float | dict`` (sync or async); see the module docstring."""

Executor = Literal["async", "thread", "process"]


class RewardConfigError(ValueError):
    """The reward configuration is wrong (unknown name, bad path, unpicklable function)."""


# ---- answer extraction ---------------------------------------------------------------------


def final_answer_text(traj: Trajectory) -> str:
    """The content of the last assistant message in ``traj.messages`` ("" if there is none).

    Content given as a list of OpenAI content parts is joined from its text parts.
    """
    for msg in reversed(traj.messages):
        if msg.get("role") != "assistant":
            continue
        content = msg.get("content")
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        return str(content)
    return ""


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        i = start + len("\\boxed{")
        depth = 1
        j = i
        while j < len(text) and depth:
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
            j += 1
        if depth == 0:
            return text[i : j - 1]
        start = text.rfind("\\boxed{", 0, start)
    return None


def extract_answer(text: str) -> str | None:
    """The marked final answer in ``text``: the last ``\\boxed{...}``, else what follows the
    last GSM8K ``####`` marker (to the end of its line); None when neither is present."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else ""
    return None


# A number: thousands-grouped ("1,234,567") or plain digits, optional decimals and exponent.
_NUMBER_RE = re.compile(
    r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\w)|(?<![\w.])[-+−]?\.\d+"
)
_FRAC_RE = re.compile(r"^\\d?frac\{([^{}]+)\}\{([^{}]+)\}$")


def parse_number(text: str) -> Fraction | None:
    """Parse one number exactly: ``42``, ``-1,234.5``, ``$12``, ``50%``, ``3/4``,
    ``\\frac{3}{4}``, ``1e3``. Returns None when ``text`` is not a single number."""
    s = text.strip().strip("$").replace("\\!", "").replace("−", "-")
    s = s.removesuffix("\\%").removesuffix("%").strip().rstrip(".").strip()
    s = s.replace("\\$", "").lstrip("$").strip()
    frac = _FRAC_RE.match(s)
    if frac:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        return None if num is None or den is None or den == 0 else num / den
    if "/" in s:
        num_s, _, den_s = s.partition("/")
        num, den = parse_number(num_s), parse_number(den_s)
        return None if num is None or den is None or den == 0 else num / den
    if re.fullmatch(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+", s):
        try:
            return Fraction(s.replace(",", ""))
        except (ValueError, ZeroDivisionError):
            return None
    return None


def _last_number(text: str) -> Fraction | None:
    matches = _NUMBER_RE.findall(text)
    return parse_number(matches[-1]) if matches else None


def _answer_number(text: str) -> tuple[Fraction | None, str]:
    """(value, how) — the marked answer if any (its first number if it is not a bare number),
    else the last number in the text."""
    marked = extract_answer(text)
    if marked is not None:
        value = parse_number(marked)
        if value is None:
            found = _NUMBER_RE.findall(marked)
            value = parse_number(found[0]) if found else None
        return value, "boxed" if _last_boxed(text) is not None else "####"
    return _last_number(text), "last_number"


def _numbers_close(a: Fraction, b: Fraction, rel_tol: float, abs_tol: float) -> bool:
    if a == b:
        return True
    if a.denominator == 1 and b.denominator == 1:
        return False  # integers compare exactly: 999999 is not 1000000 at any tolerance
    return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=abs_tol)


def _ground_truths(task: Task) -> list[str]:
    if "ground_truth" not in task.reward_spec:
        raise ValueError(
            f"task {task.id!r} has no reward_spec['ground_truth']; this reward compares the "
            'final answer with it (e.g. reward_spec={"ground_truth": "42"})'
        )
    gt = task.reward_spec["ground_truth"]
    return [str(g) for g in gt] if isinstance(gt, list | tuple) else [str(gt)]


def _normalize_text(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = s.removeprefix("\\text{").removesuffix("}") if s.startswith("\\text{") else s
    s = " ".join(s.split()).casefold()
    return s.rstrip(".").strip()


# ---- built-in reward functions -----------------------------------------------------------


def exact_match(traj: Trajectory, task: Task) -> dict[str, Any]:
    """1.0 when the answer equals ``reward_spec["ground_truth"]`` (or one of a list of them)
    after normalization (trimmed, whitespace collapsed, case-folded, trailing period dropped).

    The answer is the marked one (``\\boxed{}`` / ``####``) when present, else the whole final
    assistant message. A ground truth in GSM8K form (``"... #### 42"``) is reduced to ``42``.
    """
    text = final_answer_text(traj)
    marked = extract_answer(text)
    answer = marked if marked is not None else text
    targets = [extract_answer(g) or g for g in _ground_truths(task)]
    ok = any(_normalize_text(answer) == _normalize_text(t) for t in targets)
    return {"score": 1.0 if ok else 0.0, "answer": answer, "correct": ok}


def numeric_match(
    traj: Trajectory, task: Task, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9
) -> dict[str, Any]:
    """1.0 when the answer's number equals the ground truth's number.

    The answer is, in order: the last ``\\boxed{...}``, the text after the last ``####``
    (GSM8K), else the last number in the final assistant message. Numbers compare exactly as
    fractions (so ``1,234``, ``1234.0`` and ``2468/2`` are equal); when either is not an
    integer, also within ``rel_tol`` / ``abs_tol`` (``reward_spec`` may override both).
    """
    rel_tol = float(task.reward_spec.get("rel_tol", rel_tol))
    abs_tol = float(task.reward_spec.get("abs_tol", abs_tol))
    value, how = _answer_number(final_answer_text(traj))
    targets = []
    for g in _ground_truths(task):
        target = parse_number(extract_answer(g) or g)
        if target is None:
            target = _last_number(g)
        if target is None:
            raise ValueError(
                f"task {task.id!r}: reward_spec['ground_truth'] = {g!r} is not a number; "
                "numeric_match needs a numeric ground truth (use exact_match for text)"
            )
        targets.append(target)
    ok = value is not None and any(_numbers_close(value, t, rel_tol, abs_tol) for t in targets)
    return {
        "score": 1.0 if ok else 0.0,
        "answer": None if value is None else str(value),
        "extracted_by": how,
        "correct": ok,
    }


def calculator_reward(traj: Trajectory, task: Task) -> dict[str, Any]:
    """The calculator task's reward: 1.0 for the correct final answer, else 0.0.

    The answer is read like :func:`numeric_match` (``\\boxed{N}`` first — the format the SFT
    conversations and the system prompt teach — else the last number). There is no format
    bonus and no tool bonus on purpose: shaping terms can be farmed without solving the task,
    and the arithmetic is chosen so that the tiny model only gets it right through the tool.
    ``reward_info`` reports ``correct``, ``boxed`` (the answer was in ``\\boxed{}``),
    ``used_tool`` and ``invalid_tool_calls`` so that format and tool use can be tracked.
    """
    result = numeric_match(traj, task)
    text = final_answer_text(traj)
    result["boxed"] = _last_boxed(text) is not None
    result["used_tool"] = traj.tool_calls.get("calculator", 0) > 0
    result["invalid_tool_calls"] = _invalid_calls(traj)
    return result


_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _invalid_calls(traj: Trajectory) -> int:
    return int(traj.tool_calls.get("<invalid>", 0))


def tool_format(traj: Trajectory, task: Task) -> dict[str, Any]:
    """Fraction of the episode's tool calls that were well formed (0.0 if it made none).

    A call is well formed when the agent's parser accepted it (``traj.tool_calls`` counts
    calls per tool name, malformed ones under ``<invalid>``) — or, for trajectories without
    those counts, when each hermes ``<tool_call>`` block in the assistant messages is closed
    and holds a JSON object with a string ``name`` and an object ``arguments``. A call to a
    tool the task does not offer (``reward_spec["tools"]``, a list of names, when given)
    counts as malformed.
    """
    allowed = task.reward_spec.get("tools")
    counts = dict(traj.tool_calls)
    if not counts:
        counts = _count_text_tool_calls(traj)
    invalid = counts.pop("<invalid>", 0)
    if allowed is not None:
        for name in [n for n in counts if n not in allowed]:
            invalid += counts.pop(name)
    valid = sum(counts.values())
    total = valid + invalid
    return {
        "score": valid / total if total else 0.0,
        "valid_calls": valid,
        "invalid_calls": invalid,
    }


def _count_text_tool_calls(traj: Trajectory) -> dict[str, int]:
    import json

    counts: dict[str, int] = {}
    for msg in traj.messages:
        if msg.get("role") != "assistant":
            continue
        for call in msg.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            name = fn.get("name")
            key = name if isinstance(name, str) and name else "<invalid>"
            counts[key] = counts.get(key, 0) + 1
        content = msg.get("content")
        if not isinstance(content, str):
            continue
        for m in _TOOL_CALL_RE.finditer(content):
            closed = m.group(0).endswith("</tool_call>")
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError:
                obj = None
            ok = (
                closed
                and isinstance(obj, dict)
                and isinstance(obj.get("name"), str)
                and isinstance(obj.get("arguments", {}), dict)
            )
            key = obj["name"] if ok and isinstance(obj, dict) else "<invalid>"
            counts[key] = counts.get(key, 0) + 1
    return counts


def _check_reward(obj: Any) -> None:
    if not callable(obj):
        raise TypeError(f"a reward function must be callable, got {type(obj).__name__}")


REWARDS: Registry[RewardFn] = Registry(
    "reward function",
    config_key="reward.sources",
    check=_check_reward,
    how_to_register="decorate a function `(traj, task) -> float | dict` with "
    "@register_reward('name') in a module listed under `imports:`, or give "
    "'module:function' / 'path/file.py:function'",
)
"""Reward functions by name (built-ins below; add yours with :func:`register_reward`)."""
REWARDS.add("exact_match", exact_match)
REWARDS.add("numeric_match", numeric_match)
REWARDS.add("calculator", calculator_reward)
REWARDS.add("tool_format", tool_format)
BUILTIN_REWARDS = ("exact_match", "numeric_match", "calculator", "tool_format")
"""Names of the built-in reward functions."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available by ``name`` in reward configs."""
    return REWARDS.register(name)


def resolve_reward_fn(
    spec: str | RewardFn, *, key: str = "reward.sources", base_dir: Any = None
) -> RewardFn:
    """A registered name, a ``module:function`` / ``path/file.py:function`` spec, or a callable."""
    if not isinstance(spec, str) and not callable(spec):
        raise RewardConfigError(
            f"{key}: reward function {spec!r}: give a built-in name, a 'module:function' path or "
            "a callable"
        )
    if isinstance(spec, str) and not spec:
        raise RewardConfigError(f"{key}: empty reward function name")
    try:
        return REWARDS.get(spec, key=key, base_dir=base_dir)
    except RegistryError as exc:
        raise RewardConfigError(str(exc)) from None


# ---- running a reward function -------------------------------------------------------------


def _call_in_process(fn: RewardFn, traj: Trajectory, task: Task) -> RewardResult:
    """Runs in a pool worker: call ``fn``, driving it to completion if it is async."""
    out = fn(traj, task)
    if inspect.isawaitable(out):

        async def _await() -> RewardResult:
            return await out

        return asyncio.run(_await())
    return out  # type: ignore[return-value]  # sync functions return the result itself


def _normalize_result(result: Any, traj: Trajectory) -> tuple[float, list[float] | None, dict]:
    """(score, turn_rewards or None, extra info); raises ValueError naming what is wrong."""
    if isinstance(result, bool | int | float):
        score, turn_rewards, info = float(result), None, {}
    elif isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(
                f"reward dict has no 'score' (keys: {sorted(result)}); return {{'score': float, ...}}"
            )
        info = {k: v for k, v in result.items() if k not in ("score", "turn_rewards")}
        try:
            score = float(result["score"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"reward 'score' = {result['score']!r} is not a number") from exc
        turn_rewards = result.get("turn_rewards")
        if turn_rewards is not None:
            try:
                turn_rewards = [float(r) for r in turn_rewards]
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"reward 'turn_rewards' = {turn_rewards!r} must be a list of numbers"
                ) from exc
            if traj.num_turns and len(turn_rewards) != traj.num_turns:
                raise ValueError(
                    f"reward 'turn_rewards' has {len(turn_rewards)} entries but the episode has "
                    f"{traj.num_turns} model turns; give one per model turn"
                )
    else:
        raise ValueError(
            f"reward function returned {type(result).__name__}; return a float or a dict with 'score'"
        )
    if not math.isfinite(score):
        raise ValueError(f"reward score is {score}; it must be finite")
    return score, turn_rewards, info


class RewardManager:
    """Scores trajectories per ``data_source`` as they finish, with bounded concurrency.

    Args:
        sources: ``data_source -> reward`` (a built-in name, ``module:function`` or callable).
        default: reward for data sources not in ``sources``. When None, a data source that is
            itself a built-in name (e.g. ``calculator``) uses that built-in; any other is an error.
        executor: ``"async"`` (event loop), ``"thread"`` or ``"process"`` (see module docstring).
        max_workers: most reward calls in flight (and the pool size).
        timeout_s: per-call time limit; a call over it scores 0.0 with an error (a process-pool
            call keeps running in its worker until it returns).
        format_weight: adds ``format_weight * tool_format(traj, task)`` to every successful
            score (``reward_info["tool_format"]`` reports the term); 0 = off.

    ``score(traj, task)`` never raises for a failing reward function; it raises
    :class:`RewardConfigError` only for a data source with no reward configured.
    """

    def __init__(
        self,
        sources: Mapping[str, str | RewardFn] | None = None,
        default: str | RewardFn | None = None,
        executor: Executor = "async",
        max_workers: int = 4,
        timeout_s: float | None = None,
        format_weight: float = 0.0,
        base_dir: Any = None,
    ) -> None:
        if executor not in ("async", "thread", "process"):
            raise RewardConfigError(
                f"reward executor {executor!r}: use 'async', 'thread' or 'process'"
            )
        if max_workers < 1:
            raise RewardConfigError(f"reward max_workers = {max_workers}; it must be >= 1")
        self.executor: Executor = executor
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.format_weight = format_weight
        self._specs = dict(sources or {})
        self._fns: dict[str, RewardFn] = {
            source: resolve_reward_fn(spec, key=f"reward.sources.{source}", base_dir=base_dir)
            for source, spec in self._specs.items()
        }
        self._default = (
            resolve_reward_fn(default, key="reward.default", base_dir=base_dir)
            if default is not None
            else None
        )
        if executor == "process":
            for name, fn in [*self._fns.items(), ("<default>", self._default)]:
                if fn is not None:
                    self._check_picklable(name, fn)
        self._pool: concurrent.futures.Executor | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._counts = {"scored": 0, "errors": 0, "timeouts": 0}
        self._latency_sum = 0.0
        self._latency_max = 0.0
        self._in_flight = 0

    @classmethod
    def from_config(cls, cfg: Any, *, base_dir: Any = None) -> RewardManager:
        """Build from the ``reward`` config section (``sources``, ``default``, ``executor``,
        ``max_workers``, ``format_weight``; any object with those attributes); path specs
        resolve against ``base_dir`` (the config file's folder)."""
        return cls(
            base_dir=base_dir,
            sources=dict(cfg.sources),
            default=cfg.default,
            executor=cfg.executor,
            max_workers=cfg.max_workers,
            timeout_s=getattr(cfg, "timeout_s", None),
            format_weight=getattr(cfg, "format_weight", 0.0),
        )

    @staticmethod
    def _check_picklable(source: str, fn: RewardFn) -> None:
        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise RewardConfigError(
                f"reward function for data_source {source!r} ({getattr(fn, '__qualname__', fn)!r}) "
                f"cannot be sent to a process pool: {exc}. Define it at module level in an "
                "importable module (no lambdas or closures), or use executor='async'/'thread'"
            ) from exc

    # -- pickling: pools and semaphores are per process, created lazily ----------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_semaphore"] = None
        return state

    def reward_fn_for(self, data_source: str) -> RewardFn:
        """The reward function that scores tasks of ``data_source``."""
        if data_source in self._fns:
            return self._fns[data_source]
        if self._default is not None:
            return self._default
        if data_source in REWARDS:
            fn = REWARDS.get(data_source)
            if self.executor == "process":
                self._check_picklable(data_source, fn)
            self._fns[data_source] = fn
            return fn
        raise RewardConfigError(
            f"no reward function for data_source {data_source!r}; configured: "
            f"{sorted(self._fns) or 'none'}; add it to reward sources or set a default "
            f"(registered: {', '.join(REWARDS.names())})"
        )

    def _get_pool(self) -> concurrent.futures.Executor:
        if self._pool is None:
            if self.executor == "process":
                # spawn, not fork: the parent runs threads (servers, torch) that fork would copy
                # mid-lock.
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=self.max_workers, mp_context=multiprocessing.get_context("spawn")
                )
            else:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.max_workers, thread_name_prefix="reward"
                )
        return self._pool

    async def _run(self, fn: RewardFn, traj: Trajectory, task: Task) -> RewardResult:
        if self.executor == "process":
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._get_pool(), _call_in_process, fn, traj, task)
        if inspect.iscoroutinefunction(fn) or self.executor == "async":
            out = fn(traj, task)
            return await out if inspect.isawaitable(out) else out  # type: ignore[return-value]  # sync result
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self._get_pool(), fn, traj, task)
        return await out if inspect.isawaitable(out) else out  # type: ignore[return-value]  # sync result

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        """A copy of ``traj`` with ``reward``, ``turn_rewards``, ``reward_info`` and
        ``timings["reward"]`` set. A failing reward function gives reward 0.0 and
        ``reward_info["error"]`` (logged, counted in ``reward/errors``)."""
        fn = self.reward_fn_for(task.data_source)
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_workers)
        async with self._semaphore:
            self._in_flight += 1
            start = time.perf_counter()
            try:
                if self.timeout_s is not None:
                    result = await asyncio.wait_for(self._run(fn, traj, task), self.timeout_s)
                else:
                    result = await self._run(fn, traj, task)
                score, turn_rewards, info = _normalize_result(result, traj)
                if self.format_weight:
                    fmt = float(tool_format(traj, task)["score"])
                    info["tool_format"] = fmt
                    score += self.format_weight * fmt
                error = None
            except TimeoutError:
                self._counts["timeouts"] += 1
                error = f"reward function timed out after {self.timeout_s} s"
                score, turn_rewards, info = 0.0, None, {}
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                score, turn_rewards, info = 0.0, None, {}
            finally:
                self._in_flight -= 1
            elapsed = time.perf_counter() - start
        self._counts["scored"] += 1
        self._latency_sum += elapsed
        self._latency_max = max(self._latency_max, elapsed)
        reward_info = {**traj.reward_info, **info}
        if error is not None:
            self._counts["errors"] += 1
            reward_info["error"] = error
            logger.warning(
                "reward for trajectory %s (task %s, data_source %s) failed; scored 0.0: %s",
                traj.uid,
                task.id,
                task.data_source,
                error,
            )
        return traj.model_copy(
            update={
                "reward": score,
                "turn_rewards": turn_rewards if turn_rewards is not None else traj.turn_rewards,
                "reward_info": reward_info,
                "timings": {**traj.timings, "reward": elapsed},
            }
        )

    def metrics(self) -> dict[str, float]:
        """Cumulative counters since construction (``reward/`` family)."""
        n = self._counts["scored"]
        return {
            "reward/scored": float(n),
            "reward/errors": float(self._counts["errors"]),
            "reward/timeouts": float(self._counts["timeouts"]),
            "reward/in_flight": float(self._in_flight),
            "reward/latency_mean_s": self._latency_sum / n if n else 0.0,
            "reward/latency_max_s": self._latency_max,
        }

    def close(self) -> None:
        """Shut the worker pool down (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    async def __aenter__(self) -> RewardManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
