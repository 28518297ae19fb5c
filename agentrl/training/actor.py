"""The trainable policy: log-probs of response tokens, and the PPO-style update.

Why it exists: the trainer's correctness hinges on computing exactly the quantity the inference
servers report. :meth:`Actor.compute_log_probs` uses the servers' convention (DESIGN section 3):
log-softmax of ``logits / temperature`` at the position *before* each response token, no
top-k/top-p mask.

Guarantees:

- Micro-batches are packed by a token budget (``micro_batch_max_tokens``) and trimmed to their
  own padded length; losses are aggregated with the *mini-batch's* token/sequence counts, so
  gradient accumulation gives the full mini-batch gradient whatever the packing; the loss's
  diagnostics (``actor/ppo_kl``, clip fractions, ...) are token-weighted means over the batch,
  so they do not depend on the packing either (nor on the number of ranks).
- Mixed precision (docs/design.md): float32 on CPU; with a half ``dtype`` (``auto`` on GPU)
  the trainable actor keeps float32 master weights and computes under bf16 autocast (FSDP2:
  its ``MixedPrecisionPolicy``), LoRA keeps the frozen base in the half dtype; logits are
  always upcast to float32 before the log-softmax, for the loss and for the log-probs the
  correction compares with the servers'; the push sends the servers' dtype.
- Any local Hugging Face causal-LM directory loads (``AutoModelForCausalLM``).
- ``state_dict_for_push()`` returns contiguous CPU tensors under the Hugging Face parameter
  names, so the same file serves the embedded server and vLLM's ``reload_weights``.
- ``Actor(..., dist=DistContext)`` and ``FrozenPolicy(..., dist=...)`` (optional;
  :mod:`agentrl.training.fsdp`) hold one FSDP2 shard per rank: every log-prob pass, update,
  weight gather and save is then a collective (every rank calls it with the same arguments;
  :mod:`agentrl.training.ranks` makes the follower ranks do so), and the update gives the
  single-process full-batch gradient. Without ``dist`` nothing changes.
- ``gradient_checkpointing`` (``trainer.gradient_checkpointing``) gives the same log-probs,
  loss and gradients with less activation memory (:mod:`agentrl.training.memory`).
- ``share_prompts`` (``trainer.share_prompts``) runs each distinct prompt of a micro-batch once
  and gives the same log-probs, loss and gradients up to float rounding
  (:mod:`agentrl.training.shared_prompts`); the first shared micro-batch is checked against
  the plain forward, and sharing turns off, with a warning, if they differ.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from agentrl.algos import (
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    logits_disagreement,
    logprobs_from_logits,
)
from agentrl.batch import (
    check_batch,
    merge_micro_batches,
    prompt_group_rows,
    prompt_groups,
    split_by_prompt_groups,
    split_by_token_budget,
)
from agentrl.training.memory import checkpoint_decoder_layers
from agentrl.training.shared_prompts import (
    group_leaders,
    shared_prompt_logits,
    sharing_blocker,
)
from correction import CorrectionConfig, ProximalMethod, apply_correction, loglinear_proximal

if TYPE_CHECKING:
    from agentrl.training.fsdp import DistContext

logger = logging.getLogger(__name__)

__all__ = [
    "Actor",
    "ActorConfig",
    "FrozenPolicy",
    "OptimizerSettings",
    "lr_factor",
    "merge_rank_rows",
    "optimizer_settings",
    "rank_micro_batches",
]


@dataclass
class OptimizerSettings:
    """What the actor and the critic are both trained with: AdamW, the LR schedule
    (:func:`lr_factor`), token-budget micro-batches, PPO epochs and mini-batches, and the loss
    aggregation mode. No defaults here: :func:`optimizer_settings` fills them from the config
    (``agentrl.config`` is the only home of defaults)."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float
    warmup_steps: int
    total_steps: int
    lr_schedule: str
    micro_batch_max_tokens: int
    ppo_epochs: int
    mini_batch_size: int | None
    """Rows per optimizer step (None = the whole batch)."""
    loss_agg_mode: str
    gradient_checkpointing: bool
    """Recompute decoder-layer activations in backward (:mod:`agentrl.training.memory`)."""


