"""``agentrl sft CONFIG [key=value ...] [--output-dir DIR]``: a supervised warm start.

Why it exists: RL on a tool task needs a policy that already emits well-formed tool calls some
of the time. This command turns a ``kind: sft`` config into such a policy: it loads (or builds)
the model, loads (or generates) chat conversations, runs :func:`agentrl.training.sft.train_sft`
and writes a model directory that ``transformers``, vLLM and ``agentrl train`` load.

Guarantees:

- The output directory holds the weights (``save_pretrained``, safetensors), the tokenizer and
  its chat template, the resolved config (``sft_config.yaml``) and ``sft_manifest.json``: the
  config, seed, steps, final loss, wall time, torch/transformers versions and the sha256 of
  every weight file, so a checkpoint can be checked against the run that made it.
- Deterministic for the config on a given machine and thread count (seeded model build, data
  generation, data order and optimizer). The thread count comes from the run's thread plan
  (:func:`agentrl.threads.make_plan`: SFT is one process, so it gets every usable CPU), unless
  ``AGENTRL_THREADS`` (or the older ``AGENTRL_SFT_THREADS``) says otherwise; it is applied
  before training starts and recorded in the manifest.
- Metrics go to the configured tracker (MLflow by default; ``tracking.enabled=false`` skips it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "load_sft_data", "run", "run_sft", "sha256_weights"]

MANIFEST = "sft_manifest.json"
"""Name of the manifest file written next to the weights."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", help="a `kind: sft` YAML config (e.g. configs/sft_calculator.yaml)"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides, e.g. trainer.total_steps=10 tracking.enabled=false",
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        help="where to write the model, tokenizer and manifest (default: trainer.output_dir)",
    )


def sha256_weights(model_dir: str | Path) -> dict[str, str]:
    """``{file name: sha256 hex}`` of every ``*.safetensors`` file in ``model_dir``."""
    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        out[path.name] = h.hexdigest()
    return out


def load_sft_data(cfg: Any) -> list[dict[str, Any]]:
    """Conversations from ``data.train_files`` (JSONL), else the built-in ``data.generator``."""
    from agentrl.training.sft import load_conversations

    if cfg.data.train_files:
        rows: list[dict[str, Any]] = []
        for path in cfg.data.train_files:
            rows.extend(load_conversations(path))
        return rows
    if cfg.data.generator == "calculator":
        from agentrl.rollout.calculator_task import generate_sft_conversations

        kwargs = dict(cfg.data.generator_kwargs)
        kwargs.setdefault("n", 2048)
        kwargs.setdefault("seed", cfg.data.seed)
        try:
            return generate_sft_conversations(**kwargs)
        except TypeError as e:
            raise ValueError(
                f"data.generator_kwargs {kwargs!r} do not fit the calculator generator ({e}); "
                "use n, seed, tool_fraction, min_digits, max_digits, ops, schema_free_fraction"
            ) from None
    if cfg.data.generator is None:
        raise ValueError("no SFT data: set data.train_files or data.generator (e.g. calculator)")
    raise ValueError(
        f"data.generator = {cfg.data.generator!r} is unknown; use 'calculator' or null"
    )


