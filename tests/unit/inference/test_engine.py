"""The embedded engine: sampling math, continuous batching equals single requests, controls."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch

from agentrl.inference.engine import (
    EngineRequestError,
    EngineStepError,
    InferenceEngine,
    WeightLoadError,
    process_logits,
    sample_token,
    sample_tokens,
)
from agentrl.types import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    eng = InferenceEngine(tiny_model_dir, max_batch_size=4, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    # Different lengths so the batch is ragged (left padding is exercised).
    return [[(7 * i + j) % 250 for j in range(3 + 5 * i)] for i in range(6)]


def _reference_logprobs(
    model, prompt: list[int], out: list[int], temperature: float
) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


# ---- sampling math ----------------------------------------------------------------------------
def test_process_logits_greedy_is_unscaled_log_softmax() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0])
    lp = process_logits(logits, 0.0, -1, 1.0)
    assert torch.allclose(lp, torch.log_softmax(logits, -1))
    assert sample_token(lp, 0.0, None) == 1


def test_process_logits_temperature_topk_topp() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    lp = process_logits(logits, 0.5, -1, 1.0)
    assert torch.allclose(lp, torch.log_softmax(logits / 0.5, -1))
    topk = process_logits(logits, 1.0, 2, 1.0)
    assert torch.isinf(topk[:2]).all() and torch.allclose(
        topk[2:], torch.log_softmax(torch.tensor([2.0, 3.0]), -1)
    )
    # probs ~ [0.032, 0.087, 0.237, 0.644]; top_p=0.8 keeps {3, 2} (drops mass <= 0.2).
    topp = process_logits(logits, 1.0, -1, 0.8)
    assert torch.isinf(topp[:2]).all()
    assert torch.allclose(topp.exp().sum(), torch.tensor(1.0))
    # top_p tiny still keeps the most likely token.
    assert torch.isfinite(process_logits(logits, 1.0, -1, 1e-6)).sum() == 1


def test_seeded_sampling_follows_the_distribution() -> None:
    lp = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    gen = torch.Generator().manual_seed(0)
    draws = [sample_token(lp, 1.0, gen) for _ in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, lp.exp(), atol=0.04)


def test_batched_sampling_never_picks_a_masked_token_and_rows_are_independent() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0], [5.0, 0.0, 0.0, 0.0, 0.0]])
    lp = process_logits(logits, 1.0, 2, 1.0)  # top-k 2: per row, only the two largest
    assert torch.equal(lp, torch.stack([process_logits(row, 1.0, 2, 1.0) for row in logits]))
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    draws = torch.stack([sample_tokens(lp, 1.0, gens) for _ in range(2000)])
    assert set(draws[:, 0].tolist()) == {2, 3} and set(draws[:, 1].tolist()) <= {0, 1, 2, 3, 4}
    freq = torch.bincount(draws[:, 0], minlength=5).float() / len(draws)
    assert torch.allclose(freq, lp[0].exp(), atol=0.04)
    # A row's token depends on its own generator only, not on the rows beside it.
    alone = sample_tokens(lp[1:], 1.0, [torch.Generator().manual_seed(7)])
    beside = sample_tokens(
        lp, 1.0, [torch.Generator().manual_seed(3), torch.Generator().manual_seed(7)]
    )
    assert alone[0] == beside[1]


# ---- batching ----------------------------------------------------------------------------------
def test_waiting_requests_are_prefilled_together_token_exact(engine, hf_model) -> None:
    prompts = _prompts()[:4]  # ragged: left padding in the prefill
    params = [
        SamplingParams(max_tokens=8, temperature=t, seed=40 + i)
        for i, t in enumerate((0.0, 1.0, 0.7, 1.0))
    ]
    singles = [
        engine.submit(p, sp).result(timeout=120) for p, sp in zip(prompts, params, strict=True)
    ]
    engine.pause()
    before = engine.stats["prefill_forwards"]
    futs = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.resume()
    together = [f.result(timeout=120) for f in futs]
    assert engine.stats["prefill_forwards"] - before == 1
    for p, sp, one, t in zip(prompts, params, singles, together, strict=True):
        assert t.token_ids == one.token_ids
        assert t.logprobs == pytest.approx(one.logprobs, abs=1e-5)
        ref = _reference_logprobs(hf_model, p, t.token_ids, sp.temperature)
        assert torch.allclose(torch.tensor(t.logprobs), ref, atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_batched_equals_single_and_matches_hf_forward(engine, hf_model, temperature: float) -> None:
    prompts = _prompts()
    params = [
        SamplingParams(max_tokens=6 + 3 * i, temperature=temperature, seed=100 + i)
        for i in range(len(prompts))
    ]
    # 6 concurrent requests with max_batch_size=4: two wait and join mid-flight.
    futs = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    batched = [f.result(timeout=120) for f in futs]
    for p, sp, b in zip(prompts, params, batched, strict=True):
        single = engine.submit(p, sp).result(timeout=120)
        assert b.token_ids == single.token_ids
        assert b.logprobs == pytest.approx(single.logprobs, abs=1e-5)
        ref = _reference_logprobs(hf_model, p, b.token_ids, temperature)
        assert torch.allclose(torch.tensor(b.logprobs), ref, atol=1e-4)
        assert b.finish_reason in ("stop", "length")
        if b.finish_reason == "length":
            assert len(b.token_ids) == sp.max_tokens
        assert b.token_versions == [0] * len(b.token_ids) and b.weight_version == 0


def test_requests_join_a_running_batch(engine) -> None:
    # The long request is parked by a pause while it is in the running batch (checked, not
    # assumed), the short one is queued behind the pause, and the resume admits it into that
    # batch. The long one fills the context (~2,000 greedy steps), so it cannot finish in the
    # step or two between seeing it run and the pause landing, however fast the machine.
    n = engine.max_model_len - 3
    greedy = SamplingParams(max_tokens=n, temperature=0.0)
    two = SamplingParams(max_tokens=2, temperature=0.0)
    ref_long = engine.submit([1, 2, 3], greedy, ignore_eos=True).result(timeout=300)
    ref_short = engine.submit([4, 5], two, ignore_eos=True).result(timeout=60)
    long = engine.submit([1, 2, 3], greedy, ignore_eos=True)
    deadline = time.monotonic() + 60
    # Waiting 0 and running 1 means the long request was admitted (a finished row can linger a
    # moment after its future resolves, so "running >= 1" alone could be the previous request).
    while not (engine.num_waiting == 0 and engine.num_running == 1):
        assert time.monotonic() < deadline, "the long request was never admitted"
        time.sleep(0.001)
    engine.pause()
    try:
        assert engine.num_running == 1 and not long.done(), "the long request was not running"
        short_fut = engine.submit([4, 5], two, ignore_eos=True)
    finally:
        engine.resume()
    short = short_fut.result(timeout=60)
    assert not long.done()  # it was decoding beside the short one, which joined and left
    assert short.token_ids == ref_short.token_ids
    assert long.result(timeout=300).token_ids == ref_long.token_ids


def test_stop_token_and_max_tokens_zero(engine) -> None:
    greedy = engine.submit([10, 11, 12], SamplingParams(max_tokens=5, temperature=0.0)).result()
    stop_at = greedy.token_ids[1]
    out = engine.submit(
        [10, 11, 12], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[stop_at])
    ).result()
    first = greedy.token_ids.index(stop_at)
    assert out.token_ids == greedy.token_ids[: first + 1] and out.finish_reason == "stop"
    empty = engine.submit([10], SamplingParams(max_tokens=0)).result()
    assert empty.token_ids == [] and empty.finish_reason == "length"


def test_validation_names_the_field(engine) -> None:
    with pytest.raises(EngineRequestError) as e:
        engine.submit([engine.vocab_size], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(EngineRequestError) as e:
        engine.submit([], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(EngineRequestError) as e:
        engine.submit([1, 2], SamplingParams(max_tokens=engine.max_model_len))
    assert e.value.param == "max_tokens"
    with pytest.raises(EngineRequestError) as e:
        engine.submit([1] * engine.max_model_len, SamplingParams(max_tokens=0))
    assert e.value.param == "prompt"


# ---- controls ----------------------------------------------------------------------------------
def test_pause_parks_requests_and_resume_finishes_them(engine) -> None:
    engine.pause()
    try:
        assert engine.is_paused
        fut = engine.submit([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
        # Two control round trips through the engine loop: a whole iteration (controls, then
        # a step unless paused) ran with the request queued. It was not admitted (no timing).
        engine.weight_info()
        engine.weight_info()
        assert engine.num_waiting == 1 and engine.num_running == 0 and not fut.done()
    finally:
        engine.resume()
    assert len(fut.result(timeout=60).token_ids) <= 3


def test_abort_all_returns_partial_outputs(engine) -> None:
    engine.pause()
    futs = [engine.submit([1, 2], SamplingParams(max_tokens=50)) for _ in range(3)]
    assert engine.abort_all() == 3
    engine.resume()
    outs = [f.result(timeout=10) for f in futs]
    assert all(o.finish_reason == "abort" for o in outs)


def test_weight_swap_changes_outputs_and_version(tmp_path: Path, tiny_model_dir: Path) -> None:
    from safetensors.torch import save_file

    from agentrl.inference.tiny_model import build_tiny_model

    eng = InferenceEngine(tiny_model_dir, max_batch_size=2)
    try:
        sp = SamplingParams(max_tokens=8, temperature=0.0)
        before = eng.submit([5, 6, 7], sp).result()
        info0 = eng.weight_info(checksum=True)
        other = build_tiny_model(tmp_path / "other", seed=123)
        assert eng.load_weights_from_path(other) == 1
        after = eng.submit([5, 6, 7], sp).result()
        assert after.weight_version == 1
        assert after.logprobs != before.logprobs
        info1 = eng.weight_info(checksum=True)
        assert info1["version"] == 1 and info1["checksum"] != info0["checksum"]
        assert info1["num_params"] == info0["num_params"]
        # Back to the original weights from bytes, with an explicit version.
        orig = InferenceEngine(tiny_model_dir, max_batch_size=1)
        try:
            state = {k: v.clone().contiguous() for k, v in orig.model.state_dict().items()}
        finally:
            orig.close()
        save_file(state, str(tmp_path / "orig.safetensors"))
        assert eng.load_weights_from_bytes((tmp_path / "orig.safetensors").read_bytes(), 7) == 7
        again = eng.submit([5, 6, 7], sp).result()
        assert again.token_ids == before.token_ids and again.weight_version == 7
        assert eng.weight_info(checksum=True)["checksum"] == info0["checksum"]
        # Bad updates change nothing.
        with pytest.raises(WeightLoadError, match="do not name a parameter"):
            eng.load_state_dict({"nope": torch.zeros(1)})
        with pytest.raises(WeightLoadError, match="shape"):
            eng.load_state_dict({"lm_head.weight": torch.zeros(3, 3)})
        with pytest.raises(WeightLoadError, match="missing"):
            eng.load_state_dict({"lm_head.weight": state["lm_head.weight"]})
        with pytest.raises(WeightLoadError, match="safetensors"):
            eng.load_weights_from_bytes(b"not safetensors")
        assert eng.weight_version == 7
        assert eng.weight_info(checksum=True)["checksum"] == info0["checksum"]
        assert eng.set_weight_version(9) == 9
    finally:
        eng.close()


def test_close_aborts_pending_and_is_idempotent(tiny_model_dir: Path) -> None:
    eng = InferenceEngine(tiny_model_dir, max_batch_size=1)
    eng.pause()
    fut = eng.submit([1, 2], SamplingParams(max_tokens=5))
    eng.close()
    eng.close()
    assert fut.result(timeout=10).finish_reason == "abort"
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit([1], SamplingParams())


def test_submit_is_thread_safe(engine) -> None:
    results: list = []

    def worker(i: int) -> None:
        results.append(engine.submit([i + 1, i + 2], SamplingParams(max_tokens=3, seed=i)).result())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 8


async def test_generate_async(engine) -> None:
    out = await engine.generate([3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0))
    assert 1 <= len(out.token_ids) <= 4


def test_eos_stops_unless_ignored(engine) -> None:
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    greedy = engine.submit([20, 21, 22], sp).result()
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({greedy.token_ids[0]})
    try:
        stopped = engine.submit([20, 21, 22], sp).result()
        ignored = engine.submit([20, 21, 22], sp, ignore_eos=True).result()
    finally:
        engine.eos_token_ids = saved
    assert stopped.token_ids == greedy.token_ids[:1] and stopped.finish_reason == "stop"
    assert len(ignored.token_ids) == 6 and ignored.finish_reason == "length"


def test_parked_request_across_a_weight_swap_reports_both_versions(tiny_model_dir: Path) -> None:
    eng = InferenceEngine(tiny_model_dir, max_batch_size=2)
    try:
        fut = eng.submit([1, 2, 3], SamplingParams(max_tokens=400, seed=0), ignore_eos=True)
        deadline = time.monotonic() + 120
        while eng.stats["decode_steps"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        eng.pause()  # keep mode: the request stays parked mid-generation
        assert not fut.done()
        state = {k: v + 0.01 for k, v in eng.model.state_dict().items()}
        assert eng.load_state_dict(state) == 1
        eng.resume()
        out = fut.result(timeout=300)
    finally:
        eng.close()
    assert out.token_versions[0] == 0 and out.token_versions[-1] == 1
    assert out.token_versions == sorted(out.token_versions)
    assert out.weight_version == 0  # the oldest version: conservative for staleness


# ---- one bad request fails only itself -------------------------------------------------------
class _Poisoned:
    """Wraps a model: a prefill containing ``prefill_token`` raises, and a batched decode step
    (more than one row) with a row at position >= ``decode_position`` raises."""

    def __init__(self, model, *, prefill_token: int = -1, decode_position: int = 10**9) -> None:
        self.model = model
        self.prefill_token = prefill_token
        self.decode_position = decode_position

    def __call__(self, *, input_ids, position_ids=None, **kwargs):
        if input_ids.shape[1] > 1 and (input_ids == self.prefill_token).any():
            raise RuntimeError("poisoned prefill")
        if (
            input_ids.shape[1] == 1
            and position_ids is not None
            and (position_ids >= self.decode_position).any()
        ):
            raise RuntimeError("poisoned decode")
        return self.model(input_ids=input_ids, position_ids=position_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.fixture
def fresh(tiny_model_dir: Path):
    eng = InferenceEngine(tiny_model_dir, max_batch_size=8, seed=0)
    yield eng
    eng.close()


def test_a_failing_prefill_fails_only_its_request(fresh) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    refs = [fresh.submit([3, 4, i + 5], greedy).result(timeout=60) for i in range(3)]
    fresh.model = _Poisoned(fresh.model, prefill_token=250)
    fresh.pause()
    futs = [fresh.submit([3, 4, i + 5], greedy) for i in range(3)]
    bad = fresh.submit([250, 1, 2], greedy)
    futs.insert(1, fresh.submit([3, 4, 9], greedy))
    fresh.resume()
    with pytest.raises(EngineStepError, match="prefill failed"):
        bad.result(timeout=60)
    outs = [f.result(timeout=60) for f in futs]
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [r.token_ids for r in refs]
    assert fresh.stats["requests_failed"] == 1
    assert fresh.stats["prefill_batch_failures"] == 1  # together first, then one by one


def test_a_failing_decode_step_is_isolated_to_the_row_that_causes_it(fresh) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    refs = [fresh.submit([7, i + 1], greedy).result(timeout=60) for i in range(3)]
    fresh.model = _Poisoned(fresh.model, decode_position=40)
    fresh.pause()  # everything joins the same batch
    futs = [fresh.submit([7, i + 1], greedy) for i in range(3)]
    bad = fresh.submit(list(range(1, 41)), greedy)  # its first decode is at position 40
    fresh.resume()
    with pytest.raises(EngineStepError, match="decode failed"):
        bad.result(timeout=60)
    # The others were re-prefilled and decoded alone once, and finished token-exact.
    assert [f.result(timeout=60).token_ids for f in futs] == [r.token_ids for r in refs]
    assert fresh.stats["decode_step_failures"] >= 1 and fresh.stats["requests_failed"] == 1


def test_non_finite_logits_fail_fast_instead_of_hanging(fresh) -> None:
    with torch.no_grad():
        fresh.model.lm_head.weight.fill_(float("nan"))
    for temperature in (0.0, 1.0):
        fut = fresh.submit([1, 2, 3], SamplingParams(max_tokens=4, temperature=temperature))
        with pytest.raises(EngineStepError, match="non-finite"):
            fut.result(timeout=60)
    with pytest.raises(EngineStepError, match="non-finite"):
        fresh.probe([1, 2], token_ids=[3, 4])


def test_sampling_is_normalised_and_checked_at_the_door(engine) -> None:
    tiny_t = engine.submit([9, 9], SamplingParams(max_tokens=4, temperature=1e-50)).result(60)
    greedy = engine.submit([9, 9], SamplingParams(max_tokens=4, temperature=0.0)).result(60)
    assert tiny_t.token_ids == greedy.token_ids and tiny_t.logprobs == greedy.logprobs
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(EngineRequestError) as e:
            engine.submit([1], SamplingParams(seed=seed))
        assert e.value.param == "seed"
    out = engine.submit(
        [1, 2], SamplingParams(max_tokens=5, top_p=0.01, seed=1), num_top_logprobs=5
    ).result(60)
    assert out.top_logprobs is not None
    assert all(len(top) == 1 and all(math.isfinite(v) for _, v in top) for top in out.top_logprobs)


# ---- the probe, pauses, deadlines, cancellation ------------------------------------------------
def test_the_probe_is_served_while_paused_and_matches_a_forward_pass(engine, hf_model) -> None:
    engine.pause()
    try:
        forced = engine.probe([5, 6, 7], temperature=0.7, token_ids=[8, 9, 10, 11])
        sampled = engine.probe([5, 6, 7], temperature=0.7, max_tokens=4, seed=3)
    finally:
        engine.resume()
    ref = _reference_logprobs(hf_model, [5, 6, 7], [8, 9, 10, 11], 0.7)
    assert forced.token_ids == [8, 9, 10, 11] and forced.weight_version == engine.weight_version
    assert torch.allclose(torch.tensor(forced.logprobs), ref, atol=1e-5)
    ref = _reference_logprobs(hf_model, [5, 6, 7], sampled.token_ids, 0.7)
    assert torch.allclose(torch.tensor(sampled.logprobs), ref, atol=1e-5)
    with pytest.raises(EngineRequestError):
        engine.probe([1], max_tokens=10_000)


def test_a_pause_ends_by_its_deadline(fresh) -> None:
    fresh.pause(max_pause_s=0.2)
    fut = fresh.submit([1, 2], SamplingParams(max_tokens=2))
    assert len(fut.result(timeout=30).token_ids) >= 1  # served once the pause expired
    assert not fresh.is_paused and fresh.stats["pause_expired"] == 1
    with pytest.raises(EngineRequestError):
        fresh.pause(max_pause_s=float("nan"))


def test_a_drain_pauses_once_the_batch_is_empty_and_a_resume_cancels_it(fresh) -> None:
    long = fresh.submit([1, 2], SamplingParams(max_tokens=60), ignore_eos=True)
    deadline = time.monotonic() + 60
    while fresh.num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    epoch = fresh.start_drain()
    queued = fresh.submit([3, 4], SamplingParams(max_tokens=2))
    assert fresh.pause_state in ("draining", "paused") and fresh.is_paused
    long.result(timeout=60)
    deadline = time.monotonic() + 30
    while fresh.pause_state != "paused" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fresh.pause_state == "paused" and not queued.done()  # nothing new was admitted
    assert not fresh.cancel_pause(epoch - 1)  # a stale requester cannot resume it
    assert fresh.cancel_pause(epoch) and fresh.pause_state == "running"
    assert queued.result(timeout=60).finish_reason in ("stop", "length")


def test_deadlines_and_cancellation_end_parked_requests_at_once(fresh) -> None:
    fresh.pause()
    try:
        late = fresh.submit([1, 2], SamplingParams(max_tokens=8), timeout_s=0.1)
        assert late.result(timeout=30).finish_reason == "abort"  # while still paused
        gone = fresh.submit([1, 2], SamplingParams(max_tokens=8))
        fresh.cancel(gone)
        assert gone.result(timeout=30).finish_reason == "abort"
        assert fresh.num_waiting == 0 and fresh.stats["finish_abort"] == 2
    finally:
        fresh.resume()


# ---- weights: checked completely, version and weights together ---------------------------------
def test_bad_updates_change_neither_weights_nor_version(fresh, tmp_path: Path) -> None:
    state = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    before = fresh.weight_info(checksum=True)
    nan = dict(state, **{"lm_head.weight": state["lm_head.weight"].clone().fill_(float("nan"))})
    with pytest.raises(WeightLoadError, match="non-finite"):
        fresh.load_state_dict(nan)
    with pytest.raises(WeightLoadError, match="dtype"):
        fresh.load_state_dict({k: v.double() for k, v in state.items()})
    for version in (-1, 2**63, "3", True):
        with pytest.raises(EngineRequestError):
            fresh.load_state_dict({k: v + 1 for k, v in state.items()}, version)  # type: ignore[arg-type]
    with pytest.raises(EngineRequestError):
        fresh.set_weight_version(10**400)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 64)
    for path in (tmp_path / "bad.safetensors", tmp_path / "nope", tmp_path):
        with pytest.raises(WeightLoadError):
            fresh.load_weights_from_path(path)
    assert fresh.weight_info(checksum=True) == before
    # A lossless widening is applied and reported.
    assert fresh.load_state_dict({k: v.half() for k, v in state.items()}, 4) == 4
    assert fresh.last_load_casts == {"float16->float32": len(state)}


def test_a_second_load_is_refused_at_once_while_one_holds_the_staging_buffer(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Issue 21: loads queued behind a slow one held the server's threads and starved /pause and
    /weight_info; a load that finds the staging buffer taken is now a 409 at once."""

    from agentrl.inference.engine import VersionConflict
    from agentrl.inference.tiny_model import build_tiny_model

    eng = InferenceEngine(tiny_model_dir, max_batch_size=1)
    try:
        other = build_tiny_model(tmp_path / "other", seed=7)
        with eng.weights.staging_lock:  # a slow pull in progress
            # "At once" without a clock: this thread holds the (non-reentrant) lock, so a load
            # that waited for it would never return; that it raises proves it did not wait.
            with pytest.raises(VersionConflict, match="another weight update is in progress"):
                eng.load_weights_from_path(other)
            assert eng.weight_info()["version"] == 0  # /weight_info still answers
        assert eng.load_weights_from_path(other) == 1  # and the next load goes through
    finally:
        eng.close()
