"""The ``trainer`` sections: optimizer and schedule (shared), the RL loop and the SFT loop."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agentrl.config.section import Section

__all__ = ["OptimizerFields", "SFTTrainerConfig", "TrainerConfig"]


class OptimizerFields(Section):
    """Optimizer and schedule fields shared by the RL and SFT trainers."""

    total_steps: int = Field(default=20, ge=1)
    """Optimizer steps to train for."""
    lr: float = Field(default=1e-5, gt=0.0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(default=1.0, gt=0.0)
    """Max global gradient norm."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""
    micro_batch_max_tokens: int = Field(default=4096, ge=1)
    """Token budget of one forward/backward micro-batch (dynamic batch size)."""
    seed: int = 0
    """Seed of model init, dropout and sampling on the trainer side."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Trainer device; auto = cuda when available, else cpu."""
    output_dir: str = "outputs/run"
    """Directory for checkpoints, the resolved config and local artifacts."""


class TrainerConfig(OptimizerFields):
    """The RL trainer loop."""

    val_every: int = Field(default=0, ge=0)
    """Also validate every N steps during training (0 = only before and after training)."""
    val_before_train: bool = True
    """Validate once before the first step (the baseline of the run)."""
    val_n: int = Field(default=1, ge=1)
    """Samples per validation task (the N of mean_at_N, best/worst/maj_at_k, pass_at_k)."""
    val_temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature of validation episodes (0 = greedy; use > 0 with val_n > 1)."""
    val_k: list[int] | None = None
    """pass_at_k sizes (null = 1, 2, 4, ..., val_n); each in 1..val_n."""
    val_bootstrap_samples: int = Field(default=1000, ge=1)
    """Bootstrap subsets per task and subset size (best/worst/maj_at_k) and task resamples of the CI."""
    val_seed: int = 0
    """Seed of the validation bootstrap."""
    val_at_end: bool = True
    """Validate once after the last step."""
    save_every: int = Field(default=0, ge=0)
    """Save a checkpoint every N steps (0 = only at the end)."""
    max_staleness: int = Field(default=1, ge=0)
    """η: rollouts may run this many versions ahead of the trainer (0 = synchronous on-policy)."""
    staleness_warmup_steps: int = Field(default=0, ge=0)
    """Ramp η up from 0 over the first N steps (bound at version v: min(η, ⌊v·η/N⌋)); 0 = η from the start."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each batch."""
    mini_batch_size: int | None = Field(default=None, ge=1)
    """Tasks per optimizer step within a batch (batch_size / mini_batch_size updates per batch); null = data.batch_size (one update per batch)."""
    critic_lr: float = Field(default=1e-5, gt=0.0)
    """Critic learning rate (GAE only)."""
    critic_warmup_steps: int = Field(default=0, ge=0)
    """Steps that train only the critic before the actor starts (GAE only)."""
    critic_micro_batch_max_tokens: int | None = Field(default=None, ge=1)
    """Critic token budget per micro-batch (GAE only; null = trainer.micro_batch_max_tokens)."""
    max_failed_episode_share: float = Field(default=0.1, ge=0.0, le=1.0)
    """A finished run exits 1 when more than this share of its episodes failed (a reward, an agent or a worker raised); see docs/training.md."""
    world_size: int = Field(default=1, ge=1)
    """Data-parallel trainer ranks (FSDP2 shards actor, reference and critic; rank 0 runs the loop); see docs/distributed.md."""
    share_prompts: bool = True
    """Run each distinct prompt of a micro-batch once and its samples' responses on its KV cache (the same log-probs and gradients up to float rounding; about half the update's tokens for GRPO on an agent prompt); needs sdpa/eager attention and no sliding window, else off, logged; composes with gradient_checkpointing and FSDP2 (a prompt's rows train on one rank); see docs/training.md."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (actor and critic; less memory, about one more forward per update); see docs/training.md."""
    cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state of the FSDP2 shards in host memory (the optimizer step runs on CPU; trains through the FSDP2 path even with world_size 1); see docs/training.md."""
    log_grad_noise: bool = False
    """Log `grad_noise/*` (McCandlish's gradient noise scale) from the actor's micro-batch gradients: one more copy of the gradients; one rank (world_size 1) only; see docs/tracking.md."""


class SFTTrainerConfig(OptimizerFields):
    """The supervised trainer loop."""

    epochs: int | None = None
    """Passes over the data; None = stop after `total_steps`."""
    share_prefix: bool = False
    """Run each batch's common loss-free prefix (e.g. a long tools prompt) once, without gradient."""
