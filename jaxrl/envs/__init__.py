"""Multi-turn environments and tools: what answers a model's turn (see `jaxrl.envs.tool_calls`)."""
