"""Chunked log-probs and entropy (custom VJP) against the full-logits computation, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels.logprobs import reference_token_logprobs, token_logprobs

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


def test_the_batch_stays_split_over_the_data_axis():
    """On 8 devices with the batch split over `data`, neither pass gathers hidden states across devices (the
    chunk loop runs along the sequence), the log-probs stay split like the batch, and the values match one
    device's."""
    from test_scale_out import _run_with_8_devices

    _run_with_8_devices("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from jaxrl.kernels.logprobs import token_logprobs

        mesh = Mesh(np.array(jax.devices()), ("data",))
        rng = np.random.default_rng(0)
        batch, seq, dim, vocab = 16, 40, 8, 64  # chunk_size 64: 4 positions of every row, 10 chunks
        h = jnp.asarray(rng.standard_normal((batch, seq, dim)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((vocab, dim)), jnp.float32)
        t = jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32)
        rows = NamedSharding(mesh, P("data"))
        sharded = (jax.device_put(h, rows), jax.device_put(w, NamedSharding(mesh, P())), jax.device_put(t, rows))

        def loss(h, w, t):
            logp, entropy = token_logprobs(h, w, t, chunk_size=64)
            return jnp.sum(0.3 * logp + entropy)

        forward = jax.jit(lambda h, w, t: token_logprobs(h, w, t, chunk_size=64))
        backward = jax.jit(jax.grad(loss, argnums=(0, 1)))
        for name, fn in (("forward", forward), ("backward", backward)):
            gathers = [line for line in fn.lower(*sharded).compile().as_text().splitlines()
                       if "all-gather(" in line]
            # only the backward's scatter indices ([chunk tokens, 2] int32) may be gathered, never hidden states
            assert all(" = s32[" in line for line in gathers), (name, gathers)
        logp, entropy = forward(*sharded)
        assert logp.sharding.is_equivalent_to(rows, 2) and entropy.sharding.is_equivalent_to(rows, 2)
        for got, want in zip((logp, entropy, *backward(*sharded)), (*forward(h, w, t), *backward(h, w, t))):
            got, want = np.asarray(got), np.asarray(want)
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), np.abs(got - want).max()
        print("OK")
    """, timeout=300)
