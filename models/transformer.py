"""Decoder-only transformer (Flax NNX) covering the Llama 3, Qwen2/2.5, Qwen3 and Gemma 3 (text) families.

GQA, RoPE (+ linear / llama3 scaling), RMSNorm (plain or Gemma's `1 + w`), SwiGLU / GeGLU, optional
q/k/v(/o) biases, q/k norms, sandwich norms, scaled embeddings, sliding-window layers, soft-capping, tied
or untied output head.

Parameters mirror the Hugging Face layout exactly (names below `model.`, linear weights `[out, in]`), so a
checkpoint loads without transposes or renames and saves back bit for bit (`models.hf`).

The module is used functionally at every `jax.jit` boundary: `init` returns a `Policy` whose `params` is a
plain pytree of arrays, and `apply` / `forward` take them back explicitly together with an explicit
`KVCache`. Nothing is stored on the module between calls.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxrl.kernels.attention import (KV, attention, causal_padding_mask, quantize_int8, resolve_implementation,
                               self_attention, shared_prefix_attention, sliding_window_mask, target_platform)
from jaxrl.models.configs import ModelConfig
from jaxrl.models.partitioning import Layout

_INIT = nnx.initializers.normal(stddev=0.02)


class KVCache(NamedTuple):
    """Keys and values of every layer, written in place by the decoder.

    k, v: one array per layer, each `[batch, num_kv_heads, max_len, head_dim]` in the compute dtype, or in int8
      with per-slot scales. Separate arrays (not one stacked `[num_layers, ...]` array) so that attention reads
      a layer's cache without first slicing a copy out of the stack at every decode step.
    k_scale, v_scale: for an int8 cache, one float32 array `[batch, num_kv_heads, max_len]` per layer
      (`kernels.attention.quantize_int8`); empty tuples otherwise.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    k_scale: tuple[jax.Array, ...] = ()
    v_scale: tuple[jax.Array, ...] = ()

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, int8: bool = False) -> "KVCache":
        """An empty cache in the compute dtype, or in int8 (a quarter of float32's memory, half of bf16's)."""
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)
        layers = range(config.num_layers)
        if not int8:
            dtype = jnp.dtype(config.dtype)
            return cls(*(tuple(jnp.zeros(shape, dtype) for _ in layers) for _ in range(2)))
        return cls(*(tuple(jnp.zeros(shape, jnp.int8) for _ in layers) for _ in range(2)),
                   *(tuple(jnp.zeros(shape[:3], jnp.float32) for _ in layers) for _ in range(2)))

    @property
    def int8(self) -> bool:
        return bool(self.k_scale)

    @property
    def length(self) -> int:
        return self.k[0].shape[2]

    def layer(self, layer: int) -> KV:
        return KV(self.k[layer], self.v[layer], *((self.k_scale[layer], self.v_scale[layer]) if self.int8 else ()))

    def extend(self, slots: int) -> "KVCache":
        """The cache with `slots` more (empty) slots at the end."""
        def grow(x):
            return jnp.pad(x, [(0, 0), (0, 0), (0, slots)] + [(0, 0)] * (x.ndim - 3))
        return KVCache(*(tuple(map(grow, part)) for part in self))

    def write(self, layer: int, k: jax.Array, v: jax.Array, index, layout: Layout | None = None) -> "KVCache":
        """The cache with `k, v [batch, kv_heads, seq, head_dim]` written into `layer`'s slots
        `[index, index + seq)` in place (only those slots: a decode step does not copy the cache). `index` is a
        scalar, or `[batch]` for rows that have written different numbers of tokens (multi-turn episodes); a
        write must fit the cache (a slot range past its end would be moved back over earlier slots). With a
        `layout`, the layer's cache keeps its batch over the data axes and its KV heads over `tensor`."""
        per_row = jnp.ndim(index) == 1

        def put(arrays, value):
            value = value.astype(arrays[layer].dtype)
            if per_row:
                updated = jax.vmap(lambda a, x, i: jax.lax.dynamic_update_slice_in_dim(a, x, i, 1))(
                    arrays[layer], value, index)
            else:
                updated = jax.lax.dynamic_update_slice_in_dim(arrays[layer], value, index, 2)
            if layout is not None:
                updated = layout.constrain(updated, CACHE_AXES[:updated.ndim])
            return _replace(arrays, layer, updated)

        if not self.int8:
            return KVCache(put(self.k, k), put(self.v, v))
        (k, k_scale), (v, v_scale) = quantize_int8(k), quantize_int8(v)
        return KVCache(put(self.k, k), put(self.v, v), put(self.k_scale, k_scale), put(self.v_scale, v_scale))


