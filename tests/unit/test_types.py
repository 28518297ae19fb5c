"""The contract module: Trajectory/StopReason invariants, JSON round-trip, pickling, helpers."""

from __future__ import annotations

import json
import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from agentrl.types import (
    Generation,
    Policy,
    SamplingParams,
    StopReason,
    Task,
    Trajectory,
    TrajectoryError,
)


def _traj(**overrides: object) -> Trajectory:
    fields: dict[str, object] = {
        "prompt_ids": [1, 2, 3],
        "response_ids": [7, 8, 9, 10],
        "loss_mask": [1, 1, 0, 1],
        "rollout_logprobs": [-0.1, -2.3, 0.0, -0.5],
        "policy_version": [4, 4, -1, 5],
        "uid": "task-0",
    }
    fields.update(overrides)
    return Trajectory(**fields)  # type: ignore[arg-type]


# ---- StopReason ---------------------------------------------------------------------------


def test_stop_reason_values_are_the_documented_strings() -> None:
    assert [r.value for r in StopReason] == [
        "eos",
        "length",
        "max_turns",
        "tool_stop",
        "aborted",
        "error",
    ]
    assert StopReason("max_turns") is StopReason.MAX_TURNS
    assert StopReason.EOS == "eos"  # str enum: compares with plain strings (JSON, metrics)


def test_stop_reason_is_parsed_from_json_and_rejects_unknown() -> None:
    traj = _traj(stop_reason="tool_stop")
    assert traj.stop_reason is StopReason.TOOL_STOP
    with pytest.raises(ValidationError, match="stop_reason"):
        _traj(stop_reason="finished")


# ---- Trajectory invariants ---------------------------------------------------------------


@pytest.mark.parametrize("field", ["loss_mask", "rollout_logprobs", "policy_version"])
def test_per_token_lists_must_match_response_length(field: str) -> None:
    good = _traj()
    shorter = list(getattr(good, field))[:-1]
    with pytest.raises(ValidationError) as exc:
        _traj(**{field: shorter})
    msg = str(exc.value)
    assert f"{field} has 3 entries but response_ids has 4" in msg
    assert "'task-0'" in msg


def test_response_ids_longer_than_the_per_token_lists() -> None:
    with pytest.raises(ValidationError, match="loss_mask has 4 entries but response_ids has 5"):
        _traj(response_ids=[7, 8, 9, 10, 11])


@pytest.mark.parametrize("bad", [0.5, math.inf, -math.inf, math.nan])
def test_sampled_logprob_must_be_finite_and_nonpositive(bad: float) -> None:
    with pytest.raises(ValidationError, match=r"rollout_logprobs\[1\]"):
        _traj(rollout_logprobs=[-0.1, bad, 0.0, -0.5])


def test_logprob_zero_is_allowed_for_a_sampled_token() -> None:
    assert _traj(rollout_logprobs=[0.0, -2.3, 0.0, -0.5]).rollout_logprobs[0] == 0.0


def test_sampled_token_needs_a_version() -> None:
    with pytest.raises(ValidationError, match=r"policy_version\[3\] = -1"):
        _traj(policy_version=[4, 4, -1, -1])


def test_unsampled_token_has_zero_logprob_and_version_minus_one() -> None:
    with pytest.raises(ValidationError, match="position 2 has loss_mask 0"):
        _traj(rollout_logprobs=[-0.1, -2.3, -0.7, -0.5])
    with pytest.raises(ValidationError, match="position 2 has loss_mask 0"):
        _traj(policy_version=[4, 4, 4, 5])


def test_loss_mask_is_binary() -> None:
    with pytest.raises(ValidationError, match=r"loss_mask\[0\] = 2"):
        _traj(loss_mask=[2, 1, 0, 1])


def test_empty_prompt_is_rejected_but_empty_response_is_fine() -> None:
    with pytest.raises(ValidationError, match="prompt_ids is empty"):
        _traj(prompt_ids=[])
    empty = _traj(response_ids=[], loss_mask=[], rollout_logprobs=[], policy_version=[])
    assert empty.response_length == 0 and empty.min_version is None


def test_trajectory_error_is_a_value_error() -> None:
    assert issubclass(TrajectoryError, ValueError)


def test_unknown_fields_are_rejected() -> None:
    with pytest.raises(ValidationError, match="rewards"):
        _traj(rewards=1.0)


# ---- derived quantities ----------------------------------------------------------------


def test_derived_quantities() -> None:
    traj = _traj()
    assert traj.response_length == 4
    assert traj.num_sampled_tokens == 3
    assert traj.min_version == 4 and traj.max_version == 5
    assert traj.staleness(current_version=6) == 2
    nothing_sampled = _traj(
        loss_mask=[0, 0, 0, 0], rollout_logprobs=[0.0] * 4, policy_version=[-1] * 4
    )
    assert nothing_sampled.min_version is None and nothing_sampled.max_version is None
    assert nothing_sampled.staleness(current_version=9) == 0


def test_docstring_example_holds() -> None:
    traj = Trajectory(
        prompt_ids=[1, 2, 3],
        response_ids=[7, 8, 9],
        loss_mask=[1, 1, 0],
        rollout_logprobs=[-0.1, -2.3, 0.0],
        policy_version=[4, 4, -1],
        uid="task-0",
        stop_reason=StopReason.EOS,
    )
    assert traj.staleness(current_version=5) == 1
    assert Trajectory.from_json(traj.to_json()) == traj


