"""Loss pieces the library does not have, registered by name for tests (a config lists `imports: [loss_pieces]`)."""

import jax
import jax.numpy as jnp

from jaxrl import losses, registry

CALLS: list = []  # what was traced: the pieces run under jit in the test's own process


@registry.register("advantage", "test_rank")
def rank_advantage(inputs, config):
    """A rank-based group advantage: `[B]`, uniform in [-0.5, 0.5] over each group's ranks (0 = worst)."""
    grouped = inputs.rewards.reshape(-1, inputs.group_size)
    ranks = jnp.argsort(jnp.argsort(grouped, axis=1), axis=1).astype(jnp.float32)
    CALLS.append("advantage")
    return (ranks / (inputs.group_size - 1) - 0.5).reshape(-1)


@registry.register("objective", "test_tanh_surrogate")
def tanh_surrogate(log_ratio, advantages, logp, mask, eps_low, eps_high, dual_clip_c):
    """A soft-clipped surrogate: a smooth stand-in for PPO's hard clip."""
    CALLS.append(log_ratio.shape)
    ratio = jnp.exp(log_ratio)
    soft = 1.0 + eps_high * jnp.tanh((ratio - 1.0) / eps_high)
    return -soft * advantages, {"soft_ratio": soft}


@registry.register("term", "test_sq_log_ratio")
def squared_log_ratio_penalty(inputs, norm, controls):
    """0.05 x the squared log-ratio to the sampling policy, summed per sequence."""
    per_token = 0.5 * jnp.square(inputs.logp - jax.lax.stop_gradient(inputs.old_logp))
    value = losses.aggregate(per_token, inputs.mask, "seq-mean-token-sum", norm)
    return 0.05 * value, {"sq_log_ratio": losses.token_mean(per_token, inputs.mask, norm)}


@registry.register("term", "test_nan")
def nan_term(inputs, norm, controls):
    """A term whose value and gradient are NaN: every update it is in must be skipped."""
    return jnp.nan * jnp.sum(inputs.logp * inputs.mask), {}
