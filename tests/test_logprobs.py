"""Chunked log-probs and entropy (custom VJP) against the full-logits computation, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.logprobs import reference_token_logprobs, token_logprobs

BATCH, SEQ, DIM, VOCAB = 3, 11, 16, 50


def _inputs(seed):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
    params = {"embed": jnp.asarray(rng.standard_normal((VOCAB, DIM)), jnp.float32),
              "mix": jnp.asarray(rng.standard_normal((DIM, DIM)) / DIM**0.5, jnp.float32),
              "head": jnp.asarray(rng.standard_normal((VOCAB, DIM)), jnp.float32)}
    mask = np.ones((BATCH, SEQ), bool)
    mask[0, :4] = False  # ragged: left padding in one row, a short row
    mask[2, 7:] = False
    weights = (jnp.asarray(rng.standard_normal((BATCH, SEQ)), jnp.float32),
               jnp.asarray(rng.standard_normal((BATCH, SEQ)), jnp.float32))
    return tokens, targets, params, jnp.asarray(mask), weights


def _loss(fn, tied, params, temperature, tokens, targets, mask, weights, softcap, **kwargs):
    """A scalar of both outputs through a tiny model, so gradients reach hidden states and the head."""
    hidden = jnp.tanh(params["embed"][tokens] @ params["mix"])
    head = params["embed"] if tied else params["head"]
    logp, entropy = fn(hidden, head, targets, temperature, softcap, **kwargs)
    return jnp.sum(jnp.where(mask, weights[0] * logp + weights[1] * entropy, 0.0)), (logp, entropy)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("temperature, softcap, chunk_size", [(1.0, None, 8), (0.7, None, 5), (1.3, 4.0, 33),
                                                              (1.0, None, 1000)])
def test_values_and_gradients_equal_full_logits(tied, temperature, softcap, chunk_size):
    tokens, targets, params, mask, weights = _inputs(0)
    args = (tokens, targets, mask, weights, softcap)
    grad = jax.value_and_grad(_loss, argnums=(2, 3), has_aux=True)
    (got, (logp, entropy)), (got_params, got_t) = grad(token_logprobs, tied, params, jnp.float32(temperature),
                                                       *args, chunk_size=chunk_size)
    (want, (ref_logp, ref_entropy)), (want_params, want_t) = grad(reference_token_logprobs, tied, params,
                                                                   jnp.float32(temperature), *args)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    for name in params:  # relative to the gradient's scale: sums over chunks round in another order
        _assert_close_at_scale(got_params[name], want_params[name], name)
    _assert_close_at_scale(got_t, want_t, "temperature")


def _assert_close_at_scale(got, want, name, tolerance=1e-5):
    scale = float(np.max(np.abs(want)))
    error = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
    assert error <= tolerance * scale, f"{name}: max error {error:.3g} > {tolerance} x max |gradient| {scale:.3g}"


def test_bfloat16_inputs_keep_their_dtypes_and_stay_close():
    tokens, targets, params, mask, weights = _inputs(1)
    hidden = jnp.tanh(params["embed"][tokens] @ params["mix"])
    as_bf16 = hidden.astype(jnp.bfloat16), params["head"].astype(jnp.bfloat16)
    logp, entropy = token_logprobs(*as_bf16, targets, chunk_size=7)
    ref_logp, ref_entropy = reference_token_logprobs(*as_bf16, targets)
    assert logp.dtype == entropy.dtype == jnp.float32
    np.testing.assert_allclose(logp, ref_logp, atol=1e-4)
    np.testing.assert_allclose(entropy, ref_entropy, atol=1e-4)
    grads = jax.grad(lambda h, w: jnp.sum(token_logprobs(h, w, targets, chunk_size=7)[0]), argnums=(0, 1))(*as_bf16)
    assert grads[0].dtype == grads[1].dtype == jnp.bfloat16


def test_jit_and_traced_temperature():
    tokens, targets, params, mask, weights = _inputs(2)
    hidden = jnp.tanh(params["embed"][tokens] @ params["mix"])
    fn = jax.jit(lambda h, w, t: token_logprobs(h, w, targets, t, chunk_size=16))
    np.testing.assert_allclose(fn(hidden, params["head"], 0.5)[0],
                               reference_token_logprobs(hidden, params["head"], targets, 0.5)[0], atol=1e-5)
