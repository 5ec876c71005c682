"""The RL loop's side of the self-rewarding signals (`jaxrl.rewards.self_rewarding`, selected under
`reward.extra`; issue 35).

- Group self-rewards (TTRL): computed on the host right after a rollout's other rewards are scored
  (`with_group_rewards`, called by `rollout.score_rollout`), from the texts of each prompt's group.
- Token self-rewards (RENT, self-certainty): their per-token statistics come from the accelerator, in the same
  jitted program as the rollout's `old_logp` (`StepPrograms.logprobs`): the entropy is the one that pass
  always computes; the self-certainty `KL(U || p)` is computed from the same final hidden states by
  `token_self_certainty`, chunked like the entropy. `rollout.rollout_batch` keeps them as the batch's
  `token_stats`, and `with_token_rewards` turns them into each completion's reward before the rewards are
  composed.
- `step_metrics`: TTRL's pseudo-label and reward accuracy against the verifiable reward (scored, logged, not
  necessarily trained on).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import models
from jaxrl.config import Config
from jaxrl.kernels import token_logprobs
from jaxrl.kernels.logprobs import DEFAULT_CHUNK_SIZE
from jaxrl.registry import Entry
from jaxrl.rewards.pool import RewardResult
from jaxrl.rewards.scoring import ScoredBatch
from jaxrl.rewards.self_rewarding import self_rewards_of, ttrl_metrics
from jaxrl.sharding import process_local
from jaxrl.train import _completion_hidden

__all__ = ["completion_logprobs_with_certainty", "self_rewards", "step_metrics", "token_self_certainty",
           "token_statistics", "with_group_rewards", "with_token_rewards"]


def self_rewards(config: Config, kind: str) -> dict[str, Entry]:
    """Name -> entry of the `reward.extra` self-rewards of `kind` ("group" or "token"), in the config's order."""
    if not config.reward.extra:
        return {}
    return {name: entry for name, entry in self_rewards_of(config.reward.extra, config.pieces()).items()
            if entry.info["self_reward"] == kind}


def token_statistics(config: Config) -> tuple[str, ...]:
    """The per-token statistics the token self-rewards of `config` read (`statistic=` info), sorted; () when none."""
    return tuple(sorted({entry.info["statistic"] for entry in self_rewards(config, "token").values()}))


