"""Jitted autoregressive sampling over an explicit KV cache.

One call = one prefill of the distinct (left-padded) prompts, then a decode that stops when every sequence
has emitted a stop token or stop sequence, or `max_new_tokens` tokens exist. With `group_size=G`, the G
samples of a prompt share its prefill and its KV cache (`models.GroupKVCache`): the prompt's keys are held
once, not copied G times, and attention reads them once per group (`kernels.attention.shared_prefix_attention`).
The decode runs as a few `lax.while_loop` segments over a cache that grows between them, so early steps do
not attend over the empty tail of the cache. Everything that crosses the jit boundary is an explicit pytree
(policy params, prompts, RNG key); the cache lives in the loop carry. Bad inputs are rejected on the host
before anything compiles.

Finished rows cost nothing after the segment they end in (`SamplingConfig.compaction`, on by default): the
prefill and the decode segments are then separate jitted programs, and after each of `compaction_segments`
segments the host reads the `[batch]` finished flags and gathers the live rows into the smallest batch bucket
that holds them (`compacted_layout`: prompt slots of `G'` rows, each slot sharing its prompt's cache), so a
long-tailed batch stops decoding its short rows' padding. Each step still draws the whole batch's uniforms and
takes the live rows' share, so the tokens are those of the single program (`_sample`). Compiles stay bounded:
a decode program per segment and batch shape met, a finishing program per batch shape, and a gather (no model
in it, quick to compile) per pair of shapes.
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
    # Filters of the distribution tokens are drawn from; the returned `sampler_logp` stay those of the unfiltered
    # temperature-scaled softmax (`Rollout.sampler_logp`), which the trainer recomputes.
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
    # Stop paying for finished rows: the decode runs one jitted segment at a time (`decode_segments`), and
    # between segments the live rows are gathered into a smaller batch (`compacted_layout`), keeping each
    # prompt's cache shared by its live samples. Same tokens and log-probs as without (the per-step uniform
    # draws are taken for the whole batch and gathered). Off, or inside a caller's jit, or in a multi-process
    # run (each process would need every process's finished rows at every segment): one jitted loop.
    compaction: bool = True
    # The batch sizes (sequences) a compacted decode may run at; the largest must cover the batch (prompts *
    # group_size), and under a sharded policy each must be a multiple of the data-parallel size. Empty: the
    # batch, its halvings and three quarters of each (`default_batch_buckets`: 64, 48, 32, 24, 16, 12, ...).
    batch_buckets: tuple[int, ...] = ()
    # With compaction, the decode runs in up to this many segments instead of `decode_segments` (at least
    # `MIN_SEGMENT_STEPS` steps each): finished rows are dropped after each, so more segments drop them sooner, at
    # the price of more programs to compile. On the ragged bench-small workload (2-core CPU, 2026-11-28) 8 gave
    # 1.88x the single program's useful tokens/s; 16 was no faster (9.35 s vs 9.07 s per call) and compiles
    # twice the programs (benchmarks/RESULTS.md, issue 36).
    compaction_segments: int = dataclasses.field(default=8, metadata={"gt": 0})
    # With compaction: decode at most this many rows at once (a multiple of the data-parallel size). A larger
    # batch waits in line: after each segment, the slots of finished rows are refilled with waiting rows
    # (continuous batching), so a few long completions no longer hold a whole batch, and the own KV cache
    # holds `live_rows` rows, not the batch. Same tokens and log-probs as decoding the batch at once. None: the
    # whole batch at once. The single program (compaction off, inside a jit, multi-process) ignores it. Not faster
    # than compaction alone on the 2-core CPU (0.95x on 2026-11-27, with halving buckets: dense attention reads
    # every row's whole own cache, benchmarks/RESULTS.md issue 36); it bounds the cache's memory.
    live_rows: int | None = dataclasses.field(default=None, metadata={"gt": 0})

    def __post_init__(self):
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # NaN too: it would turn every logit into NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.decode_segments < 1:
            raise ValueError(f"decode_segments must be >= 1, got {self.decode_segments}")
        if self.compaction_segments < 1:
            raise ValueError(f"compaction_segments must be >= 1, got {self.compaction_segments}")
        if self.live_rows is not None and (isinstance(self.live_rows, bool) or not isinstance(self.live_rows, int)
                                           or self.live_rows < 1):
            raise ValueError(f"live_rows must be a positive int or None, got {self.live_rows!r}")
        if self.kv_cache_dtype not in ("compute", "int8"):
            raise ValueError(f"kv_cache_dtype must be 'compute' or 'int8', got {self.kv_cache_dtype!r}")
        buckets = self.batch_buckets
        if not isinstance(buckets, tuple) or any(not isinstance(b, int) or isinstance(b, bool) or b < 1
                                                  for b in buckets):
            raise ValueError(f"batch_buckets must be a tuple of positive ints, got {buckets!r}")
        if not 0 < self.top_p <= 1 or not 0 <= self.min_p < 1 or self.top_k < 0:
            raise ValueError(f"need 0 < top_p <= 1, 0 <= min_p < 1 and top_k >= 0, got top_p={self.top_p}, "
                             f"min_p={self.min_p}, top_k={self.top_k}")


class Rollout(NamedTuple):
    """Sampled completions. B = number of sequences, Lp = padded prompt length, N = max_new_tokens.

    tokens: `[B, Lp + N]` left-padded prompt followed by the completion (pad after it ends).
    prompt_valid: `[B, Lp]` bool, False on left padding.
    completion_mask: `[B, N]` bool, True on generated tokens up to and including EOS.
    sampler_logp: `[B, N]` float32 log-prob of each sampled token under the temperature-scaled, *unfiltered*
      softmax: what the trainer's `completion_logprobs(..., temperature)` computes for the same parameters, so
      importance weights against it are 1 on policy. Top-k / top-p / min-p only choose what is drawn (an
      exploration scheme, as verl uses vLLM's raw log-probs); temperature 0: the softmax at temperature 1.
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
    """Draw one token per row of `logits [batch, vocab]` from the filtered distribution (`filter_logits`);
    returns `(tokens [batch], logp [batch])`, `logp` under the temperature-scaled *unfiltered* softmax (the
    behaviour log-probs the trainer recomputes; temperature 0: the plain softmax of the greedy token)."""
    tokens, logp = _draw(logits, key, config, temperature)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def _draw(logits: jax.Array, key: jax.Array, config: SamplingConfig, temperature: jax.Array | None = None,
          uniform: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`(tokens [batch], log-probs [batch, vocab])` of `sample_token`: the tokens drawn from the filtered
    distribution, the log-probs of the temperature-scaled unfiltered one; `uniform [batch, 1]` replaces the draw
    from `key` (the compacted decode's rows of the whole batch's draw)."""
    if config.temperature == 0.0:
        return first_max_index(logits), jax.nn.log_softmax(logits, axis=-1)
    logp = jax.nn.log_softmax(filter_logits(logits, config, temperature), axis=-1)
    tokens = inverse_cdf_sample(jnp.exp(logp), key, uniform=uniform)
    if filters_on(config):  # drawn from the filtered distribution, scored under the unfiltered one
        logp = jax.nn.log_softmax(logits / (config.temperature if temperature is None else temperature), axis=-1)
    return tokens, logp


def filters_on(config: SamplingConfig) -> bool:
    """Whether top-k, top-p or min-p filtering is configured (a static check: without a filter, the log-probs of
    the distribution drawn from are already those returned)."""
    return bool(config.top_k) or config.top_p < 1.0 or config.min_p > 0.0


def first_max_index(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` for `x [batch, n]` as int32 (the first maximum), as two plain reductions:
    XLA:CPU runs argmax's paired (value, index) reduction about 3x slower. A row of NaNs gives `n - 1`."""
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), index, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)


