"""The scoring engine and route (a reward model served like the policy), and the tiny reward
model and scripted judge builders: scores equal a lone transformers forward whatever the batch,
one bad input fails only itself, the route speaks vLLM's /pooling and honours the API key."""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from agentrl.inference.scoring import ScoringEngine, is_classifier_dir
from agentrl.inference.server import _load_engine, create_app
from agentrl.inference.tiny_model import build_scripted_model, build_tiny_reward_model


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", seed=1)


@pytest.fixture(scope="module")
def reference(rm_dir: Path) -> Any:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)

    def score(ids: list[int]) -> list[float]:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].tolist()

    return score


@pytest.fixture
def engine(rm_dir: Path):
    eng = ScoringEngine(rm_dir, max_batch_size=8)
    yield eng
    eng.close()


async def test_batched_scores_equal_a_lone_forward_and_requests_share_passes(engine, reference):
    seqs = [list(range(1, 3 + 5 * i)) for i in range(8)] + [[256, 7, 256]]  # pad id inside
    out = await asyncio.gather(*(engine.score([s]) for s in seqs))
    for s, [logits] in zip(seqs, out, strict=True):
        assert logits == pytest.approx(reference(s), abs=1e-5)
    assert engine.stats["sequences_scored"] == len(seqs)
    assert engine.stats["forward_passes"] < len(seqs)  # concurrent requests were batched


async def test_one_bad_sequence_fails_only_itself(engine, reference):
    real = engine.model

    class Poisoned:
        config = real.config

        def __call__(self, input_ids: torch.Tensor, **kw: Any) -> Any:
            if (input_ids == 99).any():
                raise RuntimeError("poisoned row")
            return real(input_ids=input_ids, **kw)

    engine.model = Poisoned()
    futures = [engine.submit([1, 2, 3]), engine.submit([99, 4]), engine.submit([5, 6])]
    results = await asyncio.gather(
        *(asyncio.wrap_future(f) for f in futures), return_exceptions=True
    )
    assert results[0] == pytest.approx(reference([1, 2, 3]), abs=1e-5)
    assert isinstance(results[1], Exception) and "poisoned" in str(results[1])
    assert results[2] == pytest.approx(reference([5, 6]), abs=1e-5)
    assert engine.stats["requests_failed"] == 1


def test_inputs_are_checked_at_the_door(engine):
    from agentrl.inference.engine import EngineRequestError

    with pytest.raises(EngineRequestError, match="empty"):
        engine.submit([])
    with pytest.raises(EngineRequestError, match="outside the vocabulary"):
        engine.submit([1, engine.vocab_size])
    with pytest.raises(EngineRequestError, match="context limit"):
        engine.submit([1] * (engine.max_model_len + 1))


def test_close_fails_what_is_queued_and_refuses_more(rm_dir: Path):
    eng = ScoringEngine(rm_dir)
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit([1, 2])


# ---- the route ------------------------------------------------------------------------------------
async def _post(app: Any, body: dict, headers: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://rm") as c:
        return await c.post("/pooling", json=body, headers=headers or {})


async def test_pooling_route_speaks_vllms_format(engine, reference, rm_dir: Path):
    from transformers import AutoTokenizer

    app = create_app(engine)
    r = await _post(app, {"input": [[1, 2, 3], [4, 5]], "use_activation": False})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    assert body["data"][1]["data"] == pytest.approx(reference([4, 5]), abs=1e-5)
    assert body["usage"]["prompt_tokens"] == 5
    # Default activation (vLLM's): sigmoid of the one logit.
    r = await _post(app, {"input": [1, 2, 3]})
    assert r.json()["data"][0]["data"][0] == pytest.approx(
        1 / (1 + math.exp(-reference([1, 2, 3])[0])), abs=1e-5
    )
    # A string is tokenized, a chat rendered with the model's template (no generation prompt).
    tok = AutoTokenizer.from_pretrained(rm_dir)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    r = await _post(app, {"messages": msgs, "use_activation": False})
    ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert r.json()["data"][0]["data"] == pytest.approx(reference(ids), abs=1e-5)
    r = await _post(app, {"input": "hello", "use_activation": False})
    assert r.json()["data"][0]["data"] == pytest.approx(reference(tok.encode("hello")), abs=1e-5)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": [[1, 2], [1, 9999]]}, 400, "input[1]"),
        ({"input": []}, 400, "input"),
        ({"input": [1], "task": "embed"}, 400, "task"),
        ({"input": [1], "model": "other"}, 404, "model"),
        ({}, 400, "input"),
        ({"input": [1], "messages": [{"role": "user", "content": "x"}]}, 400, "input"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ],
)
async def test_pooling_route_refuses_bad_inputs_naming_them(engine, body, status, param):
    r = await _post(create_app(engine), body)
    assert r.status_code == status
    assert r.json()["error"]["param"] == param


async def test_scoring_server_serves_scoring_only_and_needs_the_key(engine):
    app = create_app(engine, api_key="k")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://rm") as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.post("/pooling", json={"input": [1]})).status_code == 401
        ok = await c.post("/pooling", json={"input": [1]}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
        gen = await c.post(
            "/v1/completions", json={"prompt": [1]}, headers={"Authorization": "Bearer k"}
        )
        assert gen.status_code == 404
        assert "agentrl_requests" in (await c.get("/metrics")).text


async def test_several_labels_softmax_and_raw(tmp_path: Path):
    d = build_tiny_reward_model(tmp_path / "rm3", num_labels=3)
    eng = ScoringEngine(d)
    try:
        r = await _post(create_app(eng), {"input": [1, 2, 3]})
        probs = r.json()["data"][0]["data"]
        assert len(probs) == 3 and sum(probs) == pytest.approx(1.0)
    finally:
        eng.close()


def test_serve_model_picks_the_scoring_engine_for_a_classifier(rm_dir: Path, tiny_model_dir: Path):
    assert is_classifier_dir(rm_dir) and not is_classifier_dir(tiny_model_dir)
    args = argparse.Namespace(
        model_dir=str(rm_dir),
        task="auto",
        dtype="float32",
        device="cpu",
        max_batch_size=4,
        max_model_len=None,
        seed=0,
        weight_version=0,
        max_pause_s=10.0,
    )
    eng = _load_engine(args)
    try:
        assert isinstance(eng, ScoringEngine) and eng.max_batch_size == 4
    finally:
        eng.close()


# ---- builders -------------------------------------------------------------------------------------
def test_scripted_model_says_its_reply_greedily(tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = build_scripted_model(tmp_path / "judge", "\\boxed{7}")
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "grade: 42 {answer} \\boxed{3}"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert tok.decode(out[0, len(ids) :]) == "\\boxed{7}<|im_end|>"
    with pytest.raises(ValueError, match="do not repeat"):
        build_scripted_model(tmp_path / "bad", "\\boxed{77}")


def test_tiny_reward_model_is_deterministic(tmp_path: Path):
    a = build_tiny_reward_model(tmp_path / "a", seed=3)
    b = build_tiny_reward_model(tmp_path / "b", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
