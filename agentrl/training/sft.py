"""Supervised warm start on chat conversations (``agentrl sft``).

Why it exists: a randomly initialised (or small) model never emits a well-formed tool call, so RL
has no signal. A short supervised phase on conversations that call tools gives RL a policy that
sometimes succeeds. The quickstart uses it on synthetic calculator-tool conversations.

Guarantees:

- The loss covers exactly the tokens the policy will later *sample*: each assistant turn's
  content and its end-of-turn token (``<|im_end|>``), found by rendering the conversation
  prefix by prefix with the model's own chat template; system/user/tool tokens and the template
  tokens that open a turn are masked out.
- A template that is not prefix-stable (render(messages[:k]) is not a prefix of
  render(messages)) is an error naming the conversation, not silently mis-masked data.
- Deterministic for a seed (data order and initialisation of the optimizer state).
- ``share_prefix=True`` (a speed knob for long shared system prompts, e.g. a tools block):
  the token prefix common to a whole batch carries no loss, so it is run once per step,
  without gradient, and its KV cache is shared by every row. Conversations with different
  ``tools`` (or none) are then batched separately (each batch from one group, groups drawn in
  proportion to their size), so that every batch has a long common prefix. The forward pass is the same
  function (same logits); only the gradient through the prefix's keys/values is dropped.
- Length-bucketed micro-batches change the speed, not the loss: each step's rows are split into
  micro-batches of similar length (at most ``micro_batch_max_tokens`` padded tokens each), run
  one after another with their gradients accumulated, and every row's token NLL is divided by
  the token count of the *whole* batch, so the gradient is the token-mean over the batch, as if
  it had run in one piece (up to float rounding). Rows of 95 and 213 tokens no longer pad to 213.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrl.kv_cache import cache_kwargs, output_cache

__all__ = ["SFTExample", "SFTSettings", "load_conversations", "tokenize_conversation", "train_sft"]


@dataclass
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class SFTSettings:
    """Knobs of a supervised run (filled from the ``kind: sft`` config)."""

    steps: int = 1000
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    grad_clip: float = 1.0
    seed: int = 0
    max_seq_len: int = 1024
    log_every: int = 50
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: str = "cosine"
    """After warmup: ``cosine`` (down to 10% of ``lr``) or ``constant``."""
    share_prefix: bool = False
    """Run the batch's common, loss-free token prefix once per step without gradient."""
    micro_batch_max_tokens: int = 4096
    """Padded tokens (rows x longest row) of one forward/backward micro-batch."""


def _render_ids(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None, gen: bool
) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=gen, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def tokenize_conversation(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None = None, *, name: str = ""
) -> SFTExample:
    """Token ids of the whole conversation and a mask of 1 on assistant-sampled tokens."""
    eos_id = tokenizer.eos_token_id
    full = _render_ids(tokenizer, messages, tools, gen=False)
    mask = [0] * len(full)
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        prefix = _render_ids(tokenizer, messages[:i], tools, gen=True)
        upto = _render_ids(tokenizer, messages[: i + 1], tools, gen=False)
        if full[: len(prefix)] != prefix or full[: len(upto)] != upto:
            raise ValueError(
                f"conversation {name or '?'}: the chat template is not prefix-stable at message "
                f"{i}; SFT masks (and the agent loop's token deltas) need render(messages[:k]) to "
                "be a prefix of render(messages)"
            )
        end = len(upto)
        # The turn ends at the first EOS after the prefix; anything after it (e.g. the
        # template's newline) is template, not sampled.
        for j in range(len(prefix), len(upto)):
            if upto[j] == eos_id:
                end = j + 1
                break
        for j in range(len(prefix), end):
            mask[j] = 1
    return SFTExample(input_ids=full, loss_mask=mask)


def load_conversations(path: str | Path) -> list[dict[str, Any]]:
    """JSONL rows ``{"messages": [...], "tools": [...]?}``; errors name the file and line."""
    rows = []
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"SFT data file {p} does not exist (data.train_files)")
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row.get("messages"), list) or not row["messages"]:
                raise ValueError(f"{p}:{lineno}: column 'messages' must be a non-empty list")
            rows.append(row)
    return rows


def _collate(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    n = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), n), dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.float32)
    for i, e in enumerate(examples):
        k = len(e.input_ids)
        ids[i, :k] = torch.tensor(e.input_ids)
        attn[i, :k] = 1
        mask[i, :k] = torch.tensor(e.loss_mask, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}


