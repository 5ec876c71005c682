"""GRPO advantages and loss against hand-computed numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.advantages import grpo_advantages
from jaxrl.losses import GRPOLossConfig, clipped_surrogate, grpo_loss, kl_k3


def test_grpo_advantages_hand_computed():
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # two groups of 4
    adv = np.asarray(grpo_advantages(rewards, 4))
    # group 1: mean 0.5, population std 0.5 -> +-1; group 2: all equal -> 0
    np.testing.assert_allclose(adv, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5)
    raw = np.asarray(grpo_advantages(rewards, 4, normalize_std=False))
    np.testing.assert_allclose(raw, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], atol=1e-7)


def test_grpo_advantages_random_against_numpy():
    r = np.random.default_rng(0).normal(size=12).astype(np.float32)
    g = r.reshape(3, 4)
    expected = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-6)).reshape(-1)
    np.testing.assert_allclose(grpo_advantages(jnp.asarray(r), 4), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="groups of 5"):
        grpo_advantages(jnp.asarray(r), 5)


def _numpy_grpo(logp, old, adv, mask, entropy, ref, eps_low, eps_high, kl_coef, ent_coef):
    ratio = np.exp(logp - old)
    per_token = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
    n = mask.sum()
    policy = (per_token * mask).sum() / n
    kl = ((np.exp(ref - logp) - (ref - logp) - 1) * mask).sum() / n
    ent = (entropy * mask).sum() / n
    return policy + kl_coef * kl - ent_coef * ent


def test_grpo_loss_matches_numpy_values_and_gradients():
    rng = np.random.default_rng(1)
    shape = (3, 5)
    logp = rng.normal(-1.0, 0.3, shape)
    old = logp + rng.normal(0, 0.3, shape)  # ratios spread over both clip boundaries
    ref = logp + rng.normal(0, 0.2, shape)
    adv = np.repeat(rng.normal(size=(3, 1)), 5, axis=1)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], np.float32)
    entropy = rng.uniform(0, 2, shape)
    config = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1, entropy_coef=0.01)
    f = lambda lp: grpo_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), jnp.asarray(entropy),
                             mask.sum(), config, ref_logp=jnp.asarray(ref))[0]
    args = (old, adv, mask, entropy, ref, 0.2, 0.28, 0.1, 0.01)
    np.testing.assert_allclose(f(jnp.asarray(logp)), _numpy_grpo(logp, *args), rtol=1e-5)
    # Gradient against central finite differences of the numpy reference (float64).
    grad = np.asarray(jax.grad(f)(jnp.asarray(logp, jnp.float32)))
    numeric = np.zeros(shape)
    for idx in np.ndindex(shape):
        step = np.zeros(shape)
        step[idx] = 1e-5
        numeric[idx] = (_numpy_grpo(logp + step, *args) - _numpy_grpo(logp - step, *args)) / 2e-5
    np.testing.assert_allclose(grad, numeric, atol=2e-4)
    assert np.all(grad[mask == 0] == 0)


def test_clipping_metrics_and_asymmetric_bounds():
    ratio = np.array([[0.5, 1.0, 1.25, 1.5]])
    logp = jnp.log(jnp.asarray(ratio))
    old = jnp.zeros_like(logp)
    pos = clipped_surrogate(logp, old, jnp.ones_like(logp), 0.2, 0.28)
    np.testing.assert_allclose(pos[0], [[-0.5, -1.0, -1.25, -1.28]], rtol=1e-6)  # clip-higher at 1.28
    np.testing.assert_array_equal(pos[1]["clip_frac_high"], [[0, 0, 0, 1]])
    neg = clipped_surrogate(logp, old, -jnp.ones_like(logp), 0.2, 0.28)
    np.testing.assert_allclose(neg[0], [[0.8, 1.0, 1.25, 1.5]], rtol=1e-6)  # pessimistic max for A < 0
    np.testing.assert_array_equal(neg[1]["clip_frac_low"], [[1, 0, 0, 0]])


def test_k3_is_nonnegative_zero_at_equality_and_clamped():
    a = jnp.array([-1.0, -2.0, -3.0])
    np.testing.assert_allclose(kl_k3(a, a), 0.0, atol=1e-7)
    assert (kl_k3(a, a + jnp.array([0.5, -0.5, 2.0])) > 0).all()
    assert np.isfinite(kl_k3(jnp.array([-200.0]), jnp.array([0.0]))).all()


def test_kl_without_reference_is_an_error():
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(x, x, x, x + 1, x, 2.0, GRPOLossConfig(kl_coef=0.1))
