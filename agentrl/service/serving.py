"""What the rollout service serves with: servers, pool, CheckpointEngine, tokenizer, rewards.

The service and the trainer must build these from a config the same way (DESIGN section 10:
"it builds its servers, pool, engine and manager through the same builder as the trainer").
The shared builder is ``agentrl.training.build.build_serving``; until it exists this module
carries :func:`_build_serving`, a stand-in of exactly its shape assembled from the pieces the
trainer uses today (``Trainer._start_servers``, ``ServerPool``, ``CheckpointEngine``,
``RewardManager.from_config``, ``build_toolset``).

MERGE NOTE (for the lead): replace the body of :func:`build_serving` below with
``from agentrl.training.build import build_serving`` and delete :func:`_build_serving`; the
service only uses the attributes listed on :class:`Serving`.

Shutdown order (leaving the context): close the pool and control clients -> close the reward
manager -> stop the servers this builder started (external servers are left running).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

from agentrl.config import ExperimentConfig
from agentrl.inference.pool import ServerPool
from agentrl.rollout.manager import AdmissionController, AgentLoopManager, WorkerConfig
from agentrl.rollout.rewards import RewardManager
from agentrl.training.checkpoint_engine import CheckpointEngine
from agentrl.types import SamplingParams

__all__ = ["Serving", "build_serving", "with_sampling"]

logger = logging.getLogger(__name__)


class Serving(Protocol):
    """What ``build_serving`` yields (the attributes the service uses)."""

    pool: ServerPool
    engine: CheckpointEngine
    tokenizer: Any
    model_dir: Path
    server_urls: list[str]
    version: int
    rewards: RewardManager

    def make_manager(
        self,
        *,
        admission: AdmissionController | None = None,
        temperature: float | None = None,
        n_samples: int = 1,
    ) -> AgentLoopManager: ...


@dataclasses.dataclass
class _Serving:
    cfg: ExperimentConfig
    pool: ServerPool
    engine: CheckpointEngine
    tokenizer: Any
    model_dir: Path
    server_urls: list[str]
    version: int
    rewards: RewardManager
    _tools: Callable[[], Any]

    def make_manager(
        self,
        *,
        admission: AdmissionController | None = None,
        temperature: float | None = None,
        n_samples: int = 1,
    ) -> AgentLoopManager:
        """An AgentLoopManager over the pool with the config's tools, rewards and workers.

        ``n_samples`` is accepted for the shared builder's signature; the service passes the
        group size to ``stream`` instead.
        """
        del n_samples
        inf = self.cfg.inference
        sampling = SamplingParams(
            max_tokens=inf.max_tokens_per_turn,
            temperature=inf.temperature if temperature is None else temperature,
            top_p=inf.top_p,
            top_k=inf.top_k,
        )
        return AgentLoopManager(
            self.pool,
            self.tokenizer,
            tools=self._tools(),
            reward=self.rewards,
            config=WorkerConfig.from_config(self.cfg.agent, sampling),
            num_workers=self.cfg.rollout.num_workers,
            max_concurrency=self.cfg.rollout.max_concurrency,
            admission=admission,
        )


def with_sampling(manager: AgentLoopManager, **overrides: Any) -> AgentLoopManager:
    """Apply sampling overrides (``temperature``, ``top_p``, ``top_k``, ``max_tokens``) to
    every in-process worker of ``manager``; ``None`` values keep the worker's setting."""
    update = {k: v for k, v in overrides.items() if v is not None}
    if not update:
        return manager
    for worker in manager.workers:
        cfg = worker.config
        worker.config = dataclasses.replace(cfg, sampling=cfg.sampling.model_copy(update=update))
    return manager


def _model_dir(cfg: ExperimentConfig) -> Path:
    if cfg.model.path:
        return Path(cfg.model.path)
    from agentrl.inference.tiny_model import build_tiny_model

    target = Path(cfg.trainer.output_dir) / "tiny-model"
    if not (target / "config.json").exists():
        build_tiny_model(target, seed=cfg.trainer.seed)
    return target


