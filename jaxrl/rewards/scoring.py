"""Score a batch with every reward a config names, and compose them with the shaping components.

`reward.function` is the verifiable reward (the component `correct`, weight 1); `reward.extra` maps more rewards
(`{name or module:function: weight}`) to their weights, each a component under its configured name. Each reward
gets its own `RewardPool` (`reward.num_workers` workers, the same timeouts), so a slow judge neither shares
workers with nor delays the timeouts of the verifiable reward; the pools are scored one after another, and a
batch's `timeouts`, `errors` and `seconds` are the sums over them. The shaping components (format, overlong,
length) are computed here on the host from the texts and token counts, and `shape` composes everything with
`RewardConfig.component_weights()`:

    with RewardScorer.from_config(config) as scorer:              # pools start on the first score()
        scored = scorer.score(texts, references, prompts=prompts, rows=rows)
        composed = shape(scored.components, texts, lengths, config.reward, config.completion_tokens)
        record.update(scored.metrics()); record.update(composed.metrics())   # reward/correct, reward/<name>
        advantages_from(composed.total)                           # [B] float32

Host-side and jax-free, like the rest of `jaxrl.rewards`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxrl.rewards.pool import RewardPool, RewardResult
from jaxrl.rewards.shaping import ComposedRewards, compose, dapo_overlong_penalty, format_reward, length_penalty

if TYPE_CHECKING:
    from jaxrl.config import Config, RewardConfig
    from jaxrl.registry import Entry

__all__ = ["RewardScorer", "ScoredBatch", "eval_reward", "pool_for", "reward_functions", "shape"]

CORRECT = "correct"  # the verifiable reward's component name


def pool_for(reward_fn: Callable, config: RewardConfig) -> RewardPool:
    """A `RewardPool` for `reward_fn` with `config`'s workers, timeouts, batch size and startup limit."""
    return RewardPool(reward_fn, num_workers=config.num_workers, timeout_s=config.timeout_s,
                      batch_timeout_s=config.batch_timeout_s, batch_size=config.batch_size,
                      startup_timeout_s=config.startup_timeout_s)


def reward_functions(config: Config, reward_fn: Callable | None = None) -> dict[str, Callable]:
    """Component name -> reward function of every reward `config` names: `correct` (`reward_fn`, or
    `reward.function`), then each `reward.extra` name in the config's order, but for the self-rewards
    (`jaxrl.rewards.self_rewarding`), which the RL loop computes itself (`jaxrl.loop.self_rewards`)."""
    pieces = config.pieces()
    functions = {CORRECT: reward_fn or pieces["reward.function"].fn}
    functions.update({name: pieces[f"reward.extra.{name}"].fn for name in config.reward.extra
                      if not pieces[f"reward.extra.{name}"].info.get("self_reward")})
    return functions


def eval_reward(config: Config) -> tuple[str, Entry]:
    """`(name, entry)` of the verifiable reward the held-out evaluation uses: `eval.reward`, or else
    `reward.function`. `entry.info.get("binary")` says whether its mean is an accuracy."""
    pieces = config.pieces()
    if config.eval.reward is not None:
        return config.eval.reward, pieces["eval.reward"]
    return config.reward.function, pieces["reward.function"]


@dataclasses.dataclass(frozen=True, eq=False)
class ScoredBatch:
    """Every configured reward of one batch of N completions.

    Attributes:
      components: name -> [N] float32, unweighted: `correct` first, then each `reward.extra` name.
      results: name -> that reward's own `RewardResult` (its timeouts, errors, seconds).
      timeouts, errors: summed over the rewards (an item that failed in two rewards counts twice).
      seconds: summed over the rewards (they are scored one after another).

    `rewards`, `timeouts`, `errors`, `seconds` and `metrics()` read like a `RewardResult` of the verifiable reward
    (with the failures and time of all of them), so code written for one pool takes a `ScoredBatch` unchanged.
    """

    components: dict[str, np.ndarray]
    results: dict[str, RewardResult]
    timeouts: int
    errors: int
    seconds: float

    @property
    def rewards(self) -> np.ndarray:
        """[N] float32: the verifiable reward (`correct`)."""
        return self.components[CORRECT]

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """`{prefix}mean`, `std` (of `correct`), `timeouts`, `errors`, `seconds` (summed over the rewards), and for
        each extra reward `{prefix}<name>/timeouts` and `{prefix}<name>/errors` (its mean comes with
        `ComposedRewards.metrics`, as `{prefix}<name>`)."""
        out = self.results[CORRECT].metrics(prefix)
        out.update({f"{prefix}timeouts": float(self.timeouts), f"{prefix}errors": float(self.errors),
                    f"{prefix}seconds": float(self.seconds)})
        for name, result in self.results.items():
            if name != CORRECT:
                out[f"{prefix}{name}/timeouts"] = float(result.timeouts)
                out[f"{prefix}{name}/errors"] = float(result.errors)
        return out


