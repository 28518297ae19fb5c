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
  scheduler and the step counter: a resumed run continues the critic exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from agentrl.algos import masked_mean, masked_var, value_loss
from agentrl.batch import merge_micro_batches, split_by_token_budget
from agentrl.training.actor import (
    OptimizerSettings,
    lr_factor,
    optimizer_settings,
    resolve_device,
    resolve_dtype,
)

__all__ = ["Critic", "CriticConfig", "load_backbone", "value_metrics"]


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


class Critic:
    """V(s_t) for every response token: an LM backbone + ``nn.Linear(hidden, 1)``, with AdamW.

    Use: ``values = critic.compute_values(batch)`` before the advantages, then
    ``critic.update(batch)`` once ``batch`` holds ``values``, ``returns`` and ``response_mask``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: CriticConfig,
        *,
        device: str,
        dtype: str,
        trust_remote_code: bool,
    ) -> None:
        self.config = config
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.backbone = load_backbone(
            model_dir, device=self.device, dtype=self.dtype, trust_remote_code=trust_remote_code
        )
        # Dropout stays off, in the update too (as for the actor): the update's first pass
        # reproduces the batch's `values`, so the clipped loss starts unclipped.
        self.backbone.eval()
        hidden = int(self.backbone.config.hidden_size)
        self.value_head = nn.Linear(hidden, 1).to(self.device)  # float32 on every device
        with torch.no_grad():
            self.value_head.weight.zero_()
            self.value_head.bias.zero_()
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
        return [*self.backbone.parameters(), *self.value_head.parameters()]

    # ---- forward ------------------------------------------------------------------------
    def _forward(self, mb: TensorDict) -> torch.Tensor:
        """Values ``[b, R]`` float32 at the positions that predict each response token."""
        prompt_len = mb["prompts"].shape[1]
        resp_len = mb["responses"].shape[1]
        hidden = self.backbone(
            input_ids=mb["input_ids"].to(self.device),
            attention_mask=mb["attention_mask"].to(self.device),
            position_ids=mb["position_ids"].to(self.device),
            use_cache=False,
        ).last_hidden_state
        hidden = hidden[:, prompt_len - 1 : prompt_len - 1 + resp_len].float()
        return self.value_head(hidden).squeeze(-1)

    def _micro_batches(self, batch: TensorDict) -> tuple[list[TensorDict], list[list[int]]]:
        return split_by_token_budget(batch, max(1, self.config.micro_batch_max_tokens))

    @torch.no_grad()
    def compute_values(self, batch: TensorDict) -> torch.Tensor:
        """V(s_t) of every response token, ``[B, T]`` float32 on CPU (0 where ``response_mask`` is 0).

        ``batch`` is the trainer's batch (``prompts`` [B, P] left-padded, ``responses`` [B, T]
        right-padded, ``input_ids``/``attention_mask``/``position_ids`` [B, P + T]).
        """
        resp_len = batch["responses"].shape[1]
        micro, indices = self._micro_batches(batch)
        outputs = [self._forward(mb).cpu() for mb in micro]
        if not outputs:
            return torch.zeros(0, resp_len)
        values = merge_micro_batches(outputs, indices, width=resp_len)
        return values * batch["response_mask"].float()

    # ---- update -------------------------------------------------------------------------
    def update(self, batch: TensorDict) -> dict[str, float]:
        """Clipped value-loss epochs over mini-batches; one optimizer step per mini-batch.

        ``batch`` must hold ``values`` [B, T] (this critic's predictions when the batch was
        collected), ``returns`` [B, T] (the GAE targets) and ``response_mask`` [B, T].

        Returns ``critic/vf_loss`` (mean per mini-batch), ``critic/vf_clipfrac``,
        ``critic/vpred_mean`` (masked mean of the predictions seen by the update),
        ``critic/grad_norm`` (before clipping) and ``critic/lr`` (after the schedule step).
        """
        for key in ("values", "returns", "response_mask"):
            if key not in batch:
                raise KeyError(
                    f"Critic.update: the batch has no {key!r}; compute values with "
                    "compute_values and returns with compute_advantage('gae', ...) first"
                )
        c = self.config
        n = batch.batch_size[0]
        mini = c.mini_batch_size or n
        resp_width = batch["responses"].shape[1]
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        vpred_sum = 0.0
        vpred_tokens = 0.0
        for _ in range(c.ppo_epochs):
            for start in range(0, n, mini):
                mb_full = batch[start : start + mini]
                mask = mb_full["response_mask"].float()
                global_tokens = mask.sum().item()
                global_seqs = (mask.sum(dim=1) > 0).sum().item()
                self.optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                clip_tokens = 0.0
                for mb in self._micro_batches(mb_full)[0]:
                    vpreds = self._forward(mb)
                    m = mb["response_mask"].to(self.device).float()
                    loss, metrics = value_loss(
                        vpreds,
                        mb["returns"].to(self.device),
                        mb["values"].to(self.device),
                        m,
                        cliprange_value=c.cliprange_value,
                        loss_agg_mode=c.loss_agg_mode,
                        global_tokens=global_tokens,
                        global_seqs=global_seqs,
                        loss_scale_factor=float(resp_width),
                    )
                    loss.backward()
                    loss_sum += loss.item()
                    tokens = m.sum().item()
                    clip_tokens += metrics["vf_clipfrac"] * tokens
                    vpred_sum += float((vpreds.detach() * m).sum())
                    vpred_tokens += tokens
                self._acc(sums, counts, "critic/vf_loss", loss_sum)
                self._acc(sums, counts, "critic/vf_clipfrac", clip_tokens / max(global_tokens, 1.0))
                grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters(), c.grad_clip)
                if not torch.isfinite(grad_norm):
                    self.optimizer.zero_grad(set_to_none=True)
                    self._acc(sums, counts, "critic/skipped_nonfinite_grad", 1.0)
                else:
                    self.optimizer.step()
                self._acc(sums, counts, "critic/grad_norm", float(grad_norm))
        self.scheduler.step()
        self.global_step += 1
        out = {k: sums[k] / counts[k] for k in sums}
        out["critic/vpred_mean"] = vpred_sum / max(vpred_tokens, 1.0)
        out["critic/lr"] = float(self.scheduler.get_last_lr()[0])
        return out

    @staticmethod
    def _acc(sums: dict[str, float], counts: dict[str, int], key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + float(value)
        counts[key] = counts.get(key, 0) + 1

    # ---- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.backbone.state_dict(),
            "value_head": self.value_head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "global_step": self.global_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.backbone.load_state_dict(state["model"])
        self.value_head.load_state_dict(state["value_head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["global_step"])
