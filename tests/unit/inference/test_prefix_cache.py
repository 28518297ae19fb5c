"""The embedded engine's prefix cache: exact keys, bounds, invalidation, and that a cached prefix
changes no token and no logprob beyond float rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentrl.inference.engine import InferenceEngine
from agentrl.inference.engine.prefix_cache import BLOCK, PrefixCache
from agentrl.types import SamplingParams


def _kv(n: int, fill: float = 1.0, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``[H=2, n, D=4]`` keys/values whose value at token ``t`` is ``fill * t``."""
    t = torch.arange(n, dtype=torch.float32)[None, :, None].expand(2, n, 4) * fill
    return [(t.clone(), -t.clone()) for _ in range(layers)]


# ---- the cache alone ---------------------------------------------------------------------------
def test_a_match_is_whole_blocks_and_never_the_last_token() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    tokens = list(range(3 * BLOCK))
    assert cache.insert(tokens, _kv(len(tokens)), generation=0) == 3
    n, kv = cache.match(tokens, generation=0)  # the last token must be computed
    assert n == 2 * BLOCK and kv is not None
    assert kv[0][0].shape == (2, 2 * BLOCK, 4)
    assert torch.equal(kv[0][0][0, :, 0], torch.arange(2 * BLOCK, dtype=torch.float32))
    n, _ = cache.match([*tokens, 7], generation=0)
    assert n == 3 * BLOCK
    n, _ = cache.match(tokens[: BLOCK + 3], generation=0)
    assert n == BLOCK


def test_keys_are_exact_prefixes() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    a = list(range(2 * BLOCK + 1))
    cache.insert(a, _kv(len(a)), 0)
    b = a.copy()
    b[BLOCK + 2] = 999  # the second block differs: only the first matches
    assert cache.match(b, 0)[0] == BLOCK
    c = [999, *a[1:]]  # the first block differs: nothing matches, whatever follows
    assert cache.match(c, 0) == (0, None)
    assert cache.peek(a, 0) == 2 * BLOCK


def test_a_new_weight_generation_empties_it_and_stale_kv_is_not_stored() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    tokens = list(range(2 * BLOCK + 1))
    cache.insert(tokens, _kv(len(tokens)), 0)
    assert cache.match(tokens, 1) == (0, None)  # the weights changed: nothing is served
    assert cache.num_tokens == 0 and cache.stats["prefix_cache_resets"] == 1
    assert cache.insert(tokens, _kv(len(tokens)), 0) == 0  # KV of the old weights
    assert cache.insert(tokens, _kv(len(tokens)), 1) == 2


def test_it_stays_within_its_bytes_and_evicts_extensions_before_their_prefix() -> None:
    one_block = 2 * 2 * (2 * BLOCK * 4 * 4)  # layers x (k, v) x [2, BLOCK, 4] float32
    cache = PrefixCache(max_bytes=3 * one_block)
    shared = list(range(BLOCK))
    for i in range(4):  # four prompts: the shared block + two blocks of their own
        tokens = shared + [1000 + i] * (2 * BLOCK) + [5]
        cache.insert(tokens, _kv(len(tokens)), 0)
        assert cache.nbytes <= cache.max_bytes
    assert len(cache.blocks) == 3 and cache.stats["prefix_cache_evicted_blocks"] > 0
    assert cache.peek([*shared, 1], 0) == BLOCK  # the shared prefix outlived the rest
    assert cache.peek(shared + [1003] * (2 * BLOCK) + [5], 0) == 3 * BLOCK


def test_zero_bytes_is_off() -> None:
    cache = PrefixCache(max_bytes=0)
    tokens = list(range(3 * BLOCK))
    assert not cache.enabled
    assert cache.insert(tokens, _kv(len(tokens)), 0) == 0
    assert cache.match(tokens, 0) == (0, None)
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)


# ---- in the engine -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path):
    off = InferenceEngine(tiny_model_dir, max_batch_size=32, seed=0)
    on = InferenceEngine(tiny_model_dir, max_batch_size=32, seed=0, prefix_cache_mb=16)
    yield off, on
    off.close()
    on.close()


