"""The ``distributed`` section: placement of servers, workers and the trainer (local or Ray),
and the CPU plan."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from agentrl.config.section import Section

__all__ = ["DistributedConfig"]


class DistributedConfig(Section):
    """Placement of servers, workers and the trainer."""

    backend: Literal["local", "ray"] = "local"
    """`local` (one process, asyncio + server subprocesses) or `ray` (actors)."""
    ray_address: str | None = None
    """Ray cluster address; None = start or join a local cluster."""
    num_gpus_per_server: float = Field(default=0.0, ge=0.0)
    """GPUs per inference server (Ray placement)."""
    num_trainer_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs for the trainer (Ray placement)."""
    placement: Literal["default", "spread"] = "default"
    """Ray scheduling of the server and worker actors: `default` (Ray's: fill a node first) or `spread` (across the nodes, so losing one node takes fewer of each)."""
    resources: dict[Literal["server", "worker", "reward", "trainer"], dict[str, float]] = Field(
        default_factory=dict
    )
    """Custom Ray resources each role's actors request, e.g. `{server: {serving: 1}}` with nodes started `--resources '{"serving": 4}'`: places a role on the nodes that offer them."""
    max_actor_restarts: int = Field(default=3, ge=-1)
    """Ray restarts of each server, worker and reward actor that dies (-1 = no limit, 0 = none); see docs/distributed.md."""
    cpus: list[int] | int | None = None
    """CPUs this run may use: a list of CPU ids, a count, or null for the process's affinity set."""
    trainer_threads: int | None = Field(default=None, ge=1)
    """Torch threads of the trainer process; null = its share of `cpus` (see docs/training.md)."""
    server_threads: int | None = Field(default=None, ge=1)
    """Torch threads of each embedded server; null = its share of `cpus`."""
    pin_cpus: bool = False
    """Pin the trainer and each embedded server to disjoint CPUs (when there are enough)."""
    colocate: bool = False
    """Colocated mode: the policy servers sleep (weights and KV cache released) while the trainer updates, and wake with the new version at the push (see docs/distributed.md); local backend, embedded or GPU vLLM servers."""
    server_nice: int | None = Field(default=None, ge=0, le=19)
    """Niceness added to each local embedded server (0-19); null = 10 when the plan has more threads than CPUs and nothing is pinned (the trainer, the critical path, wins contention), else 0."""

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for role, wanted in value.items():
            for name, amount in wanted.items():
                if name in ("CPU", "GPU", "memory") or not name:
                    raise ValueError(
                        f"{role}: {name!r} is not a custom resource; GPUs are "
                        "distributed.num_gpus_per_server / num_trainer_gpus"
                    )
                if not amount > 0:
                    raise ValueError(f"{role}.{name}={amount}; request an amount above 0")
        return value
