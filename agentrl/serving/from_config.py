"""The :class:`~agentrl.serving.spec.ServerSpec` of every server a run starts, from its config.

Why it exists: the policy servers of a local run, the Ray server actors and the model rewards'
servers (``reward.models``) are all described here, by one function, so a flag the policy
server gets (``--enable-lora``, ``--trust-remote-code``, its thread share) cannot be forgotten
by another caller. Callers differ only in where the server runs (``host``), where it logs and
which thread plan gives its share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrl.serving.spec import Backend, Role, ServerSpec
from agentrl.threads import ProcessThreads, ThreadPlan

__all__ = ["served_model", "spec_for"]


def spec_for(
    cfg: Any,
    role: Role = "policy",
    *,
    index: int = 0,
    name: str | None = None,
    model: str | Path | None = None,
    plan: ThreadPlan | None = None,
    log_dir: str | Path | None = None,
    api_key: str | None = None,
    host: str = "127.0.0.1",
) -> ServerSpec:
    """Server ``index`` of ``role`` in the resolved config ``cfg`` (an ``ExperimentConfig``).

    ``role="policy"`` serves ``model`` (the run's model directory, required) with
    ``inference.*`` and ``model.lora``; ``reward_model`` / ``judge`` serve
    ``reward.models.<name>``. ``plan`` gives an embedded server its thread share (None = the
    server sizes itself); ``log_dir`` names its log file (None = a temporary file).
    """
    if role == "policy":
        if model is None:
            raise ValueError("spec_for(role='policy') needs model= (the run's model directory)")
        return _policy(cfg, Path(model), index, plan, log_dir, api_key, host)
    if role == "teacher":
        return _teacher(cfg, index, plan, log_dir, api_key, host)
    if name is None:
        raise ValueError(f"spec_for(role={role!r}) needs name= (a key of reward.models)")
    return _model_reward(cfg, role, name, index, plan, log_dir, api_key, host)


def served_model(cfg: Any) -> str | None:
    """The model name rollouts ask the policy servers for: vLLM serves a LoRA run's adapter
    under its own name (:data:`~agentrl.inference.lora.VLLM_LORA_NAME`); None = the default."""
    if cfg.model.lora.rank > 0 and cfg.inference.backend == "vllm":
        from agentrl.inference.lora import VLLM_LORA_NAME

        return VLLM_LORA_NAME
    return None


def _spec(
    cfg: Any,
    *,
    backend: Backend,
    role: Role,
    model: Path,
    i: int,
    threads: tuple[ProcessThreads, ...],
    thread_index: int,
    log_path: Path | None,
    vllm_extra_args: list[str],
    host: str,
    api_key: str | None,
    **fields: Any,
) -> ServerSpec:
    """What every server's spec shares: an embedded server gets the run's device and dtype and
    its share of the thread plan (``threads[thread_index]``), a vLLM one its extra arguments;
    seed ``trainer.seed + i``."""
    embedded = backend == "embedded"
    device, dtype = _device(cfg) if embedded else (None, None)
    return ServerSpec(
        backend=backend,
        model=model,
        role=role,
        device=device,
        dtype=dtype,
        seed=cfg.trainer.seed + i,
        threads=_nth(threads if embedded else (), thread_index),
        startup_timeout_s=cfg.inference.startup_timeout_s,
        log_path=log_path,
        host=host,
        python=cfg.inference.vllm_python,
        extra_args=() if embedded else tuple(vllm_extra_args),
        api_key=api_key,
        **fields,
    )


def _policy(
    cfg: Any,
    model: Path,
    i: int,
    plan: ThreadPlan | None,
    log_dir: str | Path | None,
    api_key: str | None,
    host: str,
) -> ServerSpec:
    inf, lora = cfg.inference, cfg.model.lora
    return _spec(
        cfg,
        backend=inf.backend,
        role="policy",
        model=model,
        i=i,
        threads=plan.servers if plan is not None else (),
        thread_index=i,
        log_path=_log(log_dir, f"server-{i}" if inf.backend == "embedded" else f"vllm-{i}"),
        # colocated mode sleeps the policy servers around each update (vLLM: opt in at launch)
        vllm_extra_args=[*inf.vllm_extra_args]
        + (["--enable-sleep-mode"] if cfg.distributed.colocate else []),
        host=host,
        api_key=api_key,
        max_batch_size=inf.max_batch_size,
        prefix_cache_mb=inf.prefix_cache_mb,
        lora=lora.rank > 0,
        max_lora_rank=max(8, lora.rank),
        trust_remote_code=cfg.model.trust_remote_code,
    )


def _model_reward(
    cfg: Any,
    role: Role,
    name: str,
    i: int,
    plan: ThreadPlan | None,
    log_dir: str | Path | None,
    api_key: str | None,
    host: str,
) -> ServerSpec:
    from agentrl.rollout.model_rewards import model_path

    m = _reward_entry(cfg, role, name)
    return _spec(
        cfg,
        backend=m.backend,
        role=role,
        model=model_path(name, m, cfg.base_dir),
        i=i,
        threads=plan.reward_servers if plan is not None else (),
        thread_index=_reward_share(cfg, name) + i,
        log_path=_log(
            log_dir, f"reward-{name}-{i}" if m.backend == "embedded" else f"reward-{name}-vllm-{i}"
        ),
        vllm_extra_args=m.vllm_extra_args,
        host=host,
        api_key=api_key,
        # vLLM sizes a model reward's batches itself; the embedded server takes the run's.
        max_batch_size=cfg.inference.max_batch_size if m.backend == "embedded" else None,
    )


def _teacher(
    cfg: Any,
    i: int,
    plan: ThreadPlan | None,
    log_dir: str | Path | None,
    api_key: str | None,
    host: str,
) -> ServerSpec:
    """Server ``i`` of the distillation teacher (``teacher``); an embedded one takes the thread
    share after the embedded model rewards' (:func:`agentrl.rollout.teacher.local_teacher_servers`)."""
    from agentrl.rollout.model_rewards import local_model_servers
    from agentrl.rollout.teacher import teacher_path

    t = cfg.teacher
    return _spec(
        cfg,
        backend=t.backend,
        role="teacher",
        model=teacher_path(cfg),
        i=i,
        threads=plan.reward_servers if plan is not None else (),
        thread_index=local_model_servers(cfg) + i,
        log_path=_log(log_dir, f"teacher-{i}" if t.backend == "embedded" else f"teacher-vllm-{i}"),
        vllm_extra_args=t.vllm_extra_args,
        host=host,
        api_key=api_key,
        max_batch_size=cfg.inference.max_batch_size if t.backend == "embedded" else None,
    )


def _reward_entry(cfg: Any, role: Role, name: str) -> Any:
    """``reward.models.<name>``, checked to be a launchable ``role``."""
    models = cfg.reward.models
    if name not in models:
        raise KeyError(f"reward.models has no {name!r}; it has {sorted(models)}")
    m = models[name]
    if m.type != role:
        raise ValueError(f"reward.models.{name}.type is {m.type!r}, not {role!r}")
    if m.backend == "external":
        raise ValueError(f"reward.models.{name}.backend is 'external': its urls need no launch")
    return m


def _reward_share(cfg: Any, name: str) -> int:
    """The first thread share of ``reward.models.<name>``: the plan gives the embedded model
    rewards' servers one share each, in config order."""
    before = 0
    for other, m in cfg.reward.models.items():
        if other == name:
            return before
        if m.backend == "embedded":
            before += m.num_servers
    return before


def _nth(shares: tuple[ProcessThreads, ...], i: int) -> ProcessThreads | None:
    return shares[i] if i < len(shares) else None


def _device(cfg: Any) -> tuple[str, str]:
    from agentrl.inference.server import embedded_device

    return embedded_device(cfg)


def _log(log_dir: str | Path | None, stem: str) -> Path | None:
    return None if log_dir is None else Path(log_dir) / f"{stem}.log"
