"""agentrl inference: tiny-model builder, embedded engine and server, vLLM backend, PolicyClient, ServerPool."""
