"""Jitted autoregressive sampling over an explicit KV cache.

One call = one prefill of the distinct (left-padded) prompts, then a decode that stops when every sequence
has emitted a stop token or stop sequence, or `max_new_tokens` tokens exist. With `group_size=G`, the G
samples of a prompt share its prefill and its KV cache (`models.GroupKVCache`): the prompt's keys are held
once, not copied G times, and attention reads them once per group (`kernels.attention.shared_prefix_attention`).
The decode runs as a few `lax.while_loop` segments over a cache that grows between them, so early steps do
not attend over the empty tail of the cache. Everything that crosses the jit boundary is an explicit pytree
(policy params, prompts, RNG key); the cache lives in the loop carry. Bad inputs are rejected on the host
before anything compiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import models
from jaxrl.sharding import addressable_rows
from jaxrl.models import GroupKVCache, KVCache, Policy

FINISH_EOS, FINISH_LENGTH = 0, 1
MIN_SEGMENT_STEPS = 16


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How completions are drawn. `temperature == 0` means greedy decoding."""

    max_new_tokens: int = dataclasses.field(default=48, metadata={"gt": 0})
    temperature: float = dataclasses.field(default=1.0, metadata={"ge": 0})
    top_k: int = dataclasses.field(default=0, metadata={"ge": 0})  # 0: off
    top_p: float = dataclasses.field(default=1.0, metadata={"gt": 0, "le": 1})  # 1.0: off
    min_p: float = dataclasses.field(default=0.0, metadata={"ge": 0, "lt": 1})  # 0.0: off
    # Also return each sampled token's log-prob under the unmodified policy (temperature 1, no filters),
    # for importance-sampling corrections between the sampling and the training distribution.
    policy_logp: bool = False
    # The decode runs in up to this many segments, each attending over a cache only as long as the completion
    # can be by its end (`decode_segments`); 1: one loop over the full-length cache (fastest compile).
    decode_segments: int = dataclasses.field(default=4, metadata={"gt": 0})
    # "compute": keys and values cached in the model's compute dtype (bf16 on accelerators); "int8": int8 with a
    # float32 scale per slot and head (`kernels.attention.quantize_int8`), for long completions or large groups
    # whose cache would not fit. Slightly different log-probs, so sampled tokens can differ from "compute".
    kv_cache_dtype: Literal["compute", "int8"] = "compute"
    # With parameters split over the mesh's `fsdp` axis, gather them once per sampler call (the layer matrices
    # in the compute dtype, as their matmuls read them) instead of at every decode step: a decode step then
    # moves no weights between chips (a Qwen2.5-7B plan on v5e-64: 4.1 GB of all-gathers per chip per token
    # without it), at the cost of holding the gathered weights while sampling (`jaxrl plan` shows both).
    gather_weights: bool = True

    def __post_init__(self):
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # NaN too: it would turn every logit into NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.decode_segments < 1:
            raise ValueError(f"decode_segments must be >= 1, got {self.decode_segments}")
        if self.kv_cache_dtype not in ("compute", "int8"):
            raise ValueError(f"kv_cache_dtype must be 'compute' or 'int8', got {self.kv_cache_dtype!r}")
        if not 0 < self.top_p <= 1 or not 0 <= self.min_p < 1 or self.top_k < 0:
            raise ValueError(f"need 0 < top_p <= 1, 0 <= min_p < 1 and top_k >= 0, got top_p={self.top_p}, "
                             f"min_p={self.min_p}, top_k={self.top_k}")


class Rollout(NamedTuple):
    """Sampled completions. B = number of sequences, Lp = padded prompt length, N = max_new_tokens.

    tokens: `[B, Lp + N]` left-padded prompt followed by the completion (pad after it ends).
    prompt_valid: `[B, Lp]` bool, False on left padding.
    completion_mask: `[B, N]` bool, True on generated tokens up to and including EOS.
    sampler_logp: `[B, N]` float32 log-prob of each sampled token under the sampling distribution.
    finish_reason: `[B]` int, FINISH_EOS or FINISH_LENGTH.
    policy_logp: `[B, N]` float32 log-prob under the unmodified policy (`SamplingConfig.policy_logp`), or None.
    """

    tokens: jax.Array
    prompt_valid: jax.Array
    completion_mask: jax.Array
    sampler_logp: jax.Array
    finish_reason: jax.Array
    policy_logp: jax.Array | None = None

    @property
    def completion_tokens(self) -> jax.Array:
        """`[B, N]`."""
        return self.tokens[:, self.prompt_valid.shape[1]:]


