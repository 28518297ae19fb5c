"""verl's training metric families, computed from one step's batch and trajectories.

Why it exists: researchers compare runs by the metric names of verl's ``metric_utils``
(``response_length/*``, ``critic/score/*``, ``timing_per_token_ms/*``, ``perf/throughput``...).
These functions compute those families, with the same names and, where our data differs, a
documented definition (docs/tracking.md has every formula). They are pure: tensors and plain
data in, ``{name: float}`` out; nothing here logs, syncs or touches a model, except
:class:`MicroBatchGradProbe`, which only reads gradients.

Conventions: ``B`` rows (one per trajectory), ``T`` response tokens. An episode is **aborted**
when its ``stop_reason`` is ``aborted`` or ``error`` (verl: an empty response). A family whose
rows are all missing (e.g. ``critic/score/*`` when every episode aborted, ``critic/values/*``
without a critic) is omitted, never reported as 0 or NaN.

Example (in the trainer, after the update)::

    m.update(compute_data_metrics(batch, trajs, max_response_tokens=cfg.agent.max_response_tokens))
    m.update(compute_timing_metrics(timings, TokenCounts.from_trajectories(trajs)))
    m.update(compute_throughput_metrics(TokenCounts.from_trajectories(trajs), timings["step"]))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from agentrl.algos import masked_mean, masked_var
from agentrl.batch import non_tensor_list
from agentrl.types import StopReason, Trajectory

__all__ = [
    "ABORTED_STOP_REASONS",
    "DEFAULT_PHASE_TOKENS",
    "MicroBatchGradProbe",
    "TokenCounts",
    "compute_data_metrics",
    "compute_gradient_noise_metrics",
    "compute_reward_component_metrics",
    "compute_rollout_timing_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "compute_tool_metrics",
    "value_metrics",
]

ABORTED_STOP_REASONS = frozenset({StopReason.ABORTED, StopReason.ERROR})
"""Stop reasons that make an episode count as aborted (``response/aborted_ratio``)."""


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """``{prefix}/mean``, ``/max``, ``/min`` of a 1-D tensor (empty -> nothing)."""
    if values.numel() == 0:
        return {}
    v = values.double()
    return {
        f"{prefix}/mean": float(v.mean()),
        f"{prefix}/max": float(v.max()),
        f"{prefix}/min": float(v.min()),
    }


def _check_aligned(batch: TensorDict, trajectories: Sequence[Trajectory]) -> None:
    rows = batch.batch_size[0]
    if len(trajectories) != rows:
        raise ValueError(
            f"compute_data_metrics: the batch has {rows} rows but {len(trajectories)} trajectories "
            "were given; pass the trajectories the batch was built from, in row order"
        )
    if "uid" in batch:
        for row, (uid, traj) in enumerate(
            zip(non_tensor_list(batch, "uid"), trajectories, strict=True)
        ):
            if uid != traj.uid:
                raise ValueError(
                    f"compute_data_metrics: batch row {row} has uid {uid!r} but trajectory {row} "
                    f"has uid {traj.uid!r}; pass the trajectories in the batch's row order"
                )


def _length_metrics(
    trajectories: Sequence[Trajectory],
    aborted: torch.Tensor,
    max_response_tokens: int,
    max_prompt_tokens: int | None,
) -> dict[str, float]:
    resp = torch.tensor([t.response_length for t in trajectories], dtype=torch.float64)
    prompt = torch.tensor([len(t.prompt_ids) for t in trajectories], dtype=torch.float64)
    m = _stats("response_length", resp)
    m["response_length/clip_ratio"] = float((resp >= max_response_tokens).double().mean())
    kept = resp[~aborted]
    if kept.numel():
        m.update(_stats("response_length_non_aborted", kept))
        m["response_length_non_aborted/clip_ratio"] = float(
            (kept >= max_response_tokens).double().mean()
        )
    m["response/aborted_ratio"] = float(aborted.double().mean())
    m.update(_stats("prompt_length", prompt))
    if max_prompt_tokens is not None:
        m["prompt_length/clip_ratio"] = float((prompt >= max_prompt_tokens).double().mean())
    m.update(_stats("num_turns", torch.tensor([float(t.num_turns) for t in trajectories])))
    m.update(
        _stats(
            "tool_call_counts",
            torch.tensor([float(sum(t.tool_calls.values())) for t in trajectories]),
        )
    )
    return m


def _critic_metrics(batch: TensorDict, aborted: torch.Tensor) -> dict[str, float]:
    m: dict[str, float] = {}
    scores = batch["token_level_scores"]
    rewards = batch.get("token_level_rewards", scores)
    m.update(_stats("critic/score", scores.sum(-1)[~aborted]))
    m.update(_stats("critic/rewards", rewards.sum(-1)[~aborted]))
    mask = batch["response_mask"].bool()
    for key in ("advantages", "returns", "values"):
        if key in batch:
            m.update(_stats(f"critic/{key}", torch.masked_select(batch[key], mask)))
    if "values" in batch and "returns" in batch and bool(mask.any()):
        explained = value_metrics(batch["values"], batch["returns"], batch["response_mask"])
        m["critic/vf_explained_var"] = explained["critic/vf_explained_var"]
    return m


def compute_data_metrics(
    batch: TensorDict,
    trajectories: Sequence[Trajectory],
    *,
    max_response_tokens: int,
    max_prompt_tokens: int | None = None,
) -> dict[str, float]:
    """The data families of one training step (verl's ``compute_data_metrics``).

    Args:
        batch: the step's batch (``agentrl.batch.trajectories_to_batch`` layout) with
            ``token_level_scores`` ``[B, T]`` and ``response_mask`` ``[B, T]`` (after rejection
            sampling: the tokens that were trained on); optionally ``token_level_rewards``
            (scores after a KL penalty; default the scores), ``advantages``, ``returns`` and
            ``values`` ``[B, T]``.
        trajectories: the ``B`` trajectories the batch was built from, in row order (checked
            against ``batch["uid"]``); lengths, turns, tool calls and stop reasons come from them.
        max_response_tokens: the response budget (``agent.max_response_tokens``); a response
            of at least this many tokens counts as clipped.
        max_prompt_tokens: the prompt limit (``data.max_prompt_tokens``); None = no
            ``prompt_length/clip_ratio``.

    Returns:
        ``response_length/{mean,max,min,clip_ratio}``, the same under
        ``response_length_non_aborted/``, ``response/aborted_ratio``,
        ``prompt_length/{mean,max,min[,clip_ratio]}``, ``num_turns/*``, ``tool_call_counts/*``,
        ``critic/{score,rewards}/*`` (sequence sums over non-aborted rows),
        ``critic/{advantages,returns,values}/*`` (over trained tokens) and
        ``critic/vf_explained_var`` (with values and returns).
    """
    if max_response_tokens < 1:
        raise ValueError(
            f"compute_data_metrics: max_response_tokens must be >= 1, got {max_response_tokens}"
        )
    _check_aligned(batch, trajectories)
    aborted = torch.tensor(
        [t.stop_reason in ABORTED_STOP_REASONS for t in trajectories], dtype=torch.bool
    )
    return {
        **_length_metrics(trajectories, aborted, max_response_tokens, max_prompt_tokens),
        **_critic_metrics(batch, aborted),
    }


@dataclass(frozen=True)
class TokenCounts:
    """Token totals of one step: ``prompt`` + ``response`` (model and tool tokens) = ``total``;
    ``sampled`` = tokens the policy generated (``loss_mask == 1``)."""

    prompt: int
    response: int
    sampled: int

    @property
    def total(self) -> int:
        return self.prompt + self.response

    @classmethod
    def from_trajectories(cls, trajectories: Iterable[Trajectory]) -> TokenCounts:
        prompt = response = sampled = 0
        for t in trajectories:
            prompt += len(t.prompt_ids)
            response += t.response_length
            sampled += t.num_sampled_tokens
        return cls(prompt=prompt, response=response, sampled=sampled)

    def get(self, name: str) -> int:
        """The count called ``name``: ``prompt``, ``response``, ``sampled`` or ``total``."""
        if name not in ("prompt", "response", "sampled", "total"):
            raise ValueError(
                f"unknown token count {name!r}; choose prompt, response, sampled or total"
            )
        return int(getattr(self, name))


DEFAULT_PHASE_TOKENS: Mapping[str, str] = {
    "gen": "sampled",
    "old_log_prob": "total",
    "ref": "total",
    "values": "total",
    "adv": "total",
    "update_critic": "total",
    "update_actor": "total",
}
"""Phase -> the token count its time is divided by (verl: ``gen`` by generated tokens, the
passes over whole sequences by prompt + response tokens)."""


def compute_timing_metrics(
    timings: Mapping[str, float],
    num_tokens: TokenCounts,
    *,
    phase_tokens: Mapping[str, str] = DEFAULT_PHASE_TOKENS,
) -> dict[str, float]:
    """``timing_s/{phase}`` for every phase and ``timing_per_token_ms/{phase}`` =
    1000 · seconds / tokens for the phases in ``phase_tokens`` (skipped when the count is 0).

    Args:
        timings: phase -> seconds of this step (e.g. ``old_log_prob``, ``update_actor``).
        num_tokens: the step's token totals.
        phase_tokens: phase -> which count of ``num_tokens`` divides it.
    """
    out = {f"timing_s/{phase}": float(seconds) for phase, seconds in timings.items()}
    for phase, seconds in timings.items():
        which = phase_tokens.get(phase)
        if which is None:
            continue
        count = num_tokens.get(which)
        if count > 0:
            out[f"timing_per_token_ms/{phase}"] = 1000.0 * float(seconds) / count
    return out


def compute_throughput_metrics(
    num_tokens: TokenCounts, step_time_s: float, *, n_devices: int = 1
) -> dict[str, float]:
    """``perf/total_num_tokens`` (prompt + response), ``perf/time_per_step`` and
    ``perf/throughput`` = total tokens / (step time · ``n_devices``), tokens/s per device."""
    if step_time_s <= 0 or n_devices < 1:
        raise ValueError(
            f"compute_throughput_metrics: need step_time_s > 0 and n_devices >= 1, got "
            f"step_time_s={step_time_s}, n_devices={n_devices}"
        )
    total = num_tokens.total
    return {
        "perf/total_num_tokens": float(total),
        "perf/time_per_step": float(step_time_s),
        "perf/throughput": total / (step_time_s * n_devices),
    }


_EPISODE_PHASES = {
    "generate": "generate_sequences",
    "tools": "tool_calls",
    "reward": "reward",
    "total": "total",
}


def compute_rollout_timing_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Per-episode phase times (``Trajectory.timings``) under verl's agent-loop names:
    ``agent_loop/{generate_sequences,tool_calls,reward,total}/{mean,max,min}`` in seconds, over
    the episodes that report the phase."""
    out: dict[str, float] = {}
    for phase, name in _EPISODE_PHASES.items():
        seconds = [t.timings[phase] for t in trajectories if phase in t.timings]
        out.update(_stats(f"agent_loop/{name}", torch.tensor(seconds, dtype=torch.float64)))
    return out


def compute_gradient_noise_metrics(
    micro_grad_sq_norms: Sequence[float], micro_sizes: Sequence[float], batch_grad_sq_norm: float
) -> dict[str, float]:
    """Gradient noise from micro-batch gradients (McCandlish et al. 2018, arXiv:1812.06162, App. A).

    Model: micro-batch ``k`` of size ``b_k`` (the units its loss is averaged over, e.g. tokens)
    has mean-loss gradient ``g_k`` with ``E g_k = G`` and ``Cov g_k = Σ / b_k``; the mini-batch
    gradient is ``g = Σ_k (b_k / B) g_k`` with ``B = Σ_k b_k`` (what gradient accumulation with
    a global normalizer computes). Then ``E‖g_k‖² = ‖G‖² + tr Σ / b_k`` and
    ``E‖g‖² = ‖G‖² + tr Σ / B``, so

    - ``grad_noise/trace_cov`` = Σ_k (‖g_k‖² − ‖g‖²) / Σ_k (1/b_k − 1/B), unbiased for tr Σ
      (with equal sizes it is ``b ×`` the trace of the sample covariance of the ``g_k``);
    - ``grad_noise/grad_sq_norm`` = ‖g‖² − trace_cov / B, unbiased for ‖G‖²;
    - ``grad_noise/noise_scale`` = trace_cov / grad_sq_norm, McCandlish's B_simple (the batch
      size beyond which more samples give diminishing returns), only when both are > 0. It is a
      ratio of noisy estimates: average ``trace_cov`` and ``grad_sq_norm`` over steps first;
    - ``grad_noise/micro_grad_norm/{mean,std}``: the spread of ‖g_k‖ across micro-batches.

    Args:
        micro_grad_sq_norms: ‖g_k‖² of each micro-batch's *own mean-loss* gradient (if the loss
            was scaled by ``b_k / B`` for accumulation, divide the contribution's ‖·‖² by
            ``(b_k / B)²``; :class:`MicroBatchGradProbe` does this), before clipping.
        micro_sizes: ``b_k`` of each micro-batch.
        batch_grad_sq_norm: ‖g‖² of the accumulated mini-batch gradient, before clipping.

    Returns nothing for fewer than two micro-batches (the estimator needs two sizes).
    """
    if len(micro_grad_sq_norms) != len(micro_sizes):
        raise ValueError(
            f"compute_gradient_noise_metrics: {len(micro_grad_sq_norms)} norms for {len(micro_sizes)} sizes"
        )
    if any(b <= 0 for b in micro_sizes):
        raise ValueError(
            f"compute_gradient_noise_metrics: micro_sizes must be > 0, got {list(micro_sizes)}"
        )
    if len(micro_sizes) < 2:
        return {}
    big = float(sum(micro_sizes))
    sq = torch.tensor([float(x) for x in micro_grad_sq_norms], dtype=torch.float64)
    sizes = torch.tensor([float(b) for b in micro_sizes], dtype=torch.float64)
    trace = float((sq - batch_grad_sq_norm).sum() / (1.0 / sizes - 1.0 / big).sum())
    signal = float(batch_grad_sq_norm) - trace / big
    norms = sq.clamp(min=0).sqrt()
    out = {
        "grad_noise/trace_cov": trace,
        "grad_noise/grad_sq_norm": signal,
        "grad_noise/micro_grad_norm/mean": float(norms.mean()),
        "grad_noise/micro_grad_norm/std": float(norms.std(unbiased=False)),
    }
    if trace > 0 and signal > 0:
        out["grad_noise/noise_scale"] = trace / signal
    return out


class MicroBatchGradProbe:
    """Measures each micro-batch's gradient during accumulation (for the gradient-noise metrics).

    Use: ``probe = MicroBatchGradProbe(model.parameters())`` once per mini-batch (after
    ``zero_grad``); after each micro-batch's ``backward`` call ``probe.record(size, scale)``
    where ``scale`` is the factor its mean loss was multiplied by (``size / B`` with a global
    normalizer); after the last one, ``compute_gradient_noise_metrics(probe.sq_norms,
    probe.sizes, probe.total_sq_norm())``. Cost: one copy of the gradients (the previous
    accumulated state) and one subtraction per micro-batch. Gradients must be local tensors
    (single process or replicated); sharded (FSDP) gradients would need an all-reduce of the
    squared norms, which this class does not do.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        self._params = [p for p in parameters if p.requires_grad]
        self._previous: list[torch.Tensor | None] = [self._grad(p) for p in self._params]
        self.sq_norms: list[float] = []
        """‖g_k‖² of each recorded micro-batch's own mean-loss gradient."""
        self.sizes: list[float] = []

    @staticmethod
    def _grad(p: torch.nn.Parameter) -> torch.Tensor | None:
        return None if p.grad is None else p.grad.detach().clone()

    def record(self, size: float, scale: float) -> float:
        """Record the micro-batch just back-propagated; returns its ‖g_k‖²."""
        if scale <= 0:
            raise ValueError(f"MicroBatchGradProbe.record: scale must be > 0, got {scale}")
        total = 0.0
        for i, p in enumerate(self._params):
            now = self._grad(p)
            before = self._previous[i]
            if now is not None:
                delta = now if before is None else now - before
                total += float(delta.double().pow(2).sum())
            self._previous[i] = now
        sq = total / (scale * scale)
        self.sq_norms.append(sq)
        self.sizes.append(float(size))
        return sq

    def total_sq_norm(self) -> float:
        """‖g‖² of the gradient accumulated so far."""
        return float(sum(float(g.double().pow(2).sum()) for g in self._previous if g is not None))


def compute_tool_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Per tool, over one step's episodes (``Trajectory.tool_stats``): ``tools/<name>/calls``,
    ``errors``, ``timeouts`` (sums), ``latency_mean_s`` (per call) and ``latency_max_s``.

    Counted where each call ran (any process, a Ray actor), carried by the trajectories, so
    these are exactly the calls of the episodes the step trained on.
    """
    totals: dict[str, dict[str, float]] = {}
    for t in trajectories:
        for name, st in t.tool_stats.items():
            acc = totals.setdefault(
                name, {"calls": 0.0, "errors": 0.0, "timeouts": 0.0, "latency_s": 0.0, "max": 0.0}
            )
            for key in ("calls", "errors", "timeouts", "latency_s"):
                acc[key] += float(st.get(key, 0.0))
            acc["max"] = max(acc["max"], float(st.get("latency_max_s", 0.0)))
    out: dict[str, float] = {}
    for name, acc in sorted(totals.items()):
        out[f"tools/{name}/calls"] = acc["calls"]
        out[f"tools/{name}/errors"] = acc["errors"]
        out[f"tools/{name}/timeouts"] = acc["timeouts"]
        out[f"tools/{name}/latency_mean_s"] = (
            acc["latency_s"] / acc["calls"] if acc["calls"] else 0.0
        )
        out[f"tools/{name}/latency_max_s"] = acc["max"]
    return out


def _components(info: Mapping[str, object]) -> dict[str, float]:
    """The numbers of a reward's ``reward_info``: its own numeric keys and a mix's ``terms``."""
    out: dict[str, float] = {}
    for key, value in info.items():
        if isinstance(value, bool | int | float):
            out[key] = float(value)
        elif key == "terms" and isinstance(value, Mapping):
            for term, score in value.items():
                if isinstance(score, bool | int | float):
                    out[f"terms/{term}"] = float(score)
    return out


def compute_reward_component_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``reward/<data_source>/<component>/mean`` for every number a reward returned besides its
    score (``{"score": 1.0, "probes": 4}`` gives ``reward/<source>/probes/mean``; a mix's terms
    give ``reward/<source>/terms/<term>/mean``), averaged over the episodes that report it."""
    sums: dict[tuple[str, str], list[float]] = {}
    for t in trajectories:
        for key, value in _components(t.reward_info).items():
            acc = sums.setdefault((t.data_source, key), [0.0, 0.0])
            acc[0] += value
            acc[1] += 1.0
    return {
        f"reward/{source}/{key}/mean": total / n
        for (source, key), (total, n) in sorted(sums.items())
    }


def value_metrics(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How well the critic's values (before its update) predicted the returns.

    Args:
        values: ``[B, T]`` the critic's values when the batch was collected.
        returns: ``[B, T]`` the GAE returns (targets).
        response_mask: ``[B, T]`` 0/1.

    Returns:
        ``critic/values_mean``, ``critic/returns_mean`` (masked means) and
        ``critic/vf_explained_var`` = 1 − Var(R − V) / Var(R) over the masked tokens (1 is a
        perfect critic, 0 no better than a constant, negative worse; 0 when Var(R) = 0).
    """
    m = response_mask.float()
    var_returns = masked_var(returns, m)
    explained = (
        1.0 - masked_var(returns - values, m) / var_returns
        if float(var_returns) > 1e-12
        else torch.tensor(0.0)
    )
    return {
        "critic/values_mean": float(masked_mean(values, m)),
        "critic/returns_mean": float(masked_mean(returns, m)),
        "critic/vf_explained_var": float(explained),
    }
