"""Streaming rewards: score each episode the moment it ends, on a bounded pool.

A reward function is plain Python, sync or async::

    def my_reward(traj: Trajectory, task: Task) -> float | dict: ...
    async def my_judge(traj: Trajectory, task: Task) -> float | dict: ...

It returns a score, or a dict with a required ``score``, an optional ``turn_rewards`` (one
float per model turn) and anything else, which lands in ``Trajectory.reward_info``. The
answer a function grades is the content of the last assistant message in ``traj.messages``
(:func:`final_answer_text`).

:class:`RewardManager` picks the function per task by ``task.data_source`` and guarantees:

- every reward call has a deadline (``timeout_s``, config ``reward.timeout_s``) that holds
  whatever the function does: an async function is cancelled and abandoned, a sync one's
  thread is abandoned (threads cannot be killed; the pool is bounded and its threads never
  block exit), a process-pool call's worker is SIGKILLed and replaced;
- a reward function that raises, times out or returns something malformed makes
  :meth:`RewardManager.score` raise :class:`RewardError` (:class:`RewardTimeoutError` for a
  timeout) naming the function and the data source, after it is logged and counted per data
  source (``reward/<source>/errors``, ``timeouts``, ``abandoned``, ``killed``); the caller
  decides what happens to the trajectory (it is never silently scored 0.0 here);
- at most ``max_workers`` reward calls run at once (a semaphore), whatever the executor;
- ``executor="async"`` awaits async functions on the event loop (the built-in rule rewards
  of this module run inline; any other sync function runs on the reward thread pool, so its
  deadline can be enforced); ``"thread"`` runs sync functions on a bounded pool of daemon
  threads (I/O that is not async); ``"process"`` runs them in spawned worker processes
  (CPU-bound graders), which needs functions that pickle (module-level, importable) —
  checked when the manager is built.

Built-ins, by name: ``exact_match``, ``numeric_match`` (GSM8K ``#### 42``, ``\\boxed{42}``,
else the last number; tolerant numeric compare), ``calculator`` (the calculator task's
reward) and ``tool_format`` (well-formed tool calls). Anything else is a ``module:function``
path or a callable. A data source may also be scored by a model reward (a reward model or an
LLM judge, ``reward.models``; :mod:`agentrl.rollout.model_rewards`) or by a mix of rewards
(``{"terms": {name: weight}, "combine": ...}``), whose terms run concurrently, each under its
own executor and deadline; model rewards run on the event loop and take no ``max_workers`` slot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import logging
import math
import multiprocessing
import os
import pickle
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, Literal, TypeAlias, cast

from agentrl.registry import Registry, RegistryError
from agentrl.types import Task, Trajectory
from tools.executor import DaemonThreadPool

__all__ = [
    "BUILTIN_REWARDS",
    "REWARDS",
    "RewardConfigError",
    "RewardError",
    "RewardFn",
    "RewardManager",
    "RewardTimeoutError",
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
    """Calls per tool name in the assistant messages (``<invalid>`` for malformed ones), by the
    one hermes parser the agents and the proxy use (``agents.parsers``)."""
    from agents.parsers import get_parser

    parser = get_parser("hermes")
    counts: dict[str, int] = {}
    for msg in traj.messages:
        if msg.get("role") != "assistant":
            continue
        names: list[str | None] = []
        for call in msg.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            names.append(fn.get("name") if isinstance(fn.get("name"), str) else None)
        content = msg.get("content")
        if not msg.get("tool_calls") and isinstance(content, str):
            parsed = parser.parse(content)
            names += [c.name for c in parsed.calls] + [None] * len(parsed.errors)
        for name in names:
            key = name if name else "<invalid>"
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


class RewardError(RuntimeError):
    """A reward function failed: it raised, returned something malformed, or timed out.

    ``source`` is the task's ``data_source``. Raised by :meth:`RewardManager.score` after the
    failure is counted; the caller decides what happens to the trajectory.
    """

    def __init__(self, message: str, *, source: str) -> None:
        super().__init__(message)
        self.source = source

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses process boundaries (a Ray reward actor): keep the keyword-only ``source``.
        return (_rebuild_reward_error, (type(self), str(self), self.source))


def _rebuild_reward_error(cls: type[RewardError], message: str, source: str) -> RewardError:
    return cls(message, source=source)


class RewardTimeoutError(RewardError):
    """A reward function ran past ``timeout_s`` (it was abandoned, or its worker killed)."""


_ABANDON_GRACE_S = 1.0
"""Seconds a timed-out reward call has to stop before it counts as abandoned."""
_WORKER_START_TIMEOUT_S = 120.0
"""Seconds a new process worker may take to start (not counted in a call's ``timeout_s``)."""


def _call_in_process(fn: RewardFn, traj: Trajectory, task: Task) -> RewardResult:
    """Runs in a worker process: call ``fn``, driving it to completion if it is async."""
    out = fn(traj, task)
    if inspect.isawaitable(out):

        async def _await() -> RewardResult:
            return await out

        return asyncio.run(_await())
    return out  # type: ignore[return-value]  # sync functions return the result itself


def _worker_main(conn: Any) -> None:
    """A process worker: one thread for BLAS/OpenMP, then calls from ``conn`` until EOF."""
    from agentrl.threads import ENV_THREADS, THREAD_ENV_VARS

    for name in THREAD_ENV_VARS:
        os.environ[name] = os.environ.get(ENV_THREADS) or "1"
    conn.send(("ready", None))
    while True:
        try:
            fn, traj, task = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", _call_in_process(fn, traj, task)))
        except Exception as exc:  # sent back as text: user exceptions need not pickle
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


async def _readable(fd: int, timeout: float | None) -> bool:
    """Wait until ``fd`` is readable (or at EOF); False at the deadline."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


class _WorkerCallError(Exception):
    """The reward function raised inside a worker process (message: ``Type: text``)."""


class _ProcessWorker:
    """One spawned worker process and its pipe; killed when a call overruns."""

    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()

    async def ready(self) -> None:
        """Wait for the worker's hello; kill it and raise if it does not start in time."""
        if not await _readable(self.conn.fileno(), _WORKER_START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(
                f"a reward worker process did not start within {_WORKER_START_TIMEOUT_S:g} s"
            )
        self.conn.recv()

    async def call(self, fn: RewardFn, traj: Trajectory, task: Task, timeout: float) -> Any:
        """The result; raises TimeoutError (the caller kills), _WorkerCallError (the function
        raised) or RuntimeError (the worker died)."""
        self.conn.send((fn, traj, task))
        if not await _readable(self.conn.fileno(), timeout):
            raise TimeoutError
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(
                f"the reward worker process died (exit code {self.process.exitcode})"
            ) from exc
        if kind == "error":
            raise _WorkerCallError(value)
        return value

    def kill(self) -> None:
        """SIGKILL the worker; its zombie is reaped once it is gone (never blocks)."""
        self.process.kill()
        self.conn.close()
        loop = asyncio.get_running_loop()
        sentinel = self.process.sentinel

        def reap() -> None:
            """Join the killed process (non-blocking) once its sentinel is readable."""
            loop.remove_reader(sentinel)
            self.process.join(0)

        loop.add_reader(sentinel, reap)


class _ProcessWorkers:
    """Spawn-started workers, one call each at a time; a call past its deadline kills its
    worker (and a new one is started for the next call). Spawn, not fork: the parent runs
    threads (servers, torch) that fork would copy mid-lock."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: list[_ProcessWorker] = []
        self.killed = 0

    async def call(self, fn: RewardFn, traj: Trajectory, task: Task, timeout: float) -> Any:
        """``fn(traj, task)`` in a worker; TimeoutError after ``timeout`` (worker killed)."""
        worker = self._idle.pop() if self._idle else None
        if worker is None or not worker.process.is_alive():
            worker = _ProcessWorker(self._ctx)
            try:
                await worker.ready()
            except BaseException:
                worker.kill()
                raise
        try:
            result = await worker.call(fn, traj, task, timeout)
        except TimeoutError:
            self.killed += 1
            worker.kill()
            raise
        except _WorkerCallError:
            self._idle.append(worker)  # the function raised; the worker is fine
            raise
        except BaseException:  # cancelled mid-call: the worker's state is unknown
            worker.kill()
            raise
        self._idle.append(worker)
        return result

    def close(self) -> None:
        """Stop the idle workers (EOF on their pipe; killed after 5 s)."""
        for worker in self._idle:
            worker.conn.close()  # EOF: the worker returns
            worker.process.join(5)
            if worker.process.is_alive():
                worker.process.kill()
        self._idle.clear()


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


def _is_model_call(fn: Any) -> bool:
    """``fn`` is a model reward's ``score`` (runs on the event loop, whatever the executor)."""
    from agentrl.rollout.model_rewards import ModelReward

    return isinstance(getattr(fn, "__self__", None), ModelReward)


def _is_combined(fn: Any) -> bool:
    from agentrl.rollout.model_rewards import CombinedReward

    return isinstance(fn, CombinedReward)


def _function_terms(fn: Any) -> list[Any]:
    """The user functions a reward runs through the executor (what a process pool receives)."""
    if fn is None or _is_model_call(fn):
        return []
    if _is_combined(fn):
        terms = [t for _, term, _ in fn.terms for t in _function_terms(term)]
        return terms + ([fn.combine] if fn.combine is not None else [])
    return [fn]


def _reward_name(fn: Any) -> str:
    """How messages name a reward: the function's name, ``reward.models.<name>``, or the mix."""
    if _is_model_call(fn):
        return f"reward.models.{fn.__self__.name}"
    return getattr(fn, "__qualname__", None) or repr(fn)


class RewardManager:
    """Scores trajectories per ``data_source`` as they finish, with bounded concurrency.

    Args:
        sources: ``data_source -> reward`` (a built-in name, ``module:function`` or callable).
        default: reward for data sources not in ``sources``. When None, a data source that is
            itself a built-in name (e.g. ``calculator``) uses that built-in; any other is an error.
        executor: ``"async"`` (event loop), ``"thread"`` or ``"process"`` (see module docstring).
        max_workers: most reward calls in flight (and the pool size).
        timeout_s: per-call deadline (> 0). Past it the call is abandoned (async and thread:
            cancelled, its thread left to finish) or its worker process killed, and
            :class:`RewardTimeoutError` is raised.
        format_weight: adds ``format_weight * tool_format(traj, task)`` to every successful
            score (``reward_info["tool_format"]`` reports the term); 0 = off.
        models: named model rewards (``reward.models``: a reward model or an LLM judge, see
            :mod:`agentrl.rollout.model_rewards`), usable by name in ``sources``/``default``;
            they score once :meth:`connect_models` has given them their servers.

    A ``sources`` value may also be a mix ``{"terms": {name: weight} | [names], "combine":
    "module:function" | None}``: the terms run concurrently (each under its own executor and
    deadline) and their scores are summed with the weights, or handed to ``combine``. Model
    rewards always run on the event loop; only function rewards take a ``max_workers`` slot.

    ``score(traj, task)`` raises :class:`RewardError` (:class:`RewardTimeoutError` for a
    timeout) when the reward function fails, after counting it, and
    :class:`RewardConfigError` for a data source with no reward configured.
    """

    def __init__(
        self,
        sources: Mapping[str, str | RewardFn] | None = None,
        default: str | RewardFn | None = None,
        executor: Executor = "async",
        max_workers: int = 4,
        timeout_s: float = 60.0,
        format_weight: float = 0.0,
        base_dir: Any = None,
        models: Mapping[str, Any] | None = None,
    ) -> None:
        if executor not in ("async", "thread", "process"):
            raise RewardConfigError(
                f"reward executor {executor!r}: use 'async', 'thread' or 'process'"
            )
        if max_workers < 1:
            raise RewardConfigError(f"reward max_workers = {max_workers}; it must be >= 1")
        if timeout_s is None or not timeout_s > 0:
            raise RewardConfigError(
                f"reward timeout_s = {timeout_s!r}; it must be a number of seconds > 0 "
                "(every reward call needs a deadline)"
            )
        self.executor: Executor = executor
        self.max_workers = max_workers
        self.timeout_s = float(timeout_s)
        self.format_weight = format_weight
        self._specs = dict(sources or {})
        self.models: dict[str, Any] = {}
        if models:
            from agentrl.rollout.model_rewards import build_model_reward

            for name, spec in models.items():
                if name in REWARDS:
                    raise RewardConfigError(
                        f"reward.models.{name}: the name is taken by the reward function "
                        f"{name!r}; give the model reward another name"
                    )
                try:
                    self.models[name] = build_model_reward(
                        name, spec, timeout_s=self.timeout_s, base_dir=base_dir
                    )
                except (ValueError, OSError) as exc:
                    raise RewardConfigError(str(exc)) from exc
        self._base_dir = base_dir
        self._model_servers: tuple[dict[str, list[str]], str | None] = ({}, None)
        self._fns: dict[str, RewardFn] = {
            source: self._resolve(spec, key=f"reward.sources.{source}")
            for source, spec in self._specs.items()
        }
        self._default = (
            self._resolve(default, key="reward.default") if default is not None else None
        )
        if executor == "process":
            for name, fn in [*self._fns.items(), ("<default>", self._default)]:
                for term in _function_terms(fn):
                    self._check_picklable(name, term)
        self._threads: DaemonThreadPool | None = None
        self._processes: _ProcessWorkers | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._counts: dict[str, dict[str, int]] = {}
        self._latency_sum = 0.0
        self._latency_max = 0.0
        self._in_flight = 0

    @classmethod
    def from_config(cls, cfg: Any, *, base_dir: Any = None) -> RewardManager:
        """Build from the ``reward`` config section (``sources``, ``default``, ``executor``,
        ``max_workers``, ``timeout_s``, ``format_weight``, ``models``; any object with those
        attributes);
        path specs resolve against ``base_dir`` (the config file's folder)."""
        return cls(
            base_dir=base_dir,
            sources=dict(cfg.sources),
            default=cfg.default,
            executor=cfg.executor,
            max_workers=cfg.max_workers,
            timeout_s=cfg.timeout_s,
            format_weight=cfg.format_weight,
            models=dict(cfg.models),
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
        state["_threads"] = None
        state["_processes"] = None
        state["_semaphore"] = None
        return state

    def _resolve(self, spec: Any, *, key: str) -> RewardFn:
        """The reward of one ``sources``/``default`` value: a ``models`` name (its async
        ``score``), a mix of terms (:class:`~agentrl.rollout.model_rewards.CombinedReward`), or
        anything :func:`resolve_reward_fn` takes."""
        if isinstance(spec, str) and spec in self.models:
            return self.models[spec].score
        terms = spec.get("terms") if isinstance(spec, Mapping) else getattr(spec, "terms", None)
        if terms is not None:
            return self._combined(spec, terms, key=key)
        try:
            return resolve_reward_fn(cast(Any, spec), key=key, base_dir=self._base_dir)
        except RewardConfigError as exc:
            if not self.models or not isinstance(spec, str) or ":" in spec:
                raise
            raise RewardConfigError(
                f"{exc}; or a reward.models name: {sorted(self.models)}"
            ) from None

    def _combined(self, spec: Any, terms: Any, *, key: str) -> RewardFn:
        """A :class:`~agentrl.rollout.model_rewards.CombinedReward` of ``terms`` (``{name:
        weight}`` or ``[names]``) and the optional ``combine`` function of ``spec``."""
        from agentrl.registry import RegistryError, import_spec
        from agentrl.rollout.model_rewards import CombinedReward

        weights = dict(terms) if isinstance(terms, Mapping) else dict.fromkeys(terms, 1.0)
        if not weights:
            raise RewardConfigError(f"{key}.terms is empty; name at least one reward")
        parts = []
        for name, weight in weights.items():
            if not isinstance(name, str) or isinstance(weight, bool):
                raise RewardConfigError(f"{key}.terms: {name!r}: {weight!r} is not name: weight")
            parts.append((name, self._resolve(name, key=f"{key}.terms.{name}"), float(weight)))
        combine = spec.get("combine") if isinstance(spec, Mapping) else spec.combine
        if isinstance(combine, str):
            try:
                combine = import_spec(combine, base_dir=self._base_dir, key=f"{key}.combine")
            except RegistryError as exc:
                raise RewardConfigError(str(exc)) from None
        if combine is not None and not callable(combine):
            raise RewardConfigError(f"{key}.combine: {combine!r} is not a function")
        return cast(RewardFn, CombinedReward(tuple(parts), combine))

    def connect_models(self, urls: Mapping[str, Sequence[str]], api_key: str | None = None) -> None:
        """Give each model reward its servers (``{name: base URLs}``, from the builder) and the
        key they want (an entry's own ``api_key`` wins)."""
        missing = sorted(set(self.models) - set(urls))
        if missing:
            raise RewardConfigError(f"no servers for reward.models {missing}")
        for name, model in self.models.items():
            model.connect(urls[name], api_key)
        self._model_servers = ({n: list(u) for n, u in urls.items()}, api_key)

    def model_servers(self) -> tuple[dict[str, list[str]], str | None]:
        """``({name: urls}, api_key)`` as given to :meth:`connect_models`: what a manager in
        another process (a Ray reward actor) needs to reach the same servers."""
        return self._model_servers

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

    def _thread_pool(self) -> DaemonThreadPool:
        if self._threads is None:
            self._threads = DaemonThreadPool(self.max_workers, name="agentrl-reward")
        return self._threads

    def _runs_inline(self, fn: RewardFn) -> bool:
        """Sync functions run on the event loop only when they are this module's built-ins
        (bounded, ours); user code always runs where a deadline can be enforced."""
        return self.executor == "async" and getattr(fn, "__module__", None) == __name__

    async def _call(self, fn: RewardFn, traj: Trajectory, task: Task) -> tuple[Any, bool]:
        """``fn(traj, task)`` under ``timeout_s``: (result, False), or (None, True) when the
        deadline passed (the call is then abandoned or its worker killed, and counted)."""
        if _is_combined(fn):
            return await self._call_combined(cast(Any, fn), traj, task), False
        if self.executor == "process" and not _is_model_call(fn):
            if self._processes is None:
                self._processes = _ProcessWorkers()
            try:
                return await self._processes.call(fn, traj, task, self.timeout_s), False
            except TimeoutError:
                self._count(task.data_source, "killed")
                return None, True
        thread: concurrent.futures.Future[Any] | None = None
        if inspect.iscoroutinefunction(fn):
            work: asyncio.Future[Any] = asyncio.ensure_future(fn(traj, task))
        elif self._runs_inline(fn):
            return fn(traj, task), False
        else:
            future = self._thread_pool().submit(contextvars.copy_context().run, fn, traj, task)
            thread, work = future, asyncio.wrap_future(future)
        try:
            done, _ = await asyncio.wait({work}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            work.cancel()
            raise
        if not done:
            work.cancel()
            self._check_abandoned(task.data_source, work, thread)
            return None, True
        out = work.result()
        return (await out if inspect.isawaitable(out) else out), False

    async def _call_term(self, fn: RewardFn, traj: Trajectory, task: Task, name: str) -> Any:
        """One term of a mix: a function under a ``max_workers`` slot, a model reward under its
        own limit; each under ``timeout_s``. Failures name the term."""
        gate = contextlib.nullcontext() if _is_model_call(fn) else self._slot()
        async with gate:
            result, timed_out = await self._call(fn, traj, task)
        if timed_out:
            raise RewardTimeoutError(
                f"reward {name!r} (a term of data_source {task.data_source!r}) timed out after "
                f"{self.timeout_s:g} s (reward.timeout_s)",
                source=task.data_source,
            )
        try:
            return _normalize_result(result, traj)
        except ValueError as exc:
            raise ValueError(f"term {name!r}: {exc}") from exc

    async def _call_combined(self, mix: Any, traj: Trajectory, task: Task) -> Any:
        """Every term of ``mix`` concurrently, then the weighted sum or ``mix.combine``."""
        from agentrl.rollout.model_rewards import combine_terms

        async def term(name: str, fn: RewardFn) -> Any:
            """One term's normalized result; an unexpected failure names the term."""
            try:
                return await self._call_term(fn, traj, task, name)
            except (RewardError, ValueError):
                raise
            except Exception as exc:
                raise RuntimeError(f"term {name!r}: {type(exc).__name__}: {exc}") from exc

        tasks = [asyncio.ensure_future(term(name, fn)) for name, fn, _ in mix.terms]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:  # one term failed (or we were cancelled): stop the others
                t.cancel()
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise cast(BaseException, t.exception())
        results = {name: t.result() for (name, _, _), t in zip(mix.terms, tasks, strict=True)}
        if mix.combine is None:
            weights = {name: weight for name, _, weight in mix.terms}
            return combine_terms(results, weights, traj.num_turns)
        scores = {name: score for name, (score, _, _) in results.items()}
        async with self._slot():
            out, timed_out = await self._call(functools.partial(mix.combine, scores), traj, task)
        if timed_out:
            raise RewardTimeoutError(
                f"combine {mix.combine!r} timed out after {self.timeout_s:g} s",
                source=task.data_source,
            )
        score, turn_rewards, info = _normalize_result(out, traj)
        merged = {"terms": scores, **{n: i for n, (_, _, i) in results.items() if i}, **info}
        if turn_rewards is not None:
            merged["turn_rewards"] = turn_rewards
        return {**merged, "score": score}

    def _slot(self) -> asyncio.Semaphore:
        """The ``max_workers`` semaphore (created in the running loop)."""
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_workers)
        return self._semaphore

    def _check_abandoned(
        self,
        source: str,
        work: asyncio.Future[Any],
        thread: concurrent.futures.Future[Any] | None,
    ) -> None:
        """Count the timed-out call as abandoned if it still runs ``_ABANDON_GRACE_S`` later."""
        work.add_done_callback(lambda f: f.cancelled() or f.exception())

        def check() -> None:
            """Count the call as abandoned (and warn) if it is still running."""
            if not work.done() or (thread is not None and not thread.done()):
                self._count(source, "abandoned")
                logger.warning(
                    "a reward call for data_source %r still runs %.0f s after its deadline "
                    "(it ignores cancellation, or its thread cannot be stopped)",
                    source,
                    _ABANDON_GRACE_S,
                )

        asyncio.get_running_loop().call_later(_ABANDON_GRACE_S, check)

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        """A copy of ``traj`` with ``reward``, ``turn_rewards``, ``reward_info`` and
        ``timings["reward"]`` set. A reward function that raises, returns something malformed
        or runs past ``timeout_s`` raises :class:`RewardError` (counted per data source)."""
        fn = self.reward_fn_for(task.data_source)
        # Model rewards and mixes take no slot here: their function terms take one each.
        gate = self._slot() if not (_is_model_call(fn) or _is_combined(fn)) else None
        async with gate or contextlib.nullcontext():
            self._in_flight += 1
            start = time.perf_counter()
            try:
                score, turn_rewards, info, failure = await self._score_once(fn, traj, task)
            finally:
                self._in_flight -= 1
            elapsed = time.perf_counter() - start
        self._latency_sum += elapsed
        self._latency_max = max(self._latency_max, elapsed)
        if failure is not None:
            raise failure
        return traj.model_copy(
            update={
                "reward": score,
                "turn_rewards": turn_rewards if turn_rewards is not None else traj.turn_rewards,
                "reward_info": {**traj.reward_info, **info},
                "timings": {**traj.timings, "reward": elapsed},
            }
        )

    async def _score_once(
        self, fn: RewardFn, traj: Trajectory, task: Task
    ) -> tuple[float, list[float] | None, dict[str, Any], RewardError | None]:
        """One bounded call, normalized and counted; failures returned as a RewardError."""
        source = task.data_source
        name = _reward_name(fn)
        try:
            result, timed_out = await self._call(fn, traj, task)
            if timed_out:
                raise RewardTimeoutError(
                    f"reward function {name!r} for data_source {source!r} timed out after "
                    f"{self.timeout_s:g} s (reward.timeout_s)",
                    source=source,
                )
            score, turn_rewards, info = _normalize_result(result, traj)
            if self.format_weight:
                fmt = float(tool_format(traj, task)["score"])
                info["tool_format"] = fmt
                score += self.format_weight * fmt
        except RewardTimeoutError as exc:
            self._count(source, "timeouts", "errors")
            logger.warning("trajectory %s (task %s): %s", traj.uid, task.id, exc)
            return 0.0, None, {}, exc
        except Exception as exc:
            self._count(source, "errors")
            detail = (
                str(exc) if isinstance(exc, _WorkerCallError) else f"{type(exc).__name__}: {exc}"
            )
            error = RewardError(
                f"reward function {name!r} for data_source {source!r} failed: {detail}",
                source=source,
            )
            error.__cause__ = exc
            logger.warning("trajectory %s (task %s): %s", traj.uid, task.id, error)
            return 0.0, None, {}, error
        self._count(source, "scored")
        return score, turn_rewards, info, None

    def _count(self, source: str, *keys: str) -> None:
        counts = self._counts.setdefault(
            source, {"scored": 0, "errors": 0, "timeouts": 0, "abandoned": 0, "killed": 0}
        )
        for key in keys:
            counts[key] += 1

    def metrics(self) -> dict[str, float]:
        """Cumulative counters since construction (``reward/`` family).

        Totals ``reward/scored``, ``errors`` (timeouts included), ``timeouts``, and per data
        source ``reward/<source>/scored``, ``errors``, ``timeouts``, ``abandoned`` (timed-out
        calls still running ``1 s`` later: an async function ignoring cancellation, or a thread
        that cannot be stopped), ``killed`` (process workers killed at the deadline); plus
        ``reward/in_flight``, ``reward/threads_busy`` and the latency of every call; and per
        model reward ``reward/models/<name>/requests``, ``scored``, ``errors``, ``unparsed``,
        ``latency_mean_s``, ``latency_max_s``.
        """
        totals = {key: 0 for key in ("scored", "errors", "timeouts")}
        out: dict[str, float] = {}
        for source, counts in sorted(self._counts.items()):
            for key, value in counts.items():
                out[f"reward/{source}/{key}"] = float(value)
                if key in totals:
                    totals[key] += value
        n = totals["scored"] + totals["errors"]
        return {
            "reward/scored": float(totals["scored"]),
            "reward/errors": float(totals["errors"]),
            "reward/timeouts": float(totals["timeouts"]),
            "reward/in_flight": float(self._in_flight),
            "reward/threads_busy": float(self._threads.busy if self._threads else 0),
            "reward/latency_mean_s": self._latency_sum / n if n else 0.0,
            "reward/latency_max_s": self._latency_max,
            **out,
            **{k: v for model in self.models.values() for k, v in model.metrics().items()},
        }

    def close(self) -> None:
        """Stop the workers (idempotent); never waits for a hung thread."""
        if self._threads is not None:
            self._threads.shutdown(cancel_futures=True)
            self._threads = None
        if self._processes is not None:
            self._processes.close()
            self._processes = None

    async def aclose(self) -> None:
        """:meth:`close`, and close the model rewards' HTTP clients."""
        self.close()
        for model in self.models.values():
            await model.aclose()

    async def __aenter__(self) -> RewardManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
