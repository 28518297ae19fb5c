"""Model rewards (reward model, LLM judge) and reward mixes: score parsing, prompt rendering,
weighted and user combinations, the config that selects them, failures counted (never a 0.0),
the concurrency limit, and the real scoring/judge engines served in process."""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path

import httpx
import pytest

from agentrl.config import load_config
from agentrl.rollout.model_rewards import (
    CombinedReward,
    JudgeReward,
    RewardModelReward,
    combine_terms,
    parse_judge_score,
    render_judge_prompt,
)
from agentrl.rollout.rewards import RewardConfigError, RewardError, RewardManager
from agentrl.threads import make_plan
from agentrl.types import Task, Trajectory


def make_traj(answer: str = "\\boxed{42}", *, num_turns: int = 1) -> Trajectory:
    return Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        loss_mask=[1, 1],
        rollout_logprobs=[-0.5, -0.5],
        policy_version=[0, 0],
        uid="u",
        num_turns=num_turns,
        messages=[
            {"role": "user", "content": "What is 6*7?"},
            {"role": "assistant", "content": answer},
        ],
    )


def make_task(data_source: str = "mix", gt: str = "42") -> Task:
    return Task(
        id="t0", prompt="What is 6*7?", data_source=data_source, reward_spec={"ground_truth": gt}
    )


# ---- module-level functions (importable by path) ------------------------------------------------
def half(traj: Trajectory, task: Task) -> float:
    return 0.5


async def per_turn(traj: Trajectory, task: Task) -> dict:
    return {"score": 1.0, "turn_rewards": [0.25] * traj.num_turns, "note": "t"}


def product(scores: dict[str, float], traj: Trajectory, task: Task) -> dict:
    return {"score": scores["numeric_match"] * scores[f"{HERE}:half"], "combined_by": "product"}


def broken(traj: Trajectory, task: Task) -> float:
    raise RuntimeError("grader crashed")


async def slow(traj: Trajectory, task: Task) -> float:
    await asyncio.sleep(30)
    return 1.0


HERE = "tests.unit.rollout.test_model_rewards"


# ---- score parsing and prompts ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reply", "parse", "pattern", "expected"),
    [
        ("The answer is right. \\boxed{7}", "boxed", None, 7.0),
        ("first \\boxed{2} then \\boxed{9}", "boxed", None, 9.0),
        ("\\boxed{7.5}", "boxed", None, 7.5),
        ("\\boxed{3/4}", "boxed", None, 0.75),
        ("\\boxed{seven}", "boxed", None, None),
        ("score: 7", "boxed", None, None),  # no box: no score, not "the last number"
        ("  8 \n", "number", None, 8.0),
        ("8 out of 10", "number", None, None),
        ("Score: 6/10 because ...", "regex", r"Score: (\d+)/10", 6.0),
        ("no score here", "regex", r"Score: (\d+)", None),
        ("", "boxed", None, None),
        ("@#!\x00garbage}{", "boxed", None, None),
    ],
)
def test_parse_judge_score(reply, parse, pattern, expected):
    assert parse_judge_score(reply, parse=parse, pattern=pattern) == expected


def test_render_judge_prompt_fills_only_the_three_placeholders_once():
    template = "Q: {question}\nRef: {reference}\nA: {answer}\nReply as \\boxed{N}; {other}"
    out = render_judge_prompt(template, "6*7?", "I say {reference}", "42")
    assert out == "Q: 6*7?\nRef: 42\nA: I say {reference}\nReply as \\boxed{N}; {other}"


def test_combine_terms_weights_scores_and_turn_rewards():
    results = {
        "a": (1.0, None, {"x": 1}),
        "b": (0.5, [0.1, 0.2], {}),
        "c": (2.0, [1.0, 0.0], {"y": 2}),
    }
    out = combine_terms(results, {"a": 1.0, "b": 2.0, "c": -0.5}, num_turns=2)
    assert out["score"] == pytest.approx(1.0 + 1.0 - 1.0)
    assert out["turn_rewards"] == pytest.approx([0.2 - 0.5, 0.4])
    assert out["terms"] == {"a": 1.0, "b": 0.5, "c": 2.0}
    assert out["a"] == {"x": 1} and out["c"] == {"y": 2} and "b" not in out


