"""Token selections computed once per rollout batch, before it is split into mini/micro-batches.

They depend on statistics of the whole batch (entropy quantiles, log-prob/advantage covariance), so they
are computed here from the sampling policy's log-probs and entropies (`old_logp`; equal to the current
policy's on the first update of a batch) and travel with the batch as `[B, N]` arrays. That keeps every
selection independent of how the batch is later split for gradient accumulation or data parallelism.
All inputs are `[B, N]`; `mask` is the loss mask, which may have holes (multi-turn observation tokens): the
selections rank the masked-in tokens of the whole batch, in row-major order on ties, so they select what
they select on the compacted rows. Clip-Cov's random draw is per position of the `[B, N]` layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

sg = jax.lax.stop_gradient


def truncation_mask(mask: jax.Array, truncated: jax.Array) -> jax.Array:
    """Overlong filtering (DAPO): drop every token of the sequences that hit the length limit.

    truncated: `[B]` bool. Returns the loss mask `[B, N]` float32.
    """
    return mask.astype(jnp.float32) * (~truncated.astype(bool))[:, None]


def _valid_count(mask: jax.Array) -> jax.Array:
    return mask.astype(jnp.float32).sum()


def _share(fraction: float, count: jax.Array, round_up: bool) -> jax.Array:
    """`ceil` / `floor` of `fraction * count`, at least 1, ignoring the float32 rounding of the product
    (float32(0.3) * 50 is 15.000001, whose ceil would be 16)."""
    x = fraction * count
    slack = 1e-6 * x
    return jnp.maximum(jnp.ceil(x - slack) if round_up else jnp.floor(x + slack), 1.0)


def _ranks_descending(scores: jax.Array) -> jax.Array:
    """`[B, N]` rank of each entry of `scores` in descending order over the flattened batch (0 = top)."""
    flat = scores.reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    return jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32)).reshape(
        scores.shape)


def top_entropy_mask(entropy: jax.Array, mask: jax.Array, keep_fraction: float) -> jax.Array:
    """"Forking tokens" (Wang et al. 2025, arXiv 2506.01939): 1.0 on the `keep_fraction` share of valid
    tokens with the highest entropy in the batch (at least one), 0.0 elsewhere."""
    valid = mask.astype(bool)
    k = _share(keep_fraction, _valid_count(mask), round_up=True)
    ranks = _ranks_descending(jnp.where(valid, sg(entropy), -jnp.inf))
    return (valid & (ranks < k)).astype(jnp.float32)


def logp_advantage_covariance(logp: jax.Array, advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-token centred product `(logp - mean logp)(A - mean A)`, means over the batch's valid tokens
    (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617). `[B, N]`, 0 on
    masked tokens."""
    m = mask.astype(jnp.float32)
    count = jnp.maximum(m.sum(), 1.0)
    logp, advantages = sg(logp), sg(advantages)
    centred_logp = logp - jnp.sum(logp * m) / count
    centred_adv = advantages - jnp.sum(advantages * m) / count
    return centred_logp * centred_adv * m


def clip_cov_mask(logp: jax.Array, advantages: jax.Array, mask: jax.Array, key: jax.Array,
                  ratio: float = 2e-4, low: float = 1.0, high: float = 5.0) -> jax.Array:
    """Clip-Cov (Cui et al. 2025): detach a random `ratio` share of valid tokens (at least one) among those
    whose covariance lies strictly in `(low, high)`. Returns per-token weights: 0.0 on the detached
    tokens, 1.0 elsewhere."""
    valid = mask.astype(bool)
    cov = logp_advantage_covariance(logp, advantages, mask)
    candidate = valid & (cov > low) & (cov < high)
    k = _share(ratio, _valid_count(mask), round_up=False)
    priority = jnp.where(candidate, jax.random.uniform(key, cov.shape), -1.0)
    detached = candidate & (_ranks_descending(priority) < k)
    return 1.0 - detached.astype(jnp.float32)


def kl_cov_mask(logp: jax.Array, advantages: jax.Array, mask: jax.Array, ratio: float = 2e-3) -> jax.Array:
    """KL-Cov (Cui et al. 2025): 1.0 on the `ratio` share of valid tokens (at least one) with the largest
    covariance, the tokens that get a KL penalty; 0.0 elsewhere."""
    valid = mask.astype(bool)
    cov = logp_advantage_covariance(logp, advantages, mask)
    k = _share(ratio, _valid_count(mask), round_up=False)
    ranks = _ranks_descending(jnp.where(valid, cov, -jnp.inf))
    return (valid & (ranks < k)).astype(jnp.float32)