def _tiny_merges(tiny: Any, conversations: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The tiny tokenizer's BPE merges, learned from the first ``tiny.bpe_corpus_size``
    conversations rendered by its own chat template (none when ``tiny.bpe_merges`` is 0)."""
    if tiny.bpe_merges == 0:
        return []
    from agentrl.inference.tiny_model import build_tiny_tokenizer, learn_bpe_merges

    byte_tokenizer = build_tiny_tokenizer()
    texts = [
        byte_tokenizer.apply_chat_template(c["messages"], tools=c.get("tools"), tokenize=False)
        for c in conversations[: tiny.bpe_corpus_size]
    ]
    return learn_bpe_merges(texts, tiny.bpe_merges, tiny.bpe_max_token_bytes)


def _apply_threads() -> int:
    """Apply SFT's share of the thread plan (the whole machine: it runs alone); returns it.

    Call before torch is imported: ``OMP_WAIT_POLICY=PASSIVE`` (unless set) makes idle OpenMP
    threads sleep instead of spin, and OpenMP reads it once, at load. On a CPU shared with
    other work, spinning threads were measured 7-10x slower per step than one thread (load 5-10
    on 2 cores); passive ones matched it.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from agentrl.threads import ENV_THREADS, ProcessThreads, make_plan

    for name in (ENV_THREADS, "AGENTRL_SFT_THREADS"):
        raw = os.environ.get(name)
        if raw:
            try:
                share = ProcessThreads("sft", max(1, int(raw)))
            except ValueError:
                raise ValueError(f"{name}={raw!r}: give a whole number of threads") from None
            break
    else:
        share = make_plan(0).trainer
    share.apply()
    return share.threads


def _load_model(cfg: Any, conversations: list[Any]) -> tuple[Any, Any, str, dict[str, Any] | None]:
    """The model to train (``model.path``, else the tiny model built on the spot), its tokenizer,
    the device it is on and the SFT manifest it was made with (None for a fresh model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_path = cfg.model.path
        if model_path is None:
            from agentrl.inference.tiny_model import build_tiny_model

            tiny = cfg.model.tiny
            model_path = str(
                build_tiny_model(
                    Path(tmp) / "init",
                    num_layers=tiny.num_layers,
                    hidden_size=tiny.hidden_size,
                    num_heads=tiny.num_heads,
                    num_kv_heads=tiny.num_kv_heads,
                    intermediate_size=tiny.intermediate_size,
                    seed=tiny.seed,
                    merges=_tiny_merges(tiny, conversations),
                )
            )
        init_manifest = None
        if (Path(model_path) / MANIFEST).is_file():
            init_manifest = json.loads((Path(model_path) / MANIFEST).read_text())
        tokenizer = AutoTokenizer.from_pretrained(
            model_path, trust_remote_code=cfg.model.trust_remote_code
        )
        device = cfg.trainer.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = cfg.model.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device == "cuda" else "float32"
        # Any: transformers' stubs type .to() on the generate mixin, not on nn.Module.
        model: Any = AutoModelForCausalLM.from_pretrained(
            model_path,
            dtype=getattr(torch, dtype),
            trust_remote_code=cfg.model.trust_remote_code,
        )
        model.to(device)
    return model, tokenizer, device, init_manifest


def _settings(cfg: Any, num_conversations: int) -> Any:
    """The :class:`~agentrl.training.sft.SFTSettings` of ``cfg`` (``trainer.epochs`` sets the
    number of steps when given)."""
    from agentrl.training.sft import SFTSettings

    steps = cfg.trainer.total_steps
    if cfg.trainer.epochs is not None:
        steps = max(1, math.ceil(cfg.trainer.epochs * num_conversations / cfg.data.batch_size))
    return SFTSettings(
        steps=steps,
        batch_size=cfg.data.batch_size,
        lr=cfg.trainer.lr,
        weight_decay=cfg.trainer.weight_decay,
        betas=tuple(cfg.trainer.betas),
        warmup_steps=cfg.trainer.warmup_steps,
        schedule=cfg.trainer.lr_schedule,
        grad_clip=cfg.trainer.grad_clip,
        seed=cfg.trainer.seed,
        max_seq_len=cfg.data.max_seq_len,
        log_every=cfg.tracking.log_every,
        share_prefix=cfg.trainer.share_prefix,
        micro_batch_max_tokens=cfg.trainer.micro_batch_max_tokens,
    )


def run_sft(cfg: Any, output_dir: str | Path) -> dict[str, Any]:
    """Train per ``cfg`` (an :class:`~agentrl.config.SFTConfig`), save to ``output_dir`` and
    return the manifest (also written as ``sft_manifest.json``)."""
    if cfg.data.train_on != "assistant":
        raise ValueError(
            f"data.train_on = {cfg.data.train_on!r} is not supported by agentrl sft; use 'assistant'"
        )
    threads = _apply_threads()  # before torch loads OpenMP
    import torch
    import transformers

    from agentrl.tracking import tracker_for
    from agentrl.training.sft import train_sft

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    conversations = load_sft_data(cfg)
    model, tokenizer, device, init_manifest = _load_model(cfg, conversations)
    settings = _settings(cfg, len(conversations))
    steps = settings.steps
    tracker = tracker_for(cfg)
    status = "FAILED"
    try:
        tracker.log_params(cfg.flatten())

        def on_log(step: int, metrics: dict[str, float]) -> None:
            tracker.log_metrics(metrics, step)
            line = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
            print(f"[sft] step {step}/{steps} {line}", flush=True)

        t_train = time.perf_counter()
        final = train_sft(model, tokenizer, conversations, settings, on_log=on_log)
        train_s = time.perf_counter() - t_train

        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        (out / "sft_config.yaml").write_text(cfg.to_yaml())
        manifest = {
            "command": "agentrl sft",
            "config": cfg.model_dump(mode="json"),
            "seed": cfg.trainer.seed,
            "steps": steps,
            "batch_size": settings.batch_size,
            "num_conversations": len(conversations),
            "final_loss": final.get("sft/loss"),
            "final_loss_ema": final.get("sft/loss_ema"),
            "train_wall_s": round(train_s, 1),
            "total_wall_s": round(time.perf_counter() - t_start, 1),
            "num_params": sum(p.numel() for p in model.parameters()),
            "device": device,
            "torch_threads": threads,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "python_version": platform.python_version(),
            "weights_sha256": sha256_weights(out),
        }
        if init_manifest is not None:
            # Provenance of a multi-stage recipe: the manifest of the checkpoint we started from.
            manifest["init_manifest"] = init_manifest
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        tracker.log_metrics({"sft/train_wall_s": train_s}, steps)
        if cfg.tracking.enabled:
            tracker.log_artifact(out / MANIFEST)
            tracker.log_artifact(out / "sft_config.yaml")
        status = "FINISHED"
        return manifest
    finally:
        tracker.finish(status)


def run(args: argparse.Namespace) -> int:
    from agentrl.config import load_sft_config

    cfg = load_sft_config(args.config, args.overrides)
    out = args.output_dir or cfg.trainer.output_dir
    manifest = run_sft(cfg, out)
    summary = {k: manifest[k] for k in ("steps", "final_loss", "train_wall_s", "weights_sha256")}
    print(json.dumps({"output_dir": str(out), **summary}))
    return 0