def optimizer_settings(cfg: Any, *, lr: float, micro_batch_max_tokens: int) -> dict[str, Any]:
    """The :class:`OptimizerSettings` fields of an ``ExperimentConfig`` (rows = tasks x samples)."""
    t = cfg.trainer
    return {
        "lr": lr,
        "weight_decay": t.weight_decay,
        "betas": (float(t.betas[0]), float(t.betas[1])),
        "grad_clip": t.grad_clip,
        "warmup_steps": t.warmup_steps,
        "total_steps": t.total_steps,
        "lr_schedule": t.lr_schedule,
        "micro_batch_max_tokens": micro_batch_max_tokens,
        "ppo_epochs": t.ppo_epochs,
        "mini_batch_size": (t.mini_batch_size or cfg.data.batch_size) * cfg.data.n_samples,
        "loss_agg_mode": cfg.algorithm.loss_agg_mode,
        "gradient_checkpointing": t.gradient_checkpointing,
    }


@dataclass
class ActorConfig(OptimizerSettings):
    """The optimizer and loss settings the actor needs (:meth:`from_config`)."""

    temperature: float
    loss: Callable[..., tuple[torch.Tensor, dict[str, float]]]
    """The policy loss (an ``agentrl.training.algorithm.LossVariant``, or any callable with
    :func:`agentrl.algos.policy_loss`'s signature minus the name)."""
    entropy_coeff: float
    kl_loss_coef: float | None
    """β of the KL(π_θ || π_ref) loss term; None = no KL loss."""
    kl_loss_type: str
    lora: Any = None
    """The ``model.lora`` section when LoRA is on (rank > 0), else None: full fine-tuning."""
    grad_noise: bool = False
    """Log ``grad_noise/*`` from each mini-batch's micro-batch gradients (one rank only)."""
    share_prompts: bool = False
    """Run each distinct prompt of a micro-batch once (:mod:`agentrl.training.shared_prompts`)."""

    @classmethod
    def from_config(cls, cfg: Any, plan: Any) -> ActorConfig:
        """From an ``ExperimentConfig`` and its ``AlgorithmPlan``."""
        t = cfg.trainer
        return cls(
            **optimizer_settings(cfg, lr=t.lr, micro_batch_max_tokens=t.micro_batch_max_tokens),
            temperature=cfg.inference.temperature or 1.0,
            loss=plan.loss,
            entropy_coeff=plan.entropy_coeff,
            kl_loss_coef=plan.kl_loss_coef,
            kl_loss_type=plan.kl_loss_type,
            lora=cfg.model.lora if cfg.model.lora.rank > 0 else None,
            grad_noise=t.log_grad_noise,
            share_prompts=t.share_prompts,
        )


class _NoiseProbe:
    """:class:`~agentrl.training.metrics.MicroBatchGradProbe` over one mini-batch, sized in the
    units the loss averages over: tokens (``token-mean``) or sequences (the ``seq-mean`` modes),
    each micro-batch's loss scaled by its share of the mini-batch's total."""

    def __init__(self, model: Any, per_token: bool, total: float) -> None:
        from agentrl.training.metrics import MicroBatchGradProbe

        self.probe = MicroBatchGradProbe(model.parameters())
        self.per_token = per_token
        self.total = total

    def record(self, mb: TensorDict) -> None:
        """After the micro-batch's backward."""
        mask = mb["response_mask"].float()
        size = float(mask.sum()) if self.per_token else float((mask.sum(dim=1) > 0).sum())
        if size > 0:
            self.probe.record(size, size / self.total)

    def metrics(self) -> dict[str, float]:
        """``grad_noise/*`` (:func:`~agentrl.training.metrics.compute_gradient_noise_metrics`;
        nothing with fewer than two micro-batches)."""
        from agentrl.training.metrics import compute_gradient_noise_metrics

        p = self.probe
        return compute_gradient_noise_metrics(p.sq_norms, p.sizes, p.total_sq_norm())


def _noise_probe(
    model: Any, config: ActorConfig, local: bool, norm: tuple[Any, Any]
) -> _NoiseProbe | None:
    """A gradient-noise probe for this mini-batch when asked for, on one process, with
    something to learn from (``norm``: the mini-batch's token and sequence counts)."""
    per_token = config.loss_agg_mode == "token-mean"
    total = float(norm[0] if per_token else norm[1])
    if not (config.grad_noise and local and total > 0):
        return None
    return _NoiseProbe(model, per_token, total)


def lr_factor(step: int, c: Any) -> float:
    """LR multiplier at ``step``: linear warmup over ``c.warmup_steps``, then ``c.lr_schedule``
    (constant, or cosine to 0 at ``c.total_steps``). Shared by the actor and the critic."""
    if c.warmup_steps > 0 and step < c.warmup_steps:
        return (step + 1) / c.warmup_steps
    if c.lr_schedule == "constant":
        return 1.0
    if c.lr_schedule == "cosine":
        span = max(1, c.total_steps - c.warmup_steps)
        progress = min(1.0, (step - c.warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"trainer.lr_schedule={c.lr_schedule!r}; use 'constant' or 'cosine'")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            dtype
        ]
    except KeyError:
        raise ValueError(
            f"model.dtype={dtype!r}; use 'auto', 'float32', 'bfloat16' or 'float16'"
        ) from None


