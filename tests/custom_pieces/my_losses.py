"""An objective and an advantage estimator of a user's own, registered by name (listed under `imports:`)."""
import jax.numpy as jnp

from jaxrl import registry


@registry.register("objective", "tanh_surrogate")
def tanh_surrogate(log_ratio, advantages, logp, mask, eps_low, eps_high, dual_clip_c):
    """A bounded surrogate: -tanh(ratio * A), so no single token's ratio dominates."""
    ratio = jnp.exp(jnp.clip(log_ratio, -eps_low, eps_high))
    return -jnp.tanh(ratio * advantages), {}


@registry.register("advantage", "median_baseline")
def median_baseline(inputs, config):
    """Reward minus the group's median: `[B]` (the same inputs as the built-in estimators get)."""
    groups = inputs.rewards.reshape(-1, inputs.group_size)
    return (groups - jnp.median(groups, axis=1, keepdims=True)).reshape(-1)
