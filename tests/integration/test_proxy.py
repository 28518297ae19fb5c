"""The recording proxy served on a real port, driven by the stock ``openai`` client, with a
scripted policy: token-exact recording, continuation, prefix breaks, pass-through, errors."""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from agentrl.episode import EpisodeRecorder, render_prompt_ids
from agentrl.rollout.proxy import RecordingProxy, create_proxy_app
from agentrl.types import Generation, SamplingParams, StopReason

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
CALL_TEXT = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
)


class ScriptedTextPolicy:
    """Replays scripted replies (text -> byte tokens + EOS) and records every request."""

    def __init__(self, tokenizer: Any, replies: list[str | tuple[str, str]], version: int = 3):
        self.tok = tokenizer
        self.replies = list(replies)
        self.version = version
        self.requests: list[tuple[list[int], SamplingParams, str | None]] = []
        self.fail = False
        self.fail_next = 0

    async def generate(self, prompt_ids, sampling, session_id=None) -> Generation:
        self.requests.append((list(prompt_ids), sampling, session_id))
        if self.fail or self.fail_next > 0:
            self.fail_next -= 1
            raise RuntimeError("server exploded")
        reply = self.replies.pop(0)
        text, finish = reply if isinstance(reply, tuple) else (reply, "stop")
        ids = self.tok.encode(text, add_special_tokens=False)
        if finish == "stop":
            ids += [self.tok.convert_tokens_to_ids(self.tok.eos_token)]
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
        return Generation(
            token_ids=ids, logprobs=logprobs, finish_reason=finish, weight_version=self.version
        )


@pytest.fixture(scope="module")
def tok():
    from agentrl.inference.tiny_model import build_tiny_tokenizer

    return build_tiny_tokenizer()


_CLIENTS: list[AsyncOpenAI] = []


_SIDS: weakref.WeakKeyDictionary[RecordingProxy, dict[str, str]] = weakref.WeakKeyDictionary()


def sid(proxy: RecordingProxy, name: str) -> str:
    """The id the proxy issued for the session this test calls ``name`` (opened on first use)."""
    names = _SIDS.setdefault(proxy, {})
    if name not in names:
        names[name] = proxy.open_session()
    return names[name]


def client_for(proxy: RecordingProxy, name: str) -> AsyncOpenAI:
    client = AsyncOpenAI(
        base_url=proxy.session_url(sid(proxy, name)), api_key="unused", max_retries=0
    )
    _CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
async def _close_clients():
    yield
    while _CLIENTS:
        await _CLIENTS.pop().close()


async def test_tool_loop_is_recorded_like_a_native_episode(tok):
    policy = ScriptedTextPolicy(tok, [CALL_TEXT, "\\boxed{5}"])
    messages: list[Any] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    async with RecordingProxy(policy, tok) as proxy:
        client = client_for(proxy, "ep-1")
        first = await client.chat.completions.create(
            model="m", messages=messages, tools=[CALC_TOOL], temperature=0.7, seed=11
        )
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert msg.tool_calls and msg.tool_calls[0].function.name == "calculator"
        assert json.loads(msg.tool_calls[0].function.arguments) == {"expression": "2 + 3"}
        # the way most agents append the reply: the SDK object dumped, null fields included
        messages.append(msg.model_dump())
        messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"})
        second = await client.chat.completions.create(
            model="m", messages=messages, tools=[CALC_TOOL], temperature=0.7, seed=11
        )
        assert second.choices[0].message.content == "\\boxed{5}"
        assert second.choices[0].finish_reason == "stop"
        assert second.usage.prompt_tokens == len(policy.requests[1][0])
        (traj,) = proxy.finish(
            sid(proxy, "ep-1"), uid="g", index=2, task_id="t", data_source="calculator"
        )
        assert proxy.recorder.sessions() == []

    # the same episode, bookkept the native way
    rec = EpisodeRecorder.from_messages(messages[:2], tok, tools=[CALC_TOOL])
    assert policy.requests[0][0] == rec.context_ids()
    gen1 = await ScriptedTextPolicy(tok, [CALL_TEXT]).generate([1], SamplingParams())
    rec.add_generation(gen1)
    rec.add_messages([{"role": "tool", "content": "5"}])
    assert policy.requests[1][0] == rec.context_ids()
    gen2 = await ScriptedTextPolicy(tok, ["\\boxed{5}"]).generate([1], SamplingParams())
    rec.add_generation(gen2)
    native = rec.to_trajectory(uid="g")
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "policy_version"):
        assert getattr(traj, name) == getattr(native, name), name
    assert traj.num_turns == 2 and traj.stop_reason == StopReason.EOS
    assert traj.tool_calls == {"calculator": 1}
    assert (traj.uid, traj.index, traj.task_id, traj.data_source) == ("g", 2, "t", "calculator")
    assert traj.agent == "openai_proxy" and traj.metrics["proxy/prefix_breaks"] == 0.0
    assert traj.messages[-1] == {"role": "assistant", "content": "\\boxed{5}"}
    # sampling params and the session travel to the policy
    sampling = policy.requests[0][1]
    assert (sampling.temperature, sampling.seed) == (0.7, 11)
    assert policy.requests[0][2] == sid(proxy, "ep-1")


