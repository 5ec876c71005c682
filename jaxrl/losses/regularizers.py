"""KL estimators, the clipped value loss and the entropy / temperature controllers, as pure functions.

KL estimators of `KL(pi || target)` per token from sampled tokens (Schulman 2020, "Approximating KL
divergence"), with `d = logp - target_logp`:

- `k1`: `d` (unbiased, can be negative);
- `k2`: `d^2 / 2` (biased, >= 0);
- `k3`: `exp(-d) + d - 1` (unbiased, >= 0); `|d|` is clamped to 20 so that `exp` cannot overflow, with
  the gradient kept beyond the clamp;
- `full`: `sum_v p(v) (log p(v) - log q(v))` over the whole vocabulary (needs both distributions);
- `abs`: `|d|` (biased, >= 0), verl's `kl_penalty="abs"`: a penalty on the absolute log-ratio, not an estimate
  of a KL; as a loss its gradient is `sign(d) grad log pi`, a pull of constant size toward the target.

As a loss term on tokens sampled from pi, what matters is the expected gradient: `k2`'s is the gradient of
`KL(pi || target)`, `k3`'s (GRPO's choice) that of the forward `KL(target || pi)`, `full`'s the exact
gradient of `KL(pi || target)`, and `k1`'s is zero (`E_pi[grad log pi] = 0`): it pulls nowhere, so it is
refused as a loss term (`K1_AS_LOSS`); in the reward (`kl_in_reward`) any of k1/k2/k3 is a fine penalty.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

from jaxrl.losses.policy import clamp_keep_gradient

KLEstimator = Literal["k1", "k2", "k3", "full", "abs"]
K1_AS_LOSS = ("the k1 KL estimate as a loss term has gradient grad log pi, zero in expectation on the policy's "
              "own samples: it would log a KL but not pull toward the target. Use kl_estimator k2 (gradient of "
              "KL(pi || target)), k3 (GRPO's; gradient of KL(target || pi)) or full, or fold k1 into the reward "
              "with kl_in_reward: true")
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


def kl_k1(logp: jax.Array, target_logp: jax.Array) -> jax.Array:
    return logp - target_logp


def kl_k2(logp: jax.Array, target_logp: jax.Array) -> jax.Array:
    return 0.5 * jnp.square(logp - target_logp)


def kl_k3(logp: jax.Array, target_logp: jax.Array) -> jax.Array:
    log_ratio = clamp_keep_gradient(target_logp - logp)
    # expm1: in float32, `exp(x) - x - 1` is rounding noise (multiples of 1.2e-7, some negative) for |x| < ~1e-3.
    return jnp.expm1(log_ratio) - log_ratio


def kl_abs(logp: jax.Array, target_logp: jax.Array) -> jax.Array:
    """`|logp - target_logp|` per token (verl's `kl_penalty="abs"`); its gradient at `d = 0` is 0."""
    return jnp.abs(logp - target_logp)


SAMPLED_KL = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "abs": kl_abs}


def kl_estimate(logp: jax.Array, target_logp: jax.Array, estimator: str) -> jax.Array:
    """Per-token sampled KL estimate `[B, N]` of `KL(pi || target)` by name (`k1`, `k2`, `k3`, `abs`)."""
    if estimator not in SAMPLED_KL:
        raise ValueError(f"unknown sampled KL estimator {estimator!r}; valid choices: "
                         f"{', '.join(SAMPLED_KL)} ('full' needs whole distributions: use kl_full)")
    return SAMPLED_KL[estimator](logp, target_logp)


def kl_full(log_probs: jax.Array, target_log_probs: jax.Array) -> jax.Array:
    """Exact `KL(p || q)` per position from log-probabilities `[..., vocab]` of both; returns `[...]`."""
    return jnp.sum(jnp.exp(log_probs) * (log_probs - target_log_probs), axis=-1)


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, clip_eps: float | None = 0.2):
    """Clipped value loss of PPO: `0.5 max((v - R)^2, (v_old + clip(v - v_old, -eps, eps) - R)^2)`.

    All `[B, N]`. Without `clip_eps` it is `0.5 (v - R)^2`. Returns `(loss [B, N], metrics)` with the
    per-token indicator `value_clip_frac` (the value moved beyond the clip range and the clipped branch is
    the larger one).
    """
    old_values, returns = jax.lax.stop_gradient(old_values), jax.lax.stop_gradient(returns)
    unclipped = jnp.square(values - returns)
    if clip_eps is None:
        return 0.5 * unclipped, {"value_clip_frac": jnp.zeros_like(values)}
    clipped = jnp.square(old_values + jnp.clip(values - old_values, -clip_eps, clip_eps) - returns)
    # Within the clip range both branches are equal up to float32 rounding: count only real clipping.
    was_clipped = (jnp.abs(values - old_values) > clip_eps) & (clipped > unclipped)
    return 0.5 * jnp.maximum(unclipped, clipped), {"value_clip_frac": was_clipped.astype(jnp.float32)}


def adapt_entropy_coef(coef: jax.Array, entropy: jax.Array, target: float, step: float,
                       max_coef: float = 1.0) -> jax.Array:
    """Adaptive entropy bonus (Skywork-OR1, He et al. 2025, arXiv 2505.22312): raise the coefficient by
    `step` while the policy's entropy is below `target`, lower it while above; kept in `[0, max_coef]`. The
    bonus is applied only while the entropy is below the target (`Controls.entropy_below_target`)."""
    direction = jnp.sign(target - entropy)
    return jnp.clip(coef + step * direction, 0.0, max_coef)


def adapt_temperature(temperature: jax.Array, entropy: jax.Array, target: float, rate: float,
                      min_temperature: float = 0.5, max_temperature: float = 2.0) -> jax.Array:
    """Sampling-temperature controller: `T <- clip(T exp(rate (target - H)), T_min, T_max)`, which raises
    the temperature while the sampled distribution's entropy `H` (nats) is below `target`."""
    return jnp.clip(temperature * jnp.exp(rate * (target - entropy)), min_temperature, max_temperature)