def _shared_prefix_len(examples: Sequence[SFTExample]) -> int:
    """Length of the token prefix common to all ``examples`` that carries no loss, keeping at
    least one token of every row outside it (so each row has a suffix to run)."""
    first = examples[0]
    limit = min(len(e.input_ids) for e in examples) - 1
    n = 0
    while (
        n < limit
        and first.loss_mask[n] == 0
        and all(e.input_ids[n] == first.input_ids[n] and e.loss_mask[n] == 0 for e in examples)
    ):
        n += 1
    # The last prefix token's logits predict the first suffix token: that target must be
    # loss-free too, since the prefix runs without producing trainable logits.
    while n > 0 and any(e.loss_mask[n] for e in examples):
        n -= 1
    return n


MICRO_BATCH_OVERHEAD_TOKENS = 128
"""What one extra forward/backward costs, in padded tokens (measured on the tiny model: a few
ms per pass against ~0.05 ms per token); splits that save less padding than this are not made."""


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split rows of the given token lengths into micro-batches of similar length.

    Returns lists of row indices. Rows are taken longest first; each micro-batch is a run of
    consecutive rows in that order whose padded size (rows x its longest row) is at most
    ``max_tokens`` (a single longer row goes alone). Among such splits the one with the fewest
    padded tokens plus :data:`MICRO_BATCH_OVERHEAD_TOKENS` per micro-batch is chosen (exact
    dynamic programming; deterministic, ties go to fewer micro-batches).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(order)
    best = [0.0] + [math.inf] * n  # best[j]: cost of rows order[:j]
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):
            padded = (j - i) * lengths[order[i]]
            if padded > max_tokens and j - i > 1:
                break
            cost = best[i] + padded + MICRO_BATCH_OVERHEAD_TOKENS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    chunks: list[list[int]] = []
    j = n
    while j > 0:
        chunks.append(order[cut[j] : j])
        j = cut[j]
    return chunks[::-1]


def _batch_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], prefix_len: int
) -> torch.Tensor:
    """Masked token-mean NLL of a collated batch (``input_ids``/``attention_mask``/``loss_mask``:
    ``[B, T]``). With ``prefix_len > 0`` the first ``prefix_len`` columns (identical in every
    row, loss-free) run once without gradient and their KV cache is repeated for the rows."""
    return _batch_nll_sum(model, batch, prefix_len) / batch["loss_mask"][:, 1:].sum().clamp(min=1)


def _batch_nll_sum(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], prefix_len: int
) -> torch.Tensor:
    """Summed NLL over the loss-masked targets of a collated batch (see :func:`_batch_loss`)."""
    ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    kwargs: dict[str, Any] = {}
    if prefix_len > 0:
        with torch.no_grad():
            out = model(input_ids=ids[:1, :prefix_len], use_cache=True)
        cache = output_cache(out)
        cache.batch_repeat_interleave(ids.shape[0])
        kwargs.update(cache_kwargs(model, cache))
        ids, mask = ids[:, prefix_len:], mask[:, prefix_len:]
    logits = model(input_ids=ids, attention_mask=attn, **kwargs).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = ids[:, 1:]
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return (nll * mask[:, 1:]).sum()


def _train_batch(
    model: torch.nn.Module,
    picked: Sequence[SFTExample],
    pad_id: int,
    device: torch.device,
    settings: SFTSettings,
) -> tuple[float, int]:
    """Forward and backward of one step's rows in length-bucketed micro-batches; gradients
    accumulate in ``model``. Returns the batch's token-mean loss and its real token count."""
    prefix_len = _shared_prefix_len(picked) if settings.share_prefix else 0
    # Targets are tokens 1..n-1 of each row: the token-mean divides by the batch's total.
    total = sum(sum(e.loss_mask[1:]) for e in picked)
    chunks = micro_batches([len(e.input_ids) for e in picked], settings.micro_batch_max_tokens)
    loss_sum = 0.0
    tokens = 0
    for rows in chunks:
        batch = {k: v.to(device) for k, v in _collate([picked[i] for i in rows], pad_id).items()}
        part = _batch_nll_sum(model, batch, prefix_len) / max(total, 1)
        part.backward()
        loss_sum += part.item()
        tokens += int(batch["attention_mask"].sum())
    return loss_sum, tokens