async def test_history_rewrite_starts_a_new_segment_and_is_counted(tok):
    policy = ScriptedTextPolicy(tok, ["first", "second", "third"])
    async with RecordingProxy(policy, tok) as proxy:
        client = client_for(proxy, "s")
        msgs: list[Any] = [{"role": "user", "content": "hello"}]
        r1 = await client.chat.completions.create(model="m", messages=msgs)
        msgs += [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "more"},
        ]
        await client.chat.completions.create(model="m", messages=msgs)
        # the client summarises history: the first turn is rewritten
        rewritten = [
            {"role": "user", "content": "summary of hello"},
            {"role": "user", "content": "more"},
        ]
        await client.chat.completions.create(model="m", messages=rewritten)
        assert proxy.recorder.prefix_breaks(sid(proxy, "s")) == 1
        assert proxy.metrics()["proxy/prefix_breaks"] == 1.0
        trajs = proxy.finish(sid(proxy, "s"))
    assert len(trajs) == 2
    assert trajs[0].num_turns == 2 and trajs[1].num_turns == 1
    assert trajs[1].prompt_ids == render_prompt_ids(tok, rewritten)
    assert trajs[1].prompt_ids == policy.requests[2][0]
    assert trajs[0].metrics["proxy/segment"] == 0.0 and trajs[1].metrics["proxy/segment"] == 1.0
    assert all(t.metrics["proxy/prefix_breaks"] == 1.0 for t in trajs)


async def test_resending_the_reply_continues_by_token_prefix(tok):
    policy = ScriptedTextPolicy(tok, ["hello", "again"])
    async with RecordingProxy(policy, tok) as proxy:
        client = client_for(proxy, "s")
        msgs: list[Any] = [{"role": "user", "content": "hi"}]
        r1 = await client.chat.completions.create(model="m", messages=msgs)
        # no new message, just the reply: ask the model to continue with another assistant turn
        msgs.append({"role": "assistant", "content": r1.choices[0].message.content})
        await client.chat.completions.create(model="m", messages=msgs)
        assert proxy.recorder.prefix_breaks(sid(proxy, "s")) == 0
        (traj,) = proxy.finish(sid(proxy, "s"))
    assert policy.requests[1][0] == render_prompt_ids(tok, msgs)
    assert (
        traj.prompt_ids + traj.response_ids[: -len(tok.encode("again")) - 1]
        == policy.requests[1][0]
    )


async def test_length_stop_then_continuation_closes_the_turn(tok):
    policy = ScriptedTextPolicy(tok, [("abcdef", "length"), "ok"])
    async with RecordingProxy(policy, tok) as proxy:
        client = client_for(proxy, "s")
        msgs: list[Any] = [{"role": "user", "content": "hi"}]
        r1 = await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
        assert r1.choices[0].finish_reason == "length" and r1.choices[0].message.content == "abcd"
        msgs += [r1.choices[0].message.model_dump(), {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="m", messages=msgs)
        (traj,) = proxy.finish(sid(proxy, "s"))
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    # the cut turn is closed by an end-of-turn token with mask 0, as the template renders it
    assert traj.response_ids[4] == eot and traj.loss_mask[4] == 0
    assert policy.requests[1][0] == render_prompt_ids(
        tok, [msgs[0], {"role": "assistant", "content": "abcd"}, msgs[2]]
    )


async def test_malformed_tool_call_is_returned_as_text_and_counted(tok):
    bad = '<tool_call>\n{"name": "calculator", "arguments": {\n</tool_call>'
    policy = ScriptedTextPolicy(tok, [bad])
    async with RecordingProxy(policy, tok) as proxy:
        r = await client_for(proxy, "s").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], tools=[CALC_TOOL]
        )
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content == bad
        (traj,) = proxy.finish(sid(proxy, "s"))
    assert traj.tool_calls == {"<invalid>": 1}


