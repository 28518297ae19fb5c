"""Reward functions and the RewardManager: built-ins, sync/async/path/per-source/per-turn,
bounded concurrency, executors, deadlines that hold whatever the function does, and failures
raised as counted RewardErrors."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pickle
import threading
from fractions import Fraction

import pytest

from agentrl.rollout.rewards import (
    BUILTIN_REWARDS,
    RewardConfigError,
    RewardError,
    RewardManager,
    RewardTimeoutError,
    calculator_reward,
    exact_match,
    extract_answer,
    final_answer_text,
    numeric_match,
    parse_number,
    resolve_reward_fn,
    tool_format,
)
from agentrl.types import Task, Trajectory
from tests.waiting import until, within


def make_traj(answer: str | None = "", *, num_turns: int = 1, tool_calls=None, messages=None):
    if messages is None:
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
    return Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        loss_mask=[1, 0],
        rollout_logprobs=[-0.5, 0.0],
        policy_version=[0, -1],
        uid="u",
        num_turns=num_turns,
        tool_calls=tool_calls or {},
        messages=messages,
        timings={"generate": 0.1},
    )


def make_task(gt="42", data_source="default", **spec) -> Task:
    return Task(
        id="t0", prompt="q", data_source=data_source, reward_spec={"ground_truth": gt, **spec}
    )


# ---- module-level reward functions (importable, so they work by path and in processes) -----
def const_half(traj: Trajectory, task: Task) -> float:
    return 0.5


async def async_len_reward(traj: Trajectory, task: Task) -> dict:
    await asyncio.sleep(0)
    return {"score": float(len(final_answer_text(traj))), "judge": "len"}


def per_turn_reward(traj: Trajectory, task: Task) -> dict:
    return {"score": 1.0, "turn_rewards": [0.25] * traj.num_turns}


async def async_pid_reward(traj: Trajectory, task: Task) -> dict:
    return {"score": 2.0, "pid": os.getpid()}


def raising_reward(traj: Trajectory, task: Task) -> float:
    raise RuntimeError("grader crashed")


# ---- extraction ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the total is\n#### 1,234", "1,234"),
        ("The answer is \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("no marker 17", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", Fraction(42)),
        ("-1,234.5", Fraction("-1234.5")),
        ("$12", Fraction(12)),
        ("50%", Fraction(50)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("1e3", Fraction(1000)),
        ("12.", Fraction(12)),
        ("twelve", None),
        ("1 2", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_final_answer_text_uses_last_assistant_message_and_content_parts():
    msgs = [
        {"role": "assistant", "content": "first"},
        {"role": "tool", "content": "9"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {"role": "user", "content": "later user turn"},
    ]
    assert final_answer_text(make_traj(messages=msgs)) == "ab"
    assert final_answer_text(make_traj(messages=[{"role": "user", "content": "x"}])) == ""
    assert final_answer_text(make_traj(None)) == ""


# ---- built-ins ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("answer", "gt", "score"),
    [
        ("#### 42", "42", 1.0),
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("I think 40 + 2 = 42", "42", 1.0),  # last number
        ("I think 42 is not it, 41", "42", 0.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("\\boxed{1234.0000000001}", "1234", 1.0),  # tolerant
        ("\\boxed{1235}", "1234", 0.0),
        ("\\boxed{0.5}", "1/2", 1.0),
        ("#### 7", "Natalia sold 48/2 = 24 ... #### 7", 1.0),  # GSM8K-form ground truth
        ("no number at all", "3", 0.0),
        ("\\boxed{-12}", "-12", 1.0),
    ],
)
def test_numeric_match(answer, gt, score):
    assert numeric_match(make_traj(answer), make_task(gt))["score"] == score


def test_numeric_match_tolerance_from_reward_spec():
    traj = make_traj("\\boxed{3.14}")
    assert numeric_match(traj, make_task("3.14159"))["score"] == 0.0
    assert numeric_match(traj, make_task("3.14159", rel_tol=1e-3))["score"] == 1.0


def test_numeric_match_rejects_non_numeric_ground_truth():
    with pytest.raises(ValueError, match="ground_truth"):
        numeric_match(make_traj("1"), make_task("Paris"))


@pytest.mark.parametrize(
    ("answer", "gt", "score"),
    [
        ("  Paris. ", "paris", 1.0),
        ("The capital is \\boxed{Paris}", "Paris", 1.0),
        ("The capital is Paris", "Paris", 0.0),
        ("Lyon", ["Paris", "Lyon"], 1.0),
    ],
)
def test_exact_match(answer, gt, score):
    assert exact_match(make_traj(answer), make_task(gt))["score"] == score


def test_missing_ground_truth_names_the_field():
    task = Task(id="x", prompt="q", reward_spec={})
    with pytest.raises(ValueError, match=r"reward_spec\['ground_truth'\]"):
        exact_match(make_traj("1"), task)


def test_calculator_reward_scores_correct_answer_and_reports_format():
    task = make_task("178377", data_source="calculator")
    good = calculator_reward(make_traj("\\boxed{178377}", tool_calls={"calculator": 1}), task)
    assert good["score"] == 1.0
    assert good["boxed"] and good["used_tool"] and good["invalid_tool_calls"] == 0
    unboxed = calculator_reward(make_traj("it is 178377"), task)
    assert unboxed["score"] == 1.0 and not unboxed["boxed"] and not unboxed["used_tool"]
    wrong = calculator_reward(make_traj("\\boxed{178378}", tool_calls={"<invalid>": 2}), task)
    assert wrong["score"] == 0.0 and wrong["invalid_tool_calls"] == 2


def test_tool_format_from_counts_and_from_text():
    task = make_task()
    assert tool_format(make_traj(tool_calls={"calculator": 3}), task)["score"] == 1.0
    assert (
        tool_format(make_traj(tool_calls={"calculator": 1, "<invalid>": 1}), task)["score"] == 0.5
    )
    assert tool_format(make_traj(), task)["score"] == 0.0
    restricted = Task(id="t", prompt="q", reward_spec={"tools": ["calculator"]})
    assert (
        tool_format(make_traj(tool_calls={"calculator": 1, "search": 1}), restricted)["score"]
        == 0.5
    )
    msgs = [
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>',
        },
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {'},
    ]
    info = tool_format(make_traj(messages=msgs), task)
    assert (info["valid_calls"], info["invalid_calls"], info["score"]) == (1, 1, 0.5)


# ---- resolving --------------------------------------------------------------------------
def test_resolve_by_name_path_and_callable():
    assert resolve_reward_fn("numeric_match") is numeric_match
    assert resolve_reward_fn("tests.unit.rollout.test_rewards:const_half") is const_half
    assert resolve_reward_fn(const_half) is const_half


def test_unknown_name_lists_builtins():
    with pytest.raises(RewardConfigError) as err:
        resolve_reward_fn("exact_mtch")
    for name in BUILTIN_REWARDS:
        assert name in str(err.value)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("tests.unit.rollout.test_rewards:missing", "has no attribute 'missing'"),
        ("tests.unit.rollout.test_rewards:BUILTIN_REWARDS", "must be callable"),
    ],
)
def test_bad_paths_say_what_is_wrong(spec, match):
    with pytest.raises(RewardConfigError, match=match):
        resolve_reward_fn(spec)


# ---- the manager ----------------------------------------------------------------------------
async def test_manager_picks_reward_per_data_source_sync_async_and_path():
    mgr = RewardManager(
        sources={
            "math": "numeric_match",
            "judge": "tests.unit.rollout.test_rewards:async_len_reward",
            "half": const_half,
        }
    )
    traj = make_traj("\\boxed{42}")
    math_scored = await mgr.score(traj, make_task("42", data_source="math"))
    assert math_scored.reward == 1.0 and math_scored.reward_info["correct"] is True
    judged = await mgr.score(traj, make_task("42", data_source="judge"))
    assert judged.reward == float(len("\\boxed{42}")) and judged.reward_info["judge"] == "len"
    assert (await mgr.score(traj, make_task(data_source="half"))).reward == 0.5
    # a data source named like a built-in uses that built-in when no default is set
    calc = await mgr.score(traj, make_task("42", data_source="calculator"))
    assert calc.reward == 1.0 and "boxed" in calc.reward_info
    with pytest.raises(RewardConfigError, match="no reward function for data_source 'other'"):
        await mgr.score(traj, make_task(data_source="other"))
    assert mgr.metrics()["reward/scored"] == 4.0


async def test_score_returns_a_copy_with_timings_and_keeps_the_original():
    mgr = RewardManager(default="numeric_match")
    traj = make_traj("\\boxed{42}")
    scored = await mgr.score(traj, make_task("42"))
    assert traj.reward == 0.0 and "reward" not in traj.timings
    assert scored.reward == 1.0
    assert scored.timings["generate"] == 0.1 and scored.timings["reward"] >= 0.0
    assert scored.response_ids == traj.response_ids


async def test_per_turn_rewards():
    mgr = RewardManager(default=per_turn_reward)
    scored = await mgr.score(make_traj("x", num_turns=3), make_task())
    assert scored.turn_rewards == [0.25, 0.25, 0.25]

    def wrong_length(traj, task):
        return {"score": 1.0, "turn_rewards": [1.0]}

    with pytest.raises(RewardError, match="one per model turn"):
        await RewardManager(default=wrong_length).score(make_traj("x", num_turns=2), make_task())


async def test_raising_reward_raises_a_reward_error_naming_function_and_source(caplog):
    mgr = RewardManager(sources={"boom": raising_reward})
    with (
        caplog.at_level(logging.WARNING, logger="agentrl.rollout.rewards"),
        pytest.raises(RewardError) as info,
    ):
        await mgr.score(make_traj("x"), make_task(data_source="boom"))
    assert str(info.value) == (
        "reward function 'raising_reward' for data_source 'boom' failed: "
        "RuntimeError: grader crashed"
    )
    assert info.value.source == "boom" and not isinstance(info.value, RewardTimeoutError)
    m = mgr.metrics()
    assert m["reward/errors"] == 1.0 and m["reward/boom/errors"] == 1.0
    assert m["reward/scored"] == 0.0 and m["reward/boom/timeouts"] == 0.0
    assert "grader crashed" in caplog.text


@pytest.mark.parametrize(
    ("result", "match"),
    [
        ({"value": 1.0}, "no 'score'"),
        ("1.0", "return a float or a dict"),
        (float("nan"), "must be finite"),
        ({"score": "high"}, "not a number"),
    ],
)
async def test_malformed_results_are_errors(result, match):
    mgr = RewardManager(default=lambda traj, task: result)
    with pytest.raises(RewardError, match=match):
        await mgr.score(make_traj("x"), make_task())
    assert mgr.metrics()["reward/errors"] == 1.0


def test_reward_errors_pickle_with_their_source():
    for cls in (RewardError, RewardTimeoutError):
        error = pickle.loads(pickle.dumps(cls("judge failed", source="math")))
        assert type(error) is cls and str(error) == "judge failed" and error.source == "math"


def test_timeout_must_be_a_positive_number():
    for bad in (0, -1.0, None):
        with pytest.raises(RewardConfigError, match="timeout_s"):
            RewardManager(timeout_s=bad)  # type: ignore[arg-type]  # testing bad values


async def test_async_timeout_holds_even_when_the_judge_swallows_cancellation():
    # The judge ignores cancellation until the test ends (a badly written retry loop): only the
    # manager's deadline can end the call; a missed deadline hangs here, it cannot pass.
    stop = asyncio.Event()
    calls = {"cancelled": 0, "returned": 0}

    async def judge(traj: Trajectory, task: Task) -> float:
        while not stop.is_set():
            try:
                await stop.wait()
            except asyncio.CancelledError:
                calls["cancelled"] += 1
        calls["returned"] += 1
        return 1.0

    mgr = RewardManager(sources={"judge": judge}, timeout_s=0.3)
    try:
        with pytest.raises(RewardTimeoutError, match=r"'judge' timed out after 0.3 s"):
            await within(
                mgr.score(make_traj("x"), make_task(data_source="judge")),
                "the reward deadline did not fire",
            )
        # The abandon check was scheduled on this loop 1 s after the deadline, before this
        # sleep began: the loop runs it first (timer order, not a race with the wall clock).
        await asyncio.sleep(1.2)  # past the abandon grace period
        assert calls == {"cancelled": 1, "returned": 0}  # told to stop; it did not
        m = mgr.metrics()
        assert m["reward/judge/timeouts"] == 1 and m["reward/judge/abandoned"] == 1
        assert m["reward/timeouts"] == 1 and m["reward/errors"] == 1
    finally:
        stop.set()
    await until(lambda: calls["returned"] == 1, "the abandoned judge did not return once released")


async def test_a_well_behaved_timeout_is_not_counted_as_abandoned():
    async def slow(traj, task):
        await asyncio.Event().wait()  # never set: only the deadline ends the call
        return 1.0

    mgr = RewardManager(sources={"slow": slow}, timeout_s=0.05)
    with pytest.raises(RewardTimeoutError):
        await within(
            mgr.score(make_traj("x"), make_task(data_source="slow")),
            "the reward deadline did not fire",
        )
    await asyncio.sleep(1.2)  # past the grace period (the abandon check runs first: timer order)
    m = mgr.metrics()
    assert m["reward/slow/timeouts"] == 1 and m["reward/slow/abandoned"] == 0


@pytest.mark.parametrize("executor", ["async", "thread"])
async def test_a_hung_sync_reward_is_abandoned_on_the_reward_pool_not_the_default_one(executor):
    release = threading.Event()
    loop = asyncio.get_running_loop()
    # A default pool as small as the hung calls: any of them landing there would starve it.
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    threads_used: list[str] = []

    def hung(traj, task):
        threads_used.append(threading.current_thread().name)
        release.wait()  # until the test ends: only the deadline ends the call
        return 1.0

    mgr = RewardManager(sources={"hung": hung}, executor=executor, timeout_s=0.2, max_workers=2)
    try:
        for _ in range(2):
            with pytest.raises(RewardTimeoutError):
                await within(
                    mgr.score(make_traj("x"), make_task(data_source="hung")),
                    "the reward deadline did not fire",
                )
        assert len(threads_used) == 2
        assert all(name.startswith("agentrl-reward") for name in threads_used)
        # the loop's default executor is untouched by the hung calls (had they landed there,
        # this call would wait for them, i.e. until the test ends)
        seven = loop.run_in_executor(None, lambda: 7)
        assert await within(seven, "the hung reward calls starve the default executor") == 7
        await asyncio.sleep(1.2)
        m = mgr.metrics()
        assert m["reward/hung/abandoned"] == 2 and m["reward/threads_busy"] == 2
    finally:
        release.set()
        mgr.close()


async def test_process_executor_kills_a_hanging_worker_and_replaces_it():
    mgr = RewardManager(
        sources={
            "hang": "tests.unit.rollout.worker_rewards:hanging_reward",
            "ok": "tests.unit.rollout.worker_rewards:pid_reward",
        },
        executor="process",
        max_workers=1,
        timeout_s=2.0,
    )
    try:
        first = await mgr.score(make_traj("x"), make_task(data_source="ok"))
        with pytest.raises(RewardTimeoutError, match="timed out after 2 s"):
            await within(
                mgr.score(make_traj("x"), make_task(data_source="hang")),
                "the reward deadline did not kill the hanging worker",
            )
        hung_pid = first.reward_info["pid"]  # the one worker ran "ok", then "hang"
        # the killed worker is reaped by the event loop
        await until(lambda: not _alive(hung_pid), "the killed worker was never reaped")
        after = await mgr.score(make_traj("x"), make_task(data_source="ok"))
        assert after.reward == 1.0 and after.reward_info["pid"] != hung_pid
        m = mgr.metrics()
        assert m["reward/hang/killed"] == 1 and m["reward/hang/timeouts"] == 1
        assert m["reward/ok/scored"] == 2
    finally:
        mgr.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


async def test_process_executor_survives_a_worker_that_exits():
    mgr = RewardManager(
        sources={
            "exit": "tests.unit.rollout.worker_rewards:exiting_reward",
            "ok": "tests.unit.rollout.worker_rewards:pid_reward",
        },
        executor="process",
        max_workers=1,
    )
    try:
        with pytest.raises(RewardError, match="worker process died"):
            await mgr.score(make_traj("x"), make_task(data_source="exit"))
        assert (await mgr.score(make_traj("x"), make_task(data_source="ok"))).reward == 1.0
    finally:
        mgr.close()


@pytest.mark.parametrize("executor", ["async", "thread"])
async def test_concurrency_is_bounded(executor):
    active = 0
    peak = 0

    async def tracked_async(traj, task):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.01)
        active -= 1
        return 1.0

    mgr = RewardManager(default=tracked_async, executor=executor, max_workers=3)
    results = await asyncio.gather(*(mgr.score(make_traj("x"), make_task()) for _ in range(20)))
    assert all(r.reward == 1.0 for r in results)
    assert peak == 3
    mgr.close()


async def test_thread_executor_runs_sync_functions_off_the_event_loop():
    import threading

    loop_thread = threading.get_ident()
    seen = []

    def where(traj, task):
        seen.append(threading.get_ident())
        return 1.0

    async with RewardManager(default=where, executor="thread", max_workers=2) as mgr:
        await mgr.score(make_traj("x"), make_task())
    assert seen and seen[0] != loop_thread


async def test_process_executor_runs_sync_and_async_functions_in_workers():
    mgr = RewardManager(
        sources={
            "sync": "tests.unit.rollout.worker_rewards:pid_reward",
            "async": async_pid_reward,
            "boom": raising_reward,
        },
        executor="process",
        max_workers=1,
    )
    try:
        s = await mgr.score(make_traj("x"), make_task(data_source="sync"))
        a = await mgr.score(make_traj("x"), make_task(data_source="async"))
        with pytest.raises(RewardError) as info:
            await mgr.score(make_traj("x"), make_task(data_source="boom"))
        b = str(info.value).split(" ", 3)[3]
    finally:
        mgr.close()
    assert s.reward == 1.0 and s.reward_info["pid"] != os.getpid()
    assert a.reward == 2.0 and a.reward_info["pid"] == s.reward_info["pid"]
    assert b == "for data_source 'boom' failed: RuntimeError: grader crashed"


def test_process_executor_rejects_unpicklable_functions_clearly():
    with pytest.raises(RewardConfigError, match=r"cannot be sent to a process pool.*module level"):
        RewardManager(sources={"x": lambda traj, task: 1.0}, executor="process")


def test_bad_executor_and_workers():
    with pytest.raises(RewardConfigError, match="executor"):
        RewardManager(executor="gpu")  # type: ignore[arg-type]
    with pytest.raises(RewardConfigError, match="max_workers"):
        RewardManager(max_workers=0)


async def test_manager_pickles_after_use():
    mgr = RewardManager(sources={"math": "numeric_match"}, executor="thread")
    await mgr.score(make_traj("\\boxed{42}"), make_task("42", data_source="math"))
    clone = pickle.loads(pickle.dumps(mgr))
    scored = await clone.score(make_traj("\\boxed{42}"), make_task("42", data_source="math"))
    assert scored.reward == 1.0
    mgr.close()
    clone.close()


async def test_format_weight_adds_the_tool_format_term():
    mgr = RewardManager(default="numeric_match", format_weight=0.5)
    traj = make_traj("\\boxed{42}", tool_calls={"calculator": 1, "<invalid>": 1})
    scored = await mgr.score(traj, make_task("42"))
    assert scored.reward == 1.0 + 0.5 * 0.5 and scored.reward_info["tool_format"] == 0.5


def test_from_config_reads_the_reward_section():
    from agentrl.config import RewardConfig

    mgr = RewardManager.from_config(
        RewardConfig(executor="thread", max_workers=2, format_weight=0.1, timeout_s=7.0)
    )
    assert mgr.executor == "thread" and mgr.max_workers == 2 and mgr.format_weight == 0.1
    assert mgr.timeout_s == 7.0
    assert RewardManager.from_config(RewardConfig()).timeout_s == RewardConfig().timeout_s
    assert mgr.reward_fn_for("calculator") is calculator_reward
    assert mgr.reward_fn_for("gsm8k") is numeric_match
    assert mgr.reward_fn_for("anything_else") is exact_match


# ---- properties ---------------------------------------------------------------------------
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FORMATS = [
    "\\boxed{{{}}}",
    "so the answer is\n#### {}",
    "We compute it step by step: 12 + 3 = 15, and finally {}",
    "The answer is \\boxed{{{}}}.",
]


@given(n=st.integers(-(10**12), 10**12), fmt=st.sampled_from(_FORMATS), commas=st.booleans())
def test_numeric_match_finds_any_integer_in_any_supported_format(n, fmt, commas):
    written = f"{n:,}" if commas else str(n)
    traj = make_traj(fmt.format(written))
    assert numeric_match(traj, make_task(str(n)))["score"] == 1.0
    assert numeric_match(traj, make_task(str(n + 1)))["score"] == 0.0


@given(n=st.integers(0, 10**9), d=st.integers(0, 10**6 - 1))
def test_parse_number_is_exact_for_fractions_and_decimals(n, d):
    assert parse_number(f"{n}/{d + 1}") == Fraction(n, d + 1)
    assert parse_number(f"{n}.{d:06d}") == Fraction(n) + Fraction(d, 10**6)


async def test_chaos_a_hanging_judge_does_not_stall_the_rollout_stream():
    """Issue 13: one hanging judge used to stall the stream forever (no reward deadline)."""
    from agentrl.inference.tiny_model import build_tiny_tokenizer
    from agentrl.rollout.manager import AgentLoopManager
    from tests.fakes import ScriptedPolicy

    async def hanging_judge(traj: Trajectory, task: Task) -> float:
        await asyncio.Event().wait()  # never set
        return 1.0

    tok = build_tiny_tokenizer()
    rewards = RewardManager(sources={"judge": hanging_judge}, timeout_s=0.5, max_workers=4)
    mgr = AgentLoopManager(ScriptedPolicy(tok, ["\\boxed{1}"]), tok, reward=rewards)
    tasks = [Task(id=f"t{i}", prompt="q", data_source="judge") for i in range(4)]
    out = await within(mgr.generate(tasks), "the stream waited for the hanging judge")
    assert len(out) <= 4
    m = rewards.metrics()
    assert m["reward/judge/timeouts"] == 4 and m["reward/judge/scored"] == 0


def test_a_reward_function_of_the_wrong_arity_is_refused_when_resolved() -> None:
    from agentrl.rollout.rewards import RewardConfigError, RewardManager

    def one(traj):  # the mistake: no task
        return 1.0

    def three(traj, task, extra):  # a third parameter without a default
        return 1.0

    def fine(traj, task, scale=1.0):
        return scale

    for fn in (one, three):
        with pytest.raises(
            RewardConfigError, match=r"reward.sources.s: reward function .* fn\(traj, task\)"
        ):
            RewardManager(sources={"s": fn})
    assert RewardManager(sources={"s": fine}).reward_fn_for("s") is fine


async def test_four_hung_thread_rewards_do_not_drop_the_next_eight_healthy_episodes():
    """Issue 21: hung calls are detached from the reward pool, healthy ones get fresh workers."""
    release = threading.Event()

    def hung(traj, task):
        release.wait()  # until the test ends: only the deadline ends the call
        return 1.0

    def healthy(traj, task):
        return 1.0

    mgr = RewardManager(
        sources={"hung": hung, "healthy": healthy}, executor="thread", timeout_s=3.0, max_workers=4
    )
    try:
        hung_scores = [mgr.score(make_traj("x"), make_task(data_source="hung")) for _ in range(4)]
        outcomes = await within(
            asyncio.gather(*hung_scores, return_exceptions=True), "the deadline never fired"
        )
        assert all(isinstance(o, RewardTimeoutError) for o in outcomes), outcomes
        healthy_scores = [
            mgr.score(make_traj("x"), make_task(data_source="healthy")) for _ in range(8)
        ]
        scored = await within(asyncio.gather(*healthy_scores), "the healthy rewards hung")
        assert len(scored) == 8
        assert mgr.metrics()["reward/healthy/timeouts"] == 0
    finally:
        release.set()
        mgr.close()
