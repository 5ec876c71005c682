"""Policy-loss terms as small pure functions, each returning `(value, metrics)`.

Shapes: B sequences, N completion tokens. Per-token inputs are `[B, N]`; `mask` is the completion mask
(float32 or bool). Aggregation divides by a token count passed in explicitly, so that a mini-batch split
or a data-parallel shard normalises by the count of the whole batch it belongs to.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    """Token-level clipped surrogate with clip-higher, optional k3 KL and entropy bonus."""

    clip_eps_low: float = dataclasses.field(default=0.2, metadata={"ge": 0})
    clip_eps_high: float = dataclasses.field(default=0.28, metadata={"ge": 0})
    kl_coef: float = dataclasses.field(default=0.0, metadata={"ge": 0})  # k3 KL to the reference policy
    entropy_coef: float = dataclasses.field(default=0.0, metadata={"ge": 0})  # bonus: loss -= coef * H


def masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(x * mask)


def token_mean(per_token: jax.Array, mask: jax.Array, num_tokens: jax.Array | float) -> jax.Array:
    """Sum over masked tokens divided by `num_tokens` (the global count of the batch being optimised)."""
    return masked_sum(per_token, mask) / jnp.maximum(num_tokens, 1.0)


def clipped_surrogate(
    logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, eps_low: float, eps_high: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped objective per token, as a loss (negated): `-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`.

    Args: logp, old_logp, advantages `[B, N]`. Returns `(loss [B, N], per-token metric arrays [B, N])`.
    """
    ratio = jnp.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -jnp.minimum(unclipped, clipped)
    metrics = {
        "clip_frac_low": ((ratio < 1.0 - eps_low) & (advantages < 0)).astype(jnp.float32),
        "clip_frac_high": ((ratio > 1.0 + eps_high) & (advantages > 0)).astype(jnp.float32),
        "ratio": ratio,
    }
    return loss, metrics


def kl_k3(logp: jax.Array, ref_logp: jax.Array, max_log_ratio: float = 20.0) -> jax.Array:
    """Schulman's k3 estimator of KL(pi || ref) per token: `exp(ref - logp) - (ref - logp) - 1` (>= 0).

    The log-ratio is clamped to +-`max_log_ratio` so that bf16 inputs cannot overflow `exp`.
    """
    log_ratio = jnp.clip(ref_logp - logp, -max_log_ratio, max_log_ratio)
    return jnp.exp(log_ratio) - log_ratio - 1.0


def grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    entropy: jax.Array,
    num_tokens: jax.Array | float,
    config: GRPOLossConfig,
    ref_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO / DAPO-style policy loss with token-mean aggregation.

    Args:
      logp: `[B, N]` log-probs of the completion tokens under the current parameters.
      old_logp: `[B, N]` log-probs under the parameters that sampled the batch (no gradient).
      advantages: `[B, N]` (a sequence's advantage broadcast over its tokens).
      mask: `[B, N]` completion mask.
      entropy: `[B, N]` entropy of the current policy at each position.
      num_tokens: number of masked tokens normalising the mean (global over the optimised batch).
      ref_logp: `[B, N]` reference-policy log-probs; required when `config.kl_coef > 0`.

    Returns:
      `(scalar loss, metrics)`; metric values are token means over the same normaliser.
    """
    mask = mask.astype(jnp.float32)
    old_logp = jax.lax.stop_gradient(old_logp)
    surrogate, clip_metrics = clipped_surrogate(logp, old_logp, advantages, config.clip_eps_low,
                                                config.clip_eps_high)
    loss = token_mean(surrogate, mask, num_tokens)
    metrics = {name: token_mean(value, mask, num_tokens) for name, value in clip_metrics.items()}
    metrics["policy_loss"] = loss
    metrics["entropy"] = token_mean(entropy, mask, num_tokens)
    # k3 estimate of KL(old || new), a cheap monitor of how far an update moved the policy.
    metrics["approx_kl_old"] = token_mean(kl_k3(old_logp, logp), mask, num_tokens)
    if config.entropy_coef:
        loss = loss - config.entropy_coef * metrics["entropy"]
    if config.kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (the reference policy's log-probs)")
        kl = token_mean(kl_k3(logp, jax.lax.stop_gradient(ref_logp)), mask, num_tokens)
        metrics["kl_ref"] = kl
        loss = loss + config.kl_coef * kl
    metrics["loss"] = loss
    return loss, metrics