# ---- mixes of function rewards in the manager ---------------------------------------------------
async def test_weighted_mix_of_function_rewards():
    manager = RewardManager(
        sources={"mix": {"terms": {"numeric_match": 1.0, f"{HERE}:half": 2.0}}}, default=None
    )
    scored = await manager.score(make_traj("\\boxed{42}"), make_task())
    assert scored.reward == pytest.approx(1.0 + 2.0 * 0.5)
    assert scored.reward_info["terms"] == {"numeric_match": 1.0, f"{HERE}:half": 0.5}
    assert scored.reward_info["numeric_match"]["correct"] is True


async def test_mix_sums_turn_rewards_so_the_return_is_the_weighted_sum():
    manager = RewardManager(sources={"mix": {"terms": {f"{HERE}:per_turn": 2.0}}}, default=None)
    scored = await manager.score(make_traj(num_turns=3), make_task())
    assert scored.reward == 2.0 and scored.turn_rewards == [0.5, 0.5, 0.5]


async def test_user_combiner_by_path_gets_the_raw_scores_by_term_name():
    cfg = load_config(
        None,
        [
            f"reward.sources.mix={{terms: [numeric_match, '{HERE}:half'], combine: '{HERE}:product'}}"
        ],
    )
    manager = RewardManager.from_config(cfg.reward)
    scored = await manager.score(make_traj("\\boxed{42}"), make_task())
    assert scored.reward == 0.5
    assert scored.reward_info["combined_by"] == "product"
    assert scored.reward_info["terms"] == {"numeric_match": 1.0, f"{HERE}:half": 0.5}
    wrong = await manager.score(make_traj("\\boxed{41}"), make_task())
    assert wrong.reward == 0.0


def test_unknown_term_is_a_config_error_naming_the_key():
    with pytest.raises(RewardConfigError, match=r"reward\.sources\.mix\.terms\.nope"):
        RewardManager(sources={"mix": {"terms": {"nope": 1.0}}})


async def test_a_failing_term_fails_the_episode_counted_and_stops_the_others():
    manager = RewardManager(
        sources={"mix": {"terms": [f"{HERE}:broken", f"{HERE}:slow"]}}, default=None, timeout_s=20
    )
    with pytest.raises(RewardError, match="grader crashed") as info:
        await asyncio.wait_for(manager.score(make_traj(), make_task()), 10)
    assert "broken" in str(info.value) and info.value.source == "mix"
    m = manager.metrics()
    assert m["reward/mix/errors"] == 1.0 and m["reward/scored"] == 0.0


async def test_a_term_past_the_deadline_is_a_counted_timeout():
    manager = RewardManager(
        sources={"mix": {"terms": ["numeric_match", f"{HERE}:slow"]}}, default=None, timeout_s=0.2
    )
    with pytest.raises(RewardError, match=r"slow.*timed out"):
        await manager.score(make_traj(), make_task())
    assert manager.metrics()["reward/mix/timeouts"] == 1.0


# ---- config ----------------------------------------------------------------------------------
def test_config_model_rewards_must_be_used_and_well_formed(tmp_path: Path):
    with pytest.raises(Exception, match=r"reward\.models\.rm is not used"):
        load_config(None, [f"reward.models={{rm: {{type: reward_model, path: {tmp_path}}}}}"])
    with pytest.raises(Exception, match=r"\{answer\} placeholder"):
        load_config(
            None,
            [
                f"reward.models={{j: {{type: judge, path: {tmp_path}, prompt: hi}}}}",
                "reward.default=j",
            ],
        )
    with pytest.raises(Exception, match=r"unknown key 'reward\.models\.rm\.prompt'"):
        load_config(
            None,
            [
                f"reward.models={{rm: {{type: reward_model, path: {tmp_path}, prompt: x}}}}",
                "reward.default=rm",
            ],
        )
    with pytest.raises(Exception, match="list the names"):
        load_config(None, ["reward.sources.x={terms: {a: 2.0}, combine: m:f}"])
    with pytest.raises(Exception, match="needs `urls`"):
        load_config(
            None, ["reward.models={j: {type: judge, backend: external}}", "reward.default=j"]
        )


def test_model_reward_paths_are_checked_before_anything_starts(
    tmp_path: Path, tiny_model_dir: Path
):
    with pytest.raises(RewardConfigError, match=r"reward\.models\.rm\.path.*no config\.json"):
        RewardManager(models={"rm": {"type": "reward_model", "path": str(tmp_path)}}, default="rm")
    with pytest.raises(RewardConfigError, match="needs a \\*ForSequenceClassification"):
        RewardManager(
            models={"rm": {"type": "reward_model", "path": str(tiny_model_dir)}}, default="rm"
        )
    with pytest.raises(RewardConfigError, match="taken by the reward function"):
        RewardManager(
            models={"calculator": {"type": "judge", "backend": "external", "urls": ["http://x"]}}
        )


