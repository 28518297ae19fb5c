"""Build what a run needs from its config, under one ``AsyncExitStack``: the only factory.

Why it exists: servers, the server pool, the CheckpointEngine, the agent-loop manager and the
models used to be built by the trainer for everyone (the Ray backend made a throw-away trainer to
call its private methods). Here each piece has one public builder, and two context managers
compose them:

- :func:`build_serving` — the inference side: the thread plan, the model directory, the
  tokenizer, the servers (embedded or vLLM; or the URLs of running ones), the ``ServerPool``, the
  ``CheckpointEngine``, the reward manager (with the servers of its model rewards, ``reward.models``,
  started alongside the policy servers) and ``make_manager()``. The trainer, ``agentrl eval``,
  the Ray backend and the rollout service (``agentrl serve``) all build through it.
- :func:`build_run` — serving plus the training side: the algorithm plan, the actor (and the
  reference and critic the plan needs), the task sets and the tracker. With
  ``trainer.world_size`` N > 1 the models are FSDP2-sharded over N trainer ranks: this process
  is rank 0, the followers start here (:func:`start_policies`, :mod:`agentrl.training.ranks`).

Guarantees:

- everything started is registered with the exit stack the moment it exists, so any failure
  after the first server starts (a second server failing its health check, a model that does
  not load) stops every server, every trainer rank and closes every client; nothing is
  orphaned;
- servers start in parallel with loading the models (start-up is the slower of the two, not
  their sum; ``timing_s/startup`` reports it);
- every process gets its share of the run's CPU-thread plan (:mod:`agentrl.threads`).

Example::

    async with build_run(cfg) as run:
        result = await train(run)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.config import ExperimentConfig
from agentrl.serving import served_model, start_model_servers, start_servers, start_teacher_servers
from agentrl.threads import ThreadPlan, make_plan
from agentrl.training.policies import load_policies
from agentrl.training.resolve import (
    Resolved,
    build_rewards,
    build_toolset,
    model_dir,
    resolve_experiment,
)

if TYPE_CHECKING:
    from agentrl.inference.pool import ServerPool
    from agentrl.rollout.rewards import RewardManager
    from agentrl.tracking import Tracker
    from agentrl.training.run_servers import RunServers
    from agentrl.training.step import Policies
    from agentrl.weightsync.engine import CheckpointEngine

__all__ = [
    "Run",
    "Serving",
    "build_run",
    "build_serving",
    "start_policies",
    "thread_plan",
    "worker_config",
]

logger = logging.getLogger(__name__)


def thread_plan(cfg: ExperimentConfig) -> ThreadPlan:
    """The run's CPU-thread plan: the trainer and each local embedded server (policy, and the
    model rewards' reward models and judges) get a share. A synchronous or colocated run's
    trainer and servers take turns, so the trainer's share is every CPU."""
    from agentrl.rollout.model_rewards import local_model_servers
    from agentrl.rollout.teacher import local_teacher_servers

    d, inf = cfg.distributed, cfg.inference
    return make_plan(
        inf.num_servers,
        cpus=d.cpus,
        trainer_threads=d.trainer_threads,
        server_threads=d.server_threads,
        pin=d.pin_cpus,
        server_nice=d.server_nice,
        # vLLM binds its own threads; external servers are not ours to size.
        external_servers=inf.backend != "embedded",
        reward_servers=local_model_servers(cfg) + local_teacher_servers(cfg),
        turns=cfg.trainer.max_staleness == 0 or d.colocate,
    )


def worker_config(
    cfg: ExperimentConfig, *, temperature: float | None = None, greedy_baseline: bool = False
) -> Any:
    """The agent-loop ``WorkerConfig`` of ``cfg`` (sampling, limits, parser, agents)."""
    from agentrl.rollout.manager import WorkerConfig
    from agentrl.types import SamplingParams

    inf = cfg.inference
    sampling = SamplingParams(
        max_tokens=inf.max_tokens_per_turn,
        temperature=inf.temperature if temperature is None else temperature,
        top_p=inf.top_p,
        top_k=inf.top_k,
    )
    from agentrl.training.resolve import agent_kwargs, default_agent

    return WorkerConfig.from_config(
        cfg.agent,
        sampling,
        default=default_agent(cfg),
        agent_kwargs=agent_kwargs(cfg),
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        overlong_prompts=cfg.data.overlong_prompts,
        greedy_sample_index=cfg.data.n_samples if greedy_baseline else None,
        base_dir=cfg.base_dir,
        overlong_buffer_len=cfg.reward.overlong_buffer_len,
        overlong_penalty_factor=cfg.reward.overlong_penalty_factor,
    )