def _episode_prompts() -> list[list[int]]:
    """Eight prompts that share a 70-token system block, each with its own question."""
    system = [(11 * j) % 250 for j in range(70)]
    return [system + [(3 * i + j) % 250 for j in range(5 + 4 * i)] for i in range(8)]


def _two_turns(engine: InferenceEngine, prompts: list[list[int]]) -> list:
    """Turn 1 of every prompt at once, then turn 2: prompt + its output + a tool answer."""
    sp = [SamplingParams(max_tokens=12, temperature=1.0, seed=40 + i) for i in range(len(prompts))]
    first = [f.result(60) for f in [engine.submit(p, s) for p, s in zip(prompts, sp, strict=True)]]
    again = [p + o.token_ids + [17, 18, 19] for p, o in zip(prompts, first, strict=True)]
    second = [f.result(60) for f in [engine.submit(p, s) for p, s in zip(again, sp, strict=True)]]
    return first + second


def test_cached_prefixes_change_no_token_and_no_logprob(engines) -> None:
    off, on = engines
    hits_before = on.stats["prefix_cache_hit_tokens"]
    computed_off, computed_on = off.stats["prompt_tokens"], on.stats["prompt_tokens"]
    a, b = _two_turns(off, _episode_prompts()), _two_turns(on, _episode_prompts())
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    hits = on.stats["prefix_cache_hit_tokens"] - hits_before
    assert hits >= 8 * 4 * BLOCK  # turn 2 reuses each episode's turn 1
    computed_off = off.stats["prompt_tokens"] - computed_off
    computed_on = on.stats["prompt_tokens"] - computed_on
    assert computed_on + hits == computed_off
    assert computed_on < computed_off / 2
    assert on.stats["prefix_cache_tokens"] > 0


def test_requests_that_arrive_together_share_the_first_ones_prefix(engines) -> None:
    _, on = engines
    on.reset_prefix_cache()
    on.pause("keep")
    prompts = [[*p, 200 + i] for i, p in enumerate(_episode_prompts())]  # nothing cached yet
    futs = [on.submit(p, SamplingParams(max_tokens=2, temperature=0.0)) for p in prompts]
    forwards, hits = on.stats["prefill_forwards"], on.stats["prefix_cache_hit_tokens"]
    on.resume()  # all eight are admitted in one go
    for f in futs:
        f.result(60)
    assert on.stats["prefill_forwards"] - forwards == 2  # the leader, then the rest together
    assert on.stats["prefix_cache_hit_tokens"] - hits == 7 * 4 * BLOCK


def test_a_weight_load_never_serves_kv_of_the_old_weights(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = InferenceEngine(tiny_model_dir, max_batch_size=8, prefix_cache_mb=16)
    try:
        prompt = _episode_prompts()[0]
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        engine.submit(prompt, greedy).result(60)
        assert engine.stats["prefix_cache_tokens"] > 0
        new = {k: v.detach().clone() + 0.05 for k, v in engine.model.state_dict().items()}
        engine.load_state_dict(new)
        out = engine.submit(prompt, greedy).result(60)
        ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        ref.load_state_dict(new)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        expect = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])
        assert out.logprobs == pytest.approx(expect[:, 0].tolist(), abs=1e-5)
        assert engine.stats["prefix_cache_resets"] >= 1
        assert engine.reset_prefix_cache() is True
        assert engine.stats["prefix_cache_tokens"] == 0
    finally:
        engine.close()


def test_serve_model_takes_the_cache_size_and_refuses_a_bad_one(capsys) -> None:
    import argparse

    from agentrl.inference.server import DEFAULT_PREFIX_CACHE_MB, add_arguments

    parser = argparse.ArgumentParser(prog="agentrl serve-model")
    add_arguments(parser)
    assert parser.parse_args(["m"]).prefix_cache_mb == DEFAULT_PREFIX_CACHE_MB
    assert parser.parse_args(["m", "--prefix-cache-mb", "0"]).prefix_cache_mb == 0.0
    for bad in ("-1", "inf", "lots"):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["m", "--prefix-cache-mb", bad])
        assert exc.value.code == 2
        assert "--prefix-cache-mb" in capsys.readouterr().err
