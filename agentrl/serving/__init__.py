"""The serving layer: one way to describe and launch every server a run starts.

Between :mod:`agentrl.inference` / :mod:`agentrl.rollout` (below) and ``training``,
``service`` and ``distributed`` (above). The trainer's policy servers, the model rewards'
servers and the Ray server actors all go through the same two steps::

    spec = spec_for(cfg, "policy", index=0, model=path, plan=plan)   # plain data, pickles
    handle = launch(spec)                                            # healthy, or raises

- :mod:`agentrl.serving.spec`: :class:`ServerSpec` (the contract: read it first);
- :mod:`agentrl.serving.from_config`: :func:`spec_for`, the spec of any role from the config,
  and :func:`served_model`, the model name rollouts ask for;
- :mod:`agentrl.serving.launcher`: :func:`launch`, :func:`launch_call` (the launcher and its
  arguments, nothing started), :func:`launch_all` (in parallel, on an exit stack);
- :mod:`agentrl.serving.servers`: :func:`start_servers` / :func:`start_model_servers`, every
  server of a run;
- :mod:`agentrl.serving.watch`: :class:`Watchers`, one background task per watched server
  (the supervisor and the Ray run's registry);
- :mod:`agentrl.serving.supervisor`: :class:`~agentrl.serving.supervisor.ServerSupervisor`, a
  dead server ejected, restarted (bounded) and rejoining at the current version (the rollout
  service's servers and a local run's).
"""

from agentrl.inference.handle import ServerHandle
from agentrl.serving.from_config import served_model, spec_for
from agentrl.serving.launcher import launch, launch_all, launch_call
from agentrl.serving.servers import start_model_servers, start_servers, start_teacher_servers
from agentrl.serving.spec import Backend, Role, ServerSpec

__all__ = [
    "Backend",
    "Role",
    "ServerHandle",
    "ServerSpec",
    "launch",
    "launch_all",
    "launch_call",
    "served_model",
    "spec_for",
    "start_model_servers",
    "start_servers",
    "start_teacher_servers",
]
