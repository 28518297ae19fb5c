"""Placement layers: where the servers, agent-loop workers, reward workers and trainer run.

``distributed.backend: local`` (default) runs everything in one process (asyncio + server
subprocesses; see ``agentrl.training.trainer``). ``distributed.backend: ray`` places the same
classes as Ray actors: :func:`agentrl.distributed.ray_backend.run_with_ray`. Ray is imported only
when that path is used.
"""