def load_causal_lm(
    model_dir: str | Path, *, device: torch.device, dtype: torch.dtype, trust_remote_code: bool
) -> Any:
    """``AutoModelForCausalLM`` on ``device`` (typed Any: transformers' stubs are partial)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, trust_remote_code=trust_remote_code
    )
    module: Any = model  # transformers' stubs mistype .to() on pretrained models
    return module.to(device)


def rank_micro_batches(
    batch: TensorDict, max_tokens: int, dist: DistContext | None, share_prompts: bool = False
) -> tuple[list[TensorDict], list[list[int]]]:
    """The micro-batches this process runs for a forward-only pass over ``batch``, and the batch
    rows of each: all rows packed by ``max_tokens`` (one process; a prompt's rows together with
    ``share_prompts``), or this rank's token-balanced share (``dist``; an empty row list marks a
    padding micro-batch that only keeps the ranks' collectives in step)."""
    if dist is None:
        split = split_by_prompt_groups if share_prompts else split_by_token_budget
        return split(batch, max(1, max_tokens))
    plan = dist.plan_mini_batch(batch, max(1, max_tokens), share_prompts)
    return plan.micro, plan.rows


def merge_rank_rows(
    outputs: list[torch.Tensor],
    rows: list[list[int]],
    n_rows: int,
    width: int,
    dist: DistContext | None,
) -> torch.Tensor:
    """Per-micro-batch results ``[b_i, T_i]`` as one ``[n_rows, width]`` float32 CPU tensor;
    under ``dist`` every rank's rows (a collective: every rank gets the whole result)."""
    if dist is not None:
        return dist.merge_rows(outputs, rows, n_rows=n_rows, width=width)
    if not outputs:
        return torch.zeros(n_rows, width)
    return merge_micro_batches([o.cpu() for o in outputs], rows, width=width)


def _prompt_reuse(mb: TensorDict) -> tuple[float, float]:
    """The share of a micro-batch's prompt tokens that a shared forward does not recompute, and
    its prompt tokens (the weight of ``actor/prompt_tokens_reused``)."""
    p_len = mb["prompts"].shape[1]
    mask = mb["attention_mask"][:, :p_len]
    total = float(mask.sum())
    groups = prompt_groups(mb["prompts"], mask)
    if groups is None or total == 0:
        return 0.0, total
    return (total - float(mask[group_leaders(groups)].sum())) / total, total


