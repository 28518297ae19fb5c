"""ToolSet / ToolEpisode: errors become messages, lifecycles always end, limits, metrics."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.waiting import HANG_GUARD_S, until, within
from tools import (
    Tool,
    ToolResult,
    ToolSet,
    get_tool,
    register_tool,
    registered_tools,
    tool,
    truncate,
)


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return a + b


@tool
def boom(msg: str) -> str:
    """Always raises."""
    raise RuntimeError(msg)


@tool
async def slow(seconds: float) -> str:
    """Sleeps."""
    await asyncio.sleep(seconds)
    return "done"


@tool
def big(n: int) -> str:
    """Returns n characters, 0123456789 repeated."""
    return "".join(str(i % 10) for i in range(n))


class Counter(Tool):
    """A stateful tool recording its lifecycle in a shared log."""

    name = "counter"
    description = "Counts calls within an episode."
    parameters = {"type": "object", "properties": {"step": {"type": "integer"}}}  # noqa: RUF012 (test tool)

    def __init__(self, log: list[str], fail_release: bool = False, fail_create: bool = False):
        self.log = log
        self.fail_release = fail_release
        self.fail_create = fail_create
        self.created = 0

    async def create(self) -> dict[str, int]:
        await asyncio.sleep(0.01)  # give parallel calls a chance to race
        self.created += 1
        if self.fail_create:
            raise OSError("no room")
        self.log.append("create")
        return {"count": 0}

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        state["count"] += int(arguments.get("step", 1))
        if state["count"] >= 3:
            return ToolResult(content=str(state["count"]), reward=1.0, stop=True)
        return ToolResult(content=str(state["count"]), metrics={"count": float(state["count"])})

    async def release(self, state: Any) -> None:
        self.log.append(f"release:{state['count']}")
        if self.fail_release:
            raise RuntimeError("release failed")


async def test_call_validates_and_coerces_json_arguments():
    ts = ToolSet([add])
    async with ts.episode() as ep:
        r = await ep.call("add", '{"a": 2, "b": "3"}')
    assert r == ToolResult(content="5")


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("nope", {}, "error: unknown tool 'nope'; available: add, boom"),
        ("add", '{"a": 2', "error: invalid arguments for 'add': not valid JSON"),
        (
            "add",
            "[1, 2]",
            "error: invalid arguments for 'add': arguments must be a JSON object, got list",
        ),
        ("add", {"a": 1}, "error: invalid arguments for 'add': b: Field required"),
        (
            "add",
            {"a": "x", "b": 1},
            "error: invalid arguments for 'add': a: Input should be a valid integer",
        ),
        (
            "add",
            {"a": 1, "b": 2, "c": 3},
            "error: invalid arguments for 'add': c: Extra inputs are not permitted",
        ),
        ("boom", {"msg": "kaput"}, "error: RuntimeError: kaput"),
    ],
)
async def test_errors_become_messages_never_exceptions(name, arguments, expected):
    ts = ToolSet([add, boom])
    async with ts.episode() as ep:
        r = await ep.call(name, arguments)
    assert r.error is True
    assert r.content.startswith(expected), r.content


async def test_timeout_is_reported_and_counted():
    ts = ToolSet([slow], timeout_s=0.05)
    async with ts.episode() as ep:  # an hour: only the deadline ends the first call
        r = await within(ep.call("slow", {"seconds": 3600}), "the call's deadline did not fire")
        ok = await ep.call("slow", {"seconds": 0})
    assert r.error and r.timed_out and r.content == "error: tool 'slow' timed out after 0.05 s"
    assert ok.content == "done" and not ok.timed_out
    m = ts.metrics()
    assert (
        m["tools/slow/calls"] == 2 and m["tools/slow/timeouts"] == 1 and m["tools/slow/errors"] == 1
    )


async def test_a_tool_raising_timeouterror_is_not_reported_as_our_timeout():
    @tool
    def raises_timeout() -> str:
        """Raises TimeoutError itself."""
        raise TimeoutError("upstream slow")

    ts = ToolSet([raises_timeout], timeout_s=10)
    async with ts.episode() as ep:
        r = await ep.call("raises_timeout", {})
    assert r.content == "error: TimeoutError: upstream slow"
    assert ts.metrics()["tools/raises_timeout/timeouts"] == 0


async def test_per_tool_timeout_overrides_toolset_timeout():
    quick = tool(slow.fn, name="quick", timeout_s=0.05)
    ts = ToolSet([quick], timeout_s=100)
    async with ts.episode() as ep:
        r = await ep.call("quick", {"seconds": 5})
    assert r.content == "error: tool 'quick' timed out after 0.05 s"


@pytest.mark.parametrize(
    ("side", "expected"),
    [
        ("right", "0123456789...[truncated 15 chars]"),
        ("left", "...[truncated 15 chars]5678901234"),
        ("middle", "01234...[truncated 15 chars]01234"),
    ],
)
async def test_output_truncation_sides(side, expected):
    ts = ToolSet([big], max_output_chars=10, truncate_side=side)
    async with ts.episode() as ep:
        r = await ep.call("big", {"n": 25})
        short = await ep.call("big", {"n": 10})
    assert r.content == expected
    assert short.content == "0123456789"
    assert ts.metrics()["tools/big/truncated"] == 1


def test_truncate_helper_edge_cases():
    assert truncate("abc", None) == ("abc", 0)
    assert truncate("abc", 3) == ("abc", 0)
    assert truncate("abcdef", 0, "right") == ("...[truncated 6 chars]", 6)
    assert truncate("abcdef", 1, "middle") == ("a...[truncated 5 chars]", 5)
    with pytest.raises(ValueError, match="truncate_side"):
        truncate("abcdef", 2, "top")  # type: ignore[arg-type]  # testing a bad value


async def test_state_is_created_lazily_once_and_released_once():
    log: list[str] = []
    counter = Counter(log)
    ts = ToolSet([counter, add])
    async with ts.episode() as ep:
        await ep.call("add", {"a": 1, "b": 1})
        assert log == []  # not created until first used
        results = await asyncio.gather(*(ep.call("counter", {"step": 1}) for _ in range(2)))
        assert sorted(r.content for r in results) == ["1", "2"]
        last = await ep.call("counter", {})
    assert counter.created == 1
    assert log == ["create", "release:3"]
    assert last.stop and last.reward == 1.0
    assert ts.metrics()["tools/counter/count"] == pytest.approx(1.5)  # mean of reported 1, 2


async def test_each_episode_gets_its_own_state():
    log: list[str] = []
    ts = ToolSet([Counter(log)])
    async with ts.episode() as a, ts.episode() as b:
        await a.call("counter", {})
        await a.call("counter", {})
        r = await b.call("counter", {})
    assert r.content == "1"
    assert sorted(log) == ["create", "create", "release:1", "release:2"]


async def test_release_runs_when_the_episode_raises():
    log: list[str] = []
    ts = ToolSet([Counter(log)])
    with pytest.raises(ValueError, match="agent bug"):
        async with ts.episode() as ep:
            await ep.call("counter", {})
            raise ValueError("agent bug")
    assert log == ["create", "release:1"]


async def test_release_runs_when_the_episode_is_cancelled():
    log: list[str] = []
    started = asyncio.Event()
    ts = ToolSet([Counter(log), slow], timeout_s=None)

    async def episode() -> None:
        async with ts.episode() as ep:
            await ep.call("counter", {})
            started.set()
            await ep.call("slow", {"seconds": 60})

    task = asyncio.create_task(episode())
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["create", "release:1"]


async def test_failing_release_is_counted_and_does_not_mask_the_error():
    log: list[str] = []
    ts = ToolSet([Counter(log, fail_release=True)])
    with pytest.raises(KeyError):
        async with ts.episode() as ep:
            await ep.call("counter", {})
            raise KeyError("original")
    assert ts.metrics()["tools/counter/release_errors"] == 1
    # and a failing release on a normal exit does not raise either
    async with ts.episode() as ep:
        await ep.call("counter", {})
    assert ts.metrics()["tools/counter/release_errors"] == 2


async def test_failing_create_becomes_an_error_message():
    ts = ToolSet([Counter([], fail_create=True)])
    async with ts.episode() as ep:
        r = await ep.call("counter", {})
    assert r.error and r.content == "error: tool 'counter' failed to start: OSError: no room"


async def test_call_after_close_is_an_error_message():
    ts = ToolSet([add])
    ep = ts.episode()
    await ep.aclose()
    r = await ep.call("add", {"a": 1, "b": 2})
    assert r.error and "after its episode ended" in r.content


async def test_sync_tools_run_in_a_thread_and_do_not_block_the_loop():
    loop_thread = threading.get_ident()
    seen: list[int] = []
    entered, unblock = threading.Event(), threading.Event()

    @tool
    def blocking() -> str:
        """Blocks its thread until the event loop (which it must not block) unblocks it."""
        seen.append(threading.get_ident())
        entered.set()
        return "ok" if unblock.wait(HANG_GUARD_S) else "the loop never ran while I blocked"

    async def unblocker() -> None:
        # Runs on the loop: it can only unblock the tool if the loop runs while the tool blocks.
        await until(entered.is_set, "the tool never started")
        unblock.set()

    ts = ToolSet([blocking], timeout_s=None)
    async with ts.episode() as ep:
        r, _ = await asyncio.gather(ep.call("blocking", {}), unblocker())
    assert r.content == "ok"
    assert seen and seen[0] != loop_thread


async def test_return_values_are_rendered_for_the_model():
    @tool
    def data() -> dict[str, Any]:
        """Structured output."""
        return {"a": 1, "b": [1, 2]}

    @tool
    def nothing() -> None:
        """No output."""

    class Bad(Tool):
        name = "bad"

        async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult | str:
            return 42  # type: ignore[return-value]  # a broken tool on purpose

    ts = ToolSet([data, nothing, Bad()])
    async with ts.episode() as ep:
        assert json.loads((await ep.call("data", None)).content) == {"a": 1, "b": [1, 2]}
        assert (await ep.call("nothing", "")).content == ""
        bad = await ep.call("bad", {})
    assert bad.error and "returned int" in bad.content


async def test_metrics_latency_and_reset():
    now = [100.0]  # a fake clock: only the tool's own "work" moves it

    @tool
    async def work(seconds: float) -> str:
        """Takes ``seconds`` on the fake clock."""
        now[0] += seconds
        return "done"

    ts = ToolSet([add, work], clock=lambda: now[0])
    async with ts.episode() as ep:
        await ep.call("work", {"seconds": 5.0})
        await ep.call("work", {"seconds": 0.0})
        await ep.call("missing", {})
    m = ts.metrics(reset=True)
    assert m["tools/work/calls"] == 2
    assert m["tools/work/latency_max_s"] == 5.0 and m["tools/work/latency_mean_s"] == 2.5
    assert m["tools/unknown_calls"] == 1
    assert "tools/add/calls" not in m  # tools never called report nothing
    assert ts.metrics() == {
        "tools/unknown_calls": 0.0,
        "tools/abandoned_running": 0.0,
        "tools/sync_threads_busy": 0.0,
    }


def test_toolset_rejects_duplicates_and_non_tools():
    with pytest.raises(ValueError, match="unique"):
        ToolSet([add, add])
    with pytest.raises(TypeError, match="@tool"):
        ToolSet([lambda: 1])  # type: ignore[list-item]  # testing a wrong type
    with pytest.raises(ValueError, match="truncate_side"):
        ToolSet([add], truncate_side="top")  # type: ignore[arg-type]  # testing a bad value


def test_schemas_and_names():
    ts = ToolSet([add, boom])
    assert ts.names() == ["add", "boom"]
    assert [s["function"]["name"] for s in ts.schemas()] == ["add", "boom"]
    assert ts.schemas()[0]["function"]["parameters"]["properties"]["a"]["description"] == "First."


def test_registry_builtins_and_user_tools(tmp_path):
    assert {"calculator", "python", "search"} <= set(registered_tools())
    assert get_tool("calculator").name == "calculator"
    py = get_tool("python", wall_time_s=1.5)
    assert py.name == "python" and py.wall_time_s == 1.5  # type: ignore[attr-defined]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": 1, "title": "t", "text": "hello world"}\n')
    assert get_tool("search", corpus_path=corpus).name == "search"

    @tool
    def unique_echo_tool_for_registry(text: str) -> str:
        """Echo."""
        return text

    assert register_tool(unique_echo_tool_for_registry) is unique_echo_tool_for_registry
    assert get_tool("unique_echo_tool_for_registry") is unique_echo_tool_for_registry
    register_tool(unique_echo_tool_for_registry)  # the same tool again: harmless

    @tool(name="unique_echo_tool_for_registry")
    def another(text: str) -> str:
        """Another tool under a taken name."""
        return text

    with pytest.raises(ValueError, match="already registered"):
        register_tool(another)
    with pytest.raises(KeyError, match=r"unknown tool 'no_such_tool'; registered: .*calculator"):
        get_tool("no_such_tool")
    with pytest.raises(ValueError, match=r"calculator. is already registered to tools.calculator"):

        @register_tool
        @tool(name="calculator")
        def fake_calculator(expression: str) -> str:
            """Not the built-in."""
            return expression


def test_from_names_builds_configured_tools(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": 1, "title": "t", "text": "hello world"}\n')
    ts = ToolSet.from_names(
        ["calculator", "python", "search"],
        options={
            "python": {"wall_time_s": 2.0, "memory_mb": 128},
            "search": {"corpus_path": corpus},
        },
        extra=[add],
        timeout_s=3.0,
        max_output_chars=100,
        truncate_side="middle",
    )
    assert ts.names() == ["calculator", "python", "search", "add"]
    assert ts.get("python").wall_time_s == 2.0  # type: ignore[union-attr]
    assert ts.timeout_s == 3.0 and ts.max_output_chars == 100 and ts.truncate_side == "middle"
    only_calc = ToolSet.from_names(["calculator"], options={"python": {"wall_time_s": 1}})
    assert only_calc.names() == ["calculator"]  # settings of a disabled tool are ignored
    with pytest.raises(ValueError, match="unknown tools: \\['pyhton'\\]"):
        ToolSet.from_names(["calculator"], options={"pyhton": {}})
    with pytest.raises(ValueError, match="cannot build tool 'search'"):
        ToolSet.from_names(["search"])  # no corpus configured


async def test_timeouts_are_flagged_on_the_result():
    ts = ToolSet([slow], timeout_s=0.01)
    async with ts.episode() as ep:
        r = await ep.call("slow", {"seconds": 1})
    assert r.timed_out and r.error


async def test_toolsets_and_builtin_tools_pickle(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": 1, "title": "t", "text": "hello world"}\n')
    ts = ToolSet.from_names(
        ["calculator", "python", "search"], options={"search": {"corpus_path": corpus}}, extra=[add]
    )
    async with ts.episode() as ep:
        await ep.call("add", {"a": 1, "b": 2})
    clone = pickle.loads(pickle.dumps(ts))
    assert clone.names() == ts.names()
    assert clone.schemas() == ts.schemas()
    assert clone.get("add") is add  # module-level @tool pickles by reference
    assert clone.metrics()["tools/add/calls"] == 1
    async with clone.episode() as ep:
        assert (await ep.call("add", {"a": 1, "b": 2})).content == "3"
        assert (await ep.call("calculator", {"expression": "2**5"})).content == "32"
        assert "[1] t (id: 1" in (await ep.call("search", {"query": "hello"})).content
    local = tool(big.fn, name="renamed")  # not reachable by name: pickled by value
    assert pickle.loads(pickle.dumps(local)).schema() == local.schema()


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(max_size=200),
    limit=st.integers(min_value=0, max_value=250),
    side=st.sampled_from(["left", "right", "middle"]),
)
def test_truncate_properties(text, limit, side):
    out, dropped = truncate(text, limit, side)
    if len(text) <= limit:
        assert (out, dropped) == (text, 0)
        return
    marker = f"...[truncated {dropped} chars]"
    assert dropped == len(text) - limit
    assert len(out) == limit + len(marker) and marker in out
    kept = out.replace(marker, "", 1)
    if side == "right":
        assert out == text[:limit] + marker
    elif side == "left":
        assert out == marker + text[len(text) - limit :]
    else:
        assert text.startswith(kept[: limit - limit // 2]) and len(kept) == limit


async def test_state_created_after_the_episode_closed_is_released():
    log: list[str] = []
    gate = asyncio.Event()

    class SlowCreate(Counter):
        async def create(self) -> dict[str, int]:
            await gate.wait()
            self.log.append("create")
            return {"count": 0}

    ts = ToolSet([SlowCreate(log)], timeout_s=5)
    ep = ts.episode()
    call = asyncio.create_task(ep.call("counter", {}))
    await asyncio.sleep(0.02)
    await ep.aclose()  # closes while create() is still waiting
    gate.set()
    r = await call
    assert r.error and "episode already ended" in r.content
    assert log == ["create", "release:0"]


async def test_with_tools_keeps_the_limits_counters_and_pool() -> None:
    @tool
    def echo(text: str) -> str:
        """Echo."""
        return text

    base = ToolSet([], timeout_s=3.0, max_output_chars=5, truncate_side="left")
    child = base.with_tools([echo])
    assert child.limits is base.limits and child.names() == ["echo"] and base.names() == []
    async with child.episode() as ep:
        result = await ep.call("echo", {"text": "abcdefgh"})
    assert result.content.endswith("defgh")  # the parent's output limit and side
    assert base.metrics()["tools/echo/calls"] == 1  # the parent's counters
    assert child._sync_pool() is base._sync_pool()


# ---- token budget (tools.max_output_tokens) ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tok():
    from agentrl.inference.tiny_model import build_tiny_tokenizer

    return build_tiny_tokenizer()  # one token per UTF-8 byte


@tool
def accents(n: int) -> str:
    """n two-byte characters.

    Args:
        n: how many.
    """
    return "é" * n


def _n_tokens(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def test_truncate_tokens_hand_computed(tiny_tok):
    from tools.limits import truncate_tokens

    text = "abcdefghijklmnopqrstuvwxyz" * 4  # 104 one-byte tokens
    marker = "...[truncated 98 tokens]"  # 24 tokens: 30 - 24 = 6 kept, 98 dropped
    assert truncate_tokens(text, 30, "right", tiny_tok) == ("abcdef" + marker, 98)
    assert truncate_tokens(text, 30, "left", tiny_tok) == (marker + "uvwxyz", 98)
    assert truncate_tokens(text, 30, "middle", tiny_tok) == ("abc" + marker + "xyz", 98)
    assert truncate_tokens(text, 104, "right", tiny_tok) == (text, 0)
    assert truncate_tokens(text, None, "right", tiny_tok) == (text, 0)
    # a budget below the marker keeps only the marker
    assert truncate_tokens(text, 5, "right", tiny_tok) == ("...[truncated 104 tokens]", 104)


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(max_size=120),
    budget=st.integers(min_value=30, max_value=200),
    side=st.sampled_from(["left", "right", "middle"]),
)
def test_truncate_tokens_keeps_the_budget(tiny_tok, text, budget, side):
    from tools.limits import truncate_tokens

    out, dropped = truncate_tokens(text, budget, side, tiny_tok)
    if _n_tokens(tiny_tok, text) <= budget:
        assert (out, dropped) == (text, 0)
    else:
        assert _n_tokens(tiny_tok, out) <= budget and dropped > 0
        assert f"...[truncated {dropped} tokens]" in out


async def test_tool_output_is_budgeted_in_the_policys_tokens_and_chars_stay_a_cap(tiny_tok):
    # 100 characters are 200 tokens: a 150-character cap lets them through, a 60-token budget not
    ts = ToolSet([accents], max_output_chars=150, max_output_tokens=60)
    async with ts.episode(tokenizer=tiny_tok) as ep:
        long = await ep.call("accents", {"n": 100})
        short = await ep.call("accents", {"n": 20})
        over_chars = await ep.call("accents", {"n": 400})
    assert _n_tokens(tiny_tok, long.content) <= 60 and long.content.startswith("é" * 10)
    assert long.content.endswith("tokens]")
    assert short.content == "é" * 20  # 40 tokens: within both
    assert _n_tokens(tiny_tok, over_chars.content) <= 60  # both cuts apply, the tokens last
    assert ts.metrics()["tools/accents/truncated"] == 2
    with pytest.raises(ValueError, match=r"tools\.max_output_tokens=60"):
        ts.episode()  # no tokenizer to count in
    with pytest.raises(ValueError, match="max_output_tokens"):
        ToolSet([accents], max_output_tokens=0)


def test_config_key_reaches_the_run_toolset():
    from agentrl.training.resolve import build_toolset
    from tests.fakes import experiment

    assert build_toolset(experiment("tools.max_output_tokens=64")).limits.max_output_tokens == 64
    assert build_toolset(experiment()).limits.max_output_tokens is None