def token_self_certainty(hidden: jax.Array, unembedding: jax.Array, temperature: float | jax.Array = 1.0,
                         softcap: float | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE) -> jax.Array:
    """Per-token self-certainty `KL(U || p) = log-sum-exp(z) - mean_v(z) - log V` (nats, >= 0) of the
    next-token distribution `p = softmax(z)`, `z` the (soft-capped) logits / `temperature` over the `V` rows of
    `unembedding`: `(1/V) sum_v log(1/V / p(v))`.

    Args as `kernels.token_logprobs` (hidden `[batch, seq, hidden]`, unembedding `[vocab, hidden]`): chunks of
    `max(1, chunk_size // batch)` positions of every row, one `[chunk tokens, vocab]` float32 logits array
    at a time, so the batch axis stays split over the mesh. Forward only (a reward: no gradient).
    Returns `[batch, seq]` float32.
    """
    batch, seq, dim = hidden.shape
    positions = max(1, min(seq, chunk_size // batch))
    chunks = -(-seq // positions)
    padded = jnp.pad(hidden, ((0, 0), (0, chunks * positions - seq), (0, 0)))
    by_chunk = jnp.swapaxes(padded.reshape(batch, chunks, positions, dim), 0, 1)  # [chunks, batch, positions, dim]
    certainty = functools.partial(_chunk_certainty, unembedding, jnp.asarray(temperature, jnp.float32), softcap)
    out = jax.lax.map(certainty, by_chunk)  # [chunks, batch, positions]
    return jax.lax.stop_gradient(jnp.swapaxes(out, 0, 1).reshape(batch, chunks * positions)[:, :seq])


def _chunk_certainty(unembedding: jax.Array, temperature: jax.Array, softcap: float | None,
                     hidden_chunk: jax.Array) -> jax.Array:
    """`[batch, positions]` self-certainty of a chunk of hidden states `[batch, positions, dim]`."""
    logits = jax.lax.dot_general(hidden_chunk, unembedding, (((2,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    scaled = logits / temperature
    vocab = jnp.float32(unembedding.shape[0])
    return jax.nn.logsumexp(scaled, axis=-1) - jnp.mean(scaled, axis=-1) - jnp.log(vocab)


def completion_logprobs_with_certainty(policy: models.Policy, tokens: jax.Array, prompt_valid: jax.Array,
                                       temperature: float | jax.Array = 1.0
                                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`train.completion_logprobs` (`logp [B, N]`, `entropy [B, N]`, the same kernel on the same hidden states)
    and the per-token self-certainty `[B, N]` (`token_self_certainty`) from one forward pass of the model: the
    rollout's log-prob program when a self-reward reads the self-certainty."""
    hidden = _completion_hidden(policy, tokens, prompt_valid)
    unembedding, softcap = models.unembedding(policy), policy.config.final_logit_softcap
    logp, entropy = token_logprobs(hidden, unembedding, tokens[:, prompt_valid.shape[1]:], temperature,
                                   softcap=softcap)
    return logp, entropy, token_self_certainty(hidden, unembedding, temperature, softcap)


def token_stats_of(names: Sequence[str], outputs: Sequence[jax.Array]) -> dict[str, jax.Array]:
    """The statistics `names` from a log-prob program's `outputs`: `(logp, entropy[, self_certainty])`."""
    available = {"entropy": outputs[1]}
    if len(outputs) > 2:
        available["self_certainty"] = outputs[2]
    missing = sorted(set(names) - set(available))
    if missing:
        raise ValueError(f"the log-prob program computes no {missing} (setup.step_programs builds the one that does)")
    return {name: available[name] for name in names}


def _with_components(scored: ScoredBatch, values: Mapping[str, tuple[np.ndarray, float]]) -> ScoredBatch:
    """`scored` with more components `{name: (rewards [N], seconds)}` (no timeouts or errors: in-process)."""
    if not values:
        return scored
    components, results = dict(scored.components), dict(scored.results)
    for name, (rewards, seconds) in values.items():
        rewards = np.asarray(rewards, np.float32)
        if rewards.shape != scored.rewards.shape:
            raise ValueError(f"self-reward {name!r} returned shape {rewards.shape} for {scored.rewards.shape} "
                             "completions")
        components[name], results[name] = rewards, RewardResult(rewards, 0, 0, seconds)
    return ScoredBatch(components, results, scored.timeouts, scored.errors,
                       scored.seconds + sum(s for _, s in values.values()))


def with_group_rewards(scored: ScoredBatch, texts: Sequence[str], config: Config) -> ScoredBatch:
    """`scored` with the group self-rewards of `config` (TTRL): each called as `fn(completions,
    group_size=rl.group_size)` on this process's completions (whole groups: rows `p * G + g`)."""
    values = {}
    for name, entry in self_rewards(config, "group").items():
        t0 = time.perf_counter()
        rewards = entry.fn(list(texts), group_size=config.rl.group_size)
        values[name] = (rewards, time.perf_counter() - t0)
    return _with_components(scored, values)


def with_token_rewards(scored: ScoredBatch, batch: Mapping, texts: Sequence[str], config: Config,
                       mesh) -> ScoredBatch:
    """`scored` with the token self-rewards of `config` (RENT, self-certainty), each called as
    `fn(completions, token_<statistic>=[B, N], completion_mask=[B, N])` on this process's rows of the batch's
    `token_stats` (waits for the log-prob program)."""
    entries = self_rewards(config, "token")
    if not entries:
        return scored
    local = process_local({"stats": batch["token_stats"], "mask": batch["completion_mask"]}, mesh)
    values = {}
    for name, entry in entries.items():
        t0 = time.perf_counter()
        statistic = entry.info["statistic"]
        rewards = entry.fn(list(texts), completion_mask=local["mask"],
                           **{f"token_{statistic}": local["stats"][statistic]})
        values[name] = (rewards, time.perf_counter() - t0)
    return _with_components(scored, values)


def step_metrics(components: Mapping[str, np.ndarray], correct: np.ndarray, config: Config) -> dict[str, float]:
    """`ttrl/label_accuracy` and `ttrl/reward_accuracy` (`self_rewarding.ttrl_metrics`) of the whole batch's
    `components` (gathered) against the verifiable reward `correct [B]`, when TTRL is configured; else {}."""
    if "ttrl" not in self_rewards(config, "group"):
        return {}
    return ttrl_metrics(components["ttrl"], correct, config.rl.group_size)