# ---- serialization ------------------------------------------------------------------------


def _full_traj() -> Trajectory:
    return _traj(
        reward=0.75,
        turn_rewards=[0.25, 0.5],
        reward_info={"acc": 1.0, "pred": "42"},
        index=3,
        task_id="calc-7",
        agent="tool_agent",
        data_source="calculator",
        num_turns=2,
        tool_calls={"calculator": 1, "<invalid>": 1},
        stop_reason=StopReason.MAX_TURNS,
        timings={"generate": 0.5, "total": 0.75},
        metrics={"turns": 2.0},
        messages=[{"role": "user", "content": "2+2?"}],
    )


def test_json_round_trip_keeps_every_field() -> None:
    traj = _full_traj()
    text = traj.to_json()
    assert json.loads(text)["stop_reason"] == "max_turns"
    again = Trajectory.from_json(text)
    assert again == traj
    assert again.stop_reason is StopReason.MAX_TURNS
    assert Trajectory.from_json(text.encode()) == traj


def test_from_json_validates() -> None:
    data = json.loads(_full_traj().to_json())
    data["loss_mask"] = [1, 1, 0]
    with pytest.raises(ValidationError, match="loss_mask has 3 entries"):
        Trajectory.from_json(json.dumps(data))


def test_pickle_round_trip() -> None:
    traj = _full_traj()
    again = pickle.loads(pickle.dumps(traj))
    assert again == traj and again.stop_reason is StopReason.MAX_TURNS


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    n = draw(st.integers(0, 12))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    logprob = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)
    return Trajectory(
        prompt_ids=draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=8)),
        response_ids=draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n)),
        loss_mask=mask,
        rollout_logprobs=[draw(logprob) if m else 0.0 for m in mask],
        policy_version=[draw(st.integers(0, 100)) if m else -1 for m in mask],
        reward=draw(st.floats(-10, 10, allow_nan=False)),
        uid=draw(st.text(max_size=8)),
        stop_reason=draw(st.sampled_from(list(StopReason))),
        reward_info={"note": draw(st.text(max_size=8))},
    )


@settings(max_examples=50, deadline=None)
@given(trajectories())
def test_round_trips_property(traj: Trajectory) -> None:
    assert Trajectory.from_json(traj.to_json()) == traj
    assert pickle.loads(pickle.dumps(traj)) == traj


# ---- Task, SamplingParams, Generation, Policy ------------------------------------------


def test_task_needs_exactly_one_of_prompt_or_messages() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        Task()
    with pytest.raises(ValidationError, match="exactly one"):
        Task(prompt="hi", messages=[{"role": "user", "content": "hi"}])
    assert Task(prompt="hi").initial_messages("be brief") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


def test_task_initial_messages_is_a_copy_and_keeps_an_existing_system_prompt() -> None:
    msgs = [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}]
    task = Task(messages=msgs)
    got = task.initial_messages("ignored")
    assert got == msgs
    got[0]["content"] = "changed"
    assert task.messages is not None and task.messages[0]["content"] == "own"


def test_sampling_params_rl_defaults_and_bounds() -> None:
    sp = SamplingParams()
    assert sp.top_p == 1.0 and sp.top_k == -1 and sp.temperature == 1.0
    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_generation_token_ids_and_logprobs_align() -> None:
    gen = Generation(
        token_ids=[1, 2], logprobs=[-0.1, -0.2], finish_reason="stop", weight_version=3
    )
    assert gen.weight_version == 3
    with pytest.raises(ValidationError, match="2 token_ids but 1 logprobs"):
        Generation(token_ids=[1, 2], logprobs=[-0.1], finish_reason="stop", weight_version=3)
    with pytest.raises(ValidationError, match="finish_reason"):
        Generation(token_ids=[], logprobs=[], finish_reason="done", weight_version=0)  # type: ignore[arg-type]


def test_policy_protocol_is_runtime_checkable() -> None:
    class Replay:
        async def generate(
            self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
        ) -> Generation:
            return Generation(
                token_ids=[1], logprobs=[-0.5], finish_reason="stop", weight_version=0
            )

    assert isinstance(Replay(), Policy)
    assert not isinstance(object(), Policy)


def test_generation_per_token_versions():
    from agentrl.types import Generation

    plain = Generation(
        token_ids=[1, 2], logprobs=[0.0, 0.0], finish_reason="stop", weight_version=3
    )
    assert plain.versions() == [3, 3]
    mixed = plain.model_copy(update={"token_versions": [3, 4]})
    assert mixed.versions() == [3, 4]
    with pytest.raises(ValueError, match="2 token_ids but 1 token_versions"):
        Generation(
            token_ids=[1, 2],
            logprobs=[0.0, 0.0],
            finish_reason="stop",
            weight_version=3,
            token_versions=[3],
        )


def test_turn_sample_lists_are_aligned():
    from agentrl.types import TurnSample

    TurnSample(prompt_ids=[1], token_ids=[2, 3], logprobs=[-1.0, -1.0], versions=[0, 1])
    with pytest.raises(ValueError, match="2 token_ids, 1 logprobs"):
        TurnSample(prompt_ids=[1], token_ids=[2, 3], logprobs=[-1.0], versions=[0, 1])
