"""Grouped-query attention (XLA reference implementation).

`attention` serves training (no cache: keys are the queries' own tokens) and decoding (keys come from a KV
cache); `shared_prefix_attention` serves group sampling, where the samples of a prompt share its keys.
Backend-specific fast paths (cuDNN, Pallas) plug in behind these later.
"""

from __future__ import annotations

from typing import NamedTuple

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


class KV(NamedTuple):
    """One layer's keys and values, `[batch, num_kv_heads, length, head_dim]` (heads-major, the KV cache's
    layout: XLA's batched matrix products want the batch and head axes leading).

    Either in a float dtype (scales None) or int8 with float32 scales `k_scale, v_scale [batch, num_kv_heads,
    length]`, one per key slot and head (`quantize_int8`): value = int8 * scale. Attention applies the scales
    to the scores and to the softmax weights, so an int8 cache is never dequantized as a whole.
    """

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantization over the last axis: `x [..., d]` -> `(int8 [..., d], float32 scale [...])`
    with `x ~= int8 * scale` (error at most scale / 2 = max|x| / 254 per entry)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    quantized = jnp.round(x / jnp.where(scale == 0, 1.0, scale)[..., None])
    return quantized.astype(jnp.int8), scale


def attention(q: jax.Array, kv: KV, mask: jax.Array, *, scale: float | None = None,
              softcap: float | None = None) -> jax.Array:
    """Softmax attention with grouped KV heads.

    Args:
      q: `[batch, q_len, num_heads, head_dim]`.
      kv: keys and values `[batch, num_kv_heads, k_len, head_dim]`; `num_heads % num_kv_heads == 0`.
      mask: `[batch, q_len, k_len]` bool; rows with no visible key yield finite (ignored) outputs.
      scale: multiplies the scores (default `head_dim ** -0.5`).
      softcap: scores -> `softcap * tanh(scores / softcap)` before masking (Gemma); None: off.

    Returns:
      `[batch, q_len, num_heads, head_dim]` in q's dtype; softmax computed in float32.
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = kv.k.shape[1]
    q = q.reshape(batch, q_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
    per_row = (slice(None), slice(None), None, None)  # [batch, kv, len] scales -> [b, k, q, g, len]
    scores = _scores("bqkgd,bksd->bkqgs", q, kv.k, kv.k_scale, per_row)
    weights = _masked_softmax(scores, mask[:, None, :, None], head_dim, scale, softcap)
    out = _weighted_values("bkqgs,bksd->bkqgd", weights, kv.v, kv.v_scale, per_row, q.dtype)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, q_len, num_heads, head_dim)


def shared_prefix_attention(q: jax.Array, prefix: KV, own: KV, mask: jax.Array, *, scale: float | None = None,
                            softcap: float | None = None) -> jax.Array:
    """Attention of `group` sequences per prompt over their prompt's keys (held once) followed by their own.

    Equal to `attention` over keys `concat(repeat(prefix.k, group), own.k)`, without the repeat: the prefix
    scores of a prompt's whole group are one matrix product with `group * q_len * heads / kv_heads` query rows,
    so the prompt's cache is read once per group instead of once per sequence (Hydragen, Juravsky et al. 2024).

    Args:
      q: `[batch, q_len, num_heads, head_dim]`, batch = prompts * group, row `p * group + j` = sample j of p.
      prefix: the prompts' keys and values, `[prompts, num_kv_heads, prefix_len, head_dim]`.
      own: each sequence's own keys and values after the prefix, `[batch, num_kv_heads, k_len, head_dim]`.
      mask: `[batch, q_len, prefix_len + k_len]` bool over the concatenated key axis.
      scale, softcap: as in `attention`.

    Returns:
      `[batch, q_len, num_heads, head_dim]` in q's dtype; one softmax over both parts, in float32.
    """
    batch, q_len, num_heads, head_dim = q.shape
    prompts, num_kv_heads, prefix_len, _ = prefix.k.shape
    group, groups = batch // prompts, num_heads // num_kv_heads
    # Every product below has its batch axes (prompt or sequence, kv head) leading in its output, the order
    # XLA's batched matrix multiply produces; asking for another order made XLA:CPU's products up to 9x slower.
    # Only the small score and output tensors are transposed.
    per_prompt = (slice(None), slice(None), None, None, None)  # [prompts, kv, len] scales -> [p, k, j, q, g, len]
    per_row = (slice(None), slice(None), None, None)  # [batch, kv, len] -> [b, k, q, g, len]
    q_by_prompt = q.reshape(prompts, group, q_len, num_kv_heads, groups, head_dim)
    prefix_scores = _scores("pjqkgd,pksd->pkjqgs", q_by_prompt, prefix.k, prefix.k_scale, per_prompt)
    prefix_scores = prefix_scores.transpose(0, 2, 1, 3, 4, 5).reshape(batch, num_kv_heads, q_len, groups, prefix_len)
    q = q.reshape(batch, q_len, num_kv_heads, groups, head_dim)
    own_scores = _scores("bqkgd,bksd->bkqgs", q, own.k, own.k_scale, per_row)
    scores = jnp.concatenate([prefix_scores, own_scores], axis=-1)
    weights = _masked_softmax(scores, mask[:, None, :, None], head_dim, scale, softcap)  # [b, k, q, g, s]
    prefix_weights = weights[..., :prefix_len].reshape(prompts, group, num_kv_heads, q_len, groups, prefix_len)
    from_prefix = _weighted_values("pjkqgs,pksd->pkjqgd", prefix_weights, prefix.v, prefix.v_scale,
                                   (slice(None), None, slice(None), None, None), q.dtype)
    from_own = _weighted_values("bkqgs,bksd->bkqgd", weights[..., prefix_len:], own.v, own.v_scale, per_row, q.dtype)
    out = from_prefix.transpose(0, 2, 3, 1, 4, 5).reshape(batch, q_len, num_kv_heads, groups, head_dim)
    return (out + from_own.transpose(0, 2, 1, 3, 4)).reshape(batch, q_len, num_heads, head_dim)


def _scores(spec: str, q: jax.Array, k: jax.Array, k_scale: jax.Array | None, expand: tuple) -> jax.Array:
    """float32 `q . k` scores (an int8 `k` is converted to q's dtype, its scale applied per key)."""
    scores = jnp.einsum(spec, q, k.astype(q.dtype), preferred_element_type=jnp.float32)
    return scores if k_scale is None else scores * k_scale[(*expand, slice(None))]


def _weighted_values(spec: str, weights: jax.Array, v: jax.Array, v_scale: jax.Array | None, expand: tuple,
                     dtype) -> jax.Array:
    """`weights . v` in `dtype` (an int8 `v`'s per-key scale folded into the float32 weights first)."""
    if v_scale is not None:
        weights = weights * v_scale[(*expand, slice(None))]
    return jnp.einsum(spec, weights.astype(dtype), v.astype(dtype))


def _masked_softmax(scores: jax.Array, mask: jax.Array, head_dim: int, scale: float | None,
                    softcap: float | None) -> jax.Array:
    """Softmax over the last axis of float32 `scores` after scaling, soft-capping and masking."""
    scores = scores * (head_dim**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)
