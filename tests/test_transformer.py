"""The decoder: cached decoding must reproduce the full forward pass, padding must not leak."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import models
from jaxrl.models import KVCache

CONFIG = models.ModelConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, intermediate_size=64)


def _left_padded_batch(rng, batch=3, length=12, pads=(0, 3, 5)):
    tokens = rng.integers(4, CONFIG.vocab_size, size=(batch, length)).astype(np.int32)
    valid = np.ones((batch, length), bool)
    for row, pad in enumerate(pads):
        valid[row, :pad] = False
        tokens[row, :pad] = 0
    return jnp.asarray(tokens), jnp.asarray(valid)


@pytest.mark.parametrize("variant", [{}, {"qkv_bias": True, "qk_norm": True, "tie_embeddings": False}])
def test_cached_decoding_matches_full_forward(variant):
    config = models.ModelConfig(**{**CONFIG.__dict__, **variant})
    policy = models.init(config, 0)
    tokens, valid = _left_padded_batch(np.random.default_rng(0))
    full = models.forward(policy, tokens, valid)  # [B, T, V]

    prefill = 7
    total = tokens.shape[1]
    positions = models.positions_from_mask(valid)
    cache = KVCache.zeros(config, tokens.shape[0], total)
    hidden, cache = models.apply(policy, tokens[:, :prefill], positions[:, :prefill], valid, cache, 0)
    cached = [models.logits_from_hidden(policy, hidden)]
    for t in range(prefill, total):
        hidden, cache = models.apply(policy, tokens[:, t:t + 1], positions[:, t:t + 1], valid, cache, t)
        cached.append(models.logits_from_hidden(policy, hidden))
    cached = jnp.concatenate(cached, axis=1)
    np.testing.assert_allclose(np.where(valid[..., None], cached, 0), np.where(valid[..., None], full, 0),
                               atol=1e-5, rtol=1e-5)


def test_left_padding_does_not_change_logits():
    policy = models.init(CONFIG, 1)
    tokens = jnp.asarray(np.random.default_rng(1).integers(4, 40, size=(1, 6)), jnp.int32)
    alone = models.forward(policy, tokens)
    padded = jnp.concatenate([jnp.zeros((1, 4), jnp.int32), tokens], axis=1)
    valid = jnp.concatenate([jnp.zeros((1, 4), bool), jnp.ones((1, 6), bool)], axis=1)
    np.testing.assert_allclose(models.forward(policy, padded, valid)[:, 4:], alone, atol=1e-5, rtol=1e-5)


def test_parameter_count_and_grouped_heads():
    policy = models.init(CONFIG, 0)
    assert sum(x.size for x in jax.tree.leaves(policy.params)) == models.num_parameters(CONFIG)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        models.init(models.ModelConfig(num_heads=4, num_kv_heads=3), 0)


def test_rotary_embedding_is_relative():
    """Scores depend only on position differences: shifting every position leaves them unchanged."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(1, 5, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 5, 1, 8)), jnp.float32)
    pos = jnp.arange(5)[None]
    scores = lambda p: jnp.einsum("bqhd,bkhd->bqk", models.transformer.rotary_embedding(q, p, 1e4),
                                  models.transformer.rotary_embedding(k, p, 1e4))
    np.testing.assert_allclose(scores(pos), scores(pos + 11), atol=1e-4)


def test_splash_attention_model_matches_xla_logits_and_gradients():
    """A Gemma-style model (sliding and global layers, soft-capped scores) with `attention_impl=splash`
    (Pallas, interpret mode on CPU) against the XLA kernel: logits and parameter gradients."""
    base = dict(CONFIG.__dict__, family="gemma3", sliding_window=4, layer_types=("sliding", "full"),
                attn_logit_softcap=20.0)
    xla = models.init(models.ModelConfig(**{**base, "attention_impl": "xla"}), 3)
    splash = models.init(models.ModelConfig(**{**base, "attention_impl": "splash"}), 3)  # the same weights
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(splash.params), jax.tree.leaves(xla.params)))
    tokens, valid = _left_padded_batch(np.random.default_rng(3))
    np.testing.assert_allclose(np.where(valid[..., None], models.forward(splash, tokens, valid), 0),
                               np.where(valid[..., None], models.forward(xla, tokens, valid), 0), atol=1e-5)

    def loss(policy):
        return lambda params: jnp.sum(jnp.where(valid[..., None], models.forward(policy.replace(params=params),
                                                                                   tokens, valid), 0.0) ** 2)
    want, got = jax.grad(loss(xla))(xla.params), jax.grad(loss(splash))(splash.params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_replace_config_switches_the_attention_kernel_and_keeps_the_parameters():
    policy = models.init(CONFIG, 0)
    splash = models.replace_config(policy, attention_impl="splash")
    assert splash.config.attention_impl == "splash" and splash.params is policy.params
    tokens = jnp.ones((1, 5), jnp.int32)
    assert "pallas_call" in str(jax.make_jaxpr(lambda t: models.forward(splash, t))(tokens))
    assert "pallas_call" not in str(jax.make_jaxpr(lambda t: models.forward(policy, t))(tokens))
    with pytest.raises(ValueError, match="changes the parameters"):
        models.replace_config(policy, hidden_size=64)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_rematerialised_blocks_give_the_same_gradients(remat):
    """`model.remat` changes what the backward pass keeps, not what it computes; the jaxpr really checkpoints."""
    config = models.ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=8, intermediate_size=64, sliding_window=3, layer_types=("sliding", "full"))
    policy = models.init(config, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 24, (2, 7)))
    valid = jnp.asarray(np.arange(7)[None] >= np.array([[0], [2]]))

    def loss(params, p):
        return jnp.mean(models.forward(p.replace(params=params), tokens, valid) ** 2)

    expected = jax.grad(loss)(policy.params, policy)
    rematerialised = models.replace_config(policy, remat=remat)
    grads = jax.jit(jax.grad(loss))(rematerialised.params, rematerialised)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    # "dots" is `jax.checkpoint`; "full" recomputes each block after its output's cotangent (a custom VJP)
    marker, traced = ("remat", jax.grad(loss)) if remat == "dots" else ("custom_vjp_call", loss)
    assert marker in str(jax.make_jaxpr(traced)(rematerialised.params, rematerialised))
    assert marker not in str(jax.make_jaxpr(traced)(policy.params, policy))