CACHE_AXES = ("batch", "kv_heads", "cache_len", "head_dim")  # logical axes of a cache layer (scales: 3)


@struct.dataclass
class GroupKVCache:
    """Decode cache of `group` sequences per prompt (GRPO's group): each prompt's keys and values are held
    once, not once per sequence, and attention reads them once per group (`shared_prefix_attention`).

    prompt: `[prompts, kv_heads, prompt_len, head_dim]` per layer, filled by the prefill, read-only while
      decoding.
    own: `[prompts * group, kv_heads, own_len, head_dim]` per layer, each sequence's keys after the prompt;
      slot j of it is slot `prompt_len + j` of the sequence. Row `p * group + j` is sample j of prompt p.
    """

    prompt: KVCache
    own: KVCache


def rotary_embedding(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """Rotate `x [batch, seq, heads, head_dim]` by `positions [batch, seq]` (HF "rotate half" layout).

    `inv_freq` `[head_dim // 2]`: the (possibly scaled) inverse frequencies, or a float RoPE base.
    """
    half = x.shape[-1] // 2
    if isinstance(inv_freq, (int, float)):
        inv_freq = 1.0 / (inv_freq ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # [batch, seq, half]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _replace(items: tuple, index: int, value) -> tuple:
    return (*items[:index], value, *items[index + 1:])


def _activation(name: str):
    return {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}[name]


class Linear(nnx.Module):
    """`y = x W^T (+ b)` with `weight [out, in]` (the torch layout) and matmuls in the compute dtype."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, config: ModelConfig,
                 rngs: nnx.Rngs):
        self.dtype = jnp.dtype(config.dtype)
        self.weight = nnx.Param(_INIT(rngs.params(), (out_features, in_features), jnp.dtype(config.param_dtype)))
        if bias:
            self.bias = nnx.Param(jnp.zeros((out_features,), jnp.dtype(config.param_dtype)))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x `[..., in]` -> `[..., out]`. Callers pass 2-D `[tokens, in]`: XLA:CPU runs their weight
        gradients much faster than those of 3-D operands."""
        weight = self.weight[...]
        if weight.dtype != self.dtype:  # (qwix's quantized base weights are held in the compute dtype already)
            weight = weight.astype(self.dtype)
        y = jax.lax.dot_general(x.astype(self.dtype), weight, (((x.ndim - 1,), (1,)), ((), ())))
        if hasattr(self, "bias"):
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, statistics in float32.

    Llama/Qwen: `weight * normed` with `normed` cast to the compute dtype first; Gemma (`offset=1`):
    `normed * (1 + weight)` in float32, then cast (the two conventions round differently in bf16).
    """

    def __init__(self, dim: int, config: ModelConfig):
        self.eps, self.offset, self.dtype = config.norm_eps, config.norm_offset, jnp.dtype(config.dtype)
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - config.norm_offset, jnp.dtype(config.param_dtype)))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight[...].astype(jnp.float32))).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.config, self.layer = config, layer
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = Linear(d, config.num_heads * hd, bias=config.qkv_bias, config=config, rngs=rngs)
        self.k_proj = Linear(d, config.num_kv_heads * hd, bias=config.qkv_bias, config=config, rngs=rngs)
        self.v_proj = Linear(d, config.num_kv_heads * hd, bias=config.qkv_bias, config=config, rngs=rngs)
        self.o_proj = Linear(config.num_heads * hd, d, bias=config.o_bias, config=config, rngs=rngs)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config)
            self.k_norm = RMSNorm(hd, config)

    def __call__(self, x, positions, mask, cache, cache_index, layer, layout: Layout | None = None):
        """x `[batch, seq, hidden]`; `cache`: a `KVCache`, a `GroupKVCache` or None. The segment's keys and
        values are written into this layer's slots `[cache_index, cache_index + seq)` (of the `own` part of a
        `GroupKVCache`). `mask`: `(key_valid [batch, seq], window, max_segments)` without a cache and for a prefill
        through
        the self-attention kernel (`Transformer.__call__`: the segment fills an empty `KVCache` from slot 0;
        it attends to its own keys as computed, also where the cache is int8); else `[batch, seq, key_len]`
        bool over the cache. `layout`: constrains the heads to their mesh axes, and places the self-attention
        kernel (None: XLA decides). Returns `(out [batch, seq, hidden], cache)`."""
        cfg = self.config
        batch, seq, _ = x.shape
        flat = x.reshape(batch * seq, -1)
        q = self.q_proj(flat).reshape(batch, seq, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(flat).reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(flat).reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)
        if layout is not None:
            q = layout.constrain(q, ("batch", "seq", "heads", "head_dim"))
            k = layout.constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
            v = layout.constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = cfg.inv_frequencies(self.layer)
        q = rotary_embedding(q, positions, inv_freq)
        k = rotary_embedding(k, positions, inv_freq)
        settings = dict(scale=cfg.query_scale, softcap=cfg.attn_logit_softcap)
        if isinstance(mask, tuple):  # (key_valid [batch, seq], window or None, max_segments): no cache, or prefill
            key_valid, window, max_segments = mask
            out = self_attention(q, k, v, key_valid, window=window, layout=layout, max_segments=max_segments,
                                 implementation=attention_implementation(cfg, layout), **settings)
            if cache is not None:
                cache = cache.write(layer, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), cache_index, layout)
        else:
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # heads-major, as cached
            if isinstance(cache, GroupKVCache):
                cache = GroupKVCache(cache.prompt, cache.own.write(layer, k, v, cache_index, layout))
                out = shared_prefix_attention(q, cache.prompt.layer(layer), cache.own.layer(layer), mask,
                                              **settings)
            else:
                cache = cache.write(layer, k, v, cache_index, layout)
                out = attention(q, cache.layer(layer), mask, **settings)
        return self.o_proj(out.reshape(batch * seq, cfg.num_heads * cfg.head_dim)).reshape(batch, seq, -1), cache


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.activation = config.activation
        self.gate_proj = Linear(d, f, bias=False, config=config, rngs=rngs)
        self.up_proj = Linear(d, f, bias=False, config=config, rngs=rngs)
        self.down_proj = Linear(f, d, bias=False, config=config, rngs=rngs)

    def __call__(self, x, layout: Layout | None = None):
        flat = x.reshape(-1, x.shape[-1])
        hidden = _activation(self.activation)(self.gate_proj(flat)) * self.up_proj(flat)  # [tokens, mlp]
        if layout is not None:  # rows are batch-major: splitting them over the batch axes splits the batch
            hidden = layout.constrain(hidden, ("batch", "mlp"))
        return self.down_proj(hidden).reshape(x.shape)


class Block(nnx.Module):
    """Pre-norm residual block. HF names: `post_attention_layernorm` is the pre-MLP norm of Llama/Qwen but
    the attention-output norm of Gemma, whose pre-MLP norm is `pre_feedforward_layernorm`."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.post_norms, self.sliding = config.post_norms, config.layer_type(layer) == "sliding"
        self.window = config.sliding_window
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config)
        self.self_attn = Attention(config, layer, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, config)
        if config.post_norms:
            self.pre_feedforward_layernorm = RMSNorm(d, config)
            self.post_feedforward_layernorm = RMSNorm(d, config)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, positions, masks, cache, cache_index, layer, layout: Layout | None = None,
                 max_segments: int | None = None):
        if "full" not in masks:  # no cache, or a prefill: the kernel builds its own mask from padding and window
            mask = (masks["valid"], self.window if self.sliding else None, max_segments)
        else:
            mask = masks["sliding" if self.sliding else "full"]
        h, cache = self.self_attn(self.input_layernorm(x), positions, mask, cache, cache_index, layer, layout)
        if self.post_norms:
            h = self.post_attention_layernorm(h)
            x = x + h
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), layout))
        else:
            x = x + h
            x = x + self.mlp(self.post_attention_layernorm(x), layout)
        if layout is not None:
            x = layout.constrain(x, HIDDEN_AXES)
        return x, cache