class FrozenPolicy:
    """A causal LM used only for log-probs: the reference policy for KL, and the base of Actor.

    With ``dist`` (a :class:`~agentrl.training.fsdp.DistContext`, one process per device) the
    model is loaded on CPU (float32 master weights when ``dtype="auto"``) and sharded with
    FSDP2 onto ``dist.device`` (``device`` is then ignored); each rank scores its token-balanced
    share of a batch and every rank gets the whole result, so every rank must call the log-prob
    methods with the same batch (they are collectives).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        temperature: float,
        micro_batch_max_tokens: int,
        device: str,
        dtype: str,
        trust_remote_code: bool,
        dist: DistContext | None = None,
        gradient_checkpointing: bool = False,
        float32_master: bool = False,
        share_prompts: bool = False,
    ) -> None:
        self.dist = dist
        self.push_dtype = resolve_dtype(dtype, dist.device if dist else resolve_device(device))
        """The dtype the servers run (``model.dtype`` on the device): what the push sends."""
        self.autocast: torch.dtype | None = None
        """Compute dtype over float32 master weights (``float32_master``), else None."""
        if dist is not None:
            # Load whole on CPU, shard onto the device: no rank ever holds the full model there.
            device = "cpu"
            dtype = "float32" if dtype == "auto" else dtype
        self.temperature = temperature
        self.micro_batch_max_tokens = micro_batch_max_tokens
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if float32_master and dist is None and self.dtype != torch.float32:
            self.autocast, self.dtype = self.dtype, torch.float32
        self.model = load_causal_lm(
            model_dir, device=self.device, dtype=self.dtype, trust_remote_code=trust_remote_code
        )
        if gradient_checkpointing:  # before sharding: FSDP2 renames the layer classes
            checkpoint_decoder_layers(self.model)
        if dist is not None:
            self.model = dist.shard(self.model)
            self.device = dist.device
        # Dropout off: the recomputed π_old must equal the π_θ of the first update step.
        self.model.eval()
        self._keep_all_logits = False
        """True once the model refused ``logits_to_keep`` (a custom model)."""
        self.share_prompts = share_prompts and self._can_share()
        """Each distinct prompt of a micro-batch runs once (:mod:`.shared_prompts`)."""
        self._share_checked = False
        """True once a shared micro-batch was compared with the plain forward."""
        self._ranks_share = False
        """Under FSDP2: the (mini-)batch being run repeats a prompt, so every rank's micro-batches
        run the shared forward (set per pass by :meth:`_plan_sharing`, the same on every rank)."""

    def _plan_sharing(self, batch: TensorDict) -> None:
        """Before a pass over ``batch`` (which every rank holds whole under FSDP2): whether the
        ranks run the shared forward for it."""
        self._ranks_share = (
            self.dist is not None and self.share_prompts and prompt_group_rows(batch) is not None
        )

    def _can_share(self) -> bool:
        """Whether this model can run shared prompts (says why not, once)."""
        why = sharing_blocker(self.model)
        if why is not None and (self.dist is None or self.dist.is_main):
            logger.info("trainer.share_prompts: every row runs its whole prompt: %s", why)
        return why is None

    # ---- forward ------------------------------------------------------------------------
    def _forward(
        self, mb: TensorDict, *, with_entropy: bool, with_sum_pi_squared: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[b, R]`` of the micro-batch's response tokens, and the entropy (or, with
        ``with_sum_pi_squared``, Σ_v π(v)²) ``[b, R]`` at each position."""
        input_ids = mb["input_ids"].to(self.device)
        attention_mask = mb["attention_mask"].to(self.device)
        position_ids = mb["position_ids"].to(self.device)
        responses = mb["responses"].to(self.device)
        resp_len = responses.shape[1]  # input_ids = cat(prompts, responses)
        with self._compute():
            logits = self._predict_logits(input_ids, attention_mask, position_ids, resp_len)
        logits = logits.float()
        logp = logprobs_from_logits(logits, responses, temperature=self.temperature)
        extra = None
        if with_sum_pi_squared:
            z = logits / self.temperature
            extra = torch.exp(torch.logsumexp(2 * z, dim=-1) - 2 * torch.logsumexp(z, dim=-1))
        elif with_entropy:
            extra = entropy_from_logits(logits / self.temperature)
        return logp, extra

    def _predict_logits(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, resp_len: int
    ) -> torch.Tensor:
        """Logits ``[b, R, V]`` predicting each response token: each distinct prompt run once
        when prompts are shared and the micro-batch repeats one, else each row whole."""
        p_len = input_ids.shape[1] - resp_len
        groups = (
            prompt_groups(input_ids[:, :p_len], mask[:, :p_len]) if self.share_prompts else None
        )
        if groups is None and self._ranks_share:
            # FSDP2: every forward is a collective, so while the (mini-)batch repeats a prompt
            # every rank runs two per micro-batch, whether its own rows repeat one or not
            groups = torch.arange(input_ids.shape[0], device=input_ids.device)
        if groups is None:
            return self._response_logits(input_ids, mask, positions, resp_len)[
                :, -(resp_len + 1) : -1
            ]
        if self._share_checked:
            return shared_prompt_logits(self.model, input_ids, mask, positions, resp_len, groups)
        return self._checked_shared_logits(input_ids, mask, positions, resp_len, groups)

    def _checked_shared_logits(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        resp_len: int,
        groups: torch.Tensor,
    ) -> torch.Tensor:
        """The first shared micro-batch: its logits, compared with the plain forward's (no
        gradient); on a difference beyond float rounding, or an error, sharing turns off with a
        warning and the plain forward's logits (with gradient) are returned. Under FSDP2 every
        rank checks its first micro-batch and they decide together (a collective); an error
        there is raised (a rank that left the forward mid-way would leave the others waiting)."""
        self._share_checked = True
        try:
            shared = shared_prompt_logits(self.model, input_ids, mask, positions, resp_len, groups)
            with torch.no_grad():
                plain = self._response_logits(input_ids, mask, positions, resp_len)
            keep = mask[:, -resp_len:].bool()  # the valid response columns
            wanted = plain[:, -(resp_len + 1) : -1][keep]
            error = logits_disagreement(shared.detach()[keep], wanted, plain.dtype)
        except Exception as e:  # a model that takes no cache this way: the plain forward is right
            if self.dist is not None:
                raise
            error = f"{type(e).__name__}: {e}"
        if self.dist is not None:  # every rank calls this: the ranks decide together
            failed_anywhere = self.dist.any_rank(error is not None)
            if failed_anywhere and error is None:
                error = "another rank's check failed"
        if error is None:
            return shared
        logger.warning(
            "trainer.share_prompts: turned off (%s); every row runs its whole prompt", error
        )
        self.share_prompts = False
        return self._response_logits(input_ids, mask, positions, resp_len)[:, -(resp_len + 1) : -1]

    def _response_logits(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, resp_len: int
    ) -> torch.Tensor:
        """Logits ``[b, >= R + 1, V]`` of the last ``R + 1`` columns at least (those predicting
        the responses, and the last): the ``lm_head`` skips the prompt's columns
        (``logits_to_keep``) unless the model does not take it (then every column, as
        before)."""
        kwargs: dict[str, Any] = {} if self._keep_all_logits else {"logits_to_keep": resp_len + 1}
        try:
            return self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=False,
                **kwargs,
            ).logits
        except TypeError as e:
            if "logits_to_keep" not in str(e) or self._keep_all_logits:
                raise
            self._keep_all_logits = True  # a custom model without it: all columns from now on
            return self._response_logits(input_ids, mask, positions, resp_len)

    def _micro_batches(self, batch: TensorDict) -> tuple[list[TensorDict], list[list[int]]]:
        split = split_by_prompt_groups if self.share_prompts else split_by_token_budget
        return split(batch, max(1, self.micro_batch_max_tokens))

    def _compute(self) -> Any:
        """bf16/fp16 autocast over float32 master weights (``self.autocast``), else a no-op."""
        dtype = self.autocast or torch.float32
        return torch.autocast(self.device.type, dtype=dtype, enabled=self.autocast is not None)

    @torch.no_grad()
    def _score(
        self, batch: TensorDict, *, with_sum_pi_squared: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and Σ_v π(v)²) ``[B, R]`` of the whole batch, 0 on padding; under ``dist``
        each rank runs its share (padding micro-batches still run the collectives)."""
        was_training = self.model.training
        self.model.eval()
        n, resp_len = batch.batch_size[0], batch["responses"].shape[1]
        self._plan_sharing(batch)
        micro, rows = rank_micro_batches(
            batch, self.micro_batch_max_tokens, self.dist, self.share_prompts
        )
        logps, extras, kept = [], [], []
        for mb, ix in zip(micro, rows, strict=True):
            lp, extra = self._forward(
                mb, with_entropy=False, with_sum_pi_squared=with_sum_pi_squared
            )
            if ix:
                logps.append(lp)
                kept.append(ix)
                if extra is not None:
                    extras.append(extra)
        self.model.train(was_training)
        mask = batch["response_mask"].float()
        logp = merge_rank_rows(logps, kept, n, resp_len, self.dist) * mask
        if not with_sum_pi_squared:
            return logp, None
        return logp, merge_rank_rows(extras, kept, n, resp_len, self.dist) * mask

    def compute_log_probs(self, batch: TensorDict) -> torch.Tensor:
        """π of every response token under the current weights, ``[B, R]`` float32 (0 on
        padding); under ``dist`` a collective (every rank passes the same batch)."""
        return self._score(batch, with_sum_pi_squared=False)[0]

    def compute_log_probs_and_sum_pi_squared(
        self, batch: TensorDict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`compute_log_probs` and Σ_v π(v)² at every response position (``[B, R]``
        each; 0 on padding), in one forward pass (the optimal token baseline needs both)."""
        logp, spp = self._score(batch, with_sum_pi_squared=True)
        assert spp is not None  # requested above
        return logp, spp


