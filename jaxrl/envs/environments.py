"""The built-in environment `tools`: each model turn's tool calls are run, and their results are the observation.

A turn without a tool call is the episode's answer: the step returns `observation=None`. A call that cannot be
run (an unknown tool, bad arguments, a malformed call, a tool that raises, runs out of time or has no tool time
left in the episode, `env.max_tool_s`) gives the model an `error: ...` result to read and is counted in the
step's `tool_errors` / `tool_timeouts`; the episode goes on. Results come back as tool messages
`[{"role": "tool", "name": ..., "content": ...}]`, which the host renders (`jaxrl.envs.render`).

Episode state (plain data): `{"tool_s": seconds used, "tools": {tool name: that tool's state dict}}`.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping
from typing import Any

from jaxrl import registry
from jaxrl.envs.base import EnvStep, Environment, ToolContext, ToolError, ToolTimeout, clean_text
from jaxrl.envs.tool_calls import ToolCallError, parse_tool_calls, stop_strings
from jaxrl.envs.tools import MAX_RESULT_CHARS, tool_schema

__all__ = ["ToolsEnvironment"]

_STEP_MARGIN_S = 0.5  # a tool's deadline ends this long before the pool's step timeout kills the worker


@registry.register("environment", "tools")
class ToolsEnvironment(Environment):
    """Runs the tools of `config.tools` (registry kind `tool`) on the calls written in `config.tool_format`."""

    def __init__(self, config):
        super().__init__(config)
        self.tools = {name: registry.resolve("tool", name, f"env.tools[{i}]").fn
                      for i, name in enumerate(config.tools)}
        self.stop_strings = stop_strings(config.tool_format)
        self.tool_schemas = [tool_schema(name, fn) for name, fn in self.tools.items()]

    def reset(self, row: Mapping) -> tuple[dict, None]:
        return {"tool_s": 0.0, "tools": {}}, None

    def step(self, state: Any, turn: str) -> EnvStep:
        from jaxrl.rewards.pool import item_deadline  # inf outside a worker

        state = copy.deepcopy(state) if isinstance(state, dict) else {"tool_s": 0.0, "tools": {}}
        try:
            calls = parse_tool_calls(turn, self.config.tool_format)
        except ToolCallError as e:
            message = f"error: {e}"
            return EnvStep([{"role": "tool", "name": "error", "content": message}], state=state, tool_calls=1,
                           tool_errors=1, error=message)
        if not calls:
            return EnvStep(None, state=state)
        step_deadline = item_deadline() - _STEP_MARGIN_S
        results, errors, timeouts, first_error, step_s = [], 0, 0, None, 0.0
        for call in calls:
            left = self.config.max_tool_s - state["tool_s"]
            start = time.monotonic()
            timed_out = failed = True
            try:
                fn = self.tools.get(call.name)
                if fn is None:
                    raise ToolError(f"unknown tool {call.name[:50]!r}; tools: {', '.join(self.tools)}")
                if left <= 0:
                    raise ToolTimeout(f"no tool time left in this episode (env.max_tool_s: {self.config.max_tool_s:g})")
                tool_state = state["tools"].setdefault(call.name, {})
                context = ToolContext(tool_state, self.config, min(start + left, step_deadline))
                result = fn(dict(call.arguments), context)
                if not isinstance(result, str):
                    raise ToolError(f"the tool returned {type(result).__name__}, not text")
                content = clean_text(result)
                if len(content) > MAX_RESULT_CHARS:
                    content = content[:MAX_RESULT_CHARS] + f"\n[output cut: {len(content) - MAX_RESULT_CHARS} " \
                                                           "more characters]"
                if time.monotonic() - start > left:  # it finished, but past the episode's tool time
                    raise ToolTimeout(f"over the episode's tool time (env.max_tool_s: {self.config.max_tool_s:g})")
                timed_out = failed = False
            except ToolTimeout as e:
                content = f"error: timeout: {clean_text(str(e), 600)}"
            except ToolError as e:
                timed_out = False
                content = f"error: {clean_text(str(e), 600)}"
            except Exception as e:  # noqa: BLE001 - a tool's bug is the model's error result, not the batch's
                timed_out = False
                content = f"error: the tool raised {type(e).__name__}: {clean_text(str(e), 300)}"
            elapsed = time.monotonic() - start
            step_s += elapsed
            state["tool_s"] += elapsed if math.isfinite(elapsed) else 0.0
            if failed:
                timeouts += timed_out
                errors += not timed_out
                first_error = first_error or content
            results.append({"role": "tool", "name": call.name, "content": content})
        return EnvStep(results, state=state, tool_calls=len(calls), tool_errors=errors, tool_timeouts=timeouts,
                       tool_s=step_s, error=first_error)