def _start_servers(
    cfg: ExperimentConfig, model_dir: Path, stack: contextlib.ExitStack
) -> list[str]:
    """As ``Trainer._start_servers``: embedded or vLLM subprocesses, or the external URLs."""
    inf = cfg.inference
    if inf.backend == "external":
        if not inf.urls:
            raise ValueError("inference.backend=external needs inference.urls (server base URLs)")
        return list(inf.urls)
    from agentrl.training.trainer import thread_plan

    logs = Path(cfg.trainer.output_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    plan = thread_plan(cfg)
    urls = []
    for i in range(inf.num_servers):
        if inf.backend == "embedded":
            from agentrl.inference.server import launch_embedded_server

            handle: Any = launch_embedded_server(
                model_dir,
                log_path=logs / f"server-{i}.log",
                env=plan.servers[i].env(),
                extra_args=[
                    "--max-batch-size",
                    str(inf.max_batch_size),
                    "--seed",
                    str(cfg.trainer.seed + i),
                ],
            )
        else:
            from agentrl.inference.vllm_backend import launch_vllm_server

            handle = launch_vllm_server(
                model_dir,
                python=inf.vllm_python,
                log_path=logs / f"vllm-{i}.log",
                seed=cfg.trainer.seed + i,
                extra_args=inf.vllm_extra_args,
            )
        stack.callback(handle.stop)
        urls.append(handle.base_url)
    return urls


@contextlib.asynccontextmanager
async def _build_serving(cfg: ExperimentConfig) -> AsyncIterator[_Serving]:
    """Stand-in for ``agentrl.training.build.build_serving`` (see the module docstring)."""
    from transformers import AutoTokenizer

    from agentrl.inference.client import PolicyClient
    from agentrl.training.checkpoint_engine import make_transport
    from agentrl.training.trainer import build_toolset

    model_dir = _model_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with contextlib.ExitStack() as servers:
        urls = _start_servers(cfg, model_dir, servers)
        async with contextlib.AsyncExitStack() as stack:
            pool = ServerPool(
                urls,
                health_check_interval_s=cfg.inference.health_check_interval_s,
                timeout_s=cfg.inference.request_timeout_s,
            )
            stack.push_async_callback(pool.aclose)
            pool.start()
            control = [PolicyClient(u, timeout_s=cfg.checkpoint.push_timeout_s) for u in urls]
            for c in control:
                stack.push_async_callback(c.aclose)
            # No shared_dir configured: a private tmpfs directory per service (removed at exit),
            # so two services or a service and a trainer never share staged weights.
            transport = make_transport(cfg.checkpoint.transport, cfg.checkpoint.shared_dir)
            remove = getattr(transport, "remove", None)
            if cfg.checkpoint.shared_dir is None and callable(remove):
                stack.callback(remove)
            engine = CheckpointEngine(
                control,
                transport,
                pause_mode=(
                    "abort"
                    if "abort" in (cfg.rollout.partial_rollout, cfg.checkpoint.pause_mode)
                    else "keep"
                ),
                verify=cfg.checkpoint.verify,
                verify_tolerance=cfg.checkpoint.verify_tolerance,
                probe_tokens=cfg.checkpoint.probe_tokens,
                temperature=cfg.inference.temperature or 1.0,
                push_timeout_s=cfg.checkpoint.push_timeout_s,
            )
            versions = [await c.weight_version() for c in control]
            rewards = RewardManager.from_config(cfg.reward)
            stack.callback(rewards.close)
            yield _Serving(
                cfg=cfg,
                pool=pool,
                engine=engine,
                tokenizer=tokenizer,
                model_dir=model_dir,
                server_urls=urls,
                version=max(versions),
                rewards=rewards,
                _tools=lambda: build_toolset(cfg),
            )


def build_serving(cfg: ExperimentConfig) -> contextlib.AbstractAsyncContextManager[Any]:
    """The shared builder: servers, pool, engine, tokenizer and manager factory for ``cfg``."""
    return _build_serving(cfg)