_SUMMED_TERMS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss")
"""Loss terms aggregated with the mini-batch's normalizers: their micro-batch values add up."""


def wrap_lora(model: Any, lora: Any) -> Any:
    """``model`` with peft LoRA adapters on ``lora.target_modules`` (only they train).

    Dropout stays 0: the recomputed π_old must equal the π_θ of the first update step.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=list(lora.target_modules),
        lora_dropout=0.0,
        use_rslora=lora.use_rslora,
        bias="none",
    )
    return get_peft_model(model, config)


class _Stats:
    """Running (weighted) sums and weights of per-micro-batch metrics."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, key: str, value: float, weight: float = 1.0) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value) * weight
        self.counts[key] = self.counts.get(key, 0.0) + weight

    def add_terms(self, terms: dict[str, float], tokens: float) -> None:
        """One micro-batch's loss terms (summed) and diagnostics (weighted by its ``tokens``,
        so that they are token means over the mini-batch whatever the micro-batching, on any
        number of ranks)."""
        for key, value in terms.items():
            if key in _SUMMED_TERMS:
                self.add(key, value)
            else:
                self.add(key, value, tokens)


_FirstPass = tuple[list[torch.Tensor], list[list[int]]]
"""The epoch-0 log-probs of each micro-batch and the batch rows they belong to."""


