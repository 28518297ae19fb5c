"""agentrl training: trainer, actor/critic, trajectory buffer, checkpoint engine, tracking."""
