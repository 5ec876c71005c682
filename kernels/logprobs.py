"""Per-token log-probabilities and entropy of a categorical policy head, without full-vocabulary logits.

The policy loss needs, per token, the log-prob of the sampled token and the entropy of the distribution,
not the `[batch, seq, vocab]` logits (20 GB in float32 at Qwen's 151,936-token vocabulary, batch 8 and 4k
tokens, before their gradient). `token_logprobs` computes both chunk by chunk from the final hidden states:
`[chunk_size, vocab]` logits at a time, in float32. Its custom VJP keeps only the per-token log-sum-exp and
entropy from the forward pass and recomputes each chunk's logits in the backward pass, so neither pass
holds more than one chunk of logits. A chunk is a run of positions of every row, so the loop runs along the
sequence and the batch axis stays split over the mesh's data axes (a loop over chunks of the flattened
`batch * seq` tokens would gather every row's hidden states onto every device). `reference_token_logprobs`
is the plain full-logits computation, for tests and the memory benchmark (`benchmarks/logprobs_memory.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_SIZE = 1024


def token_logprobs(
    hidden: jax.Array,
    unembedding: jax.Array,
    targets: jax.Array,
    temperature: float | jax.Array = 1.0,
    softcap: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of `targets` and entropy of the full distribution at every position.

    Args:
      hidden: `[batch, seq, hidden]` final (normed) hidden states.
      unembedding: `[vocab, hidden]` output projection (the embedding table itself when tied; the Hugging
        Face layout, so no transposed copy of it is made).
      targets: `[batch, seq]` int token ids whose log-probs are wanted.
      temperature: logits are divided by it (log-probs under the sampling temperature); may be traced, and
        gets a gradient.
      softcap: logits -> `softcap * tanh(logits / softcap)` before the temperature (Gemma); None: off.
      chunk_size: tokens per chunk over the whole batch: each chunk covers `max(1, chunk_size // batch)`
        positions of every row. Peak memory holds a few `[chunk tokens, vocab]` float32 arrays (divided
        among the devices the batch is split over), plus, in the backward pass, the unembedding's float32
        gradient.

    Returns:
      `(logprobs [batch, seq], entropy [batch, seq])`, float32, in nats. Differentiable in `hidden`,
      `unembedding` and `temperature`.
    """
    batch, seq, dim = hidden.shape
    positions = max(1, min(seq, chunk_size // batch))  # of every row, per chunk
    chunks = -(-seq // positions)
    pad = chunks * positions - seq

    def by_chunk(x):  # [batch, seq, ...] -> [chunks, batch, positions, ...]; by_row drops the padded tail
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(batch, chunks, positions, *x.shape[2:]), 0, 1)

    def by_row(x):  # [chunks, batch, positions] -> [batch, seq]
        return jnp.swapaxes(x, 0, 1).reshape(batch, chunks * positions)[:, :seq]

    temperature = jnp.asarray(temperature, jnp.float32)
    logp, entropy = _chunked(softcap, by_chunk(hidden), unembedding, by_chunk(targets.astype(jnp.int32)),
                             temperature)
    return by_row(logp), by_row(entropy)


def reference_token_logprobs(
    hidden: jax.Array,
    unembedding: jax.Array,
    targets: jax.Array,
    temperature: float | jax.Array = 1.0,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`token_logprobs` over the full `[batch, seq, vocab]` float32 logits (the naive computation)."""
    logits = jnp.einsum("btd,vd->btv", hidden, unembedding, preferred_element_type=jnp.float32)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    log_probs = jax.nn.log_softmax(logits / temperature, axis=-1)
    target_logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return target_logp, entropy


def _scaled_logits(hidden_chunk, unembedding, temperature, softcap):
    """`(capped [chunk, vocab], scaled [chunk, vocab])`: the (soft-capped) float32 logits and them / T."""
    logits = jax.lax.dot_general(hidden_chunk, unembedding, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    return logits, logits / temperature


def _chunk_stats(softcap, unembedding, temperature, hidden_chunk, target_chunk):
    """hidden `[batch, positions, dim]`, targets `[batch, positions]` -> per-token `(logp, entropy,
    log-sum-exp)` of the chunk, each `[batch, positions]`."""
    shape = target_chunk.shape
    _, scaled = _scaled_logits(hidden_chunk.reshape(-1, hidden_chunk.shape[-1]), unembedding, temperature,
                               softcap)
    lse = jax.nn.logsumexp(scaled, axis=-1)
    probs = jnp.exp(scaled - lse[:, None])
    target = jnp.take_along_axis(scaled, target_chunk.reshape(-1, 1), axis=-1)[:, 0]
    return ((target - lse).reshape(shape), (lse - jnp.sum(probs * scaled, axis=-1)).reshape(shape),
            lse.reshape(shape))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(softcap, hidden, unembedding, targets, temperature):
    """hidden `[chunks, batch, positions, dim]`, targets `[chunks, batch, positions]` -> `(logp, entropy)`,
    each `[chunks, batch, positions]`."""
    logp, entropy, _ = _chunked_forward(softcap, hidden, unembedding, targets, temperature)
    return logp, entropy


def _chunked_forward(softcap, hidden, unembedding, targets, temperature):
    stats = functools.partial(_chunk_stats, softcap, unembedding, temperature)
    return jax.lax.map(lambda xs: stats(*xs), (hidden, targets))


def _chunked_fwd(softcap, hidden, unembedding, targets, temperature):
    logp, entropy, lse = _chunked_forward(softcap, hidden, unembedding, targets, temperature)
    return (logp, entropy), (hidden, unembedding, targets, temperature, entropy, lse)


def _chunked_bwd(softcap, residuals, cotangents):
    """Recompute each chunk's logits; accumulate the unembedding's gradient over chunks in float32.

    With z the scaled logits, p = softmax(z), H the entropy: d logp / dz = onehot(target) - p and
    dH / dz = -p (log p + H).
    """
    hidden, unembedding, targets, temperature, entropy, lse = residuals
    logp_bar, entropy_bar = cotangents

    def step(carry, xs):
        unembedding_bar, temperature_bar = carry
        shape = xs[0].shape  # [batch, positions, dim]; the chunk's tokens flattened below
        hidden_chunk, target_chunk, lse_chunk, entropy_chunk, logp_bar_chunk, entropy_bar_chunk = (
            x.reshape(shape[0] * shape[1], *x.shape[2:]) for x in xs)
        capped, scaled = _scaled_logits(hidden_chunk, unembedding, temperature, softcap)
        log_probs = scaled - lse_chunk[:, None]
        probs = jnp.exp(log_probs)
        scaled_bar = -probs * (logp_bar_chunk[:, None] + entropy_bar_chunk[:, None]
                               * (log_probs + entropy_chunk[:, None]))
        scaled_bar = scaled_bar.at[jnp.arange(target_chunk.shape[0]), target_chunk].add(logp_bar_chunk)
        temperature_bar = temperature_bar - jnp.sum(scaled_bar * scaled) / temperature
        logits_bar = scaled_bar / temperature
        if softcap is not None:
            logits_bar = logits_bar * (1.0 - jnp.square(capped / softcap))
        hidden_bar = jnp.dot(logits_bar, unembedding, preferred_element_type=jnp.float32)
        unembedding_bar = unembedding_bar + jax.lax.dot_general(
            logits_bar, hidden_chunk, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return (unembedding_bar, temperature_bar), hidden_bar.astype(hidden.dtype).reshape(shape)

    init = (jnp.zeros(unembedding.shape, jnp.float32), jnp.zeros((), jnp.float32))
    (unembedding_bar, temperature_bar), hidden_bar = jax.lax.scan(
        step, init, (hidden, targets, lse, entropy, logp_bar, entropy_bar))
    return hidden_bar, unembedding_bar.astype(unembedding.dtype), None, temperature_bar


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
