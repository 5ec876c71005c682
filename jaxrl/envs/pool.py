"""`EnvPool`: environment resets and steps in worker processes, with the reward pool's timeouts and isolation.

The same dispatch loop as `RewardPool` (`jaxrl.rewards.pool.WorkerPool`): spawned workers, each with one
environment instance (built from the `EnvConfig` before the worker reports ready); one job per episode; a step
still running `env.step_timeout_s` after it was handed out is killed with its worker (which is replaced).

Nothing a step does can stop the batch: a step that hangs, raises, kills its worker (`os._exit`, a segfault) or
returns something that is not a well-formed `EnvStep` ends *that* episode with `EnvStep(observation=None,
error=..., tool_errors=1)` (`tool_timeouts=1` for a timeout), and the other episodes get their results. The
observation is checked and bounded on the host too (`jaxrl.envs.base.checked_step`).

    with EnvPool(config.env) as pool:
        episodes = pool.reset(rows)                      # [(state, first observation or None)] * B
        steps = pool.step([s for s, _ in episodes], turns)  # [EnvStep] * B
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl import registry
from jaxrl.envs.base import EnvStep, MAX_ERROR_CHARS, MAX_OBSERVATION_CHARS, checked_step, clean_text
from jaxrl.rewards.pool import Outcome, PoolOwner, WorkerPool, encode_job

__all__ = ["EnvPool", "ResetFailed"]


@dataclasses.dataclass(frozen=True)
class ResetFailed:
    """The state of an episode whose `reset` failed: its first `step` ends it with this error, without a worker."""

    error: str


class _EnvSetup:
    """Built in each worker before it reports ready: one environment instance; returns the job handler."""

    def __init__(self, env_cls, config):
        self.env_cls, self.config = env_cls, config

    def __call__(self):
        env = self.env_cls(self.config)

        def handle(job: dict):
            if job["op"] == "reset":
                return _checked_reset(env.reset(job["row"]))
            return checked_step(env.step(job["state"], job["turn"]))

        return handle


def _checked_reset(value) -> tuple[Any, str | None]:
    """`reset`'s value as `(state, observation)`; TypeError for anything else."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(f"reset returned {type(value).__name__}, not a (state, observation) pair")
    state, observation = value
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"reset's observation must be a str or None, got {type(observation).__name__}")
    return state, None if observation is None else clean_text(observation, MAX_OBSERVATION_CHARS)


def _failure(what: str, outcome: Outcome, config) -> tuple[str, bool]:
    """(error message, whether it is a timeout) for a job that did not return."""
    if outcome.kind == "timeout":
        return f"{what} took longer than env.step_timeout_s ({config.step_timeout_s:g} s)", True
    if outcome.kind == "died":
        return f"{what} killed its worker (exit code {outcome.value})", False
    if outcome.kind == "raised":
        return clean_text(f"{what} raised {outcome.value}", MAX_ERROR_CHARS), False
    if outcome.kind == "unsendable":
        return f"{what}'s arguments cannot be pickled (the episode state must be plain data)", False
    return f"{what} did not finish ({outcome.kind})", outcome.kind.endswith("timeout")


class EnvPool(PoolOwner):
    """Runs the environment `config.name` (`EnvConfig`) in `config.num_workers` worker processes.

    Attributes (read from one instance built on the host, before any worker starts):
      stop_strings: strings that end a model turn besides EOS / end-of-turn (e.g. `("</tool_call>",)`).
      tool_schemas: the tools' JSON schemas, for a chat template's `tools=` (may be empty).
      env_cls: the environment class the config names.

    Args:
      config: the run's `EnvConfig` (`name` must be set).
      startup_timeout_s: seconds a worker may take to import and build its environment.
    """

    def __init__(self, config, *, startup_timeout_s: float = 60.0):
        if config.name is None:
            raise ValueError("env.name: EnvPool needs an environment; env.name is null (a single-turn run)")
        config.validate()
        self.config = config
        self.env_cls = registry.resolve("environment", config.name, "env.name").fn
        host = self.env_cls(config)
        self.stop_strings = tuple(getattr(host, "stop_strings", ()))
        self.tool_schemas = list(getattr(host, "tool_schemas", []))
        self._pool = WorkerPool(
            _EnvSetup(self.env_cls, config), num_workers=config.num_workers, startup_timeout_s=startup_timeout_s,
            what="environment", hint=("raised by the environment's constructor",
                                      "is the environment importable in a fresh process, and is the main script "
                                      "guarded by `if __name__ == '__main__':`?"))
        self._closed = False

    def _run(self, jobs: list[dict]) -> list[Outcome]:
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        timeout = float(self.config.step_timeout_s)
        outcomes, _ = self._pool.run(len(jobs), lambda j, budget_s: encode_job(j, jobs[j], budget_s),
                                     lambda j: timeout)
        return outcomes

    def reset(self, rows: Sequence[Mapping]) -> list[tuple[Any, str | None]]:
        """`[(state, first observation or None)]`, one per row. A reset that fails gives the state
        `ResetFailed(error)` and no observation: that episode's first step ends it with the error."""
        outcomes = self._run([{"op": "reset", "row": row} for row in rows])
        episodes = []
        for outcome in outcomes:
            if outcome.kind == "ok":
                try:
                    episodes.append(_checked_reset(outcome.value))
                    continue
                except TypeError as e:
                    outcome = Outcome("raised", f"TypeError: {e}")
            episodes.append((ResetFailed(_failure("environment reset", outcome, self.config)[0]), None))
        return episodes

    def step(self, states: Sequence[Any], turns: Sequence[str]) -> list[EnvStep]:
        """`[EnvStep]`, one per episode: `env.step(states[i], turns[i])` in a worker; a failed step (see the
        module docstring) is `EnvStep(observation=None, error=..., tool_errors=1 or tool_timeouts=1)`."""
        if len(states) != len(turns):
            raise ValueError(f"step: {len(states)} states but {len(turns)} turns")
        live = [i for i, s in enumerate(states) if not isinstance(s, ResetFailed)]
        outcomes = self._run([{"op": "step", "state": states[i], "turn": turns[i]} for i in live])
        steps: list[EnvStep] = [EnvStep(None, error=s.error, tool_errors=1) if isinstance(s, ResetFailed)
                                else None for s in states]
        for i, outcome in zip(live, outcomes):
            if outcome.kind == "ok":
                steps[i] = checked_step(outcome.value)
                continue
            message, timeout = _failure("environment step", outcome, self.config)
            steps[i] = EnvStep(None, error=message, tool_errors=0 if timeout else 1, tool_timeouts=int(timeout),
                               tool_s=float(self.config.step_timeout_s) if timeout else 0.0)
        return steps
