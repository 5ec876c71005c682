"""Grouped-query attention (XLA reference implementation).

One entry point for training (no cache: keys are the queries' own tokens) and decoding (keys come from a
KV cache). Backend-specific fast paths (cuDNN, Pallas) plug in behind `attention` later.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_padding_mask(query_index: jax.Array, key_valid: jax.Array) -> jax.Array:
    """Boolean mask `[batch, q_len, k_len]`: key j is visible to query i iff j <= index(i) and j is valid.

    Args:
      query_index: `[batch, q_len]` int, absolute slot of each query in the key axis.
      key_valid: `[batch, k_len]` bool, False for padding slots.
    """
    key_index = jnp.arange(key_valid.shape[1])
    causal = key_index[None, None, :] <= query_index[:, :, None]
    return causal & key_valid[:, None, :]


def sliding_window_mask(query_index: jax.Array, key_len: int, window: int) -> jax.Array:
    """`[batch, q_len, k_len]` bool: key slot j is within the last `window` slots of query slot i
    (`j > i - window`, transformers' `sliding_window_overlay`). Combine with `causal_padding_mask`.

    Slots, not rotary positions: the batch is left-padded, so the two differ by a per-row constant.
    """
    key_index = jnp.arange(key_len)
    return key_index[None, None, :] > query_index[:, :, None] - window


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None,
              softcap: float | None = None) -> jax.Array:
    """Softmax attention with grouped KV heads.

    Args:
      q: `[batch, q_len, num_heads, head_dim]`.
      k, v: `[batch, k_len, num_kv_heads, head_dim]`; `num_heads % num_kv_heads == 0`.
      mask: `[batch, q_len, k_len]` bool; rows with no visible key yield finite (ignored) outputs.
      scale: multiplies the scores (default `head_dim ** -0.5`).
      softcap: scores -> `softcap * tanh(scores / softcap)` before masking (Gemma); None: off.

    Returns:
      `[batch, q_len, num_heads, head_dim]` in q's dtype; softmax computed in float32.
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    groups = num_heads // num_kv_heads
    q = q.reshape(batch, q_len, num_kv_heads, groups, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v)
    return out.reshape(batch, q_len, num_heads, head_dim)
