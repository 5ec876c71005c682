"""Packed rows through the whole decoder: every family's tiny variant gives, at each real token of a row holding
several sequences (segment ids, positions restarting per sequence, trailing padding), the logits and the
parameter gradients of the same sequences alone in a left-padded batch, for the `xla` and `splash` (Pallas,
interpret mode on CPU) attention kernels, with and without rematerialisation."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import models

BASE = dict(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            intermediate_size=64)
FAMILIES = {
    "llama": dict(family="llama", tie_embeddings=False, norm_eps=1e-5,
                  rope_scaling=models.configs.RopeScaling("llama3", 8.0, 1.0, 4.0, 16)),
    "qwen2": dict(family="qwen2", qkv_bias=True, rope_theta=1e6),
    "qwen3": dict(family="qwen3", qk_norm=True, num_kv_heads=1),
    # sliding window 3 over segments that start at slots 5 and 14: cut by the segment, or the logits differ
    "gemma3": dict(family="gemma3", norm_offset=1.0, post_norms=True, scale_embeddings=True, qk_norm=True,
                   activation="gelu_tanh", query_pre_attn_scalar=16.0, attn_logit_softcap=5.0,
                   final_logit_softcap=8.0, sliding_window=3, layer_types=("sliding", "full"),
                   local_rope_theta=100.0),
}
LENGTHS = ((5, 9, 4), (7, 12))  # sequences of each packed row
ROW = 20  # packed row length: rows end in 2 and 1 padding slots


def _sequences():
    rng = np.random.default_rng(0)
    return [rng.integers(1, BASE["vocab_size"], n).astype(np.int32) for row in LENGTHS for n in row]


def _packed():
    """tokens, segment ids, positions `[rows, ROW]`, and each sequence's (row, first slot)."""
    tokens, segments, positions = (np.zeros((len(LENGTHS), ROW), np.int32) for _ in range(3))
    places, sequences = [], iter(_sequences())
    for r, row in enumerate(LENGTHS):
        slot = 0
        for s, n in enumerate(row):
            tokens[r, slot:slot + n] = next(sequences)
            segments[r, slot:slot + n] = s + 1
            positions[r, slot:slot + n] = np.arange(n)
            places.append((r, slot))
            slot += n
    return jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions), places


def _padded():
    """The same sequences left-padded, one per row: tokens, valid `[sequences, longest]`."""
    sequences = _sequences()
    longest = max(map(len, sequences))
    tokens = np.zeros((len(sequences), longest), np.int32)
    valid = np.zeros((len(sequences), longest), bool)
    for i, s in enumerate(sequences):
        tokens[i, longest - len(s):], valid[i, longest - len(s):] = s, True
    return jnp.asarray(tokens), jnp.asarray(valid)


