"""The `env` section of the run config: which environment answers the model's turns, and the episode's limits.

`env.name: null` (the default) is a single-turn run: one prompt, one completion, one reward, as before.
`env.name: tools` runs the tools named in `env.tools` on the calls the model writes in `env.tool_format`
(see `jaxrl.envs.environments`); another registered environment (registry kind `environment`, or
`module:Class`) answers turns its own way.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from jaxrl.envs.tool_calls import TOOL_FORMATS


def _field(default, **constraints):
    """A field with bounds (`gt`, `ge`, `lt`, `le`), checked by `configlib` (as `jaxrl.config._field`)."""
    return dataclasses.field(default=default, metadata=constraints)


# name -> (least allowed value, exclusive): the positive limits; checked here too, so that an EnvConfig built in
# Python (a notebook) gets the same clear error as one loaded from YAML.
_POSITIVE = ("max_turns", "max_tokens", "turn_tokens", "observation_tokens", "max_tool_s", "step_timeout_s")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Multi-turn episodes: the environment, its tools and the per-episode limits."""

    # The environment (registry kind `environment`: `tools`, or those of modules under `imports:`; or
    # module:Class); None: single-turn.
    name: str | None = None
    # tools of the `tools` environment (registry kind `tool`: calculator, python, retrieval)
    tools: tuple[str, ...] = ()
    tool_format: Literal["hermes", "fenced"] = "hermes"  # how the model writes a call (jaxrl.envs.tool_calls)
    max_turns: int = _field(4, gt=0)  # model turns per episode
    # tokens of an episode after the prompt, model and observation tokens (in a multi-turn run this is the
    # budget; rl.sampling.max_new_tokens is not used)
    max_tokens: int = _field(512, gt=0)
    turn_tokens: int = _field(256, gt=0)  # tokens of one model turn at most
    observation_tokens: int = _field(256, gt=0)  # an observation is cut to this many tokens
    max_tool_s: float = _field(10.0, gt=0)  # seconds of tool time per episode; later calls are errors
    step_timeout_s: float = _field(10.0, gt=0)  # one environment step in the worker pool; past it: killed
    num_workers: int = _field(2, ge=1)  # environment worker processes
    retrieval_file: str | None = None  # the `retrieval` tool's corpus: JSONL rows with "text", or a text file

    def validate(self) -> None:
        """Cross-field checks; ValueError naming the field (`env.max_turns: must be > 0, got 0`)."""
        for name in _POSITIVE:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise _error(name, f"must be > 0, got {value!r}")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise _error("num_workers", f"must be an integer >= 1, got {self.num_workers!r}")
        if self.tool_format not in TOOL_FORMATS:
            raise _error("tool_format", f"unknown tool-call format {self.tool_format!r}; formats: "
                                        f"{', '.join(TOOL_FORMATS)}")
        if self.name is None:
            if self.tools:
                raise _error("tools", f"{list(self.tools)} given without env.name: set env.name: tools to run them")
            return
        if not isinstance(self.name, str) or not self.name.strip():
            raise _error("name", f"expected an environment name or module:Class, got {self.name!r}")
        if self.name == "tools" and not self.tools:
            raise _error("tools", "env.name is 'tools' but no tools are named: list them, e.g. "
                                  "env.tools=[calculator]")
        if len(set(self.tools)) != len(self.tools):
            raise _error("tools", f"names a tool twice: {list(self.tools)}")
        if self.tool_format == "fenced" and self.name == "tools" and set(self.tools) != {"python"}:
            raise _error("tools", f"the fenced format calls the python tool only, got {list(self.tools)}")
        if "retrieval" in self.tools:
            if self.retrieval_file is None:
                raise _error("retrieval_file", "the retrieval tool needs a corpus: set env.retrieval_file to a "
                                               "JSONL file (rows with \"text\") or a text file")
            if not os.path.isfile(self.retrieval_file):
                raise _error("retrieval_file", f"no such file: {self.retrieval_file!r}")

    @property
    def multi_turn(self) -> bool:
        return self.name is not None


class EnvConfigError(ValueError):
    """A bad `env` field; `field` is its dotted name, which the config loader turns into file:line."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def _error(name: str, message: str) -> EnvConfigError:
    return EnvConfigError(f"env.{name}: {message}", field=f"env.{name}")