class Actor(FrozenPolicy):
    """A Hugging Face causal LM with AdamW, warmup + constant/cosine LR, and the policy update.

    With ``dist`` (see :class:`FrozenPolicy`) every rank must also call :meth:`update`,
    :meth:`score_tokens`, :meth:`state_dict_for_push` and :meth:`save_pretrained` with the same
    arguments (they are collectives).
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: ActorConfig,
        *,
        device: str,
        dtype: str,
        trust_remote_code: bool,
        dist: DistContext | None = None,
    ) -> None:
        super().__init__(
            model_dir,
            temperature=config.temperature,
            micro_batch_max_tokens=config.micro_batch_max_tokens,
            device=device,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            dist=dist,
            gradient_checkpointing=config.gradient_checkpointing,
            # full fine-tuning: AdamW updates float32 weights (a bf16 weight would round a
            # small step away); LoRA keeps the frozen base in the serving dtype
            float32_master=config.lora is None,
            share_prompts=config.share_prompts,
        )
        self.config = config
        if config.lora is not None:
            self.model = wrap_lora(self.model, config.lora)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        self.global_step = 0

    # ---- learning-rate schedule ---------------------------------------------------------
    def _lr_lambda(self, step: int) -> float:
        return lr_factor(step, self.config)

    # ---- update -------------------------------------------------------------------------
    def update(self, batch: TensorDict) -> dict[str, float]:
        """PPO epochs over mini-batches; one optimizer step per mini-batch.

        ``batch`` must hold ``old_log_probs`` (π_old, or π_rollout in bypass mode),
        ``advantages``, ``response_mask`` (after rejection sampling) and optionally
        ``rollout_is_weights`` and ``ref_log_prob``.
        """
        return self.update_with_log_probs(batch)[0]

    def fuses_old_log_probs(self, num_rows: int) -> bool:
        """True when an update of ``num_rows`` rows is one optimizer step (one epoch, one
        mini-batch) in this process: π_old is then exactly the update's own first forward."""
        c = self.config
        return (
            self.dist is None and c.ppo_epochs == 1 and (c.mini_batch_size or num_rows) >= num_rows
        )

    def update_with_log_probs(
        self, batch: TensorDict, *, anchor: CorrectionConfig | None = None
    ) -> tuple[dict[str, float], torch.Tensor]:
        """:meth:`update`, also returning the first pass's log-probs ``[B, R]`` (detached).

        In bypass mode those are π_θ as the update first sees it (before the step for the first
        mini-batch; after the earlier mini-batches' steps for later ones), which the off-policy
        diagnostics use without an extra forward pass.

        With ``anchor`` (only where :meth:`fuses_old_log_probs`), ``batch`` holds no
        ``old_log_probs``: π_old is each micro-batch's own forward, detached (the weights have
        not moved yet), and the IS weights of ``anchor`` are computed per micro-batch from it
        and ``rollout_log_probs`` (row-local: no RS, no batch normalization). That saves the
        separate π_old pass, which computed the same numbers. With a ``loglinear`` anchor
        (``proximal='loglinear'``, any update shape) π_old is AReaL's approximation instead:
        π_rollout + ``prox_alpha`` · (π_θ − π_rollout), from each micro-batch's forward.

        An update in which no mini-batch took an optimizer step (every token masked, or a
        non-finite gradient) leaves the model, the optimizer (moments, step counts, learning
        rate) and the LR schedule exactly as they were; ``actor/skipped_all_masked`` is 1.0
        when every mini-batch had no valid token.
        """
        needs = ("advantages",) if anchor is not None else ("old_log_probs", "advantages")
        check_batch(batch, "Actor.update", require=needs)
        c = self.config
        n = batch.batch_size[0]
        mini = c.mini_batch_size or n
        loglinear = anchor is not None and anchor.proximal is ProximalMethod.LOGLINEAR
        if anchor is not None and not loglinear and not self.fuses_old_log_probs(n):
            raise ValueError("anchor= needs one optimizer step per batch (fuses_old_log_probs)")
        stats = _Stats()
        first: _FirstPass = ([], [])
        outcomes: list[str] = []
        for epoch in range(c.ppo_epochs):
            for start in range(0, n, mini):
                mb = batch[start : start + mini]
                outcomes.append(self._mini_batch_step(mb, start, epoch, stats, first, anchor))
        if "stepped" in outcomes:
            # The schedule counts optimizer updates (as Hugging Face's Trainer does when it
            # skips one): a step that changed nothing does not advance the learning rate.
            self.scheduler.step()
            self.global_step += 1
        sums, counts = stats.sums, stats.counts
        if self.dist is not None:
            sums, counts = self.dist.reduce_metric_sums(sums, counts)
        metrics = {k: sums[k] / counts[k] if counts[k] else 0.0 for k in sums}
        # pg_loss and entropy were accumulated per micro-batch with global normalizers: their
        # per-mini-batch value is the *sum* over micro-batches, so report sums per mini-batch.
        n_mini = c.ppo_epochs * math.ceil(n / mini)
        for key in _SUMMED_TERMS:
            if key in sums:
                metrics[key] = sums[key] / max(1, n_mini)
        metrics["actor/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["actor/skipped_all_masked"] = float(all(o == "empty" for o in outcomes))
        width = batch["responses"].shape[1]
        if self.dist is not None:
            merged = self.dist.merge_rows(first[0], first[1], n_rows=n, width=width)
        else:
            merged = merge_micro_batches(first[0], first[1], width=width)
        return metrics, merged * batch["response_mask"].float()

    def _mini_batch_step(
        self,
        mb_full: TensorDict,
        start: int,
        epoch: int,
        stats: _Stats,
        first: _FirstPass,
        anchor: CorrectionConfig | None = None,
    ) -> str:
        """Accumulate the gradient of one mini-batch over its micro-batches, then step; returns
        ``"stepped"``, or why not: ``"nonfinite"`` (gradient) or ``"empty"`` (no valid token)."""
        width = float(mb_full["responses"].shape[1])
        self.optimizer.zero_grad(set_to_none=True)
        self._plan_sharing(mb_full)
        if self.dist is None:
            mask = mb_full["response_mask"].float()
            norm = (mask.sum().item(), (mask.sum(dim=1) > 0).sum().item())
            micro, indices = self._micro_batches(mb_full)
            loss_scale = 1.0
        else:
            # this rank's rows; global normalizers; loss x world size (FSDP averages)
            plan = self.dist.plan_mini_batch(
                mb_full, max(1, self.micro_batch_max_tokens), self.share_prompts
            )
            norm = (plan.global_tokens, plan.global_seqs)
            micro, indices, loss_scale = plan.micro, plan.rows, plan.loss_scale
        probe = _noise_probe(self.model, self.config, self.dist is None, norm)
        for mb, rows in zip(micro, indices, strict=True):
            # a padding micro-batch (data-parallel only) keeps the ranks' collectives in step:
            # its loss counts 0 and it records nothing
            padding = not rows
            logp, entropy = self._forward(mb, with_entropy=True)
            if not padding:
                reused, prompt_tokens = _prompt_reuse(mb) if self.share_prompts else (0.0, 1.0)
                stats.add("actor/prompt_tokens_reused", reused, prompt_tokens)
            if epoch == 0 and not padding:
                first[0].append(logp.detach().cpu())
                first[1].append([start + r for r in rows])
            assert entropy is not None
            loss, terms = self._micro_loss(mb, logp, entropy, norm, width, anchor)
            if self.dist is not None:
                loss = loss * (0.0 if padding else loss_scale)
            loss.backward()
            if not padding:
                stats.add_terms(terms, float(mb["response_mask"].float().sum()))
            if probe is not None:
                probe.record(mb)
        if probe is not None:
            for key, value in probe.metrics().items():
                stats.add(key, value)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        if self.dist is not None:
            from agentrl.training.fsdp import full_tensor

            grad_norm = full_tensor(grad_norm)  # a replicated DTensor under FSDP2
        stats.add("actor/grad_norm", float(grad_norm))
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            stats.add("actor/skipped_nonfinite_grad", 1.0)
            return "nonfinite"
        if norm[0] == 0:
            # Nothing to learn from (rejection sampling masked every token; the count is
            # global under FSDP): AdamW's momentum alone would still move the weights.
            self.optimizer.zero_grad(set_to_none=True)
            stats.add("actor/skipped_empty_minibatch", 1.0)
            return "empty"
        self.optimizer.step()
        return "stepped"

    def _micro_loss(
        self,
        mb: TensorDict,
        logp: torch.Tensor,
        entropy: torch.Tensor,
        norm: tuple[Any, Any],
        width: float,
        anchor: CorrectionConfig | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Policy loss − entropy bonus + KL loss of one micro-batch, and its metric terms.

        Micro-batches are trimmed to their own width: the aggregation gets the mini-batch's
        token/sequence counts (``norm``) and one constant divisor for all of them (``width``,
        the batch's response width, for ``seq-mean-token-sum-norm``).
        """
        c = self.config
        m = mb["response_mask"].to(self.device).float()
        agg = {"global_tokens": norm[0], "global_seqs": norm[1], "loss_scale_factor": width}
        extra = {}
        if anchor is not None:  # π_old is this forward: the weights have not moved yet
            old = logp.detach()
            rollout = mb["rollout_log_probs"].to(self.device)
            if "prox_alpha" in mb:  # AReaL's log-linear π_old (proximal='loglinear')
                old = loglinear_proximal(rollout, old, mb["prox_alpha"].to(self.device)) * m
            if anchor.is_level is not None:
                weights = apply_correction(anchor, (old - rollout) * m, m).weights
                assert weights is not None
                extra["rollout_is_weights"] = weights
        else:
            old = mb["old_log_probs"].to(self.device)
            if "rollout_is_weights" in mb:
                extra["rollout_is_weights"] = mb["rollout_is_weights"].to(self.device)
        pg_loss, pg_metrics = c.loss(
            old,
            logp,
            mb["advantages"].to(self.device),
            m,
            loss_agg_mode=c.loss_agg_mode,
            **agg,
            **extra,
        )
        ent = agg_loss(entropy, m, c.loss_agg_mode, **agg)
        loss = pg_loss - c.entropy_coeff * ent if c.entropy_coeff else pg_loss
        terms = {"actor/pg_loss": pg_loss.item(), "actor/entropy": ent.item()}
        terms.update({f"actor/{k}": v for k, v in pg_metrics.items()})
        if c.kl_loss_coef is not None and "ref_log_prob" in mb:
            kl_mat = kl_penalty(logp, mb["ref_log_prob"].to(self.device), c.kl_loss_type)
            kl = agg_loss(kl_mat, m, c.loss_agg_mode, **agg)
            loss = loss + c.kl_loss_coef * kl
            terms["actor/kl_loss"] = kl.item()
        return loss, terms

    @torch.no_grad()
    def score_tokens(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """Log-probs of ``token_ids`` after ``prompt_ids`` by the servers' convention."""
        ids = torch.tensor([list(prompt_ids) + list(token_ids)], device=self.device)
        with self._compute():
            logits = self.model(input_ids=ids, use_cache=False).logits[0].float()
        p = len(prompt_ids)
        logits = logits[p - 1 : p - 1 + len(token_ids)]
        target = torch.tensor(token_ids, device=self.device)
        logp = logprobs_from_logits(logits[None], target[None], temperature=self.temperature)
        return [float(x) for x in logp[0].cpu()]

    # ---- weights ------------------------------------------------------------------------
    def state_dict_for_push(self) -> Any:
        """Hugging Face-named, contiguous CPU tensors (tied weights appear once); with LoRA, the
        adapter only (an ``agentrl.inference.lora.LoraAdapter``: A/B matrices and its spec).

        Under ``dist`` a collective: rank 0 gets the gathered full weights, other ranks ``{}``.
        """
        if self.config.lora is not None:
            from agentrl.inference.lora import LoraAdapter

            return LoraAdapter.from_peft(self.model)
        if self.dist is not None:
            from agentrl.training.fsdp import full_state_dict_for_push

            return full_state_dict_for_push(self.model, self.push_dtype)
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in self.model.state_dict().items():
            key = tensor.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            t = tensor.detach()
            t = t.to(self.push_dtype) if t.is_floating_point() else t
            out[name] = t.to("cpu").contiguous()
        return out

    def save_pretrained(self, out_dir: str | Path) -> None:
        """The model as a Hugging Face directory (safetensors); under ``dist`` a collective
        (the full weights are gathered and rank 0 writes them)."""
        if self.dist is None and self.config.lora is not None:
            # The adapter (peft layout) under adapter/, and the merged model beside it, so the
            # final model loads anywhere a plain Hugging Face model does.
            self.model.save_pretrained(str(Path(out_dir) / "adapter"), safe_serialization=True)
            merged = copy.deepcopy(self.model).merge_and_unload()
            merged.save_pretrained(str(out_dir), safe_serialization=True)
            return
        if self.dist is None:
            self.model.save_pretrained(str(out_dir), safe_serialization=True)
            return
        from agentrl.training.fsdp import full_state_dict_for_push

        full = full_state_dict_for_push(self.model)
        if self.dist.is_main:
            self.model.save_pretrained(str(out_dir), state_dict=full, safe_serialization=True)

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and step, to resume exactly; under ``dist`` this rank's
        shard (``DTensor`` entries), loadable only by the same rank of the same world size."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "global_step": self.global_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["global_step"])
