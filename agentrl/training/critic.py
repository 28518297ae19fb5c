"""The value model for GAE: a causal LM's backbone plus a scalar value head, and its update.

Why it exists: ``algorithm.adv_estimator: gae`` needs V(s_t) for every response token, and PPO
needs those values to be learned from the returns it computes (Schulman et al. 2017,
arXiv:1707.06347; the value head on an LM backbone as in verl's critic and InstructGPT).

Position convention (the same as :meth:`agentrl.training.actor.FrozenPolicy.compute_log_probs`):
the value of response token ``t`` is read at the position that *predicts* token ``t`` (the last
prompt token for ``t = 0``), i.e. V of the state before the token is sampled.

Guarantees:

- Any local Hugging Face causal-LM directory loads: ``AutoModel`` takes the base model (no LM
  head) from the causal LM's weights; a backbone weight missing from the directory is an error,
  not a silent random init.
- The value head ``nn.Linear(hidden, 1)`` starts at zero (V ≡ 0 before the first update, so the
  first GAE advantages are the whitened discounted returns), is float32 on every device, and
  reads the backbone's last hidden state in float32.
- Micro-batches are packed by a token budget and trimmed; the loss is aggregated with the
  *mini-batch's* token/sequence counts, so gradient accumulation gives the full mini-batch
  gradient whatever the packing (as the actor does).
- ``state_dict()`` / ``load_state_dict()`` cover the backbone, the head, the optimizer, the LR
  scheduler and the step counter: a resumed run continues the critic exactly (under FSDP2 each
  rank saves and loads its own shard).
- ``Critic(..., dist=DistContext)`` shards backbone + value head with FSDP2; its values and its
  update equal the single-process ones up to float summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict
from torch import nn

from agentrl.algos import value_loss
from agentrl.batch import check_batch, split_by_token_budget
from agentrl.training.actor import (
    OptimizerSettings,
    lr_factor,
    merge_rank_rows,
    optimizer_settings,
    rank_micro_batches,
    resolve_device,
    resolve_dtype,
)
from agentrl.training.memory import checkpoint_decoder_layers

if TYPE_CHECKING:
    from agentrl.training.fsdp import DistContext

__all__ = ["Critic", "CriticConfig", "ValueModel", "load_backbone"]


@dataclass
class CriticConfig(OptimizerSettings):
    """The optimizer and loss settings of the critic (:meth:`from_config`)."""

    cliprange_value: float

    @classmethod
    def from_config(cls, cfg: Any) -> CriticConfig:
        """From an ``ExperimentConfig`` (its own LR and micro-batch budget, the actor's rest)."""
        t = cfg.trainer
        micro = t.critic_micro_batch_max_tokens or t.micro_batch_max_tokens
        return cls(
            **optimizer_settings(cfg, lr=t.critic_lr, micro_batch_max_tokens=micro),
            cliprange_value=cfg.algorithm.cliprange_value,
        )


def load_backbone(
    model_dir: str | Path, *, device: torch.device, dtype: torch.dtype, trust_remote_code: bool
) -> Any:
    """The base model (``AutoModel``) of a causal-LM directory on ``device``.

    The causal LM's head weights are expected to be left over; a *missing* backbone weight
    raises, naming the keys (it would otherwise be randomly initialised without a word).
    """
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    # The load report lists `lm_head.weight` as unexpected (we drop the LM head on purpose);
    # we check the loading info ourselves below instead of printing that report.
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModel.from_pretrained(
            str(model_dir),
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(previous)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ValueError(
            f"critic backbone from {model_dir}: weights missing from the checkpoint: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}; point model.path at a "
            "Hugging Face causal-LM directory whose base model matches its config"
        )
    module: Any = model  # transformers' stubs mistype .to() on pretrained models
    return module.to(device)


class ValueModel(nn.Module):
    """The critic as one module: an LM backbone and its value head, so that FSDP2 shards them
    as one root (the forward must enter through the root for its hooks to gather the weights)."""

    def __init__(self, backbone: Any, value_head: nn.Linear) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = value_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        prompt_len: int,
        resp_len: int,
    ) -> torch.Tensor:
        """Values ``[b, resp_len]`` float32 at the positions that predict each response token
        (inputs ``[b, prompt_len + resp_len]``)."""
        hidden = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        hidden = hidden[:, prompt_len - 1 : prompt_len - 1 + resp_len].float()
        # a copy, not a view: FSDP2's pre-backward hook must stay on the module's output
        return self.value_head(hidden).squeeze(-1).clone()


class Critic:
    """V(s_t) for every response token: an LM backbone + ``nn.Linear(hidden, 1)``, with AdamW.

    Use: ``values = critic.compute_values(batch)`` before the advantages, then
    ``critic.update(batch)`` once ``batch`` holds ``values``, ``returns`` and ``response_mask``.

    With ``dist`` (a :class:`~agentrl.training.fsdp.DistContext`) backbone and value head are
    loaded on CPU and sharded with FSDP2 as one module onto ``dist.device`` (the head computes in
    float32 whatever the mixed precision); ``compute_values``, ``update`` and
    ``full_state_dict`` are then collectives (every rank calls them with the same batch), and
    the update is the single-process full-batch update (token-balanced rows, global normalizers,
    padding micro-batches, as the actor's).
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: CriticConfig,
        *,
        device: str,
        dtype: str,
        trust_remote_code: bool,
        dist: DistContext | None = None,
    ) -> None:
        self.config = config
        self.dist = dist
        if dist is not None:
            device = "cpu"  # load whole on CPU, shard onto the device
            dtype = "float32" if dtype == "auto" else dtype
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.backbone = load_backbone(
            model_dir, device=self.device, dtype=self.dtype, trust_remote_code=trust_remote_code
        )
        hidden = int(self.backbone.config.hidden_size)
        self.value_head = nn.Linear(hidden, 1).to(self.device)  # float32 on every device
        with torch.no_grad():
            self.value_head.weight.zero_()
            self.value_head.bias.zero_()
        self.module = ValueModel(self.backbone, self.value_head)
        if config.gradient_checkpointing:  # before sharding: FSDP2 renames the layer classes
            checkpoint_decoder_layers(self.backbone)
        if dist is not None:
            dist.shard(self.module, layers_of=self.backbone, float32_units=[self.value_head])
            self.device = dist.device
        # Dropout stays off, in the update too (as for the actor): the update's first pass
        # reproduces the batch's `values`, so the clipped loss starts unclipped.
        self.module.eval()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, self.config)
        )
        self.global_step = 0

    def parameters(self) -> list[nn.Parameter]:
        """The backbone's parameters, then the value head's."""
        return list(self.module.parameters())

    # ---- forward ------------------------------------------------------------------------
    def _forward(self, mb: TensorDict) -> torch.Tensor:
        """Values ``[b, R]`` float32 at the positions that predict each response token."""
        return self.module(
            mb["input_ids"].to(self.device),
            mb["attention_mask"].to(self.device),
            mb["position_ids"].to(self.device),
            mb["prompts"].shape[1],
            mb["responses"].shape[1],
        )

    def _micro_batches(self, batch: TensorDict) -> tuple[list[TensorDict], list[list[int]]]:
        return split_by_token_budget(batch, max(1, self.config.micro_batch_max_tokens))

    @torch.no_grad()
    def compute_values(self, batch: TensorDict) -> torch.Tensor:
        """V(s_t) of every response token, ``[B, T]`` float32 on CPU (0 where ``response_mask`` is 0).

        ``batch`` is the trainer's batch (``prompts`` [B, P] left-padded, ``responses`` [B, T]
        right-padded, ``input_ids``/``attention_mask``/``position_ids`` [B, P + T]). Under
        ``dist`` each rank computes its share (a collective).
        """
        n, resp_len = batch.batch_size[0], batch["responses"].shape[1]
        micro, rows = rank_micro_batches(batch, self.config.micro_batch_max_tokens, self.dist)
        outputs, kept = [], []
        for mb, ix in zip(micro, rows, strict=True):
            values = self._forward(mb)  # padding micro-batches still run the collectives
            if ix:
                outputs.append(values)
                kept.append(ix)
        values = merge_rank_rows(outputs, kept, n, resp_len, self.dist)
        return values * batch["response_mask"].float()

    # ---- update -------------------------------------------------------------------------
    def update(self, batch: TensorDict) -> dict[str, float]:
        """Clipped value-loss epochs over mini-batches; one optimizer step per mini-batch.

        ``batch`` must hold ``values`` [B, T] (this critic's predictions when the batch was
        collected), ``returns`` [B, T] (the GAE targets) and ``response_mask`` [B, T].

        Returns ``critic/vf_loss`` (mean per mini-batch), ``critic/vf_clipfrac``,
        ``critic/vpred_mean`` (masked mean of the predictions seen by the update),
        ``critic/grad_norm`` (before clipping), ``critic/lr`` (after the schedule step) and
        ``critic/skipped_all_masked`` (1.0 when no mini-batch had a valid token: then nothing,
        weights, optimizer or schedule, changed);
        under ``dist`` the same numbers as one process on the whole batch.
        """
        check_batch(batch, "Critic.update", require=("values", "returns"))
        c = self.config
        n = batch.batch_size[0]
        mini = c.mini_batch_size or n
        # this rank's sums of vf_loss, clipped-token fraction, predictions and predicted tokens
        totals = [0.0, 0.0, 0.0, 0.0]
        grad_norms: list[float] = []
        outcomes: list[str] = []
        for _ in range(c.ppo_epochs):
            for start in range(0, n, mini):
                norm, outcome = self._mini_batch_step(batch[start : start + mini], totals)
                grad_norms.append(norm)
                outcomes.append(outcome)
        if "stepped" in outcomes:  # an update that changed nothing does not advance the LR
            self.scheduler.step()
            self.global_step += 1
        if self.dist is not None:
            totals = self.dist.sum_over_ranks(totals)
        n_mini = len(grad_norms)
        out = {
            "critic/vf_loss": totals[0] / n_mini,
            "critic/vf_clipfrac": totals[1] / n_mini,
            "critic/grad_norm": sum(grad_norms) / n_mini,
        }
        if "nonfinite" in outcomes:
            out["critic/skipped_nonfinite_grad"] = 1.0
        out["critic/skipped_all_masked"] = float(all(o == "empty" for o in outcomes))
        out["critic/vpred_mean"] = totals[2] / max(totals[3], 1.0)
        out["critic/lr"] = float(self.scheduler.get_last_lr()[0])
        return out

    def _mini_batch_step(self, mb_full: TensorDict, totals: list[float]) -> tuple[float, str]:
        """Accumulate one mini-batch's value-loss gradient over its micro-batches (this rank's
        rows under ``dist``), clip, step; add to ``totals``; the pre-clip gradient norm and
        ``"stepped"``, or why not: ``"nonfinite"`` (gradient) or ``"empty"`` (no valid token:
        AdamW's momentum alone would still move the weights)."""
        c = self.config
        width = float(mb_full["responses"].shape[1])
        if self.dist is None:
            mask = mb_full["response_mask"].float()
            norm = (mask.sum().item(), (mask.sum(dim=1) > 0).sum().item())
            micro, rows = self._micro_batches(mb_full)
            loss_scale = 1.0
        else:
            plan = self.dist.plan_mini_batch(mb_full, max(1, c.micro_batch_max_tokens))
            norm = (plan.global_tokens, plan.global_seqs)
            micro, rows, loss_scale = plan.micro, plan.rows, plan.loss_scale
        self.optimizer.zero_grad(set_to_none=True)
        for mb, ix in zip(micro, rows, strict=True):
            padding = not ix  # data-parallel only: keeps the ranks' collectives in step
            vpreds = self._forward(mb)
            m = mb["response_mask"].to(self.device).float()
            loss, metrics = value_loss(
                vpreds,
                mb["returns"].to(self.device),
                mb["values"].to(self.device),
                m,
                cliprange_value=c.cliprange_value,
                loss_agg_mode=c.loss_agg_mode,
                global_tokens=norm[0],
                global_seqs=norm[1],
                loss_scale_factor=width,
            )
            if self.dist is not None:
                (loss * (0.0 if padding else loss_scale)).backward()
            else:
                loss.backward()
            if padding:
                continue
            tokens = m.sum().item()
            totals[0] += loss.item()
            totals[1] += metrics["vf_clipfrac"] * tokens / max(norm[0], 1.0)
            totals[2] += float((vpreds.detach() * m).sum())
            totals[3] += tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters(), c.grad_clip)
        if self.dist is not None:
            from agentrl.training.fsdp import full_tensor

            grad_norm = full_tensor(grad_norm)  # a replicated DTensor under FSDP2
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return float(grad_norm), "nonfinite"
        if norm[0] == 0:
            self.optimizer.zero_grad(set_to_none=True)
            return float(grad_norm), "empty"
        self.optimizer.step()
        return float(grad_norm), "stepped"

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Backbone and head weights as whole CPU tensors (``backbone.*``, ``value_head.*``);
        under ``dist`` a collective that gathers them on rank 0 (``{}`` on the other ranks)."""
        if self.dist is not None:
            from agentrl.training.fsdp import full_state_dict_for_push

            return full_state_dict_for_push(self.module)
        return {k: v.detach().to("cpu").clone() for k, v in self.module.state_dict().items()}

    # ---- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Backbone, head, optimizer, scheduler and step, to resume exactly; under ``dist`` this
        rank's shard (``DTensor`` entries), loadable only by the same rank of the same world size."""
        return {
            "model": self.backbone.state_dict(),
            "value_head": self.value_head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "global_step": self.global_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.backbone.load_state_dict(state["model"])
        self.value_head.load_state_dict(state["value_head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["global_step"])
