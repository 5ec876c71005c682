"""Jitted autoregressive sampling over an explicit KV cache.

One call = one prefill of the (left-padded) prompts followed by a `lax.while_loop` decode that stops when
every sequence has emitted EOS or `max_new_tokens` tokens exist. Everything that crosses the jit boundary
is an explicit pytree (policy params, prompts, RNG key); the cache lives in the loop carry.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

import models
from models import KVCache, Policy

FINISH_EOS, FINISH_LENGTH = 0, 1


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How completions are drawn. `temperature == 0` means greedy decoding."""

    max_new_tokens: int = dataclasses.field(default=48, metadata={"gt": 0})
    temperature: float = dataclasses.field(default=1.0, metadata={"ge": 0})
    top_k: int = dataclasses.field(default=0, metadata={"ge": 0})  # 0: off
    top_p: float = dataclasses.field(default=1.0, metadata={"gt": 0, "le": 1})  # 1.0: off


class Rollout(NamedTuple):
    """Sampled completions. B = number of sequences, Lp = padded prompt length, N = max_new_tokens.

    tokens: `[B, Lp + N]` left-padded prompt followed by the completion (pad after it ends).
    prompt_valid: `[B, Lp]` bool, False on left padding.
    completion_mask: `[B, N]` bool, True on generated tokens up to and including EOS.
    sampler_logp: `[B, N]` float32 log-prob of each sampled token under the sampling distribution.
    finish_reason: `[B]` int, FINISH_EOS or FINISH_LENGTH.
    """

    tokens: jax.Array
    prompt_valid: jax.Array
    completion_mask: jax.Array
    sampler_logp: jax.Array
    finish_reason: jax.Array

    @property
    def completion_tokens(self) -> jax.Array:
        """`[B, N]`."""
        return self.tokens[:, self.prompt_valid.shape[1]:]


def filter_logits(logits: jax.Array, config: SamplingConfig, temperature: jax.Array | None = None) -> jax.Array:
    """Temperature, top-k and top-p applied to `logits [batch, vocab]` (float32); removed entries -> -inf.

    `temperature` (a traced scalar) replaces `config.temperature` when given.
    """
    logits = logits / (config.temperature if temperature is None else temperature)
    if config.top_k:
        kth = jax.lax.top_k(logits, config.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if config.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep = mass_before < config.top_p  # the most likely token is always kept
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def sample_token(logits: jax.Array, key: jax.Array, config: SamplingConfig,
                 temperature: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row of `logits [batch, vocab]`; returns `(tokens [batch], logp [batch])`."""
    if config.temperature == 0.0:
        tokens = jnp.argmax(logits, axis=-1)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        filtered = filter_logits(logits, config, temperature)
        tokens = jax.random.categorical(key, filtered, axis=-1)
        logp = jax.nn.log_softmax(filtered, axis=-1)
    return tokens.astype(jnp.int32), jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("config", "eos_id", "pad_id"))
def sample(
    policy: Policy,
    prompt_tokens: jax.Array,
    prompt_valid: jax.Array,
    rng: jax.Array,
    config: SamplingConfig,
    eos_id: int | tuple[int, ...],
    pad_id: int,
    temperature: jax.Array | None = None,
) -> Rollout:
    """Sample one completion per prompt row.

    Args:
      policy: the policy pytree.
      prompt_tokens: `[B, Lp]` int, left-padded (the last column is every prompt's last token).
      prompt_valid: `[B, Lp]` bool, False on padding.
      rng: PRNG key; the same key gives the same rollout.
      config: static sampling settings.
      eos_id: the id, or a tuple of ids, that end a completion (static; e.g. `tokenizer.stop_ids`: EOS and
        end-of-turn tokens). The stop token itself is part of the completion.
      pad_id: token id written after a completion ends (static).
      temperature: optional traced scalar overriding `config.temperature` (> 0) without recompiling, for
        temperature controllers; ignored for greedy configs.
    """
    stop_ids = jnp.asarray(eos_id if isinstance(eos_id, tuple) else (eos_id,), jnp.int32)
    batch, prompt_len = prompt_tokens.shape
    max_new = config.max_new_tokens
    key_valid = jnp.concatenate([prompt_valid, jnp.ones((batch, max_new), bool)], axis=1)
    positions = models.positions_from_mask(prompt_valid)
    cache = KVCache.zeros(policy.config, batch, prompt_len + max_new)

    hidden, cache = models.apply(policy, prompt_tokens, positions, key_valid, cache, 0)
    logits = models.logits_from_hidden(policy, hidden[:, -1:])[:, 0]
    next_position = positions[:, -1] + 1

    def cond(carry):
        step, *_, done = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, cache, logits, tokens, logps, mask, done = carry
        token, logp = sample_token(logits, jax.random.fold_in(rng, step), config, temperature)
        token = jnp.where(done, pad_id, token)
        tokens = tokens.at[:, step].set(token)
        logps = logps.at[:, step].set(jnp.where(done, 0.0, logp))
        mask = mask.at[:, step].set(~done)
        done = done | jnp.isin(token, stop_ids)
        hidden, cache = models.apply(
            policy, token[:, None], (next_position + step)[:, None], key_valid, cache, prompt_len + step
        )
        logits = models.logits_from_hidden(policy, hidden)[:, 0]
        return step + 1, cache, logits, tokens, logps, mask, done

    carry = (
        jnp.int32(0),
        cache,
        logits,
        jnp.full((batch, max_new), pad_id, jnp.int32),
        jnp.zeros((batch, max_new), jnp.float32),
        jnp.zeros((batch, max_new), bool),
        jnp.zeros((batch,), bool),
    )
    _, _, _, tokens, logps, mask, done = jax.lax.while_loop(cond, body, carry)
    return Rollout(
        tokens=jnp.concatenate([prompt_tokens, tokens], axis=1),
        prompt_valid=prompt_valid,
        completion_mask=mask,
        sampler_logp=logps,
        finish_reason=jnp.where(done, FINISH_EOS, FINISH_LENGTH).astype(jnp.int32),
    )
