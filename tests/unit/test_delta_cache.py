"""DeltaRenderer's LRU cache of delta ids: hits, misses, bounded size, and exact ids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.episode import DeltaRenderer, EpisodeRecorder, _render, render_prompt_ids
from agentrl.inference.tiny_model import CHAT_TEMPLATE, build_tiny_tokenizer
from agentrl.rollout.calculator_task import calculator_tool_schemas
from agentrl.types import Generation

TOOLS = calculator_tool_schemas()


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _tool(content: str) -> list[dict[str, str]]:
    return [{"role": "tool", "tool_call_id": "call_1_0", "name": "calculator", "content": content}]


def test_hit_returns_the_uncached_ids_and_counts(tok):
    cached, uncached = DeltaRenderer(tok), DeltaRenderer(tok, cache_size=0)
    first = cached.delta_ids(_tool("42"), TOOLS)
    assert cached.cache_info() == {"hits": 0, "misses": 1, "size": 1, "maxsize": 4096}
    again = cached.delta_ids(_tool("42"), TOOLS)
    other = cached.delta_ids(_tool("43"), TOOLS)
    assert cached.cache_info()["hits"] == 1 and cached.cache_info()["misses"] == 2
    assert first == again == uncached.delta_ids(_tool("42"), TOOLS)
    assert other == uncached.delta_ids(_tool("43"), TOOLS) != first
    assert uncached.cache_info() == {"hits": 0, "misses": 2, "size": 0, "maxsize": 0}


def test_cache_is_a_bounded_lru(tok):
    r = DeltaRenderer(tok, cache_size=2)
    for content in ("b", "c", "b", "d"):  # "b" is used again, so "c" is the one evicted
        r.delta_ids(_tool(content))
    assert r.cache_info()["size"] == 2
    hits = r.cache_info()["hits"]
    r.delta_ids(_tool("b"))
    assert r.cache_info()["hits"] == hits + 1
    r.delta_ids(_tool("c"))
    assert r.cache_info()["hits"] == hits + 1 and r.cache_info()["size"] == 2
    r.cache_clear()
    assert r.cache_info() == {"hits": 0, "misses": 0, "size": 0, "maxsize": 2}
    with pytest.raises(ValueError, match="cache_size"):
        DeltaRenderer(tok, cache_size=-1)


def test_key_covers_generation_prompt_and_every_field(tok):
    r, plain = DeltaRenderer(tok), DeltaRenderer(tok, cache_size=0)
    r.delta_ids(_tool("x"))
    with_prompt = r.delta_ids(_tool("7"))
    without = r.delta_ids(_tool("7"), add_generation_prompt=False)
    assert with_prompt != without == plain.delta_ids(_tool("7"), add_generation_prompt=False)
    user = [{"role": "user", "content": "7"}]
    assert r.delta_ids(user) == plain.delta_ids(user) != with_prompt
    assert r.cache_info()["hits"] == 0


class _Text(str):
    """A str subclass: equal to its str, yet not a plain str (so not a cache key)."""


def test_values_that_are_not_plain_strings_are_never_cached(tok):
    r = DeltaRenderer(tok)
    for _ in range(2):  # a template may render 1, 1.0 and True differently: they share a hash
        r.delta_ids([{"role": "tool", "content": "1", "meta": 1}])
        r.delta_ids([{"role": "tool", "content": _Text("1")}])
    assert r.cache_info()["hits"] == 0 and r.cache_info()["size"] == 0
    assert r.cache_info()["misses"] == 4


def test_returned_ids_are_copies(tok):
    r = DeltaRenderer(tok)
    r.delta_ids(_tool("x"))
    ids = r.delta_ids(_tool("5"))
    expected = list(ids)
    ids.append(-1)
    assert r.delta_ids(_tool("5")) == expected


def test_tools_that_render_in_the_delta_are_part_of_the_key():
    tok = build_tiny_tokenizer()
    # A prefix-stable template that renders the number of tools after every tool message.
    tok.chat_template = CHAT_TEMPLATE.replace(
        "{%- for message in loop_messages %}",
        "{%- for message in loop_messages %}{%- if tools and message.role == 'tool' %}"
        "{{- '[' ~ (tools | length) ~ ' tools]' }}{%- endif %}",
    )
    assert "tools]" in tok.chat_template, "the template patch must apply"
    r, plain = DeltaRenderer(tok), DeltaRenderer(tok, cache_size=0)
    one, two = TOOLS[:1], [*TOOLS[:1], {**TOOLS[0], "function": {**TOOLS[0]["function"]}}]
    two[1]["function"]["name"] = "calculator2"
    a, b = r.delta_ids(_tool("9"), one), r.delta_ids(_tool("9"), two)
    assert a != b
    assert a == plain.delta_ids(_tool("9"), one) and b == plain.delta_ids(_tool("9"), two)
    assert r.delta_ids(_tool("9"), two) == b and r.cache_info()["hits"] == 1


def test_nondeterministic_template_is_never_cached():
    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE + "{#- a date would come from strftime_now -#}"
    r = DeltaRenderer(tok)
    for _ in range(3):
        r.delta_ids(_tool("1"))
    assert r.cache_info() == {"hits": 0, "misses": 3, "size": 0, "maxsize": 0}


_content = st.sampled_from(["1", "2", "42", "", " spaced ", "é ü", "<tool_call>", "a\nb"])


@settings(max_examples=25, deadline=None)
@given(turns=st.lists(st.lists(_content, min_size=1, max_size=3), min_size=1, max_size=6))
def test_cached_episode_equals_the_full_render(turns):
    """With repeats (hits) and new contents (misses), every context is the full render."""
    tok = _TOK
    r_cached = DeltaRenderer(tok, cache_size=3)
    msgs = [{"role": "user", "content": "q"}]
    rec = EpisodeRecorder.from_messages(msgs, tok, tools=TOOLS)
    call = [*tok.encode("call", add_special_tokens=False), tok.eos_token_id]
    for contents in turns:
        rec.add_generation(
            Generation(
                token_ids=call, logprobs=[-0.1] * len(call), finish_reason="stop", weight_version=0
            )
        )
        new = [{"role": "tool", "content": c} for c in contents]
        delta = r_cached.delta_ids(new, TOOLS)
        assert delta == rec.add_messages(new)
        msgs += [{"role": "assistant", "content": "call"}, *new]
        assert rec.context_ids() == render_prompt_ids(tok, msgs, TOOLS)


_TOK = build_tiny_tokenizer()


def test_direct_template_render_equals_apply_chat_template(tok):
    r = DeltaRenderer(tok)
    assert r._direct is not None, "the tiny tokenizer uses the stock apply_chat_template"
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, *_tool("3")]
    for agp in (True, False):
        assert r._render_full(msgs, None, agp) == _render(tok, msgs, None, agp)
    assert r._direct_checked == {True, False} and r._direct is not None


def test_direct_render_that_disagrees_is_dropped_for_apply_chat_template(tok):
    r = DeltaRenderer(tok)
    assert r._direct is not None
    template, variables = r._direct

    class Skewed:
        def render(self, **kw):
            return template.render(**kw) + " "

    r._direct = (Skewed(), variables)
    msgs = [{"role": "user", "content": "U"}]
    assert r._render_full(msgs, None, True) == _render(tok, msgs, None, True)
    assert r._direct is None


def test_overridden_apply_chat_template_is_always_used():
    tok = build_tiny_tokenizer()
    base = type(tok)

    class Custom(base):  # type: ignore[misc, valid-type]  # a subclass made at run time
        def apply_chat_template(self, *args, **kwargs):
            return base.apply_chat_template(self, *args, **kwargs).replace("tool\n", "tool:\n")

    tok.__class__ = Custom
    r = DeltaRenderer(tok)
    assert r._direct is None
    assert "tool:" in tok.decode(r.delta_ids(_tool("1")))
