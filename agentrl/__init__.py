"""agentrl: asynchronous multi-turn reinforcement learning for tool-using LLM agents.

Packages: ``agentrl.types`` (contracts), ``agentrl.config`` (typed configuration),
``agentrl.batch`` (trajectories -> TensorDict), ``agentrl.algos`` (advantages, losses, KL),
``agentrl.inference`` (embedded server, vLLM backend, client, pool), ``agentrl.rollout``
(agent-loop manager, rewards, datasets, recording proxy), ``agentrl.training`` (trainer,
checkpoint engine). Importing ``agentrl`` itself is cheap: no torch, servers or trackers.
"""

__version__ = "0.1.0"