@dataclass
class Serving:
    """The inference side of a run (see :func:`build_serving`)."""

    cfg: ExperimentConfig
    model_dir: Path
    tokenizer: Any
    server_urls: list[str]
    pool: ServerPool
    """The started server pool."""
    engine: CheckpointEngine
    """The checkpoint engine over every server."""
    rewards: RewardManager
    threads: ThreadPlan
    workers: list[Any] | None = None
    """Ready-made agent-loop workers (Ray actor adapters); None = in-process workers."""
    version: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    loaded: Any = None
    """What ``load_models`` returned (loaded while the servers started)."""
    handles: list[Any] = field(default_factory=list)
    """The :class:`~agentrl.inference.handle.ServerHandle` of each server this run launched, in
    the order of ``server_urls`` (empty for external servers or given URLs)."""
    api_key: str | None = None
    """The inference servers' bearer token (what a relaunched server must require too)."""

    def make_manager(
        self,
        *,
        admission: Any = None,
        temperature: float | None = None,
        greedy_baseline: bool = False,
    ) -> Any:
        """An ``AgentLoopManager`` over the pool with the config's tools, rewards and limits;
        with a ``temperature`` (validation, ``agentrl eval``) the teacher does not score."""
        import functools

        from agentrl.rollout.manager import AgentLoopManager

        rollout = self.cfg.rollout
        reward = self.rewards
        if temperature is not None and getattr(reward, "teacher", None) is not None:
            import copy

            reward = copy.copy(reward)  # held-out episodes are measured, not distilled
            reward.teacher = None
        return AgentLoopManager(
            self.pool,
            self.tokenizer,
            tools=functools.partial(build_toolset, self.cfg),
            reward=reward,
            config=worker_config(
                self.cfg, temperature=temperature, greedy_baseline=greedy_baseline
            ),
            num_workers=rollout.num_workers,
            max_concurrency=rollout.max_concurrency,
            admission=admission,
            workers=self.workers if temperature is None else None,
        )


@dataclass(kw_only=True)
class Run(Serving):
    """Serving plus the training side (see :func:`build_run`); every field is set by
    :func:`build_run` except ``tracker``, which the trainer attaches."""

    resolved: Resolved
    policies: Policies
    """The actor, and the reference and critic the algorithm needs."""
    output_dir: Path
    pad_token_id: int
    tracker: Tracker | None = None
    servers: RunServers | None = None
    """What watches the servers this run launched (set while training; None: pushes go to
    ``engine`` as it is)."""


