"""Sampling: processed logprobs and one token per row, each row from its request's own stream.

Why it exists: the engine must sample exactly as vLLM does with
``--logprobs-mode processed_logprobs``, and a request's tokens must not depend on what else is in
its batch. The math is pure functions (unit-tested on their own); :func:`sample_group` applies it
to a group of requests that share sampling parameters.

Logprob convention (DESIGN section 3): the logprob of a sampled token is
``log_softmax(logits / temperature)`` after top-k and then top-p masking when those are on
(masked tokens get ``-inf`` and the rest are renormalised). With ``temperature == 0`` the engine
is greedy (argmax of the raw logits) and reports ``log_softmax(logits)``: the unscaled
distribution, as vLLM does.

Invariants:

- every operation is along the last axis: a row of NaNs spoils only itself;
- each row draws exactly one uniform number from its own generator per token (inverse CDF), so a
  request's tokens are the same whether it is sampled alone or in any batch;
- a token with probability 0 is never picked;
- :func:`sample_group` appends to a request only a token whose logprob is finite; every other
  member gets the error that fails it, and nothing is appended to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from agentrl.inference.engine.request import EngineRequest, EngineStepError

__all__ = ["process_logits", "sample_group", "sample_token", "sample_tokens"]


def process_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Processed log-probabilities ``[..., V]`` of raw logits ``[..., V]`` (float32), per row.

    ``temperature == 0``: ``log_softmax(logits)`` (greedy; the unscaled distribution).
    Otherwise ``log_softmax`` of ``logits / temperature`` after top-k (keep the k largest;
    ``top_k <= 0`` is off) and top-p (drop the smallest tokens whose cumulative mass is at most
    ``1 - top_p``, always keeping the most likely one; vLLM's rule) masking. Every operation is
    along the last axis, so a row of NaNs spoils only itself.
    """
    x = logits.float()
    if temperature == 0.0:
        return torch.log_softmax(x, dim=-1)
    x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p)
        drop[..., -1] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return torch.log_softmax(x, dim=-1)


def sample_tokens(
    logprobs: torch.Tensor,
    temperature: float,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row of processed logprobs ``[N, V]`` (CPU): ``[N]`` token ids.

    Greedy (``temperature == 0``): the argmax. Otherwise inverse-CDF sampling with one uniform
    draw per row from that row's generator (a request's own stream, so its tokens do not depend
    on what else is in the batch): the first token whose cumulative probability (float64)
    exceeds ``u`` times the row's total. A token with probability 0 is never picked.
    """
    if temperature == 0.0:
        return torch.argmax(logprobs, dim=-1)
    probs = torch.exp(logprobs.double())
    cum = probs.cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    picked = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0]
    picked = picked.clamp_(max=probs.shape[-1] - 1)
    # u * total rounds up to the total only at the very end: fall back to the last token that
    # has probability (a masked tail has none).
    last = probs.shape[-1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.where(probs.gather(1, picked[:, None])[:, 0] > 0, picked, last)


def sample_token(
    logprobs: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> int:
    """One token from processed logprobs ``[V]`` (CPU); :func:`sample_tokens` for one row."""
    return int(sample_tokens(logprobs[None], temperature, [generator])[0].item())


def sample_group(
    members: Sequence[EngineRequest],
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    version: int,
) -> list[EngineStepError | None]:
    """Append one sampled token to each member from its raw logits (row ``j`` of ``[N, V]``,
    CPU float32), with its processed logprob, ``version`` and (when asked) its top logprobs.

    Per member: None when a token was appended, else the error that fails it (its logits are
    not finite, or the group's numbers broke the sampler); the caller fails those.
    """
    try:
        lp = process_logits(logits, temperature, top_k, top_p)
        finite = torch.isfinite(lp).any(dim=-1).tolist()
        toks = sample_tokens(lp, temperature, [r.generator for r in members])
        values = lp.gather(1, toks[:, None])[:, 0].tolist()
        toks_list = toks.tolist()
    except Exception as e:  # the group's numbers broke the sampler: its members fail
        why = f"sampling failed: {type(e).__name__}: {e}"
        return [EngineStepError(why) for _ in members]  # one error each: each is raised alone
    out: list[EngineStepError | None] = []
    for j, req in enumerate(members):
        if not finite[j] or not math.isfinite(values[j]):
            why = (
                "every logit is NaN or -inf"
                if not finite[j]
                else (f"the sampled token {toks_list[j]} has logprob {values[j]}")
            )
            out.append(EngineStepError(f"sampling failed (non-finite logits?): {why}"))
            continue
        req.output_ids.append(toks_list[j])
        req.logprobs.append(values[j])
        req.versions.append(version)
        if req.num_top_logprobs:
            req.top_logprobs.append(_top_logprobs(lp[j], req.num_top_logprobs))
        out.append(None)
    return out


def _top_logprobs(lp: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(token, logprob)`` of one row ``[V]``, masked tokens left out."""
    top = torch.topk(lp, min(k, lp.shape[-1]))
    return [
        (int(t), float(v))
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        if math.isfinite(v)
    ]