def test_unknown_source_name_lists_the_model_rewards():
    models = {"judge": {"type": "judge", "backend": "external", "urls": ["http://127.0.0.1:1"]}}
    with pytest.raises(RewardConfigError, match=r"reward\.models name: \['judge'\]"):
        RewardManager(sources={"x": "jugde"}, models=models)


def test_manager_with_model_rewards_pickles_without_connections():
    models = {"judge": {"type": "judge", "backend": "external", "urls": ["http://127.0.0.1:1"]}}
    manager = RewardManager(
        sources={"x": {"terms": {"numeric_match": 1.0, "judge": 0.5}}}, models=models
    )
    manager.connect_models({"judge": ["http://127.0.0.1:1"]}, "secret")
    assert manager.model_servers() == ({"judge": ["http://127.0.0.1:1"]}, "secret")
    copy = pickle.loads(pickle.dumps(manager))
    judge = copy.models["judge"]
    assert isinstance(judge, JudgeReward) and judge.servers is not None
    assert judge.servers.urls == ["http://127.0.0.1:1"] and judge.servers.api_key == "secret"
    assert isinstance(copy.reward_fn_for("x"), CombinedReward)


def test_thread_plan_counts_the_model_reward_servers():
    plan = make_plan(1, cpus=4, reward_servers=2)
    assert [s.role for s in plan.reward_servers] == ["reward0", "reward1"]
    assert plan.trainer.threads + sum(s.threads for s in (*plan.servers, *plan.reward_servers)) == 4
    assert "reward1=1" in plan.describe()


def test_the_runs_thread_plan_counts_its_embedded_model_servers():
    from agentrl.training.build import thread_plan

    cfg = load_config(
        None,
        [
            "reward.models={rm: {type: reward_model, path: rm, num_servers: 2},"
            " j: {type: judge, backend: external, urls: ['http://judge']}}",
            "reward.default=rm",
            "reward.sources.q=j",
            "distributed.cpus=4",
            "inference.num_servers=1",
        ],
    )
    plan = thread_plan(cfg)
    assert [s.role for s in plan.servers] == ["server0"]
    assert [s.role for s in plan.reward_servers] == ["reward0", "reward1"]  # external: none


def test_process_executor_refuses_an_unpicklable_term_and_keeps_model_terms_on_the_loop():
    models = {"judge": {"type": "judge", "backend": "external", "urls": ["http://127.0.0.1:1"]}}
    with pytest.raises(RewardConfigError, match="cannot be sent to a process pool"):
        RewardManager(
            sources={"x": {"terms": {"judge": 1.0}, "combine": lambda s, t, k: 0.0}},
            models=models,
            executor="process",
        )
    # A model reward needs no pickling to a worker: it runs on the event loop.
    RewardManager(
        sources={"x": {"terms": ["numeric_match", "judge"]}}, models=models, executor="process"
    )


# ---- model rewards over HTTP (scripted transport) -----------------------------------------------
def _judge_transport(
    replies: list[str], seen: list[dict], gate: dict | None = None
) -> httpx.MockTransport:
    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(
            {"path": request.url.path, "body": body, "auth": request.headers.get("authorization")}
        )
        if gate is not None:
            gate["now"] += 1
            gate["max"] = max(gate["max"], gate["now"])
            await asyncio.sleep(0.05)
            gate["now"] -= 1
        reply = replies[min(len(seen), len(replies)) - 1]
        return httpx.Response(200, json={"choices": [{"message": {"content": reply}}]})

    return httpx.MockTransport(handler)


def _judge_manager(transport: httpx.AsyncBaseTransport, **spec) -> RewardManager:
    models = {"judge": {"type": "judge", "backend": "external", "urls": ["http://judge"], **spec}}
    manager = RewardManager(
        sources={"mix": {"terms": {"numeric_match": 1.0, "judge": 2.0}}, "j": "judge"},
        models=models,
    )
    manager.models["judge"].connect(["http://judge"], "k", transport=transport)
    return manager