@functools.cache
def _policy(family: str) -> models.Policy:
    """Random weights, norms and biases too (zero biases and unit norms would test nothing)."""
    policy = models.init(models.ModelConfig(**{**BASE, **FAMILIES[family]}, attention_impl="xla"), 0)
    leaves, tree = jax.tree.flatten(policy.params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noise = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return policy.replace(params=jax.tree.unflatten(tree, noise))


def _token_weights(vocab: int):
    """Per-token loss weights `[tokens, vocab]` in sequence order."""
    total = sum(map(sum, LENGTHS))
    return jnp.asarray(np.random.default_rng(3).standard_normal((total, vocab)), jnp.float32)


def _packed_logits(policy, params):
    tokens, segments, positions, places = _packed()
    policy = policy.replace(params=params)
    hidden, _ = models.apply(policy, tokens, positions, segments, max_segments=3)
    logits = models.logits_from_hidden(policy, hidden)
    rows = [logits[r, slot:slot + len(s)] for (r, slot), s in zip(places, _sequences())]
    return jnp.concatenate(rows), logits, segments


def _padded_logits(policy, params):
    tokens, valid = _padded()
    logits = models.forward(policy.replace(params=params), tokens, valid)
    longest = tokens.shape[1]
    return jnp.concatenate([logits[i, longest - len(s):] for i, s in enumerate(_sequences())])


@functools.cache
def _reference(family: str):
    """The padded path's logits `[tokens, vocab]` and parameter gradients (XLA, no remat)."""
    policy = _policy(family)
    weights = _token_weights(policy.config.vocab_size)

    def loss(params):
        logits = _padded_logits(policy, params)
        return jnp.sum(logits * weights), logits
    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(policy.params)
    return np.asarray(logits), grads


# Every family with each kernel; rematerialised blocks (`config.remat`, which only changes the backward pass) on
# the two families whose blocks differ most (Gemma: sliding window, soft-caps, sandwich norms; Qwen3: q/k norms).
CASES = [(f, i, "none") for f in sorted(FAMILIES) for i in ("xla", "splash")] + [
    (f, i, "full") for f in ("gemma3", "qwen3") for i in ("xla", "splash")]


@pytest.mark.parametrize("family, implementation, remat", CASES)
def test_packed_rows_give_each_sequences_logits_and_gradients(family, implementation, remat):
    policy = models.replace_config(_policy(family), attention_impl=implementation, remat=remat)
    weights = _token_weights(policy.config.vocab_size)

    def loss(params):
        logits, whole, segments = _packed_logits(policy, params)
        return jnp.sum(logits * weights), (logits, whole, segments)
    (_, (logits, whole, segments)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(policy.params)
    want_logits, want_grads = _reference(family)
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=1e-5, rtol=1e-5)
    assert np.isfinite(np.asarray(whole)).all()  # padding slots too: nothing there may poison a gradient
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        g, w = np.asarray(g), np.asarray(w)  # float32 sums in another order: 1e-5 of the leaf's largest entry
        np.testing.assert_allclose(g, w, atol=1e-5 * np.abs(w).max(), rtol=1e-5, err_msg=jax.tree_util.keystr(path))
        assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w), jax.tree_util.keystr(path)


def _ragged_attention_on_cpu(q, k, v, lengths, starts, scale, window):
    """cuDNN's variable-length kernel's semantics on the CPU (as in tests/test_attention.py): each described
    segment `[start, start + length)` attended causally, within `window`, on its own."""
    slot = jnp.arange(q.shape[1])
    starts = starts[:, :-1]
    inside = (slot >= starts[:, :, None]) & (slot < (starts + lengths)[:, :, None]) & (lengths >= 0)[:, :, None]
    same = jnp.einsum("bmi,bmj->bij", inside.astype(jnp.int32), inside.astype(jnp.int32)) > 0
    mask = same & (slot[:, None] >= slot[None, :])
    if window is not None:
        mask &= slot[:, None] - slot[None, :] < window
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="xla")


@pytest.mark.parametrize("remat", ["none", "full"])
def test_max_segments_reaches_the_cudnn_kernel(monkeypatch, remat):
    """`models.apply(..., max_segments=)` is the bound the cuDNN packed path gets, rematerialised or not: with the
    kernel's semantics rendered on the CPU, bf16 logits equal the XLA path's at a bound of 3 (rows of 3 and 2
    sequences) and are NaN on the 3-sequence row at a bound of 2."""
    module = importlib.import_module("jaxrl.kernels.attention")  # (`jaxrl.kernels.attention` the name is a function)
    monkeypatch.setattr(module, "cudnn_packed_available", lambda mesh=None: True)
    monkeypatch.setattr(module, "_cudnn_ragged_attention", _ragged_attention_on_cpu)
    policy = models.replace_config(_policy("qwen2"), dtype="bfloat16", remat=remat)
    tokens, segments, positions, _ = _packed()

    def logits(impl, bound):
        p = models.replace_config(policy, attention_impl=impl)
        hidden, _ = models.apply(p, tokens, positions, segments, max_segments=bound)
        return np.asarray(models.logits_from_hidden(p, hidden))
    real = np.asarray(segments != 0)
    want, got = logits("xla", None)[real], logits("cudnn", 3)[real]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    short = logits("cudnn", 2)
    assert np.isnan(short[0][real[0]]).all() and np.isfinite(short[1]).all()
