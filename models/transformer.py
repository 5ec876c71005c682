"""Decoder-only transformer (Flax NNX): GQA, RoPE, RMSNorm, SwiGLU, optional qkv bias / qk-norm / tied
embeddings.

The module is used functionally at every `jax.jit` boundary: `init` returns `(graphdef, params)` where
`params` is a plain pytree of arrays, and `forward` takes them back explicitly together with an explicit
`KVCache`. Nothing is stored on the module between calls.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kernels.attention import attention, causal_padding_mask
from models.configs import ModelConfig

_INIT = nnx.initializers.normal(stddev=0.02)


class KVCache(NamedTuple):
    """Keys and values of every layer, written in place by the decoder.

    k, v: `[num_layers, batch, max_len, num_kv_heads, head_dim]` in the compute dtype.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int) -> "KVCache":
        shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
        dtype = jnp.dtype(config.dtype)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate `x [batch, seq, heads, head_dim]` by `positions [batch, seq]` (HF "rotate half" layout)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, seq, half]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, hd = config.hidden_size, config.head_dim
        kw = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype), rngs=rngs,
                  kernel_init=_INIT)
        self.q_proj = nnx.Linear(d, config.num_heads * hd, use_bias=config.qkv_bias, **kw)
        self.k_proj = nnx.Linear(d, config.num_kv_heads * hd, use_bias=config.qkv_bias, **kw)
        self.v_proj = nnx.Linear(d, config.num_kv_heads * hd, use_bias=config.qkv_bias, **kw)
        self.o_proj = nnx.Linear(config.num_heads * hd, d, use_bias=False, **kw)
        if config.qk_norm:
            norm_kw = dict(epsilon=config.norm_eps, param_dtype=jnp.dtype(config.param_dtype), rngs=rngs)
            self.q_norm = nnx.RMSNorm(hd, **norm_kw)
            self.k_norm = nnx.RMSNorm(hd, **norm_kw)

    def __call__(self, x, positions, mask, cache_kv, cache_index):
        """x `[batch, seq, hidden]`; cache_kv `(k, v)` of this layer `[batch, max_len, kv_heads, head_dim]`
        or None. Returns `(out [batch, seq, hidden], (k, v))`."""
        cfg = self.config
        batch, seq, _ = x.shape
        flat = x.reshape(batch * seq, -1)
        q = self.q_proj(flat).reshape(batch, seq, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(flat).reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(flat).reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary_embedding(q, positions, cfg.rope_theta)
        k = rotary_embedding(k, positions, cfg.rope_theta)
        if cache_kv is not None:
            k = jax.lax.dynamic_update_slice_in_dim(cache_kv[0], k.astype(cache_kv[0].dtype), cache_index, 1)
            v = jax.lax.dynamic_update_slice_in_dim(cache_kv[1], v.astype(cache_kv[1].dtype), cache_index, 1)
        out = attention(q, k, v, mask).reshape(batch * seq, cfg.num_heads * cfg.head_dim)
        return self.o_proj(out).reshape(batch, seq, -1), (k, v)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        kw = dict(use_bias=False, dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype),
                  rngs=rngs, kernel_init=_INIT)
        self.gate_proj = nnx.Linear(d, f, **kw)
        self.up_proj = nnx.Linear(d, f, **kw)
        self.down_proj = nnx.Linear(f, d, **kw)

    def __call__(self, x):
        # Matmuls on [tokens, features]: XLA:CPU runs the weight gradients of 2-D operands much faster.
        flat = x.reshape(-1, x.shape[-1])
        out = self.down_proj(nnx.silu(self.gate_proj(flat)) * self.up_proj(flat))
        return out.reshape(x.shape)


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        norm_kw = dict(epsilon=config.norm_eps, dtype=jnp.dtype(config.dtype),
                       param_dtype=jnp.dtype(config.param_dtype), rngs=rngs)
        self.input_norm = nnx.RMSNorm(config.hidden_size, **norm_kw)
        self.attn = Attention(config, rngs=rngs)
        self.post_attention_norm = nnx.RMSNorm(config.hidden_size, **norm_kw)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, positions, mask, cache_kv, cache_index):
        attn_out, kv = self.attn(self.input_norm(x), positions, mask, cache_kv, cache_index)
        x = x + attn_out
        return x + self.mlp(self.post_attention_norm(x)), kv


