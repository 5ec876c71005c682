"""Attention kernels: the shared-prefix form and int8 caches against plain attention over explicit keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import KV, attention, causal_padding_mask, quantize_int8, shared_prefix_attention

PROMPTS, GROUP, HEADS, KV_HEADS, HEAD_DIM, PREFIX, OWN = 3, 4, 8, 2, 16, 7, 5


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _case(q_len):
    rng = np.random.default_rng(q_len)
    batch = PROMPTS * GROUP
    q = _normal(rng, batch, q_len, HEADS, HEAD_DIM)
    prefix = KV(_normal(rng, PROMPTS, KV_HEADS, PREFIX, HEAD_DIM), _normal(rng, PROMPTS, KV_HEADS, PREFIX, HEAD_DIM))
    own = KV(_normal(rng, batch, KV_HEADS, OWN, HEAD_DIM), _normal(rng, batch, KV_HEADS, OWN, HEAD_DIM))
    prefix_valid = np.ones((PROMPTS, PREFIX), bool)
    prefix_valid[1, :3] = False  # a left-padded prompt
    key_valid = jnp.concatenate([jnp.repeat(jnp.asarray(prefix_valid), GROUP, 0), jnp.ones((batch, OWN), bool)], 1)
    query_index = jnp.broadcast_to(PREFIX + OWN - q_len + jnp.arange(q_len), (batch, q_len))
    mask = causal_padding_mask(query_index, key_valid)
    return q, prefix, own, mask


def _repeated(prefix: KV, own: KV) -> KV:
    """The prefix copied to every sequence of its group, followed by the sequence's own keys."""
    def join(a, b):
        return None if a is None else jnp.concatenate([jnp.repeat(a, GROUP, 0), b], axis=2)
    return KV(*(join(a, b) for a, b in zip(prefix, own)))


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_shared_prefix_attention_equals_attention_over_repeated_keys(q_len, softcap):
    q, prefix, own, mask = _case(q_len)
    shared = shared_prefix_attention(q, prefix, own, mask, softcap=softcap)
    reference = attention(q, _repeated(prefix, own), mask, softcap=softcap)
    np.testing.assert_allclose(shared, reference, atol=1e-5, rtol=1e-5)


def test_quantize_int8_error_bound():
    x = _normal(np.random.default_rng(0), 4, 6, 16) * 3.0
    quantized, scale = quantize_int8(x)
    assert quantized.dtype == jnp.int8 and scale.shape == (4, 6)
    error = np.abs(np.asarray(quantized.astype(jnp.float32) * scale[..., None] - x))
    assert (error <= np.asarray(scale)[..., None] / 2 + 1e-6).all()
    zeros, zero_scale = quantize_int8(jnp.zeros((2, 8)))
    assert (zeros == 0).all() and (zero_scale == 0).all()


def _int8(kv: KV) -> tuple[KV, KV]:
    """`kv` quantized, and the float values it stands for."""
    (k, k_scale), (v, v_scale) = quantize_int8(kv.k), quantize_int8(kv.v)
    return KV(k, v, k_scale, v_scale), KV(k * k_scale[..., None], v * v_scale[..., None])


@pytest.mark.parametrize("q_len", [1, 3])
def test_int8_caches_equal_attention_over_their_dequantized_values(q_len):
    q, prefix, own, mask = _case(q_len)
    (prefix8, prefix_values), (own8, own_values) = _int8(prefix), _int8(own)
    np.testing.assert_allclose(shared_prefix_attention(q, prefix8, own8, mask),
                               attention(q, _repeated(prefix_values, own_values), mask), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(attention(q, _repeated(prefix8, own8), mask),
                               attention(q, _repeated(prefix_values, own_values), mask), atol=1e-5, rtol=1e-5)
    exact = attention(q, _repeated(prefix, own), mask)
    assert np.abs(np.asarray(shared_prefix_attention(q, prefix8, own8, mask) - exact)).max() < 0.05


def test_bfloat16_shared_prefix_attention_close_to_float32():
    q, prefix, own, mask = _case(1)
    as_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), (q, prefix, own))
    out = shared_prefix_attention(*as_bf16, mask)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), attention(q, _repeated(prefix, own), mask), atol=2e-2)