def filter_logits(logits: jax.Array, config: SamplingConfig, temperature: jax.Array | None = None) -> jax.Array:
    """Temperature, top-k and top-p applied to `logits [batch, vocab]` (float32); removed entries -> -inf.

    `temperature` (a traced scalar) replaces `config.temperature` when given.
    """
    logits = logits / (config.temperature if temperature is None else temperature)
    if config.top_k:  # k beyond the vocabulary keeps everything, as in transformers
        kth = jax.lax.top_k(logits, min(config.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if config.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep = mass_before < config.top_p  # the most likely token is always kept
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    if config.min_p > 0.0:  # keep tokens at least min_p times as likely as the most likely one
        threshold = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(config.min_p)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def sample_token(logits: jax.Array, key: jax.Array, config: SamplingConfig,
                 temperature: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row of `logits [batch, vocab]`; returns `(tokens [batch], logp [batch])`."""
    if config.temperature == 0.0:
        tokens = first_max_index(logits)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        logp = jax.nn.log_softmax(filter_logits(logits, config, temperature), axis=-1)
        tokens = inverse_cdf_sample(jnp.exp(logp), key)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def first_max_index(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` for `x [batch, n]` as int32 (the first maximum), as two plain reductions:
    XLA:CPU runs argmax's paired (value, index) reduction about 3x slower. A row of NaNs gives `n - 1`."""
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), index, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)


def _last_true_index(x: jax.Array) -> jax.Array:
    """Index of the last True along the last axis of bool `x [batch, n]` (-1 if none), int32."""
    return jnp.max(jnp.where(x, jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1), -1), axis=-1)