async def test_logprobs_max_tokens_and_top_p_pass_through(tok):
    policy = ScriptedTextPolicy(tok, ["abc"], version=7)
    async with RecordingProxy(policy, tok, default_max_tokens=99) as proxy:
        r = await client_for(proxy, "s").chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            logprobs=True,
            top_p=0.5,
            max_completion_tokens=17,
        )
        (traj,) = proxy.finish(sid(proxy, "s"))
    sampling = policy.requests[0][1]
    assert (sampling.max_tokens, sampling.top_p) == (17, 0.5)
    got = [(c.token, c.logprob) for c in r.choices[0].logprobs.content]
    assert got == [
        (f"token_id:{t}", lp)
        for t, lp in zip(traj.response_ids, traj.rollout_logprobs, strict=True)
    ]
    assert traj.policy_version == [7] * 4
    assert r.model_extra and r.model_extra["weight_version"] == 7


async def test_context_budget_ends_with_length(tok):
    prompt = [{"role": "user", "content": "x"}]
    budget = len(render_prompt_ids(tok, prompt)) + 3
    policy = ScriptedTextPolicy(tok, ["abcdef"])
    async with RecordingProxy(policy, tok, max_context_tokens=budget) as proxy:
        r = await client_for(proxy, "s").chat.completions.create(model="m", messages=prompt)
        assert r.choices[0].finish_reason == "length"
        (traj,) = proxy.finish(sid(proxy, "s"))
    assert policy.requests[0][1].max_tokens == 3
    assert traj.response_ids == tok.encode("abc") and traj.stop_reason == StopReason.LENGTH


async def test_concurrent_sessions_are_kept_apart(tok):
    policy = ScriptedTextPolicy(tok, [f"reply{i}" for i in range(12)])
    async with RecordingProxy(policy, tok) as proxy:

        async def one(i: int) -> None:
            await client_for(proxy, f"s{i}").chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"q{i}"}]
            )

        await asyncio.gather(*(one(i) for i in range(12)))
        trajs = {f"s{i}": proxy.finish(sid(proxy, f"s{i}")) for i in range(12)}
    for i in range(12):
        (traj,) = trajs[f"s{i}"]
        assert traj.uid == sid(proxy, f"s{i}")  # no task bound: the session id
        assert traj.prompt_ids == render_prompt_ids(tok, [{"role": "user", "content": f"q{i}"}])
    assert proxy.metrics()["proxy/sessions"] == 12.0


async def test_bad_requests_get_openai_errors(tok):
    policy = ScriptedTextPolicy(tok, [])
    async with RecordingProxy(policy, tok) as proxy:
        client = client_for(proxy, "s")
        msgs = [{"role": "user", "content": "x"}]
        with pytest.raises(openai.BadRequestError, match="stream"):
            await client.chat.completions.create(model="m", messages=msgs, stream=True)
        with pytest.raises(openai.BadRequestError, match="n=2"):
            await client.chat.completions.create(model="m", messages=msgs, n=2)
        with pytest.raises(openai.BadRequestError, match="stop strings"):
            await client.chat.completions.create(model="m", messages=msgs, stop=["\n"])
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.chat.completions.create(model="m", messages=msgs, temperature=-1)
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]"):
            await client.chat.completions.create(model="m", messages=[{"content": "no role"}])  # type: ignore[list-item]
        policy.fail = True
        with pytest.raises(openai.InternalServerError, match="server exploded"):
            await client.chat.completions.create(model="m", messages=msgs)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["agentrl-policy"]
    with pytest.raises(KeyError, match="no open proxy session 'nope'"):
        proxy.finish("nope")


async def test_create_proxy_app_in_process(tok):
    import httpx

    policy = ScriptedTextPolicy(tok, ["hi"])
    app = create_proxy_app(policy, tok, model_name="tiny")
    a = app.state.recorder.open_session()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 1)), base_url="http://proxy"
    ) as http:
        r = await http.post(
            f"/sessions/{a}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 200 and r.json()["model"] == "tiny"
    (traj,) = app.state.recorder.finish(a)
    assert traj.num_sampled_tokens == 3


async def test_a_failed_request_leaves_the_session_untouched_for_the_retry(tok):
    def run_episode(policy, proxy, retries):
        async def go():
            client = AsyncOpenAI(
                base_url=proxy.session_url(sid(proxy, "s")), api_key="unused", max_retries=retries
            )
            _CLIENTS.append(client)
            msgs: list[Any] = [{"role": "user", "content": "q"}]
            r1 = await client.chat.completions.create(model="m", messages=msgs, tools=[CALC_TOOL])
            msgs += [r1.choices[0].message.model_dump(), {"role": "tool", "content": "5"}]
            policy.fail_next = 1 if retries else 0  # the second request fails once, then succeeds
            await client.chat.completions.create(model="m", messages=msgs, tools=[CALC_TOOL])
            return proxy.finish(sid(proxy, "s"))

        return go()

    clean_policy = ScriptedTextPolicy(tok, [CALL_TEXT, "\\boxed{5}"])
    async with RecordingProxy(clean_policy, tok) as proxy:
        (clean,) = await run_episode(clean_policy, proxy, retries=0)
    flaky_policy = ScriptedTextPolicy(tok, [CALL_TEXT, "\\boxed{5}"])
    async with RecordingProxy(flaky_policy, tok) as proxy:
        (retried,) = await run_episode(flaky_policy, proxy, retries=1)
        assert proxy.metrics()["proxy/errors"] == 1.0
        assert proxy.metrics()["proxy/prefix_breaks"] == 0.0
    assert (
        len(flaky_policy.requests) == 3
        and flaky_policy.requests[1][0] == flaky_policy.requests[2][0]
    )
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "policy_version"):
        assert getattr(retried, name) == getattr(clean, name), name


