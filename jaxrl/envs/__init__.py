"""Multi-turn environments and tools: what answers a model's turn.

- `jaxrl.envs.tool_calls`: the tool-call formats (`hermes`, `fenced`), parsed and written.
- `jaxrl.envs.base`: `EnvStep`, `Environment`, `ToolContext`, `checked_step`.
- `jaxrl.envs.config`: `EnvConfig`, the run config's `env` section.
- `jaxrl.envs.tools`: the built-in tools `calculator`, `python`, `retrieval` (registry kind `tool`).
- `jaxrl.envs.environments`: the built-in environment `tools` (registry kind `environment`).
- `jaxrl.envs.pool`: `EnvPool`, resets and steps in worker processes with hard timeouts.
- `jaxrl.envs.render`: `observation_text`, `check_tool_role` (observations as text, with or without a chat
  template).

Importing this package is cheap (no jax).
"""

from jaxrl.envs.base import EnvStep, Environment, ToolContext, ToolError, ToolTimeout, checked_step
from jaxrl.envs.config import EnvConfig
from jaxrl.envs.tool_calls import ToolCall, ToolCallError, format_tool_call, parse_tool_calls, plain_observation

__all__ = ["EnvConfig", "EnvStep", "Environment", "ToolCall", "ToolCallError", "ToolContext", "ToolError",
           "ToolTimeout", "checked_step", "format_tool_call", "parse_tool_calls", "plain_observation"]
