"""Multi-turn decoding over a KV cache kept across turns: the device side of an episode.

An episode is a prompt followed by model turns and observations (tool results, an environment's reply)
alternating. Three jitted programs carry an explicit `Episodes` pytree between them, and the host runs the
environment in between (`jaxrl.loop.episodes`):

- `start`: prefill the distinct prompts once (the G samples of a prompt share its keys, as in
  `jaxrl.sampling`); every row's episode is empty.
- `decode_turn`: decode the rows the host names until each has ended its turn (a stop id or stop sequence)
  or hit its turn budget or the episode's capacity. Rows that stopped wait (their steps write nothing)
  while the others go on, so a row that ends early waits at most one turn's decode.
- `append_observation`: prefill each row's observation tokens (right-padded `[B, L]`, L a small bucket) at
  the end of its own episode, so decoding resumes with the whole history in the cache: only the
  observation's tokens are computed, never the history again.

Rows are at different lengths, so each row writes its own cache slot (`KVCache.write` with a `[batch]`
index) and its episode stays contiguous: `tokens [B, T]` holds model and observation tokens in order, then
padding, and `model_mask [B, T]` marks the model's tokens (the training mask, with holes at observations).
Rotary positions continue from each row's prompt: `position = valid prompt tokens + length`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl import models
from jaxrl.models import GroupKVCache, KVCache
from jaxrl.sampling import SamplingConfig, _ends_with_stop, gathered_weights, sample_token

TURN_STOPPED, TURN_BUDGET, EPISODE_FULL = 0, 1, 2  # why a row's turn ended (`decode_turn`)


class Episodes(NamedTuple):
    """A batch of episodes on the device. B rows (`prompts * group`), Lp padded prompt length, T capacity.

    cache: the prompts' keys (`[prompts, ..., Lp]`, shared by each group) and each row's own (`[B, ..., T + S]`:
      S spare slots take the writes of rows that wait, past their end).
    prompt_valid: `[B, Lp]` bool, False on left padding.
    logits: `[B, vocab]` float32, each row's next-token logits (after its last token so far).
    length: `[B]` int32, the episode's tokens so far (model and observation).
    tokens: `[B, T]` int32, the episode's tokens, then `pad_id`.
    model_mask: `[B, T]` bool, True on tokens the model sampled.
    sampler_logp: `[B, T]` float32, each sampled token's log-prob under the temperature-scaled unfiltered softmax
      (as `sampling.Rollout.sampler_logp`; 0 elsewhere).
    policy_logp: `[B, T]` float32 under the unmodified policy (`SamplingConfig.policy_logp`), else a scalar 0.
    """

    cache: models.GroupKVCache
    prompt_valid: jax.Array
    logits: jax.Array
    length: jax.Array
    tokens: jax.Array
    model_mask: jax.Array
    sampler_logp: jax.Array
    policy_logp: jax.Array

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def positions(self, offsets: jax.Array) -> jax.Array:
        """Rotary positions `[B, n]` of episode slots `length + offsets [n]`."""
        return (self.prompt_valid.sum(axis=1, dtype=jnp.int32) + self.length)[:, None] + offsets[None, :]

    def key_valid(self, extra: jax.Array) -> jax.Array:
        """`[B, Lp + own slots]`: the prompt's valid slots and each row's first `length + extra [B]` own slots."""
        own = jnp.arange(self.cache.own.length)[None, :] < (self.length + extra)[:, None]
        return jnp.concatenate([self.prompt_valid, own], axis=1)


@functools.partial(jax.jit, static_argnames=("group_size", "capacity", "spare", "int8", "policy_logp", "pad_id"))
def start(policy: models.Policy, prompt_tokens: jax.Array, prompt_valid: jax.Array, *, group_size: int,
          capacity: int, spare: int, pad_id: int, int8: bool = False, policy_logp: bool = False) -> Episodes:
    """Empty episodes after `prompt_tokens [P, Lp]` (left-padded; `prompt_valid [P, Lp]`): each prompt is
    prefilled once and shared by its `group_size` rows (row `p * group_size + g`). `capacity`: episode tokens
    per row; `spare`: extra cache slots, at least the longest observation bucket `append_observation` gets."""
    policy = gathered_weights(policy)
    num_prompts, prompt_len = prompt_tokens.shape
    batch = num_prompts * group_size
    prompt_cache = KVCache.zeros(policy.config, num_prompts, prompt_len, int8)
    hidden, prompt_cache = models.apply(policy, prompt_tokens, models.positions_from_mask(prompt_valid),
                                        prompt_valid, prompt_cache, 0)
    logits = jnp.repeat(models.logits_from_hidden(policy, hidden[:, -1:])[:, 0], group_size, axis=0)
    zeros = jnp.zeros((batch, capacity), jnp.float32)
    return Episodes(
        cache=GroupKVCache(prompt_cache, KVCache.zeros(policy.config, batch, capacity + spare, int8)),
        prompt_valid=jnp.repeat(prompt_valid, group_size, axis=0),
        logits=logits,
        length=jnp.zeros((batch,), jnp.int32),
        tokens=jnp.full((batch, capacity), pad_id, jnp.int32),
        model_mask=jnp.zeros((batch, capacity), bool),
        sampler_logp=zeros,
        policy_logp=zeros if policy_logp else jnp.zeros((), jnp.float32),
    )


def _last_tokens(episodes: Episodes, turn_start: jax.Array, width: int) -> jax.Array:
    """`[B, width]`: each row's last `width` tokens, -1 where they lie before `turn_start [B]` (a stop sequence
    matches inside the current turn only, never across an observation)."""
    index = episodes.length[:, None] - width + jnp.arange(width)[None, :]
    tokens = jnp.take_along_axis(episodes.tokens, jnp.clip(index, 0, episodes.capacity - 1), axis=1)
    return jnp.where(index >= turn_start[:, None], tokens, -1)


@functools.partial(jax.jit, static_argnames=("config", "stop_ids", "pad_id", "stop_sequences", "turn_tokens"))
def decode_turn(policy: models.Policy, episodes: Episodes, active: jax.Array, rng: jax.Array,
                config: SamplingConfig, stop_ids: tuple[int, ...], pad_id: int, temperature=None, *,
                turn_tokens: int, stop_sequences: tuple[tuple[int, ...], ...] = ()
                ) -> tuple[Episodes, jax.Array]:
    """Decode one turn of the `active [B]` rows (the others are left exactly as they are).

    A row's turn ends at a token of `stop_ids` or the end of one of `stop_sequences` (both part of the turn),
    after `turn_tokens` tokens, or when its episode is full. Decode step t of the call draws with
    `fold_in(rng, t)`. Returns the episodes and, per row, why its turn ended: `TURN_STOPPED`, `TURN_BUDGET`
    or `EPISODE_FULL` (meaningless for inactive rows).
    """
    policy = gathered_weights(policy)
    stop_array = jnp.asarray(stop_ids, jnp.int32)
    turn_start = episodes.length
    width = max(map(len, stop_sequences), default=0)

    def body(carry):
        step, ep, decoding, why = carry
        token, logp = sample_token(ep.logits, jax.random.fold_in(rng, step), config, temperature)
        token = jnp.where(decoding, token, pad_id)
        rows = jnp.arange(token.shape[0])
        slot = jnp.where(decoding, ep.length, ep.capacity)  # out of range: dropped
        tokens = ep.tokens.at[rows, slot].set(token, mode="drop")
        sampler_logp = ep.sampler_logp.at[rows, slot].set(logp, mode="drop")
        model_mask = ep.model_mask.at[rows, slot].set(True, mode="drop")
        policy_logp = ep.policy_logp
        if config.policy_logp:
            raw = jnp.take_along_axis(jax.nn.log_softmax(ep.logits, axis=-1), token[:, None], axis=-1)[:, 0]
            policy_logp = policy_logp.at[rows, slot].set(raw, mode="drop")
        # Waiting rows write their (ignored) keys one slot past their end, into a slot a later write overwrites
        # before anything attends to it.
        hidden, cache = models.apply(policy, token[:, None], ep.positions(jnp.zeros((1,), jnp.int32)),
                                     ep.key_valid(jnp.ones_like(ep.length)), ep.cache, ep.length)
        logits = jnp.where(decoding[:, None], models.logits_from_hidden(policy, hidden)[:, 0], ep.logits)
        length = ep.length + decoding.astype(jnp.int32)
        ep = ep._replace(cache=cache, logits=logits, length=length, tokens=tokens, model_mask=model_mask,
                         sampler_logp=sampler_logp, policy_logp=policy_logp)
        stopped = jnp.isin(token, stop_array)
        if stop_sequences:
            stopped = stopped | _ends_with_stop(_last_tokens(ep, turn_start, width), stop_sequences)
        full = length >= ep.capacity
        budget = length - turn_start >= turn_tokens
        ended = decoding & (stopped | full | budget)
        why = jnp.where(ended, jnp.where(stopped, TURN_STOPPED, jnp.where(full, EPISODE_FULL, TURN_BUDGET)), why)
        return step + 1, ep, decoding & ~ended, why

    decoding = active & (episodes.length < episodes.capacity)
    why = jnp.where(decoding, TURN_STOPPED, EPISODE_FULL).astype(jnp.int32)
    carry = (jnp.int32(0), episodes, decoding, why)
    _, episodes, _, why = jax.lax.while_loop(lambda c: (c[0] < turn_tokens) & jnp.any(c[2]), body, carry)
    return episodes, why


@jax.jit
def append_observation(policy: models.Policy, episodes: Episodes, observation: jax.Array,
                       observation_len: jax.Array) -> Episodes:
    """Append `observation [B, L]` (right-padded token ids; row b's first `observation_len[b]` are real, 0 for a
    row with nothing to append) after each row's episode: only these tokens are run through the model, their
    keys written at the row's end, and the row's next-token logits become those after its last observation
    token. The host keeps `length + observation_len <= capacity` and `L <=` the cache's spare slots."""
    policy = gathered_weights(policy)
    width = observation.shape[1]
    offsets = jnp.arange(width)
    hidden, cache = models.apply(policy, observation, episodes.positions(offsets),
                                 episodes.key_valid(observation_len), episodes.cache, episodes.length)
    last = jnp.take_along_axis(hidden, jnp.maximum(observation_len - 1, 0)[:, None, None], axis=1)
    appending = observation_len > 0
    logits = jnp.where(appending[:, None], models.logits_from_hidden(policy, last)[:, 0], episodes.logits)
    rows = jnp.arange(observation.shape[0])[:, None]
    slots = jnp.where(offsets[None, :] < observation_len[:, None], episodes.length[:, None] + offsets[None, :],
                      episodes.capacity)  # out of range: dropped
    return episodes._replace(cache=cache, logits=logits, length=episodes.length + observation_len,
                             tokens=episodes.tokens.at[rows, slots].set(observation, mode="drop"))


def compiled_programs() -> int:
    """Multi-turn programs compiled in this process (one per static setting and shape: observation buckets
    and batch sizes keep the count small)."""
    return start._cache_size() + decode_turn._cache_size() + append_observation._cache_size()
