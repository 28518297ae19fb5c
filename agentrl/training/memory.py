"""Memory savers of the trainer: activation checkpointing, and host offload of the FSDP2 shards.

Why it exists: on one accelerator a 1.5B-7B actor does not fit with every decoder layer's
activations kept for backward and with AdamW's two float32 moments beside the weights. Two
knobs trade time for memory, and compose with the token-budget micro-batching (which bounds
the activations of one forward):

- ``trainer.gradient_checkpointing``: :func:`checkpoint_decoder_layers` makes each decoder layer
  keep only its inputs in forward and recompute its activations in backward (about one more
  forward pass per update). The numbers are the same as without it (dropout is off in the
  trainer, and the RNG state is restored for the recompute anyway).
- ``trainer.cpu_offload``: :func:`~agentrl.training.fsdp.offload_policy` is FSDP2's ``CPUOffloadPolicy``: parameter
  shards, gradients and the optimizer state live in host memory, each layer's parameters are
  copied to the device for its forward/backward, and the optimizer step runs on the CPU.

Guarantees:

- :func:`checkpoint_decoder_layers` wraps the layers that FSDP2 shards
  (:func:`~agentrl.training.fsdp.decoder_layers`), so it works for any Hugging Face causal LM,
  under peft LoRA (the adapters sit inside the layers) and under FSDP2 (apply it before
  sharding); without grad mode (log-prob passes) the layers run as before.
- A layer that runs on top of a KV cache (``trainer.share_prompts``) is recomputed from the
  cache as its forward found it, so shared prompts and checkpointing compose.
- It does not depend on ``module.training``: the trainer keeps its models in eval mode (no
  dropout), where Hugging Face's own ``gradient_checkpointing_enable`` would do nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from agentrl.training.fsdp import decoder_layers

__all__ = ["checkpoint_decoder_layers"]


_CACHE_KWARGS = ("cache", "past_key_values")
"""The names a decoder layer takes its KV cache under (transformers 5.25 on, and before)."""


def _checkpointed(forward: Any) -> Any:
    """``forward`` recomputed in backward when grad mode is on; plain otherwise.

    A layer that runs on top of a KV cache (the trainer's shared prompts) appends its keys and
    values to it; its recompute in backward starts from the cache as the forward found it, so
    the replay attends to the same keys (not to its own twice)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
        layers = getattr(cache, "layers", None)
        if not layers:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        found = [dict(vars(layer)) for layer in layers]  # its tensors are replaced, never edited

        def replay(*a: Any, **k: Any) -> Any:
            for layer, state in zip(layers, found, strict=True):
                vars(layer).clear()
                vars(layer).update(state)
            return forward(*a, **k)

        return checkpoint(replay, *args, use_reentrant=False, **kwargs)

    run.agentrl_checkpointed = True  # type: ignore[attr-defined]
    return run


def checkpoint_decoder_layers(model: torch.nn.Module) -> int:
    """Activation checkpointing on every decoder layer of ``model``; returns how many.

    Idempotent: a layer already wrapped is left alone. Call it before FSDP2 sharding and before
    or after peft wrapping (both keep the layer modules).
    """
    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer.forward, "agentrl_checkpointed", False):
            continue
        layer.forward = _checkpointed(layer.forward)  # type: ignore[method-assign]
    return len(layers)
