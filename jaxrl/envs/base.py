"""The environment interface: `EnvStep` (what one step returns), `Environment` (reset / step), `ToolContext`
(what a tool is given besides its arguments), and `checked_step`, which the host applies to whatever came back
from a worker before it trusts it.

An environment is a class registered as kind `environment` (`@registry.register("environment", "name")`),
constructed once per worker with the run's `EnvConfig`:

    class Countdown(Environment):
        def reset(self, row):            # -> (state, first observation or None)
            return {"target": int(row["target"])}, None
        def step(self, state, turn):     # turn: the model turn's text
            done = state["target"] in turn
            return EnvStep(None if done else "no, again: ", rewards={"hit": float(done)}, state=state)

Everything in an `EnvStep` crosses a process boundary: plain, picklable data only.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["EnvStep", "Environment", "ToolContext", "ToolError", "ToolTimeout", "checked_step", "clean_text",
           "MAX_OBSERVATION_CHARS"]

# An observation is cut to this many characters on the host, whatever the environment returned (the sampler
# then cuts it to env.observation_tokens tokens): a hostile or broken environment cannot flood the host.
MAX_OBSERVATION_CHARS = 65536
MAX_TOOL_MESSAGES = 16
MAX_REWARD_PARTS = 32
MAX_ERROR_CHARS = 300


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """What one environment step returns.

    observation: text appended after the model's turn; or tool messages `[{"role": "tool", "name": ...,
      "content": ...}]` the host renders (`jaxrl.envs.render.observation_text`); None: the episode is over.
    rewards: this turn's reward parts (name -> finite float), may be empty.
    state: the episode's next state (picklable data).
    tool_calls / tool_errors / tool_timeouts: counts of this step (calls made; calls that failed: unknown tool,
      bad arguments, a crash, bad output; calls cut off at a time limit).
    tool_s: seconds spent in tools this step.
    error: the first error of the step, short, for logs; None when none.
    """

    observation: str | list[dict] | None
    rewards: Mapping[str, float] = dataclasses.field(default_factory=dict)
    state: Any = None
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_s: float = 0.0
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.observation is None


class Environment:
    """Base class of environments (subclassing it is optional: `reset` and `step` are what is checked).

    `stop_strings`: strings that end a model turn besides EOS / end-of-turn; `tool_schemas`: JSON schemas of
    the tools for a chat template's `tools=` (may be empty).
    """

    stop_strings: tuple[str, ...] = ()
    tool_schemas: list[dict] = []

    def __init__(self, config):
        self.config = config

    def reset(self, row: Mapping) -> tuple[Any, str | None]:
        """`(state, first observation appended after the rendered prompt, or None)` for one data row."""
        return None, None

    def step(self, state: Any, turn: str) -> EnvStep:
        raise NotImplementedError


class ToolError(Exception):
    """A tool's failure that the model reads as `error: <message>` (counted in `tool_errors`)."""


class ToolTimeout(ToolError):
    """A tool cut off at its time limit (counted in `tool_timeouts`)."""


@dataclasses.dataclass
class ToolContext:
    """What a tool gets besides its arguments.

    state: this tool's own state in this episode (a dict the tool may change; it is kept in the episode state
      and given back at the next call of the same episode: the python tool keeps its earlier cells here).
    config: the run's `EnvConfig` (e.g. `retrieval_file`).
    deadline: `time.monotonic()` by which the call must be done (the episode's tool time and the step's
      timeout, whichever ends first).
    """

    state: dict
    config: Any
    deadline: float

    def time_left(self) -> float:
        """Seconds until `deadline` (may be <= 0)."""
        return self.deadline - time.monotonic()


def clean_text(text: str, limit: int | None = None) -> str:
    """`text` with lone surrogates and other unencodable characters replaced, cut to `limit` characters."""
    text = text.encode("utf-8", "replace").decode("utf-8", "replace")
    return text if limit is None or len(text) <= limit else text[:limit]


def _error_step(message: str, timeout: bool = False) -> EnvStep:
    return EnvStep(None, error=clean_text(message, MAX_ERROR_CHARS), tool_errors=0 if timeout else 1,
                   tool_timeouts=1 if timeout else 0)


def _count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= 10**6:
        raise TypeError(f"EnvStep.{name} must be an int in [0, 10**6], got {value!r}"[:MAX_ERROR_CHARS])
    return int(value)


def _observation(value) -> str | list[dict] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return clean_text(value, MAX_OBSERVATION_CHARS)
    if not isinstance(value, list) or not 0 < len(value) <= MAX_TOOL_MESSAGES:
        raise TypeError(f"EnvStep.observation must be a str, None or a list of 1..{MAX_TOOL_MESSAGES} tool "
                        f"messages, got {type(value).__name__}")
    messages, left = [], MAX_OBSERVATION_CHARS
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role", "tool") != "tool":
            raise TypeError('EnvStep.observation: each tool message must be a dict {"role": "tool", "content": '
                            'str, "name": str}')
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise TypeError("EnvStep.observation: a tool message's name must be a str")
        content = clean_text(m["content"], max(left, 0))
        left -= len(content)
        message = {"role": "tool", "content": content}
        if name is not None:
            message["name"] = clean_text(name, 100)
        messages.append(message)
    return messages


def checked_step(value: Any) -> EnvStep:
    """`value` (what an environment's step returned) as a trusted `EnvStep`: every field's type checked,
    strings cleaned of lone surrogates, the observation cut to `MAX_OBSERVATION_CHARS`; anything wrong gives
    an `EnvStep` that ends the episode with a recorded error (`tool_errors=1`)."""
    if not isinstance(value, EnvStep):
        return _error_step(f"environment step returned {type(value).__name__}, not an EnvStep")
    try:
        rewards = value.rewards
        if not isinstance(rewards, Mapping) or len(rewards) > MAX_REWARD_PARTS:
            raise TypeError(f"EnvStep.rewards must be a mapping of at most {MAX_REWARD_PARTS} name -> float")
        parts = {}
        for k, v in rewards.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, numbers.Real) \
                    or not math.isfinite(float(v)) or abs(float(v)) > 1e30:
                raise TypeError(f"EnvStep.rewards: {k!r} -> {v!r} is not a name -> finite float"[:MAX_ERROR_CHARS])
            parts[clean_text(k, 100)] = float(v)
        tool_s = value.tool_s
        if isinstance(tool_s, bool) or not isinstance(tool_s, numbers.Real) or not 0 <= float(tool_s) < 1e9:
            raise TypeError(f"EnvStep.tool_s must be a finite float >= 0, got {tool_s!r}"[:MAX_ERROR_CHARS])
        error = value.error
        if error is not None and not isinstance(error, str):
            raise TypeError(f"EnvStep.error must be a str or None, got {type(error).__name__}")
        return EnvStep(_observation(value.observation), parts, value.state, _count(value.tool_calls, "tool_calls"),
                       _count(value.tool_errors, "tool_errors"), _count(value.tool_timeouts, "tool_timeouts"),
                       float(tool_s), None if error is None else clean_text(error, MAX_ERROR_CHARS))
    except Exception as e:  # noqa: BLE001 - a field whose checks themselves raise (a hostile __eq__, __len__)
        return _error_step(f"bad EnvStep: {type(e).__name__}: {e}")
