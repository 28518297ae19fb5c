"""The engine's forward pass: new tokens on top of a KV cache, the logits after each row's last.

Why it exists: on a small model a forward is mostly Python, not arithmetic. ``transformers``'
generic model call builds a 4-D mask, a cache object, output records and hook wrappers on every
call; on the quickstart's model that doubled a decode step (16 rows: 2.2 ms against 1.2 ms for
the same modules driven directly). :class:`LeanForward` drives the model's *own* modules (its
embedding, rotary embedding, norms, projections, MLP and ``lm_head``, so its weights, pushes and
merged adapters are the served ones) with one attention call per layer and no wrappers.
:class:`HFForward` is the model's own call, for everything else.

Invariants:

- both answer the same question, ``(logits [N, V] after each row's last column, KV per layer
  [N, H_kv, P + S, D])`` for ``ids [N, S]`` on top of ``past`` ``[N, H_kv, P, D]`` under a 2-D
  ``mask [N, P + S]`` (1 = a real token) and explicit ``positions [N, S]``;
- a row's real tokens attend to real tokens at or before their column only; a padded query
  column attends to itself (so nothing is NaN; its output is never used);
- :func:`make_forward` uses :class:`LeanForward` only for a model it knows the layout of (Llama,
  Qwen2, Qwen3: full attention, rotary embeddings from the model's own module) *and* whose logits
  match :class:`HFForward` on a prefill and a decode step at load; anything else, or a mismatch
  (logged), gets :class:`HFForward`. ``AGENTRL_LEAN_FORWARD=0`` turns the lean path off.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

from agentrl.algos import logits_disagreement
from agentrl.kv_cache import cache_kwargs, output_cache

__all__ = ["KV", "HFForward", "LeanForward", "make_forward"]

log = logging.getLogger(__name__)

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(keys, values)``, each ``[N, H_kv, T, D]``."""

LEAN_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
"""Model types whose decoder layout :class:`LeanForward` drives (others: :class:`HFForward`)."""
ENV_LEAN = "AGENTRL_LEAN_FORWARD"
"""``0`` turns :class:`LeanForward` off (every forward is the model's own call)."""


class HFForward:
    """The model's own ``forward`` (any causal LM, and any stand-in that takes its keywords)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    @torch.no_grad()
    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, past: KV | None
    ) -> tuple[torch.Tensor, KV]:
        """Logits after each row's last column ``[N, V]`` and the KV cache ``[N, H, P + S, D]``."""
        from transformers import DynamicCache

        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs(
                self.model, DynamicCache(ddp_cache_data=past) if past else DynamicCache()
            ),
        )
        return out.logits[:, -1], [(layer.keys, layer.values) for layer in output_cache(out).layers]


class LeanForward:
    """The model's modules driven directly: embed, per layer (norm, attention with rotary
    embeddings and the cache, norm, MLP), final norm, ``lm_head`` on the last column only."""

    def __init__(self, model: Any) -> None:
        self.model = model
        body = model.model
        self.embed, self.rotary, self.norm = body.embed_tokens, body.rotary_emb, body.norm
        self.layers = list(body.layers[: model.config.num_hidden_layers])
        self.rope = sys.modules[type(body.layers[0].self_attn).__module__].apply_rotary_pos_emb

    @torch.no_grad()
    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, past: KV | None
    ) -> tuple[torch.Tensor, KV]:
        """Logits after each row's last column ``[N, V]`` and the KV cache ``[N, H, P + S, D]``."""
        x = self.embed(ids)
        cos, sin = self.rotary(x, positions)
        allowed = _allowed(mask, ids.shape[1], past is None)
        kv: KV = []
        for i, layer in enumerate(self.layers):
            h, pair = self._attend(
                layer.self_attn, layer.input_layernorm(x), cos, sin, allowed, past, i
            )
            kv.append(pair)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.norm(x[:, -1:]))[:, -1], kv

    def _attend(
        self,
        attn: Any,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor | None,
        past: KV | None,
        i: int,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        n, s, _ = h.shape
        shape = (n, s, -1, attn.head_dim)
        q, k = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head norms before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        if past:
            k = torch.cat([past[i][0], k], dim=2)
            v = torch.cat([past[i][1], v], dim=2)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=allowed,
            is_causal=allowed is None and s > 1,
            scale=attn.scaling,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return attn.o_proj(out.transpose(1, 2).reshape(n, s, -1)), (k, v)


def _allowed(mask: torch.Tensor, s: int, fresh: bool) -> torch.Tensor | None:
    """``[N, 1, S, T]`` bool: True where query ``j`` (column ``T - S + j``) may attend to column
    ``c`` (``c`` real and not after it, or ``c`` is the query's own column). None when no row
    has padding and plain causal attention says the same (``fresh``: no cache before these
    columns; a single query attends to every column)."""
    if (fresh or s == 1) and bool(mask.all()):
        return None
    t = mask.shape[1]
    real = mask[:, None, None, :].bool()
    if s == 1:
        allowed = real.clone()
        allowed[..., -1] = True
        return allowed
    cols = torch.arange(t, device=mask.device)
    rows = torch.arange(t - s, t, device=mask.device)[:, None]
    return (real & (cols <= rows)) | (cols == rows)


def make_forward(model: Any) -> HFForward | LeanForward:
    """:class:`LeanForward` when the model's layout is known and it matches :class:`HFForward`
    at load (see the module's invariants), else :class:`HFForward`."""
    hf = HFForward(model)
    if os.environ.get(ENV_LEAN, "1") == "0" or not _lean_layout(model):
        return hf
    try:
        lean = LeanForward(model)
        error = _self_check(lean, hf, model)
    except Exception as e:  # a layout we misread: the model's own call is always right
        error = f"{type(e).__name__}: {e}"
    if error is None:
        return lean
    log.warning("lean forward disagrees with transformers (%s); using transformers'", error)
    return hf


def _lean_layout(model: Any) -> bool:
    """True for a decoder whose modules :class:`LeanForward` knows (full attention only): a
    ``transformers`` model itself, never a wrapper around one."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return False
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in LEAN_MODEL_TYPES:
        return False
    body = getattr(model, "model", None)
    needed = ("embed_tokens", "rotary_emb", "layers", "norm")
    if body is None or not all(hasattr(body, a) for a in needed) or not hasattr(model, "lm_head"):
        return False
    types = getattr(cfg, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in types) and all(
        getattr(layer.self_attn, "sliding_window", None) is None for layer in body.layers
    )


def _self_check(lean: LeanForward, hf: HFForward, model: Any) -> str | None:
    """Compare both on a left-padded prefill of two rows and one decode step; None if they
    agree (within float rounding of the model's dtype), else what differed."""
    param = next(model.parameters())
    device, vocab = param.device, int(model.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 7), generator=gen).to(device)
    mask = torch.ones(2, 7, dtype=torch.long, device=device)
    mask[1, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    (a, kv_a), (b, kv_b) = lean(ids, pos, mask, None), hf(ids, pos, mask, None)
    step_ids, step_pos = ids[:, -1:], pos[:, -1:] + 1
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long, device=device)], 1)
    (c, _), (d, _) = lean(step_ids, step_pos, mask2, kv_a), hf(step_ids, step_pos, mask2, kv_b)
    for what, x, y in (("prefill", a, b), ("decode", c, d)):
        error = logits_disagreement(x, y, param.dtype)
        if error is not None:
            return f"{what}: {error}"
    return None