class RewardScorer:
    """One `RewardPool` per reward function; `score` runs a batch through each of them.

    Args:
      functions: component name -> reward function (see `RewardPool`); must hold `correct`.
      config: the pools' settings (`num_workers`, `timeout_s`, `batch_timeout_s`, `batch_size`,
        `startup_timeout_s`); `batch_timeout_s` applies to each reward's `score` call separately.

    Workers start on the first `score` and die with `close()` (or the process). Not thread-safe, like the pool.
    """

    def __init__(self, functions: Mapping[str, Callable], config: RewardConfig):
        if CORRECT not in functions:
            raise ValueError(f"RewardScorer needs the verifiable reward {CORRECT!r}, got {list(functions)}")
        self.pools: dict[str, RewardPool] = {}
        try:
            for name, fn in functions.items():
                self.pools[name] = pool_for(fn, config)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, config: Config, reward_fn: Callable | None = None) -> RewardScorer:
        """The scorer of every reward `config` names (`reward_fn` replaces `reward.function` when given)."""
        return cls(reward_functions(config, reward_fn), config.reward)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every pool's workers. Idempotent."""
        for pool in self.pools.values():
            pool.close()

    def score(self, completions: Sequence[str], references: Sequence[str], *,
              prompts: Sequence[str] | None = None, rows: Sequence | None = None) -> ScoredBatch:
        """Every reward of N completions (`prompts` and `rows`: as `RewardPool.score`, needed by the rewards
        that take them)."""
        results = {name: pool.score(completions, references, prompts=prompts, rows=rows)
                   for name, pool in self.pools.items()}
        return ScoredBatch(components={name: r.rewards for name, r in results.items()}, results=results,
                           timeouts=sum(r.timeouts for r in results.values()),
                           errors=sum(r.errors for r in results.values()),
                           seconds=sum(r.seconds for r in results.values()))


def shape(components: Mapping[str, np.ndarray], texts: Sequence[str], lengths: np.ndarray, config: RewardConfig,
          max_new_tokens: int, env_rewards: np.ndarray | None = None,
          weights: Mapping[str, float] | None = None) -> ComposedRewards:
    """The scored `components` (`ScoredBatch.components`: `correct` and the extras, [N] each) with the shaping
    components `config` enables (the format reward of `texts`; DAPO's overlong and the length penalty of the
    completion `lengths` [N] in tokens, `max_new_tokens` the sampling limit), composed with
    `weights` (default `config.component_weights()`): `total` [N] float32 and every component, unweighted, for
    logging. Multi-turn, `env_rewards` [N] (the environment's reward parts summed over each episode's turns) is
    the component `env`, weighted as `Config.component_weights` says."""
    components = {name: np.asarray(v, np.float32) for name, v in components.items()}
    if env_rewards is not None:
        components["env"] = np.asarray(env_rewards, np.float32)
    if config.format_weight:
        components["format"] = np.array([format_reward(t, pattern=config.format_pattern) for t in texts],
                                        np.float32)
    if config.overlong_buffer is not None:
        components["overlong"] = dapo_overlong_penalty(lengths, max_new_tokens, config.overlong_buffer)
    if config.length_target is not None:
        components["length"] = length_penalty(lengths, config.length_target, config.length_penalty_coef)
    return compose(components, config.component_weights() if weights is None else weights)
