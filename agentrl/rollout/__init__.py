"""agentrl rollout: the AgentLoopManager, streaming rewards, datasets and the recording proxy."""
