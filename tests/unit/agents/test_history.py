"""``agent.history``: exact concatenation vs per-turn samples, under a Qwen3-style chat template
that strips earlier turns' thinking. In both modes the tokens trained on are exactly the tokens
the server saw (the scripted policy keeps every request)."""

from __future__ import annotations

import pytest

from agentrl.inference.tiny_model import CHAT_TEMPLATE, build_tiny_tokenizer
from agentrl.training.step import expand_turn_samples
from agentrl.types import SamplingParams, StopReason
from agents import AgentContext, AgentLimits
from tests.fakes import ScriptedPolicy

_ASSISTANT_CONTENT = "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
# Qwen3's rule: an assistant turn before the last user query loses its <think> block.
QWEN3_STYLE = CHAT_TEMPLATE.replace(
    "{%- for message in loop_messages %}",
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in loop_messages %}",
    1,
).replace(
    _ASSISTANT_CONTENT,
    "{%- set content = message['content'] or '' %}"
    "{%- if loop.index0 < ns.last_query and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if content %}{{- content }}{%- endif %}",
    1,
)

TURNS = ["<think>\nadd them up\n</think>\nIt is 5.", "<think>\ncheck again\n</think>\nYes, 5."]


@pytest.fixture(scope="module")
def tok():
    t = build_tiny_tokenizer()
    assert _ASSISTANT_CONTENT in CHAT_TEMPLATE  # the replacement above took effect
    t.chat_template = QWEN3_STYLE
    return t


async def _episode(tok, history: str):
    ctx = AgentContext(
        policy=ScriptedPolicy(tok, TURNS),
        tokenizer=tok,
        sampling=SamplingParams(max_tokens=64),
        limits=AgentLimits(max_response_tokens=512),
        session_id="s0",
        uid="g0",
        history=history,
    )
    ctx.start_episode([{"role": "user", "content": "2 + 3?"}])
    ctx.parse(await ctx.generate())
    ctx.add_messages([{"role": "user", "content": "Sure?"}])
    ctx.parse(await ctx.generate())
    traj = ctx.finish(StopReason.EOS).model_copy(update={"reward": 1.0})
    return traj, ctx.policy.requests  # type: ignore[attr-defined]  # ScriptedPolicy


def _seen(tok, requests) -> list[list[int]]:
    """What the server saw per request: its prompt, then the tokens it sampled."""
    return [
        list(p) + list(tok.encode(TURNS[k], add_special_tokens=False)) + [tok.eos_token_id]
        for k, (p, _, _) in enumerate(requests)
    ]


def test_the_template_strips_earlier_thinking(tok) -> None:
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": TURNS[0]},
        {"role": "user", "content": "Sure?"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "add them up" not in text and "It is 5." in text


async def test_concat_trains_one_sequence_that_is_every_request_extended(tok) -> None:
    traj, requests = await _episode(tok, "concat")
    full = traj.prompt_ids + traj.response_ids
    seen = _seen(tok, requests)
    for s in seen:
        assert full[: len(s)] == s  # each request + its tokens is a prefix of the trained row
    assert full[: len(seen[-1])] == seen[-1]
    assert "add them up" in tok.decode(requests[1][0])  # the exact history keeps the thinking
    (row,) = expand_turn_samples([traj], None, {})
    assert row is traj and traj.turn_samples == []


async def test_per_turn_trains_each_turn_as_the_template_renders_it(tok) -> None:
    traj, requests = await _episode(tok, "per_turn")
    second_prompt = tok.decode(requests[1][0])
    assert "add them up" not in second_prompt and "It is 5." in second_prompt
    m: dict[str, float] = {}
    rows = expand_turn_samples([traj], None, m)
    assert m == {"rollout/turn_samples": 2.0}
    assert [r.prompt_ids + r.response_ids for r in rows] == _seen(tok, requests)
    for row in rows:
        assert row.loss_mask == [1] * len(row.response_ids)
        assert (row.uid, row.index, row.reward) == ("g0", 0, 1.0)  # one group, one reward
    assert rows[0].rollout_logprobs == traj.turn_samples[0].logprobs
    with pytest.raises(ValueError, match="ReMax"):
        import torch

        expand_turn_samples([traj], torch.zeros(1), {})


async def test_per_turn_resumes_an_aborted_turn_from_its_own_prompt(tok) -> None:
    from agentrl.types import Generation

    ids = [*tok.encode("It is 5.", add_special_tokens=False), tok.eos_token_id]
    first = Generation(
        token_ids=ids[:3], logprobs=[-0.1] * 3, finish_reason="abort", weight_version=1
    )
    rest = Generation(
        token_ids=ids[3:], logprobs=[-0.2] * (len(ids) - 3), finish_reason="stop", weight_version=2
    )
    ctx = AgentContext(
        policy=ScriptedPolicy(tok, [first, rest]),
        tokenizer=tok,
        sampling=SamplingParams(max_tokens=64),
        session_id="s0",
        uid="g0",
        history="per_turn",
    )
    ctx.start_episode([{"role": "user", "content": "2 + 3?"}])
    await ctx.generate()
    (p1, _, _), (p2, _, _) = ctx.policy.requests  # type: ignore[attr-defined]  # ScriptedPolicy
    assert p2 == p1 + ids[:3]
    (sample,) = ctx.turn_samples
    assert sample.prompt_ids == p1 and sample.token_ids == ids
    assert sample.versions == [1] * 3 + [2] * (len(ids) - 3)
