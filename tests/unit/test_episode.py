"""EpisodeRecorder: token-exact multi-turn bookkeeping against the tiny model's chat template."""

from __future__ import annotations

import itertools
import pickle

import pytest

from agentrl.episode import (
    ChatTemplateError,
    EpisodeRecorder,
    get_delta_renderer,
    render_prompt_ids,
)
from agentrl.inference.tiny_model import build_tiny_tokenizer
from agentrl.rollout.calculator_task import calculator_tool_schemas
from agentrl.types import Generation, StopReason

TOOLS = calculator_tool_schemas()
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _gen(tok, text: str, *, eos: bool = True, version: int = 3, lp: float = -0.25) -> Generation:
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    return Generation(
        token_ids=ids,
        logprobs=[lp] * len(ids),
        finish_reason="stop" if eos else "length",
        weight_version=version,
    )


def test_multi_turn_context_equals_full_render(tok):
    """After each turn the context equals the chat template's render of the whole conversation."""
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    rec = EpisodeRecorder.from_messages(msgs, tok, tools=TOOLS)
    assert rec.context_ids() == render_prompt_ids(tok, msgs, TOOLS)
    prompts = [rec.context_ids()]
    for turn in range(3):
        rec.add_generation(_gen(tok, CALL, version=turn))
        tool_msgs = [{"role": "tool", "content": f"result {turn}"}]
        rec.add_messages(tool_msgs)
        msgs += [{"role": "assistant", "content": CALL}, *tool_msgs]
        assert rec.context_ids() == render_prompt_ids(tok, msgs, TOOLS)
        prompts.append(rec.context_ids())
    # each prompt is the previous prompt plus new tokens: earlier turns never change
    for prev, nxt in itertools.pairwise(prompts):
        assert nxt[: len(prev)] == prev and len(nxt) > len(prev)


def test_masks_logprobs_versions_align(tok):
    rec = EpisodeRecorder.from_messages([{"role": "user", "content": "hi"}], tok)
    g1 = _gen(tok, CALL, version=1, lp=-0.5)
    rec.add_generation(g1)
    delta = rec.add_messages([{"role": "tool", "content": "4"}])
    g2 = _gen(tok, "The answer is 4.", version=2, lp=-0.1)
    rec.add_generation(g2)
    traj = rec.to_trajectory(uid="u", stop_reason=StopReason.EOS)
    n1, nd, n2 = len(g1.token_ids), len(delta), len(g2.token_ids)
    assert traj.response_ids == g1.token_ids + delta + g2.token_ids
    assert traj.loss_mask == [1] * n1 + [0] * nd + [1] * n2
    assert traj.rollout_logprobs == [-0.5] * n1 + [0.0] * nd + [-0.1] * n2
    assert traj.policy_version == [1] * n1 + [-1] * nd + [2] * n2
    assert traj.num_turns == 2
    # the template's newline after <|im_end|> is part of the (mask-0) delta
    assert tok.decode(delta).startswith("\n<|im_start|>tool")
    assert tok.decode(delta).endswith("<|im_start|>assistant\n")


def test_turn_cut_by_length_is_closed_with_end_of_turn(tok):
    rec = EpisodeRecorder.from_messages([{"role": "user", "content": "hi"}], tok)
    rec.add_generation(_gen(tok, "partial answ", eos=False))
    delta = rec.add_messages([{"role": "user", "content": "go on"}])
    assert delta[0] == tok.eos_token_id
    n = len(tok.encode("partial answ", add_special_tokens=False))
    assert rec.loss_mask[n] == 0  # the appended <|im_end|> is not a sampled token
    full = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "partial answ"},
        {"role": "user", "content": "go on"},
    ]
    assert rec.context_ids() == render_prompt_ids(tok, full)