def inverse_cdf_sample(probs: jax.Array, key: jax.Array, block: int = 128) -> jax.Array:
    """One index per row of `probs [batch, vocab]` (non-negative, any total), drawn with probability
    proportional to its entry: the first index whose cumulative sum exceeds a uniform draw. int32 `[batch]`.

    One uniform number per row instead of `jax.random.categorical`'s Gumbel noise over the whole vocabulary
    (on CPU, generating that noise took a third of the decode time). The cumulative sum is taken in two
    levels, over blocks of `block` entries and then within the chosen block, because a cumulative sum over a
    32k vocabulary is 20x slower on XLA:CPU than the two short ones. Zero-probability entries are never drawn;
    a row without probability mass (NaN logits) gives index 0, so the id stays inside the vocabulary.
    """
    batch, vocab = probs.shape
    blocks = -(-vocab // block)
    probs = jnp.pad(probs.astype(jnp.float32), ((0, 0), (0, blocks * block - vocab))).reshape(batch, blocks, block)
    block_mass = probs.sum(axis=-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    u = jax.random.uniform(key, (batch, 1), jnp.float32) * block_cdf[:, -1:]
    chosen = _positive_at_or_after(block_mass, jnp.sum(block_cdf <= u, axis=-1))  # the first cdf above u
    within = jnp.take_along_axis(probs, chosen[:, None, None], axis=1)[:, 0]
    u_within = u - jnp.take_along_axis(block_cdf - block_mass, chosen[:, None], axis=1)
    index = _positive_at_or_after(within, jnp.sum(jnp.cumsum(within, axis=-1) <= u_within, axis=-1))
    return jnp.clip(chosen * block + index, 0, vocab - 1).astype(jnp.int32)


def _positive_at_or_after(values: jax.Array, index: jax.Array) -> jax.Array:
    """The first entry of `values [batch, n]` at or after `index [batch]` that is > 0, else the last one that
    is (-1 if none), int32 `[batch]`.

    Makes a drawn index one with probability. Float32 rounding can otherwise point a draw at a zero entry: u
    rounded up to the total (index n), a chosen block's start (its cdf minus its mass) that rounds above the
    cdf of the block before it, or a parallel prefix sum (as accelerators may compute `cumsum`) whose
    sum after a zero entry rounds lower than the sum before it.
    """
    n = values.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
    positive = values > 0
    after = jnp.min(jnp.where(positive & (iota >= index[:, None]), iota, n), axis=-1)
    return jnp.where(after < n, after, _last_true_index(positive))


def sample(
    policy: Policy,
    prompt_tokens: jax.Array,
    prompt_valid: jax.Array,
    rng: jax.Array,
    config: SamplingConfig,
    eos_id: int | tuple[int, ...],
    pad_id: int,
    temperature: jax.Array | None = None,
    *,
    group_size: int = 1,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
) -> Rollout:
    """Sample `group_size` completions per prompt row.

    Args:
      policy: the policy pytree.
      prompt_tokens: `[P, Lp]` int, left-padded (the last column is every prompt's last token).
      prompt_valid: `[P, Lp]` bool, False on padding.
      rng: PRNG key; the same key gives the same rollout.
      config: static sampling settings.
      eos_id: the id, or a tuple of ids, that end a completion (static; e.g. `tokenizer.stop_ids`: EOS and
        end-of-turn tokens). The stop token itself is part of the completion.
      pad_id: token id written after a completion ends (static).
      temperature: optional traced scalar overriding `config.temperature` (> 0) without recompiling, for
        temperature controllers; ignored for greedy configs.
      group_size: samples per prompt (static): row `p * group_size + g` of the rollout is sample g of prompt
        p. Each prompt is prefilled once; the result equals sampling `jnp.repeat(prompts, group_size, 0)`.
      stop_sequences: token id sequences that end a completion when its last tokens equal one (static; e.g.
        a stop string's encoding: `stop_sequences_for`). The sequence is part of the completion;
        `finish_reason` is FINISH_EOS.

    Raises `ValueError` before compiling for no prompts, an empty prompt, a token id outside the vocabulary (in
    a prompt, its padding, `pad_id`, `eos_id` or `stop_sequences`; `eos_id` may be -1: never sampled), a prompt
    plus `max_new_tokens` beyond the model's `max_position_embeddings`, or `group_size < 1`.
    """
    _check_inputs(policy, prompt_tokens, prompt_valid, config, group_size)
    vocab = policy.config.vocab_size
    eos_id = _token_ids("eos_id", eos_id, vocab, allow_never=True)
    stop_sequences = tuple(_token_ids(f"stop_sequences[{i}]", _sequence(f"stop_sequences[{i}]", seq), vocab,
                                      allow_never=False)
                           for i, seq in enumerate(_sequence("stop_sequences", stop_sequences)))
    if any(not seq for seq in stop_sequences):
        raise ValueError("stop_sequences: every stop sequence needs at least one token id")
    if not 0 <= pad_id < vocab:  # fed back after a completion ends: beyond the table, NaN
        raise ValueError(f"pad_id: token id {pad_id} is outside the model's vocabulary [0, {vocab})")
    return _sample(policy, prompt_tokens, prompt_valid, rng, config, eos_id, pad_id, temperature,
                   group_size=group_size, stop_sequences=stop_sequences)


def _sequence(name: str, value) -> tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name}: expected a sequence of token ids, got {value!r}")
    return tuple(value)


def _token_ids(name: str, value, vocab_size: int, allow_never: bool) -> int | tuple[int, ...]:
    """`value` (an id or a sequence of ids) as a hashable static argument, each id checked to be a token of
    the model (or -1, "never", where `allow_never`): a stop id beyond the vocabulary would never stop."""
    ids = (value,) if isinstance(value, (int, np.integer)) else _sequence(name, value)
    for token in ids:
        if not isinstance(token, (int, np.integer)) or isinstance(token, bool):
            raise ValueError(f"{name}: token ids must be integers, got {token!r}")
        if not (0 <= token < vocab_size or (allow_never and token == -1)):
            raise ValueError(f"{name}: token id {token} is outside the model's vocabulary [0, {vocab_size})")
    return int(value) if isinstance(value, (int, np.integer)) else tuple(int(t) for t in ids)


def compiled_programs() -> int:
    """How many sampler programs have been compiled in this process (one per distinct static setting and
    input shape): the figure to keep small by bucketing prompt lengths and batch sizes."""
    return _sample._cache_size()


def _check_inputs(policy: Policy, prompt_tokens, prompt_valid, config: SamplingConfig, group_size: int) -> None:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if prompt_tokens.ndim != 2 or prompt_tokens.shape != prompt_valid.shape:
        raise ValueError(f"prompt_tokens {prompt_tokens.shape} and prompt_valid {prompt_valid.shape} must be the "
                         "same [batch, prompt_len] shape")
    if not prompt_tokens.shape[0]:
        raise ValueError(f"prompt_tokens {prompt_tokens.shape} has no rows: need at least one prompt")
    total = prompt_tokens.shape[1] + config.max_new_tokens
    if total > policy.config.max_position_embeddings:
        raise ValueError(f"prompt length {prompt_tokens.shape[1]} + max_new_tokens {config.max_new_tokens} = "
                         f"{total} exceeds the model's max_position_embeddings "
                         f"({policy.config.max_position_embeddings})")
    if isinstance(prompt_tokens, jax.core.Tracer) or isinstance(prompt_valid, jax.core.Tracer):
        return  # traced inside a caller's jit: values are not known here
    # In a multi-host run each process checks the rows it holds.
    (tokens, first), (valid, _) = addressable_rows(prompt_tokens), addressable_rows(prompt_valid)
    empty = np.flatnonzero(~valid.any(axis=1))
    if empty.size:
        raise ValueError(f"prompt row {first + int(empty[0])} is empty (no valid token); {empty.size} empty rows")
    if not valid[:, -1].all():
        raise ValueError(f"prompt row {first + int(np.flatnonzero(~valid[:, -1])[0])} is not left-padded: its "
                         "last column is padding")
    # Padding slots too: masked attention multiplies their value by 0, and 0 x NaN (an id beyond the
    # embedding table) is NaN in every real position of the row.
    bad = (tokens < 0) | (tokens >= policy.config.vocab_size)
    if bad.any():
        row, col = map(int, np.argwhere(bad)[0])
        slot = "" if valid[row, col] else " (a padding slot)"
        raise ValueError(f"prompt row {row + first}, position {col}{slot}: token id {int(tokens[row, col])} is "
                         f"outside the model's vocabulary [0, {policy.config.vocab_size})")


def decode_segments(max_new_tokens: int, segments: int) -> list[tuple[int, int]]:
    """Split the decode steps `[0, max_new_tokens)` into at most `segments` equal `(start, end)` ranges of at
    least `MIN_SEGMENT_STEPS` steps each.

    The decode loop runs one segment at a time with a cache just long enough for it: attention over the
    completion so far reads `end` slots instead of `max_new_tokens`, about halving its work for long
    completions, at the price of one more compiled loop body per segment.
    """
    count = max(1, min(segments, -(-max_new_tokens // MIN_SEGMENT_STEPS)))
    length = -(-max_new_tokens // count)
    return [(start, min(start + length, max_new_tokens)) for start in range(0, max_new_tokens, length)]


def stop_sequences_for(tokenizer, stop_strings) -> tuple[tuple[int, ...], ...]:
    """The token sequences that end a completion at each stop string (no BOS), without repeats: the string
    encoded on its own, after a space, and on its own less a first token that decodes to whitespace only.

    Mid-text, a string is often written with other tokens than on its own: a sentencepiece (or Metaspace)
    tokenizer starts a text with a "▁" token that the middle of a text lacks, and a byte-level BPE merges a
    space before the string into its first token. Matching is on tokens, inside the jitted decode loop, so a
    model that writes the string merged with the text around it is still not stopped. Vocabulary tokens such
    as `<|im_end|>` go in `stop_ids` instead.
    """
    sequences = []
    for text in stop_strings:
        alone = tuple(tokenizer.encode(text))
        if not alone:
            raise ValueError(f"stop string {text!r} encodes to no tokens")
        variants = [alone, tuple(tokenizer.encode(" " + text))]
        if len(alone) > 1 and not tokenizer.decode(alone[:1]).strip() and tokenizer.decode(alone[1:]) == text:
            variants.append(alone[1:])
        sequences += [v for v in dict.fromkeys(variants) if v not in sequences]
    return tuple(sequences)


def _ends_with_stop(recent: jax.Array, stop_sequences: tuple[tuple[int, ...], ...]) -> jax.Array:
    """`[batch]` bool: the last tokens `recent [batch, K]` end with one of `stop_sequences` (lengths <= K)."""
    width = recent.shape[1]
    hits = [jnp.all(recent[:, width - len(seq):] == jnp.asarray(seq, jnp.int32), axis=1) for seq in stop_sequences]
    return jnp.any(jnp.stack(hits), axis=0)


def sampling_layout(layout: models.Layout | None) -> models.Layout | None:
    """The layout of the weights the decode loop reads (`gathered_weights`): `layout` without its `fsdp` axis
    (other splits kept), or None when there is nothing to gather (no layout, or an `fsdp` axis of size 1)."""
    if layout is None or layout.mesh.shape.get("fsdp", 1) == 1:
        return None
    return dataclasses.replace(layout, rules=tuple((name, tuple(a for a in axes if a != "fsdp"))
                                                   for name, axes in layout.rules))


def sampling_dtype(path, x, compute_dtype) -> jnp.dtype:
    """The dtype a gathered parameter is held in: layer matrices in the compute dtype (their matmuls cast them to
    it anyway); the embedding table, the output head and vectors (norms, biases) as they are."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if x.ndim >= 2 and "embed_tokens" not in names and "lm_head" not in names:
        return jnp.dtype(compute_dtype)
    return jnp.dtype(x.dtype)


def gathered_weights(policy: Policy) -> Policy:
    """`policy` with its parameters no longer split over the mesh's `fsdp` axis (`sampling_layout`), layer
    matrices cast first (`sampling_dtype`): the values the model computes with. Inside a jitted function, before
    a loop: the loop then reads local weights. Unchanged without a layout or an fsdp axis."""
    gathered = sampling_layout(policy.layout)
    if gathered is None:
        return policy

    def place(path, x):
        x = x.astype(sampling_dtype(path, x, policy.config.dtype))
        return jax.lax.with_sharding_constraint(x, gathered.param_sharding(path, x.shape))

    return policy.replace(params=jax.tree_util.tree_map_with_path(place, policy.params))


@functools.partial(jax.jit, static_argnames=("config", "eos_id", "pad_id", "group_size", "stop_sequences"))
def _sample(policy, prompt_tokens, prompt_valid, rng, config: SamplingConfig, eos_id, pad_id, temperature,
            *, group_size: int, stop_sequences: tuple[tuple[int, ...], ...] = ()) -> Rollout:
    stop_ids = jnp.asarray(eos_id if isinstance(eos_id, tuple) else (eos_id,), jnp.int32)
    if config.gather_weights:
        policy = gathered_weights(policy)
    num_prompts, prompt_len = prompt_tokens.shape
    batch, max_new = num_prompts * group_size, config.max_new_tokens
    positions = models.positions_from_mask(prompt_valid)

    # Prefill the distinct prompts once; their caches are shared by the samples of each (never repeated).
    int8 = config.kv_cache_dtype == "int8"
    prompt_cache = KVCache.zeros(policy.config, num_prompts, prompt_len, int8)
    hidden, prompt_cache = models.apply(policy, prompt_tokens, positions, prompt_valid, prompt_cache, 0)
    logits = jnp.repeat(models.logits_from_hidden(policy, hidden[:, -1:])[:, 0], group_size, axis=0)
    prompt_tokens, prompt_valid, positions = (jnp.repeat(x, group_size, axis=0)
                                              for x in (prompt_tokens, prompt_valid, positions))
    next_position = positions[:, -1] + 1

    def body(carry, key_valid):
        step, cache, logits, tokens, logps, policy_logps, mask, done = carry
        token, logp = sample_token(logits, jax.random.fold_in(rng, step), config, temperature)
        token = jnp.where(done, pad_id, token)
        tokens = tokens.at[:, step].set(token)
        logps = logps.at[:, step].set(jnp.where(done, 0.0, logp))
        if config.policy_logp:
            raw = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None], axis=-1)[:, 0]
            policy_logps = policy_logps.at[:, step].set(jnp.where(done, 0.0, raw))
        mask = mask.at[:, step].set(~done)
        done = done | jnp.isin(token, stop_ids)
        if stop_sequences:  # the completion's last tokens (-1 before its start: never part of a match)
            width = max(map(len, stop_sequences))
            window = jax.lax.dynamic_slice_in_dim(jnp.pad(tokens, ((0, 0), (width, 0)), constant_values=-1),
                                                  step + 1, width, axis=1)
            done = done | _ends_with_stop(window, stop_sequences)
        hidden, cache = models.apply(policy, token[:, None], (next_position + step)[:, None], key_valid, cache,
                                     step)
        logits = models.logits_from_hidden(policy, hidden)[:, 0]
        return step + 1, cache, logits, tokens, logps, policy_logps, mask, done

    carry = (
        jnp.int32(0),
        GroupKVCache(prompt_cache, KVCache.zeros(policy.config, batch, 0, int8)),
        logits,
        jnp.full((batch, max_new), pad_id, jnp.int32),
        jnp.zeros((batch, max_new), jnp.float32),
        jnp.zeros((batch, max_new), jnp.float32) if config.policy_logp else jnp.zeros((), jnp.float32),
        jnp.zeros((batch, max_new), bool),
        jnp.zeros((batch,), bool),
    )
    for start, end in decode_segments(max_new, config.decode_segments):
        step, cache, *rest = carry
        carry = (step, GroupKVCache(cache.prompt, cache.own.extend(end - start)), *rest)
        key_valid = jnp.concatenate([prompt_valid, jnp.ones((batch, end), bool)], axis=1)
        carry = jax.lax.while_loop(lambda carry, end=end: (carry[0] < end) & ~jnp.all(carry[-1]),
                                   functools.partial(body, key_valid=key_valid), carry)
    _, _, _, tokens, logps, policy_logps, mask, done = carry
    return Rollout(
        tokens=jnp.concatenate([prompt_tokens, tokens], axis=1),
        prompt_valid=prompt_valid,
        completion_mask=mask,
        sampler_logp=logps,
        finish_reason=jnp.where(done, FINISH_EOS, FINISH_LENGTH).astype(jnp.int32),
        policy_logp=policy_logps if config.policy_logp else None,
    )
