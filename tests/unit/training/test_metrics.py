"""verl's metric families on small batches with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.batch import trajectories_to_batch
from agentrl.training.metrics import (
    MicroBatchGradProbe,
    TokenCounts,
    compute_data_metrics,
    compute_gradient_noise_metrics,
    compute_rollout_timing_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
)
from agentrl.types import StopReason, Trajectory


def make(
    uid: str,
    prompt: int,
    mask: list[int],
    *,
    reward: float,
    stop: StopReason = StopReason.EOS,
    turns: int = 1,
    tools: dict[str, int] | None = None,
    timings: dict[str, float] | None = None,
) -> Trajectory:
    return Trajectory(
        prompt_ids=list(range(1, prompt + 1)),
        response_ids=[7] * len(mask),
        loss_mask=mask,
        rollout_logprobs=[-0.5 if m else 0.0 for m in mask],
        policy_version=[0 if m else -1 for m in mask],
        uid=uid,
        reward=reward,
        stop_reason=stop,
        num_turns=turns,
        tool_calls=tools or {},
        timings=timings or {},
    )


@pytest.fixture
def trajs() -> list[Trajectory]:
    return [
        make("a", 3, [1, 1, 0, 1], reward=1.0, turns=2, tools={"calculator": 1, "<invalid>": 1}),
        make("b", 2, [1, 1], reward=0.0, turns=1),
        make("c", 4, [1], reward=0.5, stop=StopReason.ABORTED, turns=1, tools={"calculator": 3}),
    ]


def test_length_turn_and_tool_families(trajs):
    batch = trajectories_to_batch(trajs, pad_token_id=0)
    m = compute_data_metrics(batch, trajs, max_response_tokens=4, max_prompt_tokens=4)
    # response lengths 4, 2, 1; budget 4 -> one clipped
    assert m["response_length/mean"] == pytest.approx(7 / 3)
    assert m["response_length/max"] == 4.0
    assert m["response_length/min"] == 1.0
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)
    # without the aborted row c: lengths 4, 2
    assert m["response_length_non_aborted/mean"] == 3.0
    assert m["response_length_non_aborted/min"] == 2.0
    assert m["response_length_non_aborted/clip_ratio"] == 0.5
    assert m["response/aborted_ratio"] == pytest.approx(1 / 3)
    # prompts 3, 2, 4; limit 4 -> one at the limit
    assert m["prompt_length/mean"] == 3.0
    assert m["prompt_length/clip_ratio"] == pytest.approx(1 / 3)
    assert m["num_turns/mean"] == pytest.approx(4 / 3)
    assert m["num_turns/max"] == 2.0
    # tool calls per episode 2, 0, 3 (malformed calls count)
    assert m["tool_call_counts/mean"] == pytest.approx(5 / 3)
    assert m["tool_call_counts/min"] == 0.0
    assert m["tool_call_counts/max"] == 3.0
    assert "prompt_length/clip_ratio" not in compute_data_metrics(
        batch, trajs, max_response_tokens=4
    )


def test_critic_families(trajs):
    batch = trajectories_to_batch(trajs, pad_token_id=0)  # [3, 4]
    batch["token_level_rewards"] = batch["token_level_scores"] - 0.1 * batch["response_mask"]
    batch["advantages"] = torch.tensor(
        [[1.0, 2.0, 99.0, 3.0], [-1.0, -2.0, 99.0, 99.0], [0.5, 99.0, 99.0, 99.0]]
    )
    batch["returns"] = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0, 0], [0.5, 0, 0, 0]])
    batch["values"] = batch["returns"].clone()
    m = compute_data_metrics(batch, trajs, max_response_tokens=8)
    # sequence scores over the non-aborted rows a, b: 1.0 and 0.0
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == (0.5, 1.0, 0.0)
    # rewards: minus 0.1 per sampled token (a has 3, b has 2)
    assert m["critic/rewards/max"] == pytest.approx(0.7)
    assert m["critic/rewards/min"] == pytest.approx(-0.2)
    # advantages over trained tokens only (99 sits on tool tokens or padding)
    assert m["critic/advantages/mean"] == pytest.approx((1 + 2 + 3 - 1 - 2 + 0.5) / 6)
    assert m["critic/advantages/max"] == 3.0
    assert m["critic/advantages/min"] == -2.0
    assert m["critic/returns/mean"] == pytest.approx(3.5 / 6)
    assert m["critic/values/max"] == 1.0
    assert m["critic/vf_explained_var"] == pytest.approx(1.0)  # a perfect critic
    no_critic = compute_data_metrics(trajectories_to_batch(trajs, 0), trajs, max_response_tokens=8)
    assert not any(
        k.startswith(("critic/values", "critic/vf", "critic/advantages")) for k in no_critic
    )
    assert no_critic["critic/rewards/mean"] == no_critic["critic/score/mean"]


def test_all_aborted_omits_the_non_aborted_families():
    trajs = [make("x", 2, [1], reward=1.0, stop=StopReason.ERROR)]
    m = compute_data_metrics(trajectories_to_batch(trajs, 0), trajs, max_response_tokens=4)
    assert m["response/aborted_ratio"] == 1.0
    assert not any(k.startswith(("response_length_non_aborted", "critic/score")) for k in m)


def test_misaligned_trajectories_are_an_error(trajs):
    batch = trajectories_to_batch(trajs, pad_token_id=0)
    with pytest.raises(ValueError, match="row 0 has uid 'a' but trajectory 0 has uid 'b'"):
        compute_data_metrics(batch, [trajs[1], trajs[0], trajs[2]], max_response_tokens=4)
    with pytest.raises(ValueError, match="3 rows but 2 trajectories"):
        compute_data_metrics(batch, trajs[:2], max_response_tokens=4)


# ---- timing and throughput ------------------------------------------------------------------


def test_token_counts(trajs):
    counts = TokenCounts.from_trajectories(trajs)
    assert counts == TokenCounts(prompt=9, response=7, sampled=6)
    assert counts.total == 16
    with pytest.raises(ValueError, match="unknown token count 'tokens'"):
        counts.get("tokens")


def test_timing_per_token_divides_by_the_phase_tokens():
    counts = TokenCounts(prompt=300, response=700, sampled=500)
    m = compute_timing_metrics({"gen": 2.0, "update_actor": 4.0, "push": 0.5}, counts)
    assert m["timing_s/gen"] == 2.0
    assert m["timing_s/push"] == 0.5
    assert m["timing_per_token_ms/gen"] == pytest.approx(1000 * 2.0 / 500)  # generated tokens
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(1000 * 4.0 / 1000)  # all tokens
    assert "timing_per_token_ms/push" not in m
    custom = compute_timing_metrics({"push": 0.5}, counts, phase_tokens={"push": "response"})
    assert custom["timing_per_token_ms/push"] == pytest.approx(500 / 700)


def test_throughput():
    m = compute_throughput_metrics(
        TokenCounts(prompt=300, response=700, sampled=500), 2.0, n_devices=4
    )
    assert m == {
        "perf/total_num_tokens": 1000.0,
        "perf/time_per_step": 2.0,
        "perf/throughput": 125.0,
    }
    with pytest.raises(ValueError, match="step_time_s=0"):
        compute_throughput_metrics(TokenCounts(1, 1, 1), 0)


def test_rollout_timing_uses_verls_agent_loop_names():
    trajs = [
        make("a", 2, [1], reward=0, timings={"generate": 1.0, "tools": 0.5, "total": 2.0}),
        make("b", 2, [1], reward=0, timings={"generate": 3.0, "total": 3.5}),
    ]
    m = compute_rollout_timing_metrics(trajs)
    assert m["agent_loop/generate_sequences/mean"] == 2.0
    assert m["agent_loop/generate_sequences/max"] == 3.0
    assert m["agent_loop/tool_calls/mean"] == 0.5  # only the episode that called tools
    assert m["agent_loop/total/min"] == 2.0
    assert not any(k.startswith("agent_loop/reward") for k in m)


# ---- gradient noise -------------------------------------------------------------------------


def test_gradient_noise_hand_case():
    # g1 = (2, 0), g2 = (0, 0), one unit each: g = (1, 0)
    m = compute_gradient_noise_metrics([4.0, 0.0], [1, 1], 1.0)
    # tr Σ = ((4 - 1) + (0 - 1)) / ((1 - 1/2) * 2) = 2 ; |G|² = 1 - 2/2 = 0
    assert m["grad_noise/trace_cov"] == pytest.approx(2.0)
    assert m["grad_noise/grad_sq_norm"] == pytest.approx(0.0)
    assert "grad_noise/noise_scale" not in m  # no signal: the ratio is undefined
    assert m["grad_noise/micro_grad_norm/mean"] == pytest.approx(1.0)
    assert m["grad_noise/micro_grad_norm/std"] == pytest.approx(1.0)
    assert compute_gradient_noise_metrics([1.0], [5], 1.0) == {}


def test_gradient_noise_equal_sizes_is_b_times_the_sample_covariance_trace():
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(5, 7, generator=gen, dtype=torch.float64) + 2.0
    b = 3
    mean = grads.mean(0)
    m = compute_gradient_noise_metrics(
        grads.pow(2).sum(1).tolist(), [b] * 5, float(mean.pow(2).sum())
    )
    sample_cov_trace = float(grads.var(0, unbiased=True).sum())
    assert m["grad_noise/trace_cov"] == pytest.approx(b * sample_cov_trace)
    assert m["grad_noise/grad_sq_norm"] == pytest.approx(
        float(mean.pow(2).sum()) - sample_cov_trace / 5
    )
    assert m["grad_noise/noise_scale"] == pytest.approx(
        m["grad_noise/trace_cov"] / m["grad_noise/grad_sq_norm"]
    )


def test_gradient_noise_estimates_are_unbiased_with_unequal_sizes():
    """g_k = G + noise of covariance σ²I / b_k: the averages approach tr Σ = d σ² and |G|²."""
    gen = torch.Generator().manual_seed(1)
    d, sigma2 = 4, 2.0
    big_g = torch.tensor([1.0, -1.0, 0.5, 0.0], dtype=torch.float64)
    sizes = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)
    traces, signals = [], []
    for _ in range(4000):
        noise = (
            torch.randn(3, d, generator=gen, dtype=torch.float64) * (sigma2 / sizes).sqrt()[:, None]
        )
        g_k = big_g + noise
        g = (sizes[:, None] * g_k).sum(0) / sizes.sum()
        m = compute_gradient_noise_metrics(
            g_k.pow(2).sum(1).tolist(), sizes.tolist(), float(g.pow(2).sum())
        )
        traces.append(m["grad_noise/trace_cov"])
        signals.append(m["grad_noise/grad_sq_norm"])
    assert sum(traces) / len(traces) == pytest.approx(d * sigma2, rel=0.05)
    assert sum(signals) / len(signals) == pytest.approx(float(big_g.pow(2).sum()), rel=0.05)


def test_gradient_noise_input_errors():
    with pytest.raises(ValueError, match="2 norms for 3 sizes"):
        compute_gradient_noise_metrics([1.0, 2.0], [1, 1, 1], 1.0)
    with pytest.raises(ValueError, match="micro_sizes must be > 0"):
        compute_gradient_noise_metrics([1.0, 2.0], [1, 0], 1.0)


def test_probe_recovers_each_micro_batch_gradient_during_accumulation():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    xs = [torch.randn(2, 3), torch.randn(3, 3), torch.randn(1, 3)]
    sizes = [float(len(x)) for x in xs]
    total = sum(sizes)

    def own_grad_sq_norm(x: torch.Tensor) -> float:
        model.zero_grad()
        model(x).pow(2).sum(-1).mean().backward()
        return sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)

    expected = [own_grad_sq_norm(x) for x in xs]
    model.zero_grad()
    probe = MicroBatchGradProbe(model.parameters())
    for x, size in zip(xs, sizes, strict=True):
        scale = size / total
        (model(x).pow(2).sum(-1).mean() * scale).backward()
        probe.record(size, scale)
    assert probe.sq_norms == pytest.approx(expected, rel=1e-5)
    assert probe.sizes == sizes
    accumulated = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)
    assert probe.total_sq_norm() == pytest.approx(accumulated, rel=1e-6)
    m = compute_gradient_noise_metrics(probe.sq_norms, probe.sizes, probe.total_sq_norm())
    assert math.isfinite(m["grad_noise/trace_cov"])