async def test_judge_score_is_parsed_normalized_and_combined():
    seen: list[dict] = []
    manager = _judge_manager(_judge_transport(["Looks right. \\boxed{7}"], seen))
    scored = await manager.score(make_traj("\\boxed{42}"), make_task())
    assert scored.reward == pytest.approx(1.0 + 2.0 * 0.7)
    assert scored.reward_info["judge"]["judge_score"] == 7.0
    prompt = seen[0]["body"]["messages"][-1]["content"]
    assert (
        "What is 6*7?" in prompt and "\\boxed{42}" in prompt and "Reference answer:\n42" in prompt
    )
    assert seen[0]["path"] == "/v1/chat/completions" and seen[0]["auth"] == "Bearer k"
    assert seen[0]["body"]["temperature"] == 0.0
    m = manager.metrics()
    assert m["reward/models/judge/scored"] == 1.0 and m["reward/mix/scored"] == 1.0


@pytest.mark.parametrize("reply", ["I cannot grade this.", "\\boxed{11}", "\\boxed{-1}", ""])
async def test_a_judge_that_returns_garbage_is_a_counted_failure_never_a_zero(reply):
    manager = _judge_manager(_judge_transport([reply], []))
    with pytest.raises(RewardError, match="replied with"):
        await manager.score(make_traj(), make_task(data_source="j"))
    with pytest.raises(RewardError, match="replied with"):
        await manager.score(make_traj(), make_task(data_source="mix"))
    m = manager.metrics()
    assert m["reward/models/judge/unparsed"] == 2.0 and m["reward/models/judge/errors"] == 2.0
    assert m["reward/j/errors"] == 1.0 and m["reward/mix/errors"] == 1.0
    assert m["reward/scored"] == 0.0


async def test_judge_requests_respect_max_concurrency():
    gate = {"now": 0, "max": 0}
    manager = _judge_manager(_judge_transport(["\\boxed{5}"], [], gate), max_concurrency=2)
    trajs = [make_traj() for _ in range(6)]
    out = await asyncio.gather(*(manager.score(t, make_task(data_source="j")) for t in trajs))
    assert [t.reward for t in out] == [0.5] * 6
    assert gate["max"] == 2


async def test_a_model_reward_whose_servers_are_down_is_a_counted_failure():
    models = {"judge": {"type": "judge", "backend": "external", "urls": ["http://127.0.0.1:1"]}}
    manager = RewardManager(sources={"j": "judge"}, models=models, timeout_s=10)
    manager.connect_models({"judge": ["http://127.0.0.1:1"]})
    with pytest.raises(RewardError, match="every server failed"):
        await manager.score(make_traj(), make_task(data_source="j"))
    assert manager.metrics()["reward/models/judge/errors"] == 1.0
    await manager.aclose()


async def test_an_unconnected_model_reward_says_how_to_connect_it():
    models = {"judge": {"type": "judge", "backend": "external", "urls": ["http://127.0.0.1:1"]}}
    manager = RewardManager(sources={"j": "judge"}, models=models)
    with pytest.raises(RewardError, match="not connected"):
        await manager.score(make_traj(), make_task(data_source="j"))


# ---- the real engines, in process ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentrl.inference.tiny_model import build_tiny_reward_model

    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm", seed=0)


async def test_reward_model_scores_conversations_and_tokens_like_transformers(tiny_rm_dir: Path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from agentrl.inference.scoring import ScoringEngine
    from agentrl.inference.server import create_app

    engine = ScoringEngine(tiny_rm_dir)
    try:
        transport = httpx.ASGITransport(create_app(engine))
        for kind in ("messages", "tokens"):
            spec = {"type": "reward_model", "path": str(tiny_rm_dir), "input": kind}
            manager = RewardManager(
                sources={"mix": {"terms": {"numeric_match": 1.0, "rm": 0.5}}}, models={"rm": spec}
            )
            rm = manager.models["rm"]
            assert isinstance(rm, RewardModelReward)
            rm.connect(["http://rm"], transport=transport)
            traj = make_traj("\\boxed{42}")
            scored = await manager.score(traj, make_task())
            tok = AutoTokenizer.from_pretrained(tiny_rm_dir)
            ids = (
                tok.apply_chat_template(traj.messages, tokenize=True, return_dict=False)
                if kind == "messages"
                else [*traj.prompt_ids, *traj.response_ids]
            )
            model = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir)
            with torch.no_grad():
                want = model(torch.tensor([ids])).logits[0, 0].item()
            assert scored.reward_info["rm"]["logits"][0] == pytest.approx(want, abs=1e-5)
            assert scored.reward == pytest.approx(1.0 + 0.5 * want, abs=1e-5)
    finally:
        engine.close()