HIDDEN_AXES = ("batch", "seq", "activation_embed")  # logical axes of the residual stream


def attention_implementation(config: ModelConfig, layout: Layout | None) -> str:
    """`config.attention_impl` resolved for the devices the program runs on: `layout.mesh`'s (a TPU topology
    compiled for on a CPU host gets splash), else the default backend's."""
    return resolve_implementation(config.attention_impl, target_platform(None if layout is None else layout.mesh))


def is_kernel_prefill(config: ModelConfig, seq: int, cache, cache_index, layout: Layout | None) -> bool:
    """Whether a segment of `seq` tokens is a prefill that goes through the self-attention kernel: it fills a
    `KVCache` (not a `GroupKVCache`) of length `seq` from slot 0 (a static 0: the sampler's prompt pass), so
    its keys are exactly its own tokens' and the attention is the training one (causal, padding, window), and
    the resolved implementation is a kernel (`xla` keeps the dense attention over the cache)."""
    return (isinstance(cache, KVCache) and isinstance(cache_index, int) and cache_index == 0
            and cache.length == seq and attention_implementation(config, layout) != "xla")


class Embedding(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.weight = nnx.Param(_INIT(rngs.params(), (config.vocab_size, config.hidden_size),
                                      jnp.dtype(config.param_dtype)))

    def __call__(self, tokens: jax.Array, layout: Layout | None = None) -> jax.Array:
        """`[batch, seq]` ids -> `[batch, seq, hidden]` in the compute dtype."""
        cfg = self.config
        table = self.weight[...]
        if layout is not None:  # gather the FSDP-split hidden dimension first (as for every FSDP weight): a
            table = layout.constrain(table, ("vocab", None))  # lookup into split columns would need a reshuffle
        x = jnp.take(table, tokens, axis=0).astype(jnp.dtype(cfg.dtype))
        if cfg.scale_embeddings:  # as HF: sqrt(hidden) rounded to the compute dtype, multiplied in it
            x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
        return x


# Rematerialisation (`ModelConfig.remat`) of each block when training: "none" keeps every activation for the
# backward pass; "full" keeps only each block's input and recomputes the rest; "dots" also keeps the outputs
# of the weight matmuls and recomputes attention scores, norms and activations.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _rematerialised_block(block: "Block", layer: int, layout: Layout | None, max_segments: int | None, policy):
    """`(x, positions, masks) -> x`: block `layer` without a cache, rematerialised by `policy`. The block goes in
    as its split state and is merged inside, so nothing flows back out of the rematerialised trace (`nnx.remat`
    writes the block's state back, which a qwix-adapted block cannot take).

    "full" (`nothing_saveable`) compiled for CPU is `_recomputed_after_cotangent`, not `jax.checkpoint`:
    `jax.checkpoint` keeps its recomputation apart from the forward pass with an optimization barrier on the
    recomputation's inputs alone, which XLA's CPU compiler removes before scheduling; the recomputation was then
    merged with the forward pass or scheduled during it, and a "full" step kept every block's activations (no
    memory saved). The TPU compiler keeps the barrier, and there `jax.checkpoint` needs less: the Qwen2.5-7B
    v5e-64 plan's train step peaks at 7.48 GiB per chip with it, 9.53 GiB with the custom VJP (2026-11-28)."""
    graphdef, state = nnx.split(block)

    def forward(state, x, positions, masks):
        return nnx.merge(graphdef, state)(x, positions, masks, None, 0, layer, layout, max_segments)[0]

    if recomputes_after_cotangent(policy, layout):
        recomputed = _recomputed_after_cotangent(forward)
        return lambda x, positions, masks: recomputed(state, x, positions, masks)
    checkpointed = jax.checkpoint(forward, policy=policy)
    return lambda x, positions, masks: checkpointed(state, x, positions, masks)


def recomputes_after_cotangent(policy, layout: Layout | None) -> bool:
    """Whether a block rematerialised by `policy` under `layout` is `_recomputed_after_cotangent` (a "full"
    remat compiled for CPU) rather than `jax.checkpoint` (see `_rematerialised_block`)."""
    return (policy is jax.checkpoint_policies.nothing_saveable
            and target_platform(None if layout is None else layout.mesh) == "cpu")


def _recomputed_after_cotangent(forward):
    """`forward(state, x, *rest)` whose backward pass keeps only its inputs and recomputes the rest once the
    output's cotangent g has arrived: the recomputation's `x` is `x + 0 * g` (the same shape and layout, so
    elementwise, with no communication), a data dependency no compiler may drop (0 * g is not 0 for a
    non-finite g), so the recomputed activations of a block cannot be merged with the forward pass's nor
    computed before the blocks above it are done. A non-finite element of g makes that position's recomputation
    non-finite, as the block's weight gradients (sums over every position) already are.

    The backward pass is traced with the forward pass (`jax.closure_convert`), not after it: interceptors
    active during the model's call, such as qwix's LoRA adapters, are then active in the recomputation too."""
    traced = {}

    def backward(state, x, rest, g):
        x = x + (g * 0).astype(x.dtype)
        return jax.vjp(forward, state, x, *rest)[1](g)

    @jax.custom_vjp
    def run(state, x, *rest):
        return forward(state, x, *rest)

    def run_forward(state, x, *rest):
        y = forward(state, x, *rest)
        traced["backward"], consts = jax.closure_convert(backward, state, x, rest, y)
        return y, (state, x, rest, consts)

    def run_backward(saved, g):
        state, x, rest, consts = saved
        return traced["backward"](state, x, rest, g, *consts)

    run.defvjp(run_forward, run_backward)
    return run


class Transformer(nnx.Module):
    """Attributes named as HF's `model.*` (and top-level `lm_head`) so checkpoints map one to one."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embedding(config, rngs=rngs)
        self.layers = nnx.List([Block(config, i, rngs=rngs) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config)
        if not config.tie_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, config=config, rngs=rngs)

    def __call__(self, tokens, positions, key_valid, cache=None, cache_index=0, layout: Layout | None = None,
                 max_segments: int | None = None):
        """See `apply`."""
        cfg = self.config
        x = self.embed_tokens(tokens, layout)
        if layout is not None:
            x = layout.constrain(x, HIDDEN_AXES)
        masks = {"valid": key_valid}
        if cache is not None and not is_kernel_prefill(cfg, tokens.shape[1], cache, cache_index, layout):
            # dense masks over the cache; without one (or in a prefill) the attention kernel builds its own
            first_slot = jnp.asarray(cache_index) + (cache.prompt.length if isinstance(cache, GroupKVCache) else 0)
            query_index = jnp.broadcast_to(first_slot[..., None] + jnp.arange(tokens.shape[1]), tokens.shape)
            masks["full"] = causal_padding_mask(query_index, key_valid)
            if cfg.sliding_window:
                masks["sliding"] = masks["full"] & sliding_window_mask(query_index, key_valid.shape[1],
                                                                       cfg.sliding_window)
        remat = REMAT_POLICIES[cfg.remat] if cache is None else None  # decoding keeps no activations
        for i, layer in enumerate(self.layers):
            if remat is None:
                x, cache = layer(x, positions, masks, cache, cache_index, i, layout, max_segments)
            else:  # the backward pass recomputes what `remat` does not save of this block
                x = _rematerialised_block(layer, i, layout, max_segments, remat)(x, positions, masks)
        return self.norm(x), cache

    def unembedding(self) -> jax.Array:
        """`[vocab, hidden]` output projection (the embedding table when tied)."""
        if self.config.tie_embeddings:
            return self.embed_tokens.weight[...]
        return self.lm_head.weight[...]


# ----------------------------------------------------------------------------- functional interface


@struct.dataclass
class Policy:
    """A policy as an explicit pytree: only `params` are traced; structure and config are static."""

    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    config: ModelConfig = struct.field(pytree_node=False)
    params: nnx.State
    # Mesh and logical-axis rules the params are placed by (`shard`); None: wherever they are, XLA decides.
    layout: Layout | None = struct.field(pytree_node=False, default=None)
    # With LoRA adapters (`models.lora`): the frozen base, while `params` are the adapters alone. Traced but
    # never differentiated, updated or checkpointed with the params. None: every parameter is in `params`.
    frozen: nnx.State | None = None


def init(config: ModelConfig, seed: int | jax.Array) -> Policy:
    """A policy with random parameters (normal, std 0.02; norms at scale 1)."""
    config.validate()
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(seed)), nnx.Param)
    return Policy(graphdef, config, params)


def abstract(config: ModelConfig) -> Policy:
    """The policy's structure with `jax.ShapeDtypeStruct` leaves: no memory allocated."""
    config.validate()
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
    return Policy(graphdef, config, params)


def replace_config(policy: Policy, **changes) -> Policy:
    """The policy with config fields changed that leave its parameters as they are (`attention_impl`, the
    compute `dtype`, ...): the modules are rebuilt from the new config, the parameters reused."""
    if policy.frozen is not None:
        raise ValueError(f"cannot change {', '.join(changes)} of a policy with LoRA adapters: change the base's "
                         "config before adding them (models.lora.add_adapters)")
    config = dataclasses.replace(policy.config, **changes)
    rebuilt = abstract(config)
    if jax.tree.structure(rebuilt.params) != jax.tree.structure(policy.params) or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(rebuilt.params), jax.tree.leaves(policy.params))):
        raise ValueError(f"changing {', '.join(changes)} changes the parameters; build a new policy instead")
    return Policy(rebuilt.graphdef, config, policy.params, policy.layout)