async def test_sessions_exist_only_when_issued_and_failed_requests_create_none(tok):
    import httpx

    policy = ScriptedTextPolicy(tok, ["a", "b"])
    async with RecordingProxy(policy, tok) as proxy:
        guessed = AsyncOpenAI(base_url=proxy.session_url("ep-1"), api_key="x", max_retries=0)
        _CLIENTS.append(guessed)
        with pytest.raises(openai.NotFoundError, match="unknown or expired session"):
            await guessed.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}]
            )
        assert proxy.recorder.sessions() == [] and policy.requests == []
        issued = proxy.open_session()
        assert len(issued) >= 32 and issued != proxy.open_session()  # unguessable, unique
        # a request that fails validation leaves the issued session as it was: no segment
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{proxy.session_url(issued)}/chat/completions",
                json={"messages": [{"role": "wizard", "content": "x"}]},
            )
        assert r.status_code == 400 and "wizard" in r.json()["error"]["message"]
        assert proxy.recorder.session_info(issued)["segments"] == 0


async def test_unknown_roles_and_lone_surrogates_are_400(tok):
    import httpx

    policy = ScriptedTextPolicy(tok, [])
    async with RecordingProxy(policy, tok) as proxy:
        url = f"{proxy.session_url(proxy.open_session())}/chat/completions"
        async with httpx.AsyncClient() as http:
            r = await http.post(url, json={"messages": [{"role": "developer", "content": "x"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
            body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
            r = await http.post(url, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "messages[0].content"
    assert policy.requests == []


async def test_idle_sessions_are_evicted_after_their_ttl(tok):
    policy = ScriptedTextPolicy(tok, ["a"])
    async with RecordingProxy(policy, tok, session_ttl_s=0.2) as proxy:
        keep = proxy.open_session(ttl_s=60)
        gone = proxy.open_session()
        await asyncio.sleep(0.3)
        assert proxy.recorder.evict_expired() == [gone]
        assert proxy.recorder.sessions() == [keep]
        assert proxy.metrics()["proxy/evicted"] == 1.0
        with pytest.raises(KeyError):
            proxy.finish(gone)


async def test_a_session_bound_to_a_task_names_its_trajectories(tok):
    from agentrl.types import Task

    task = Task(id="calc-7", prompt="q", data_source="calculator")
    policy = ScriptedTextPolicy(tok, ["a"])
    async with RecordingProxy(policy, tok) as proxy:
        s = proxy.open_session(task, index=3)
        client = AsyncOpenAI(base_url=proxy.session_url(s), api_key="x", max_retries=0)
        _CLIENTS.append(client)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        (traj,) = proxy.finish(s)
    assert (traj.uid, traj.task_id, traj.data_source, traj.index) == (
        "calc-7",
        "calc-7",
        "calculator",
        3,
    )


async def test_with_an_api_key_every_route_but_health_needs_it(tok):
    import httpx

    policy = ScriptedTextPolicy(tok, ["ok"])
    async with RecordingProxy(policy, tok, api_key="s3cret") as proxy:
        s = proxy.open_session()
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            assert (await http.get("/health")).status_code == 200
            for path in (f"/sessions/{s}/v1/models", "/metrics", "/openapi.json"):
                assert (await http.get(path)).status_code == 401, path
        wrong = AsyncOpenAI(base_url=proxy.session_url(s), api_key="nope", max_retries=0)
        right = AsyncOpenAI(base_url=proxy.session_url(s), api_key="s3cret", max_retries=0)
        _CLIENTS.extend([wrong, right])
        msgs = [{"role": "user", "content": "q"}]
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="m", messages=msgs)  # type: ignore[arg-type]
        r = await right.chat.completions.create(model="m", messages=msgs)  # type: ignore[arg-type]
        assert r.choices[0].message.content == "ok"