def load_tokenizer(cfg: ExperimentConfig, path: Path) -> Any:
    """The model's tokenizer (``model.trust_remote_code`` honoured); it must have a pad token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=cfg.model.trust_remote_code)
    if tok.pad_token_id is None:
        raise ValueError(f"model.path: the tokenizer of {path} has no pad token; set one")
    return tok


def server_api_key(cfg: ExperimentConfig, *, launching: bool) -> str | None:
    """The inference servers' bearer token: ``inference.api_key``, else ``$AGENTRL_API_KEY``,
    else (for servers this run launches) a fresh random key that only this run knows."""
    import os
    import secrets

    key = cfg.inference.api_key or os.environ.get("AGENTRL_API_KEY") or None
    if key is None and launching:
        key = secrets.token_urlsafe(32)
    return key


def _engine(
    cfg: ExperimentConfig, urls: list[str], temperature: float, transport: Any, api_key: str | None
) -> Any:
    from agentrl.inference.client import PolicyClient
    from agentrl.weightsync.engine import CheckpointEngine, transport_from_config

    ck = cfg.checkpoint
    control = [PolicyClient(u, timeout_s=ck.push_timeout_s, api_key=api_key) for u in urls]
    transport = transport or transport_from_config(ck)
    # `rollout.partial_rollout` and `checkpoint.pause_mode` name the same choice from the rollout
    # and the server side; either one set to `abort` aborts in-flight turns (the agent loop
    # resumes them on the new weights, per-token versions recorded).
    abort = "abort" in (cfg.rollout.partial_rollout, ck.pause_mode)
    return CheckpointEngine(
        control,
        transport,
        pause_mode="abort" if abort else "keep",
        verify=ck.verify,
        verify_tolerance=ck.verify_tolerance,
        probe_tokens=ck.probe_tokens,
        temperature=temperature,
        push_timeout_s=ck.push_timeout_s,
    )


async def _close_engine(engine: Any, owned: bool) -> None:
    await engine.aclose()  # the control clients and the transport's weight server
    if owned and hasattr(engine.transport, "remove"):  # the run's own staging dir (shared_dir)
        engine.transport.remove()


@contextlib.asynccontextmanager
async def build_serving(
    cfg: ExperimentConfig,
    *,
    server_urls: Sequence[str] | None = None,
    transport: Any = None,
    workers: list[Any] | None = None,
    stack: contextlib.AsyncExitStack | None = None,
    load_models: Any = None,
) -> AsyncIterator[Serving]:
    """Start (or attach to) the servers of ``cfg`` and yield a :class:`Serving`.

    ``server_urls`` attaches to running servers instead of starting any (tests, Ray placement);
    ``load_models`` (a function run in a thread while the servers start) lets :func:`build_run`
    load the actor meanwhile; its result is ``serving.timings["models"]``'s work.
    """
    from agentrl.inference.pool import ServerPool
    from agentrl.rollout.teacher import Teacher

    async with contextlib.AsyncExitStack() as own:
        stack = stack or own
        t0 = time.perf_counter()
        plan = thread_plan(cfg)
        plan.trainer.apply()
        logger.info("thread plan: %s", plan.describe())
        path = model_dir(cfg)
        tokenizer = load_tokenizer(cfg, path)
        rewards = build_rewards(cfg)  # names checked
        models = asyncio.to_thread(load_models) if load_models is not None else None
        launching = server_urls is None and cfg.inference.backend != "external"
        key = server_api_key(cfg, launching=launching)
        handles: list[Any] = []
        servers = (
            _given(server_urls)
            if server_urls is not None
            else start_servers(cfg, path, plan, stack, key, handles)
        )
        # Model rewards (reward models, judges) get their own servers, started alongside.
        reward_key = key or server_api_key(
            cfg, launching=bool(cfg.reward.models) or cfg.teacher.enabled
        )
        reward_servers = start_model_servers(cfg, plan, stack, reward_key)
        teacher_servers = start_teacher_servers(cfg, plan, stack, reward_key)
        results = await asyncio.gather(
            servers,
            reward_servers,
            teacher_servers,
            *([models] if models else []),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r
        urls = list(results[0])  # type: ignore[arg-type]  # checked above
        pool = ServerPool.from_config(urls, cfg.inference, api_key=key, model=served_model(cfg))
        stack.push_async_callback(pool.aclose)
        temperature = cfg.inference.temperature or 1.0
        engine = _engine(cfg, urls, temperature, transport, key)
        stack.push_async_callback(_close_engine, engine, transport is None)
        stack.push_async_callback(rewards.aclose)
        rewards.connect_models(results[1], reward_key)  # type: ignore[arg-type]  # checked above
        if cfg.teacher.enabled:
            rewards.teacher = Teacher.from_config(cfg)
            rewards.teacher.connect(results[2], reward_key)  # type: ignore[arg-type]  # checked above
        pool.start()
        versions = [await c.weight_version() for c in engine.clients]
        serving = Serving(
            cfg=cfg,
            model_dir=path,
            tokenizer=tokenizer,
            server_urls=urls,
            pool=pool,
            engine=engine,
            rewards=rewards,
            threads=plan,
            workers=workers,
            version=max(versions),
            timings={"startup": time.perf_counter() - t0},
            loaded=results[3] if models else None,
            handles=handles,
            api_key=key,
        )
        yield serving


async def _given(urls: Sequence[str]) -> list[str]:
    return list(urls)


def start_policies(
    cfg: ExperimentConfig, path: Path, plan: Any, stack: contextlib.AsyncExitStack
) -> Any:
    """The run's models: in this process (``trainer.world_size`` 1), or sharded over
    ``trainer.world_size`` trainer ranks with this process as rank 0 and the models wrapped in
    :class:`~agentrl.training.ranks.RankedModel` proxies (the loop and the step call them as
    plain models). The followers' stop is on ``stack`` before the first one starts."""
    if cfg.trainer.world_size == 1 and not cfg.trainer.cpu_offload:
        return load_policies(cfg, path, plan)
    # host offload is an FSDP2 policy: with world_size 1 this process is the only rank
    from agentrl.training.ranks import start_ranks

    ranks = start_ranks(cfg, path, threads=thread_plan(cfg).trainer, register=stack.callback)
    return ranks.wrap(load_policies(cfg, path, plan, dist=ranks.dist))


@contextlib.asynccontextmanager
async def build_run(
    cfg: ExperimentConfig,
    *,
    resolved: Resolved | None = None,
    server_urls: Sequence[str] | None = None,
    transport: Any = None,
    workers: list[Any] | None = None,
) -> AsyncIterator[Run]:
    """Serving plus the models, under one exit stack (see the module docstring)."""
    resolved = resolved or resolve_experiment(cfg)
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as stack:
        path = model_dir(cfg)  # built once here, so both threads below see the same directory

        def load() -> Any:
            return start_policies(cfg, path, resolved.plan, stack)

        serving = await stack.enter_async_context(
            build_serving(
                cfg,
                server_urls=server_urls,
                transport=transport,
                workers=workers,
                stack=stack,
                load_models=load,
            )
        )
        run = Run(
            **{f: getattr(serving, f) for f in Serving.__dataclass_fields__},
            resolved=resolved,
            policies=serving.loaded,
            output_dir=out,
            pad_token_id=int(serving.tokenizer.pad_token_id),
        )
        yield run