def shard(policy: Policy, layout: Layout) -> Policy:
    """The policy with its parameters placed on `layout.mesh` by their logical axes (FSDP over `embed`,
    tensor parallelism over heads, MLP columns and vocabulary with the default rules), and the layout kept so
    that jitted functions constrain activations, KV caches and gradients to match."""
    layout = layout.for_model(policy.config)  # weights split whole heads, as their activations and KV cache
    frozen = None if policy.frozen is None else jax.device_put(policy.frozen, layout.param_shardings(policy.frozen))
    return policy.replace(params=jax.device_put(policy.params, layout.param_shardings(policy.params)),
                          layout=layout, frozen=frozen)


def apply(
    policy: Policy,
    tokens: jax.Array,
    positions: jax.Array,
    key_valid: jax.Array,
    cache: KVCache | GroupKVCache | None = None,
    cache_index: int | jax.Array = 0,
    max_segments: int | None = None,
) -> tuple[jax.Array, KVCache | GroupKVCache | None]:
    """Run the decoder over a segment of tokens.

    Args:
      tokens: `[batch, seq]` int.
      positions: `[batch, seq]` int rotary positions (padding excluded from the count).
      key_valid: `[batch, key_len]` bool; key_len = seq without a cache, the cache's length with a `KVCache`,
        `prompt_len + own_len` with a `GroupKVCache`. Without a cache it may instead be int segment ids
        `[batch, seq]` of packed rows (`jaxrl.packing`): 0 on padding, and each token attends only to earlier
        tokens of its own segment (give `positions` restarting at 0 per segment). A segment is a run of equal
        ids; a sliding window counts slots, so within a segment positions, and it stops at the segment's start.
      cache: optional KV cache; the segment's keys/values are written at `cache_index`.
      cache_index: slot of `tokens[:, 0]` in the cache (in its `own` part for a `GroupKVCache`): a scalar, or
        `[batch]` int when rows are at different slots (multi-turn episodes).
      max_segments: packed rows only: a static (Python int) bound on the segments of one row, for the cuDNN
        kernel (`kernels.attention.self_attention`; ignored by the other implementations). None: the row length
        (always enough, but cuDNN then does and keeps work for that many segments per row); a row with more
        segments than the bound gets NaN hidden states at its real tokens.

    A prefill (a `KVCache` exactly as long as the segment, written from a static `cache_index` 0, so every slot
    is overwritten) attends through the self-attention kernel of `config.attention_impl` unless that resolves
    to `xla` (`is_kernel_prefill`). It attends to the segment's keys as computed: with an int8 cache it reads
    the unquantized keys, where the `xla` path reads the quantized cache.

    Returns:
      `(hidden [batch, seq, hidden_size], updated cache or None)`.
    """
    return module(policy)(tokens, positions, key_valid, cache, cache_index, policy.layout, max_segments)


def module(policy: Policy) -> Transformer:
    """The policy's parameters (and frozen base) merged into its module, for one traced call."""
    if policy.frozen is None:
        return nnx.merge(policy.graphdef, policy.params)
    return nnx.merge(policy.graphdef, policy.params, policy.frozen)


def unembedding(policy: Policy) -> jax.Array:
    """`[vocab, hidden]` output projection of the policy head."""
    return module(policy).unembedding()


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(x / cap)` (Gemma's soft-capping); identity when `cap` is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def logits_from_hidden(policy: Policy, hidden: jax.Array) -> jax.Array:
    """`[batch, seq, vocab]` float32 logits from final hidden states `[batch, seq, hidden]`."""
    logits = jnp.einsum("btd,vd->btv", hidden, unembedding(policy), preferred_element_type=jnp.float32)
    return softcap(logits, policy.config.final_logit_softcap)


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