def _last_true_index(x: jax.Array) -> jax.Array:
    """Index of the last True along the last axis of bool `x [batch, n]` (-1 if none), int32."""
    return jnp.max(jnp.where(x, jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1), -1), axis=-1)


def inverse_cdf_sample(probs: jax.Array, key: jax.Array, block: int = 128,
                       uniform: jax.Array | None = None) -> jax.Array:
    """One index per row of `probs [batch, vocab]` (non-negative, any total), drawn with probability
    proportional to its entry: the first index whose cumulative sum exceeds a uniform draw. int32 `[batch]`.

    One uniform number per row instead of `jax.random.categorical`'s Gumbel noise over the whole vocabulary
    (on CPU, generating that noise took a third of the decode time). The cumulative sum is taken in two
    levels, over blocks of `block` entries and then within the chosen block, because a cumulative sum over a
    32k vocabulary is 20x slower on XLA:CPU than the two short ones. Zero-probability entries are never drawn;
    a row without probability mass (NaN logits) gives index 0, so the id stays inside the vocabulary.
    `uniform [batch, 1]` in [0, 1), when given, is used instead of `jax.random.uniform(key, (batch, 1))`.
    """
    batch, vocab = probs.shape
    blocks = -(-vocab // block)
    probs = jnp.pad(probs.astype(jnp.float32), ((0, 0), (0, blocks * block - vocab))).reshape(batch, blocks, block)
    block_mass = probs.sum(axis=-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    if uniform is None:
        uniform = jax.random.uniform(key, (batch, 1), jnp.float32)
    u = uniform * block_cdf[:, -1:]
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
    forced_lengths=None,
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
      forced_lengths: for benchmarks and tests: `[P * group_size]` ints in `[1, max_new_tokens]`; row i emits
        the first stop id of `eos_id` (not -1) at step `forced_lengths[i] - 1` and ends there (FINISH_EOS),
        its log-probs those of that token. Stop ids and stop sequences sampled before do not end such rows,
        so the lengths are exact. None (the default) costs nothing.

    With `config.compaction` (the default), the decode runs one jitted segment at a time and continues with
    only the rows that have not finished (`_sample_compacted`); the tokens and log-probs are those of the
    single-program sampler (`_sample`), which runs instead inside a caller's jit, in multi-process runs and
    with compaction off. With `config.live_rows` below the batch, at most that many rows decode at once and
    the others wait for the slots of finished ones (`_refilled_decode`); the rollout is the same.

    Raises `ValueError` before compiling for no prompts, an empty prompt, a token id outside the vocabulary (in
    a prompt, its padding, `pad_id`, `eos_id` or `stop_sequences`; `eos_id` may be -1: never sampled), a prompt
    plus `max_new_tokens` beyond the model's `max_position_embeddings`, `group_size < 1`, bad
    `forced_lengths`, `config.batch_buckets` that do not cover the batch (or `live_rows`), or `live_rows` not a
    multiple of the data-parallel size.
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
    batch = prompt_tokens.shape[0] * group_size
    if forced_lengths is not None:
        forced_lengths = _check_forced_lengths(forced_lengths, batch, config, eos_id)
    off = _compaction_off_reason(policy, prompt_tokens, prompt_valid, rng, temperature, config, batch)
    parallel = data_parallel_size(policy.layout)
    if config.live_rows is not None and config.live_rows % parallel:
        raise ValueError(f"SamplingConfig.live_rows {config.live_rows} is not a multiple of the data-parallel size "
                         f"{parallel} of the policy's mesh")
    at_once = batch if config.live_rows is None else min(batch, config.live_rows)
    buckets = batch_buckets(config, at_once, parallel) if config.compaction else ()
    if off is not None:
        return _sample(policy, prompt_tokens, prompt_valid, rng, config, eos_id, pad_id, temperature,
                       group_size=group_size, stop_sequences=stop_sequences, forced_lengths=forced_lengths)
    return _sample_compacted(policy, prompt_tokens, prompt_valid, rng, config, eos_id, pad_id, temperature,
                             group_size=group_size, stop_sequences=stop_sequences, forced_lengths=forced_lengths,
                             buckets=buckets)


def _check_forced_lengths(forced_lengths, batch: int, config: SamplingConfig, eos_id) -> jax.Array:
    if isinstance(forced_lengths, jax.core.Tracer):
        raise ValueError("forced_lengths must be concrete (a benchmark and test setting), not traced")
    lengths = np.asarray(forced_lengths)
    if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"forced_lengths must be {batch} ints (one per sampled row), got shape {lengths.shape} "
                         f"of {lengths.dtype}")
    if lengths.min() < 1 or lengths.max() > config.max_new_tokens:
        raise ValueError(f"forced_lengths must lie in [1, max_new_tokens={config.max_new_tokens}], got "
                         f"[{lengths.min()}, {lengths.max()}]")
    if all(t < 0 for t in (eos_id if isinstance(eos_id, tuple) else (eos_id,))):
        raise ValueError("forced_lengths needs a stop id in eos_id to emit (eos_id is -1, never sampled)")
    return jnp.asarray(lengths, jnp.int32)


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
    return sum(program._cache_size() for program in _PROGRAMS)


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

    def place_frozen(path, x):  # a LoRA base as it is held (a quantized one keeps its integer values)
        return jax.lax.with_sharding_constraint(x, gathered.param_sharding(path, x.shape))

    frozen = None if policy.frozen is None else jax.tree_util.tree_map_with_path(place_frozen, policy.frozen)
    return policy.replace(params=jax.tree_util.tree_map_with_path(place, policy.params), frozen=frozen)


class _Decode(NamedTuple):
    """The decode loop's carry over `B'` rows: the whole batch (`B = P * G`), or after compaction the live rows
    of `P'` prompt slots of `G'` rows each (unused rows padded as finished). N = max_new_tokens."""

    step: jax.Array  # int32 next decode step: a scalar, or `[B']` per row when rows are refilled (`live_rows`)
    cache: GroupKVCache  # prompt part `[P', ...]`, own part `[P' * G', ...]` (length: the steps so far, or more)
    logits: jax.Array  # `[B', vocab]` float32: the next token's logits
    tokens: jax.Array  # `[B', N]` int32 completion so far (pad after a row's end)
    logps: jax.Array  # `[B', N]` float32 sampler log-probs
    policy_logps: jax.Array  # `[B', N]` float32 (`SamplingConfig.policy_logp`), else a float32 scalar 0
    mask: jax.Array  # `[B', N]` bool completion mask
    done: jax.Array  # `[B']` bool: finished (or an unused slot)
    position: jax.Array  # `[B']` int32 rotary position of step 0's token
    prompt_valid: jax.Array  # `[B', Lp]` bool
    rows: jax.Array | None  # `[B']` int32 rollout row of each row (B: an unused slot); None: the whole batch
    forced: jax.Array | None  # `[B']` int32 forced completion lengths (`sample(forced_lengths=...)`) or None


def _prefill(policy: Policy, prompt_tokens, prompt_valid, forced, config: SamplingConfig, pad_id: int,
             group_size: int, rows: bool) -> tuple[_Decode, jax.Array, jax.Array]:
    """Prefill the distinct prompts once (their caches shared by the samples of each, never repeated): the
    decode state before step 0, and the prompt tokens and mask repeated per sample `[B, Lp]`."""
    num_prompts, prompt_len = prompt_tokens.shape
    batch, max_new = num_prompts * group_size, config.max_new_tokens
    positions = models.positions_from_mask(prompt_valid)
    int8 = config.kv_cache_dtype == "int8"
    prompt_cache = KVCache.zeros(policy.config, num_prompts, prompt_len, int8)
    hidden, prompt_cache = models.apply(policy, prompt_tokens, positions, prompt_valid, prompt_cache, 0)
    logits = jnp.repeat(models.logits_from_hidden(policy, hidden[:, -1:])[:, 0], group_size, axis=0)
    prompt_tokens, prompt_valid, positions = (jnp.repeat(x, group_size, axis=0)
                                              for x in (prompt_tokens, prompt_valid, positions))
    state = _Decode(
        step=jnp.int32(0),
        cache=GroupKVCache(prompt_cache, KVCache.zeros(policy.config, batch, 0, int8)),
        logits=logits,
        tokens=jnp.full((batch, max_new), pad_id, jnp.int32),
        logps=jnp.zeros((batch, max_new), jnp.float32),
        policy_logps=jnp.zeros((batch, max_new), jnp.float32) if config.policy_logp else jnp.zeros((), jnp.float32),
        mask=jnp.zeros((batch, max_new), bool),
        done=jnp.zeros((batch,), bool),
        position=positions[:, -1] + 1,
        prompt_valid=prompt_valid,
        rows=jnp.arange(batch, dtype=jnp.int32) if rows else None,
        forced=None if forced is None else jnp.asarray(forced, jnp.int32),
    )
    return state, prompt_tokens, prompt_valid


def _decode_step(state: _Decode, key_valid, *, policy, rng, config: SamplingConfig, temperature, stop_ids,
                 pad_id: int, stop_sequences, batch: int) -> _Decode:
    """One decode step of every row of `state`: draw (the row's share of the whole batch's uniforms when the
    rows are a compacted subset), record, check the stops, and run the new tokens through the model."""
    step, max_new = state.step, config.max_new_tokens
    per_row = step.ndim == 1  # rows at different steps (refilled slots): each draws and writes at its own
    key = jax.random.fold_in(rng, step) if not per_row else rng
    uniform = None
    if state.rows is not None and config.temperature != 0.0:  # the whole batch's draw, as without compaction
        row = jnp.minimum(state.rows, batch - 1)
        if per_row:
            uniform = jax.vmap(lambda t, r: jax.random.uniform(jax.random.fold_in(rng, t), (batch, 1),
                                                               jnp.float32)[r])(step, row)
        else:
            uniform = jax.random.uniform(key, (batch, 1), jnp.float32)[row]
    token, logp = _draw(state.logits, key, config, temperature, uniform)
    if state.forced is not None:
        force = step == state.forced - 1
        token = jnp.where(force, stop_ids[0], token)
    done = state.done
    token = jnp.where(done, pad_id, token)
    logp = jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
    if per_row:  # a finished row (its stop, or max_new_tokens reached) writes nothing and stays at its step
        live = ~done & (step < max_new)
        at = (jnp.arange(step.shape[0]), jnp.where(live, step, max_new))

        def put(x, value):
            return x.at[at].set(value, mode="drop")
    else:
        def put(x, value):
            return x.at[:, step].set(value)
    tokens = put(state.tokens, token)
    logps = put(state.logps, jnp.where(done, 0.0, logp))
    policy_logps = state.policy_logps
    if config.policy_logp:
        raw = jnp.take_along_axis(jax.nn.log_softmax(state.logits, axis=-1), token[:, None], axis=-1)[:, 0]
        policy_logps = put(policy_logps, jnp.where(done, 0.0, raw))
    mask = put(state.mask, ~done)
    if state.forced is not None:  # the forced length alone ends the row
        done = done | force
    else:
        done = done | jnp.isin(token, stop_ids)
        if stop_sequences:  # the completion's last tokens (-1 before its start: never part of a match)
            width = max(map(len, stop_sequences))
            padded = jnp.pad(tokens, ((0, 0), (width, 0)), constant_values=-1)
            if per_row:
                window = jax.vmap(lambda x, t: jax.lax.dynamic_slice_in_dim(x, t + 1, width))(padded, step)
            else:
                window = jax.lax.dynamic_slice_in_dim(padded, step + 1, width, axis=1)
            done = done | _ends_with_stop(window, stop_sequences)
    if per_row:  # a row that reached max_new_tokens drew no token: it stays unfinished by a stop
        done = jnp.where(live, done, state.done)
    hidden, cache = models.apply(policy, token[:, None], (state.position + step)[:, None], key_valid, state.cache,
                                 step)
    logits = models.logits_from_hidden(policy, hidden)[:, 0]
    step = step + live if per_row else step + 1
    return state._replace(step=step, cache=cache, logits=logits, tokens=tokens, logps=logps,
                          policy_logps=policy_logps, mask=mask, done=done)


def _decode_segment(policy, state: _Decode, rng, temperature, end, *, cache_len: int, config: SamplingConfig,
                    eos_id, pad_id: int, stop_sequences, batch: int, iterations: int | None = None) -> _Decode:
    """Decode until step `end` (an int, or traced) or until every row of `state` has finished, over an own cache
    grown to `cache_len >= end` slots. With per-row steps (`iterations` set): `iterations` steps of every
    live row, or until every row has finished (its stop, or `max_new_tokens`); `cache_len` must exceed every
    step reached."""
    stop_ids = jnp.asarray(eos_id if isinstance(eos_id, tuple) else (eos_id,), jnp.int32)
    stop_ids = stop_ids[jnp.argmax(stop_ids >= 0)][None] if state.forced is not None else stop_ids
    rows = state.logits.shape[0]
    own = state.cache.own
    if own.length < cache_len:
        state = state._replace(cache=GroupKVCache(state.cache.prompt, own.extend(cache_len - own.length)))
    key_valid = jnp.concatenate([state.prompt_valid, jnp.ones((rows, cache_len), bool)], axis=1)
    body = functools.partial(_decode_step, key_valid=key_valid, policy=policy, rng=rng, config=config,
                             temperature=temperature, stop_ids=stop_ids, pad_id=pad_id,
                             stop_sequences=stop_sequences, batch=batch)
    if iterations is None:
        return jax.lax.while_loop(lambda s: (s.step < end) & ~jnp.all(s.done), body, state)

    def running(carry):
        i, s = carry
        return (i < iterations) & ~jnp.all(s.done | (s.step >= config.max_new_tokens))

    return jax.lax.while_loop(running, lambda carry: (carry[0] + 1, body(carry[1])), (jnp.int32(0), state))[1]


def _rollout(tokens, logps, policy_logps, mask, done, prompt_tokens, prompt_valid, config: SamplingConfig):
    return Rollout(
        tokens=jnp.concatenate([prompt_tokens, tokens], axis=1),
        prompt_valid=prompt_valid,
        completion_mask=mask,
        sampler_logp=logps,
        finish_reason=jnp.where(done, FINISH_EOS, FINISH_LENGTH).astype(jnp.int32),
        policy_logp=policy_logps if config.policy_logp else None,
    )


@functools.partial(jax.jit, static_argnames=("config", "eos_id", "pad_id", "group_size", "stop_sequences"))
def _sample(policy, prompt_tokens, prompt_valid, rng, config: SamplingConfig, eos_id, pad_id, temperature,
            *, group_size: int, stop_sequences: tuple[tuple[int, ...], ...] = (), forced_lengths=None) -> Rollout:
    """The whole sampler as one program: prefill, then the decode segments, each a `lax.while_loop` that
    stops early only when every row has finished."""
    if config.gather_weights:
        policy = gathered_weights(policy)
    state, prompt_tokens, prompt_valid = _prefill(policy, prompt_tokens, prompt_valid, forced_lengths, config,
                                                  pad_id, group_size, rows=False)
    for _, end in decode_segments(config.max_new_tokens, config.decode_segments):
        state = _decode_segment(policy, state, rng, temperature, end, cache_len=end, config=config, eos_id=eos_id,
                                pad_id=pad_id, stop_sequences=stop_sequences, batch=state.done.shape[0])
    return _rollout(state.tokens, state.logps, state.policy_logps, state.mask, state.done, prompt_tokens,
                    prompt_valid, config)


# ----------------------------------------------------------------------------- compacted decode: one program
# for the prefill, one per decode segment and batch shape (the own cache grows to the segment's end: a cache as
# long as `max_new_tokens` from the start made the ragged bench-small workload 1.4x slower on a 2-core CPU), one
# gather per pair of batch shapes (the compaction before a segment), one to finish per batch shape. The host
# reads the finished flags between segments and gathers the live rows into the smallest bucket that holds them.

@functools.partial(jax.jit, static_argnames=("config", "pad_id", "group_size"))
def _prefill_program(policy, prompt_tokens, prompt_valid, forced, *, config: SamplingConfig, pad_id: int,
                     group_size: int):
    """The decode state before step 0 and the rollout's outputs (`_scatter_rows`)."""
    state, _, _ = _prefill(policy, prompt_tokens, prompt_valid, forced, config, pad_id, group_size, rows=True)
    return state, _scatter_rows(None, state, state.done.shape[0])


@functools.partial(jax.jit, static_argnames=("end", "config", "eos_id", "pad_id", "stop_sequences", "batch",
                                             "iterations"))
def _segment_program(policy, state: _Decode, rng, temperature, *, end: int, config: SamplingConfig, eos_id,
                     pad_id: int, stop_sequences, batch: int, iterations: int | None = None) -> _Decode:
    """One decode segment of the compacted decode: to step `end` (or, with per-row steps, `iterations` steps over
    an own cache of `end` slots). One program per segment and batch shape: the gather that forms the batch is a
    program of its own (`_regather_program`), so the decode loops are not compiled again per pair of shapes."""
    return _decode_segment(policy, state, rng, temperature, end, cache_len=end, config=config, eos_id=eos_id,
                           pad_id=pad_id, stop_sequences=stop_sequences, batch=batch, iterations=iterations)


@functools.partial(jax.jit, static_argnames=("batch",))
def _regather_program(outputs, state: _Decode | None, initial: _Decode, plan, *, batch: int):
    """`_regather` as a program: `(outputs, state)` of the next batch, from `plan = (slot_prompts, state_rows,
    initial_rows)` (`_gather_plan`)."""
    return _regather(outputs, state, initial, *plan, batch)


_gather_program = jax.jit(gathered_weights)


def _regather(outputs, state: _Decode | None, initial: _Decode, slot_prompts, state_rows, initial_rows,
              batch: int):
    """Write the rows of `state` (if any) into the rollout's `outputs` (tokens, logps, policy_logps, mask, done
    over all `batch` rows), then gather the next batch: prompt slot s holds the cache of prompt
    `slot_prompts[s]` (from `initial`, the prefill's state of every row); row j continues the state's row
    `state_rows[j]`, or, where that is -1, starts the rollout row `initial_rows[j]` from the prefill (a refilled
    slot, at step 0), or, where both are -1, is unused (finished). Fresh rows find stale keys in their own cache
    slots: the causal mask hides every slot a row has not written yet."""
    fresh = initial_rows >= 0
    used = fresh | (state_rows >= 0)

    def take(x, rows):
        return jnp.take(x, jnp.maximum(rows, 0), axis=0)

    def pick(name):
        first = getattr(initial, name)
        if first is None or first.ndim == 0:
            return first
        x = take(first, initial_rows)
        if state is None:
            return x
        where = fresh.reshape(fresh.shape + (1,) * (x.ndim - 1))
        return jnp.where(where, x, take(getattr(state, name), state_rows))

    if state is not None:
        outputs = _scatter_rows(outputs, state, batch)
    prompt = KVCache(*(tuple(jnp.take(x, slot_prompts, axis=0) for x in part) for part in initial.cache.prompt))
    source, source_rows = (initial, initial_rows) if state is None else (state, state_rows)  # (prefill: 0 slots)
    own = KVCache(*(tuple(take(x, source_rows) for x in part) for part in source.cache.own))
    if state is None:  # the first batch of a refilled decode: per-row steps from here on
        step = jnp.zeros(fresh.shape, jnp.int32)
    elif state.step.ndim:
        step = jnp.where(fresh, 0, take(state.step, state_rows))
    else:  # compaction only: every row at the same step
        step = state.step
    rows = pick("rows")
    return outputs, _Decode(
        step=step,
        cache=GroupKVCache(prompt, own),
        logits=pick("logits"),
        tokens=pick("tokens"),
        logps=pick("logps"),
        policy_logps=pick("policy_logps"),
        mask=pick("mask"),
        done=pick("done") | ~used,
        position=pick("position"),
        prompt_valid=pick("prompt_valid"),
        rows=jnp.where(used, rows, batch),
        forced=pick("forced"),
    )


def _scatter_rows(outputs, state: _Decode, batch: int):
    """`outputs` (or new ones) with each row of `state` written at its rollout row (unused rows dropped)."""
    parts = (state.tokens, state.logps, state.policy_logps, state.mask, state.done)
    if outputs is None:
        outputs = tuple(x if x.ndim == 0 else jnp.zeros((batch, *x.shape[1:]), x.dtype) for x in parts)
    return tuple(full if part.ndim == 0 else full.at[state.rows].set(part, mode="drop")
                 for full, part in zip(outputs, parts))


@functools.partial(jax.jit, static_argnames=("config", "group_size"))
def _finish_program(outputs, state: _Decode, prompt_tokens, prompt_valid, *, config: SamplingConfig,
                    group_size: int) -> Rollout:
    """The rollout: `outputs` with the last state's rows written in. `state` comes without its cache (one
    program per batch shape, not per cache length)."""
    outputs = _scatter_rows(outputs, state, prompt_tokens.shape[0] * group_size)
    prompt_tokens, prompt_valid = (jnp.repeat(x, group_size, axis=0) for x in (prompt_tokens, prompt_valid))
    return _rollout(*outputs, prompt_tokens, prompt_valid, config)


_PROGRAMS = (_sample, _prefill_program, _segment_program, _regather_program, _gather_program, _finish_program)


def data_parallel_size(layout: models.Layout | None) -> int:
    """The number of parts the batch is split into under `layout` (its `batch` rule's mesh axes); 1 without."""
    if layout is None:
        return 1
    return int(np.prod([layout.mesh.shape[a] for a in dict(layout.rules).get("batch", ())], dtype=np.int64))


def default_batch_buckets(batch: int, parallel: int = 1) -> tuple[int, ...]:
    """The batch sizes a compacted decode of `batch` rows may shrink to by default: `batch`, its successive
    halvings and three quarters of each (64: 64, 48, 32, 24, 16, 12, ...), rounded up to a multiple of `parallel`
    (the data-parallel size), ascending. Halvings alone left a batch of 33 live rows at 64 and one of 17 at 32."""
    def fitted(rows: int) -> int:  # rounded up to a multiple of `parallel`
        return -(-rows // parallel) * parallel

    sizes, size = {batch}, batch
    while size > parallel:
        sizes.add(fitted(-(-3 * size // 4)))
        size = -(-size // 2)
        sizes.add(fitted(size))
    return tuple(sorted(sizes))


def batch_buckets(config: SamplingConfig, batch: int, parallel: int = 1) -> tuple[int, ...]:
    """`config.batch_buckets` checked against a batch of `batch` sequences (or the default ones), ascending."""
    if not config.batch_buckets:
        return default_batch_buckets(batch, parallel)
    buckets = tuple(sorted(set(config.batch_buckets)))
    if buckets[-1] < batch:
        raise ValueError(f"SamplingConfig.batch_buckets {config.batch_buckets} do not cover the batch of {batch} "
                         f"sequences (prompts x group_size, or live_rows if fewer): the largest bucket must be "
                         f">= {batch}")
    uneven = [b for b in buckets if b % parallel]
    if uneven:
        raise ValueError(f"SamplingConfig.batch_buckets {uneven} are not multiples of the data-parallel size "
                         f"{parallel} of the policy's mesh")
    return buckets


def compacted_layout(live_rows: np.ndarray, group_size: int, buckets: tuple[int, ...],
                     parallel: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Where the live rows go in a compacted batch: `(slot_prompts [P'], rows [P' * G'])`.

    `live_rows`: the rollout rows `p * group_size + g` still decoding, ascending. The compacted batch is `P'`
    prompt slots of `G'` rows each: slot s shares the cache of prompt `slot_prompts[s]`, and its rows are
    `rows[s * G' : (s + 1) * G']` (-1: an unused row). A prompt with more than `G'` live rows takes several
    slots (its cache gathered into each). `P' * G'` is the smallest bucket that holds the live rows this way with
    `P'` a multiple of `parallel`, and `G'` is `group_size` where that fits in it (one slot per prompt: the most
    sharing), else 1 (a slot per row, which always fits the smallest bucket). Two widths only, so that a run
    meets few batch shapes, each compiled once (intermediate widths saved little: past the prompt, a row reads
    its own keys, not shared ones). Unused slots read prompt `slot_prompts[0]`.
    """
    prompts = live_rows // group_size
    widths = sorted({group_size, 1}, reverse=True)
    counts = np.bincount(prompts, minlength=int(prompts.max()) + 1) if prompts.size else np.zeros(1, np.int64)
    for size in buckets:
        for width in widths:
            if size % width or (size // width) % parallel:
                continue
            needed = int(np.sum(-(-counts // width)))
            if needed <= size // width:
                slots, rows = [], []
                for p in np.flatnonzero(counts):
                    mine = live_rows[prompts == p]
                    for first in range(0, mine.size, width):
                        chunk = mine[first:first + width]
                        slots.append(p)
                        rows += [*chunk, *[-1] * (width - chunk.size)]
                unused = size // width - len(slots)
                slots += [slots[0] if slots else 0] * unused
                rows += [-1] * (unused * width)
                return np.asarray(slots, np.int32), np.asarray(rows, np.int32)
    raise ValueError(f"no batch bucket of {buckets} holds {live_rows.size} rows")  # buckets cover the batch


def _compaction_off_reason(policy: Policy, prompt_tokens, prompt_valid, rng, temperature, config: SamplingConfig,
                           batch: int) -> str | None:
    """Why the sampler runs as one program (`_sample`) instead of compacting, or None."""
    if not config.compaction:
        return "SamplingConfig.compaction is off"
    if any(isinstance(x, jax.core.Tracer)
           for x in jax.tree.leaves((policy.params, prompt_tokens, prompt_valid, rng, temperature))):
        return "traced inside a caller's jit: the host cannot read the finished rows"
    if jax.process_count() > 1:
        return "multi-process run: every process would need every process's finished rows at every segment"
    if batch == 1 or len(decode_segments(config.max_new_tokens, config.compaction_segments)) == 1:
        return "nothing to compact: one row, or one decode segment"
    return None


def _sample_compacted(policy, prompt_tokens, prompt_valid, rng, config: SamplingConfig, eos_id, pad_id: int,
                      temperature, *, group_size: int, stop_sequences, forced_lengths, buckets) -> Rollout:
    """The sampler with the decode driven from the host, one segment at a time (see `SamplingConfig.compaction`
    and `SamplingConfig.live_rows`)."""
    num_prompts = prompt_tokens.shape[0]
    batch = num_prompts * group_size
    parallel = data_parallel_size(policy.layout)
    if config.gather_weights and sampling_layout(policy.layout) is not None:
        policy = _gather_program(policy)
    initial, outputs = _prefill_program(policy, prompt_tokens, prompt_valid, forced_lengths, config=config,
                                        pad_id=pad_id, group_size=group_size)
    segments = decode_segments(config.max_new_tokens, config.compaction_segments)
    program = functools.partial(_segment_program, policy, rng=rng, temperature=temperature, config=config,
                                eos_id=eos_id, pad_id=pad_id, stop_sequences=stop_sequences, batch=batch)
    if config.live_rows is None or config.live_rows >= batch:
        state, rows = initial, np.arange(batch)  # the rollout row of each row of the state
        for start, end in segments:
            if start:
                live = rows[(rows >= 0) & ~np.asarray(state.done)]
                if not live.size:
                    break
                new_slots, new_rows = compacted_layout(live, group_size, buckets, parallel)
                if new_rows.size < rows.size:
                    plan = _gather_plan(new_slots, new_rows, rows, np.zeros(0, np.int64))
                    outputs, state = _regather_program(outputs, state, initial, plan, batch=batch)
                    rows = new_rows
            state = program(state, end=end)
    else:
        state, outputs = _refilled_decode(program, initial, outputs, group_size, buckets, parallel, config,
                                          segments[0][1])
    state = state._replace(cache=None, logits=None)
    return _finish_program(outputs, state, prompt_tokens, prompt_valid, config=config, group_size=group_size)


def _gather_plan(slots: np.ndarray, rows: np.ndarray, state_rows: np.ndarray, fresh: np.ndarray):
    """`_regather`'s arguments for the next batch `(slots [P'], rows [B'])` of `compacted_layout`: the prompt of
    each slot, and where each row comes from (`state_rows`: the current batch's rollout rows; `fresh`: the rows
    that start now)."""
    position = {int(r): j for j, r in enumerate(state_rows) if r >= 0}
    starting = set(fresh.tolist())
    from_state = np.asarray([position.get(int(r), -1) if r not in starting else -1 for r in rows], np.int32)
    from_prefill = np.asarray([r if r in starting else -1 for r in rows], np.int32)
    return np.asarray(slots, np.int32), from_state, from_prefill


def _refilled_decode(program, initial: _Decode, outputs, group_size: int, buckets, parallel: int,
                     config: SamplingConfig, length: int):
    """Decode the batch `config.live_rows` rows at a time, refilling finished rows' slots with waiting rows
    (in rollout order) after every `length` steps; the decode ends when no row is live or waiting. Each row
    keeps its own step; the own cache holds `max_new_tokens` slots throughout, so the programs differ only by
    batch shape (a cache grown to the deepest live row, as the compacted decode does, made 83 programs over 60
    calls of the bound test instead of 27, and saves little: once the first rows finish, some live row is deep
    most of the time). Returns the last state and the rollout's outputs."""
    batch, capacity, max_new = initial.done.shape[0], config.live_rows, config.max_new_tokens
    state, rows, waiting = None, np.zeros(0, np.int64), 0
    while True:
        if state is None:
            live = np.zeros(0, np.int64)
        else:
            done, step = np.asarray(state.done), np.asarray(state.step)
            running = (rows >= 0) & ~done & (step < max_new)
            live = rows[running]
        fresh = np.arange(waiting, min(batch, waiting + capacity - live.size))
        waiting += fresh.size
        if not live.size and not fresh.size:
            return state, outputs
        slots, next_rows = compacted_layout(np.sort(np.concatenate([live, fresh])), group_size, buckets, parallel)
        plan = _gather_plan(slots, next_rows, rows, fresh)
        outputs, state = _regather_program(outputs, state, initial, plan, batch=batch)
        state = program(state, end=max_new, iterations=length)
        rows = next_rows
