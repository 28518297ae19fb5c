"""Start every server of a run from its config: the policy servers, the model rewards' and the
distillation teacher's.

Guarantees: servers start in parallel; each started server is stopped by the caller's exit
stack (also when another fails to start); ``external`` backends start nothing and give their
configured URLs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from agentrl.inference.handle import ServerHandle
from agentrl.serving.from_config import spec_for
from agentrl.serving.launcher import launch_all
from agentrl.threads import ThreadPlan

__all__ = ["start_model_servers", "start_servers", "start_teacher_servers"]


async def start_servers(
    cfg: Any,
    path: Path,
    plan: ThreadPlan,
    stack: contextlib.AsyncExitStack,
    api_key: str | None = None,
    handles: list[ServerHandle] | None = None,
) -> list[str]:
    """Launch the ``inference.num_servers`` policy servers of ``path``; their URLs (and their
    handles appended to ``handles`` when given, in the same order)."""
    inf = cfg.inference
    if inf.backend == "external":
        return list(inf.urls)
    logs = Path(cfg.trainer.output_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    specs = [
        spec_for(cfg, "policy", index=i, model=path, plan=plan, log_dir=logs, api_key=api_key)
        for i in range(inf.num_servers)
    ]
    started = await launch_all(specs, stack)
    if handles is not None:
        handles.extend(started)
    return [h.base_url for h in started]


async def start_model_servers(
    cfg: Any, plan: ThreadPlan, stack: contextlib.AsyncExitStack, api_key: str | None
) -> dict[str, list[str]]:
    """Start the servers of every ``reward.models`` entry in parallel; ``{name: urls}``.

    External models give their ``urls``. Embedded servers get the thread plan's
    ``reward_servers`` shares, in config order.
    """
    urls: dict[str, list[str]] = {}
    names: list[str] = []
    specs = []
    logs = Path(cfg.trainer.output_dir) / "logs"
    for name, m in cfg.reward.models.items():
        if m.backend == "external":
            urls[name] = list(m.urls)
            continue
        logs.mkdir(parents=True, exist_ok=True)
        for i in range(m.num_servers):
            names.append(name)
            specs.append(
                spec_for(cfg, m.type, index=i, name=name, plan=plan, log_dir=logs, api_key=api_key)
            )
    for name, handle in zip(names, await launch_all(specs, stack), strict=True):
        urls.setdefault(name, []).append(handle.base_url)
    return urls


async def start_teacher_servers(
    cfg: Any, plan: ThreadPlan, stack: contextlib.AsyncExitStack, api_key: str | None
) -> list[str]:
    """Start the ``teacher.num_servers`` servers of the distillation teacher (none without one,
    ``teacher.path: null``); their URLs."""
    if not cfg.teacher.enabled:
        return []
    logs = Path(cfg.trainer.output_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    specs = [
        spec_for(cfg, "teacher", index=i, plan=plan, log_dir=logs, api_key=api_key)
        for i in range(cfg.teacher.num_servers)
    ]
    return [h.base_url for h in await launch_all(specs, stack)]