def _tokenize_all(
    tokenizer: Any, conversations: Sequence[dict[str, Any]], max_seq_len: int
) -> list[SFTExample]:
    """Every conversation tokenized; one too long or without an assistant message is an error."""
    examples = []
    for k, conv in enumerate(conversations):
        ex = tokenize_conversation(tokenizer, conv["messages"], conv.get("tools"), name=str(k))
        if len(ex.input_ids) > max_seq_len:
            raise ValueError(
                f"conversation {k} has {len(ex.input_ids)} tokens > max_seq_len "
                f"{max_seq_len}; raise trainer.max_seq_len or shorten the data"
            )
        if sum(ex.loss_mask) == 0:
            raise ValueError(f"conversation {k} has no assistant message to learn from")
        examples.append(ex)
    if not examples:
        raise ValueError("no SFT conversations to train on")
    return examples


def _lr_factor(settings: SFTSettings) -> Callable[[int], float]:
    """The learning-rate multiplier per step: linear warm-up, then constant or cosine to 0.1."""

    def lr_at(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        if settings.schedule == "constant":
            return 1.0
        span = max(1, settings.steps - settings.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - settings.warmup_steps) / span))

    return lr_at


class _Batches:
    """Draws each step's examples: shuffled epochs, or, with ``share_prefix`` and more than one
    tool set, a batch from one tool-set group (conversations offering the same tools share a
    long system-prompt prefix)."""

    def __init__(
        self,
        examples: list[SFTExample],
        conversations: Sequence[dict[str, Any]],
        settings: SFTSettings,
        rng: random.Random,
    ) -> None:
        self.examples, self.settings, self.rng = examples, settings, rng
        self.order: list[int] = []
        self.groups: dict[str, list[int]] = {}
        for k, conv in enumerate(conversations):
            self.groups.setdefault(json.dumps(conv.get("tools"), sort_keys=True), []).append(k)
        self.keys = sorted(self.groups)
        self.weights = [len(self.groups[g]) for g in self.keys]
        self.pending: dict[str, list[int]] = {g: [] for g in self.keys}

    def draw(self) -> list[SFTExample]:
        """The next batch of ``settings.batch_size`` examples."""
        n = self.settings.batch_size
        if self.settings.share_prefix and len(self.keys) > 1:
            key = self.rng.choices(self.keys, self.weights)[0]
            picked = []
            for _ in range(n):
                if not self.pending[key]:
                    self.pending[key] = list(self.groups[key])
                    self.rng.shuffle(self.pending[key])
                picked.append(self.examples[self.pending[key].pop()])
            return picked
        if len(self.order) < n:
            more = list(range(len(self.examples)))
            self.rng.shuffle(more)
            self.order.extend(more)
        return [self.examples[self.order.pop()] for _ in range(n)]


def train_sft(
    model: torch.nn.Module,
    tokenizer: Any,
    conversations: Sequence[dict[str, Any]],
    settings: SFTSettings,
    *,
    on_log: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Train ``model`` in place; returns the final metrics (``sft/loss``, ``sft/tokens_per_s``)."""
    examples = _tokenize_all(tokenizer, conversations, settings.max_seq_len)
    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if settings.schedule not in ("cosine", "constant"):
        raise ValueError(f"schedule = {settings.schedule!r}; use 'cosine' or 'constant'")
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=settings.lr,
        betas=settings.betas,
        weight_decay=settings.weight_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(settings))
    model.train()
    batches = _Batches(examples, conversations, settings, rng)
    metrics: dict[str, float] = {}
    tokens = 0
    t0 = time.perf_counter()
    loss_ema = None
    for step in range(settings.steps):
        picked = batches.draw()
        opt.zero_grad(set_to_none=True)
        loss, step_tokens = _train_batch(model, picked, pad_id, device, settings)
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        opt.step()
        sched.step()
        tokens += step_tokens
        loss_ema = loss if loss_ema is None else 0.95 * loss_ema + 0.05 * loss
        if (step + 1) % settings.log_every == 0 or step + 1 == settings.steps:
            elapsed = time.perf_counter() - t0
            metrics = {
                "sft/loss": loss,
                "sft/loss_ema": loss_ema,
                "sft/lr": float(sched.get_last_lr()[0]),
                "perf/tokens_per_s": tokens / max(elapsed, 1e-9),
            }
            if on_log is not None:
                on_log(step + 1, metrics)
    model.eval()
    return metrics