class Transformer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.hidden_size, dtype=jnp.dtype(config.dtype),
                               param_dtype=jnp.dtype(config.param_dtype), embedding_init=_INIT, rngs=rngs)
        self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = nnx.RMSNorm(config.hidden_size, epsilon=config.norm_eps,
                                      dtype=jnp.dtype(config.dtype),
                                      param_dtype=jnp.dtype(config.param_dtype), rngs=rngs)
        if not config.tie_embeddings:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False,
                                      dtype=jnp.dtype(config.dtype),
                                      param_dtype=jnp.dtype(config.param_dtype), kernel_init=_INIT,
                                      rngs=rngs)

    def __call__(self, tokens, positions, key_valid, cache=None, cache_index=0):
        """See `forward`."""
        x = self.embed(tokens)
        seq = tokens.shape[1]
        query_index = jnp.broadcast_to(cache_index + jnp.arange(seq), tokens.shape)
        mask = causal_padding_mask(query_index, key_valid)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else (cache.k[i], cache.v[i])
            x, (k, v) = layer(x, positions, mask, layer_cache, cache_index)
            new_k.append(k)
            new_v.append(v)
        hidden = self.final_norm(x)
        new_cache = None if cache is None else KVCache(jnp.stack(new_k), jnp.stack(new_v))
        return hidden, new_cache

    def unembedding(self) -> jax.Array:
        """`[hidden, vocab]` output projection."""
        if self.config.tie_embeddings:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]


# ----------------------------------------------------------------------------- functional interface


@struct.dataclass
class Policy:
    """A policy as an explicit pytree: only `params` are traced; structure and config are static."""

    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    config: ModelConfig = struct.field(pytree_node=False)
    params: nnx.State


def init(config: ModelConfig, seed: int | jax.Array) -> Policy:
    """A policy with random parameters (normal, std 0.02; norms at 1)."""
    config.validate()
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(seed)), nnx.Param)
    return Policy(graphdef, config, params)


def apply(
    policy: Policy,
    tokens: jax.Array,
    positions: jax.Array,
    key_valid: jax.Array,
    cache: KVCache | None = None,
    cache_index: int | jax.Array = 0,
) -> tuple[jax.Array, KVCache | None]:
    """Run the decoder over a segment of tokens.

    Args:
      tokens: `[batch, seq]` int.
      positions: `[batch, seq]` int rotary positions (padding excluded from the count).
      key_valid: `[batch, key_len]` bool; key_len = seq without a cache, the cache's max_len with one.
      cache: optional KV cache; the segment's keys/values are written at `cache_index`.
      cache_index: slot of `tokens[:, 0]` in the cache (scalar).

    Returns:
      `(hidden [batch, seq, hidden_size], updated cache or None)`.
    """
    model = nnx.merge(policy.graphdef, policy.params)
    return model(tokens, positions, key_valid, cache, cache_index)


def unembedding(policy: Policy) -> jax.Array:
    """`[hidden, vocab]` output projection of the policy head."""
    return nnx.merge(policy.graphdef, policy.params).unembedding()


def logits_from_hidden(policy: Policy, hidden: jax.Array) -> jax.Array:
    """`[batch, seq, vocab]` float32 logits from final hidden states `[batch, seq, hidden]`."""
    return jnp.einsum("btd,dv->btv", hidden, unembedding(policy), preferred_element_type=jnp.float32)


def positions_from_mask(valid: jax.Array) -> jax.Array:
    """Rotary positions `[batch, seq]` for a left-padded batch: 0 at the first valid token."""
    return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 0)


def forward(policy: Policy, tokens: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Full forward pass without a cache: logits `[batch, seq, vocab]` in float32.

    `valid` `[batch, seq]` marks real tokens of a left-padded batch (default: all valid).
    """
    if valid is None:
        valid = jnp.ones(tokens.shape, bool)
    hidden, _ = apply(policy, tokens, positions_from_mask(valid), valid)
    return logits_from_hidden(policy, hidden)