def test_response_budget_truncates_safely(tok):
    rec = EpisodeRecorder.from_messages(
        [{"role": "user", "content": "hi"}], tok, max_response_tokens=20
    )
    assert rec.remaining_budget == 20
    rec.add_generation(_gen(tok, "x" * 12))
    assert rec.remaining_budget == 7 and not rec.truncated
    rec.add_messages([{"role": "tool", "content": "a long tool response " * 5}])
    assert rec.truncated and len(rec.response_ids) == 20 and rec.remaining_budget == 0
    traj = rec.to_trajectory(uid="u", stop_reason=StopReason.LENGTH)  # invariants hold
    assert traj.loss_mask == [1] * 13 + [0] * 7


def test_context_budget_counts_the_prompt(tok):
    msgs = [{"role": "user", "content": "hi"}]
    n_prompt = len(render_prompt_ids(tok, msgs))
    rec = EpisodeRecorder.from_messages(msgs, tok, max_context_tokens=n_prompt + 5)
    assert rec.remaining_budget == 5
    rec.add_generation(_gen(tok, "abcdefgh"))
    assert rec.truncated and len(rec.context_ids()) == n_prompt + 5
    assert rec.to_trajectory(uid="u").response_length == 5


def test_truncate_to_and_errors(tok):
    rec = EpisodeRecorder([1, 2, 3], tokenizer=tok)
    rec.add_environment_tokens([4, 5, 6])
    assert not rec.truncate_to(3) and rec.truncate_to(1)
    assert rec.response_ids == [4] and rec.loss_mask == [0]
    with pytest.raises(ValueError, match="max_len"):
        rec.truncate_to(-1)
    with pytest.raises(ValueError, match="non-empty prompt_ids"):
        EpisodeRecorder([])
    with pytest.raises(ValueError, match="weight_version"):
        rec.add_generation(
            Generation(token_ids=[1], logprobs=[-1.0], finish_reason="stop", weight_version=-1)
        )


def test_prefix_unstable_template_is_rejected():
    tok = build_tiny_tokenizer()
    # A template that renders earlier assistant turns differently once more messages follow
    # (like Qwen3 dropping earlier thinking blocks) cannot be recorded token-exactly.
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}[old]{% else %}{{ m.content }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rec = EpisodeRecorder.from_messages([{"role": "user", "content": "hi"}], tok)
    rec.add_generation(_gen(tok, "hello"))
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        rec.add_messages([{"role": "user", "content": "again"}])


def test_template_without_end_of_turn_token_is_rejected():
    tok = build_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match="does not end an assistant turn"):
        get_delta_renderer(tok).delta_ids([{"role": "user", "content": "x"}])


def test_recorder_pickles(tok):
    rec = EpisodeRecorder.from_messages([{"role": "user", "content": "hi"}], tok, tools=TOOLS)
    rec.add_generation(_gen(tok, "hey"))
    copy = pickle.loads(pickle.dumps(rec))
    assert copy.context_ids() == rec.context_ids() and copy.loss_mask == rec.loss_mask


def test_continue_turn_appends_to_the_same_model_turn(tok):
    rec = EpisodeRecorder.from_messages([{"role": "user", "content": "hi"}], tok)
    partial = _gen(tok, "hel", eos=False, version=1)
    rec.add_generation(partial.model_copy(update={"finish_reason": "abort"}))
    rec.add_generation(_gen(tok, "lo", version=2), continue_turn=True)
    assert rec.num_turns == 1
    assert rec.policy_version == [1, 1, 1, 2, 2, 2]
    # the resumed turn ended with <|im_end|>, so no closing token is added before new messages
    delta = rec.add_messages([{"role": "user", "content": "again"}])
    assert delta[0] != tok.eos_token_id


def test_a_generation_that_crossed_a_push_stamps_each_token_with_its_version(tok):
    rec = EpisodeRecorder.from_messages([{"role": "user", "content": "hi"}], tok)
    gen = _gen(tok, "hey", version=1)
    n = len(gen.token_ids)
    rec.add_generation(gen.model_copy(update={"token_versions": [1] + [2] * (n - 1)}))
    assert rec.policy_version == [1] + [2] * (n - 1)
    bad = gen.model_copy(update={"token_versions": [-1] * n})
    with pytest.raises(ValueError, match="versions"):
        rec.add_generation(bad)
