"""Shared prompts: each distinct prompt of a micro-batch runs once, its samples on top of it.

Why it exists: GRPO samples every task n times, so a batch holds each prompt n times (and an
agent's prompt, the system prompt and the tool block, is most of its tokens). The trainer's
forward passes computed every copy: on the quickstart about half of the update's tokens were
repeats. Here a micro-batch runs its distinct prompts once (``use_cache``), the KV cache is
indexed out to the rows (``cache.batch_select_indices``), and every row's response runs on top of
its prompt's cache, as a generation step would. Gradients flow through the cache into the
prompt's forward, so the update is the same as before: each prompt's share of the gradient is
the sum over its samples, accumulated by autograd instead of computed n times.

Guarantees:

- Rows share a prompt only when its tokens and padding are identical, compared exactly
  (:func:`agentrl.batch.prompt_groups`), whatever the task ids say; the micro-batches keep a
  prompt's rows together (:func:`agentrl.batch.split_by_prompt_groups`).
- :func:`shared_prompt_logits` returns the logits that predict each response token, ``[b, R, V]``,
  equal to one forward over ``cat(prompt, response)`` per row up to float rounding (the tests
  compare log-probs and gradients on Llama and Qwen2 layouts, with LoRA, left-padded prompts of
  different lengths and rows without a partner).
- :func:`sharing_blocker` says why a model cannot share (a sliding window, an attention kernel
  that takes no padding mask with a cache); the actor then runs every row whole and says so
  once. The actor also checks the first shared micro-batch against the plain forward and turns
  sharing off, with a warning, if they differ.
- With activation checkpointing a layer's recompute starts from the cache as its forward found
  it (:mod:`agentrl.training.memory`), so the two compose.
- Under FSDP2 a prompt's rows go to one rank together (``DistContext.plan_mini_batch``); while
  a mini-batch repeats a prompt every rank runs the two forwards of every micro-batch (FSDP2's
  forwards are collectives), and the ranks decide the check together.
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.kv_cache import base_model, cache_kwargs, output_cache

__all__ = [
    "group_leaders",
    "shared_prompt_logits",
    "sharing_blocker",
]

_MASKED_ATTENTION = ("sdpa", "eager")
"""Attention kernels that take a padding mask beside a KV cache in every transformers version."""


def group_leaders(groups: torch.Tensor) -> torch.Tensor:
    """The first row of each group ``[g]``."""
    n = int(groups.max()) + 1
    rows = torch.arange(len(groups), device=groups.device)
    start = torch.full((n,), len(groups), dtype=torch.long, device=groups.device)
    return start.scatter_reduce(0, groups, rows, "amin")


def sharing_blocker(model: Any) -> str | None:
    """Why ``model`` cannot run shared prompts, or None when it can."""
    config = getattr(base_model(model), "config", None)
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in _MASKED_ATTENTION:
        return f"attention {attn!r} (sharing needs sdpa or eager)"
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    windowed = getattr(config, "use_sliding_window", False) and getattr(
        config, "sliding_window", None
    )
    if windowed or any(t != "full_attention" for t in layer_types):
        return "a sliding-window or non-standard attention layer"
    return None


def shared_prompt_logits(
    model: Any,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    resp_len: int,
    groups: torch.Tensor,
) -> torch.Tensor:
    """Logits ``[b, R, V]`` predicting each response token of ``input_ids = cat(prompts,
    responses)`` (``[b, P + R]``, prompts left-padded), each group's prompt run once.

    Column 0 is the prompt's last logit (it predicts the first response token of every row of
    the group); columns 1.. come from the responses' own forward over the cache."""
    p_len = input_ids.shape[1] - resp_len
    lead = group_leaders(groups)
    out = model(
        input_ids=input_ids[lead, :p_len],
        attention_mask=mask[lead, :p_len],
        position_ids=positions[lead, :p_len],
        use_cache=True,
        logits_to_keep=1,
    )
    cache = output_cache(out)
    cache.batch_select_indices(groups)
    rest = model(
        input_ids=input_ids[:, p_len:],
        attention_mask=mask,
        position_ids=positions[:, p_len:],
        use_cache=False,
        logits_to_keep=resp_len,
        **cache_kwargs(model, cache),
    ).logits
    return torch.cat([out.logits[:, -1:][groups], rest[:, : resp_len - 1]], dim=1)
