"""Importance ratios and policy-gradient objectives, per token.

Every function takes `[B, N]` arrays (B sequences, N completion tokens) and returns a per-token loss (to be
aggregated, see `aggregation.py`) with per-token metric arrays. The mask may have holes (the observation
tokens of a multi-turn episode): sequence means and sums are over the masked-in tokens only. Only `logp`
(the current policy's log-probs) carries gradients; `old_logp` and advantages are treated as constants.

Ratios (registered as kind `ratio`, see `jaxrl.registry`), each returning the log importance ratio per token:

- `token`: `logp - old_logp` (PPO, Schulman et al. 2017).
- `sequence`: GSPO's length-normalised sequence ratio `mean_t(logp - old_logp)` broadcast to the
  sequence's tokens (Zheng et al. 2025, arXiv 2507.18071).
- `sequence_token`: GSPO-token, `sg[seq] + logp - sg[logp]`: the sequence ratio's value with per-token
  gradients, so token-level advantages stay usable.

Objectives (kind `objective`), `(log_ratio, advantages, logp, mask, eps_low, eps_high, dual_clip_c)`:

- `ppo_clip`: `max(-r A, -clip(r, 1-eps_low, 1+eps_high) A)`, with the dual clip `min(., -c A)` for
  `A < 0` when `dual_clip_c` is set (Ye et al. 2020, arXiv 1912.09729); `eps_high > eps_low` is DAPO's
  clip-higher.
- `reinforce`: `-r A`, the unclipped importance-weighted policy gradient (KL-Cov's base objective).
- `cispo`: `-sg[clip(r, 1-eps_low, 1+eps_high)] A logp`: a REINFORCE term with a clipped, detached IS
  weight, so no token's gradient is dropped (MiniMax-M1, arXiv 2506.13585).
- `gmpo`: geometric mean of the token ratios of a sequence, each clipped in log space to
  `[-eps_low, eps_high]` on the pessimistic side, times the advantage (Zhao et al. 2025, arXiv
  2507.20673); the sequence's loss is broadcast to its tokens.

The second wave's objectives (`gpg`, `bapo`, `dcpo`, `aspo`, `cpgd`) live in `jaxrl.losses.updates`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.registry import register

sg = jax.lax.stop_gradient

# Bound on |log ratio| before exp (exp overflows float32 near 88): a ratio beyond e^20 means the token is
# far off-policy; its value is capped there but its gradient keeps its sign (see `clamp_keep_gradient`).
MAX_LOG_RATIO = 20.0



def _sequence_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """`[B]` mean of `x [B, N]` over each row's valid tokens (0 for an empty row)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(x * m, axis=1) / jnp.maximum(m.sum(axis=1), 1.0)


@register("ratio", "token")
def token_log_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """`[B, N]` `logp - old_logp`, zero on masked tokens (so padding can never overflow `exp`)."""
    return jnp.where(mask.astype(bool), logp - sg(old_logp), 0.0)


@register("ratio", "sequence")
def sequence_log_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO: `[B, N]`, each valid token holds its sequence's `mean_t(logp - old_logp)`."""
    seq = _sequence_mean(token_log_ratio(logp, old_logp, mask), mask)
    return jnp.where(mask.astype(bool), seq[:, None], 0.0)


@register("ratio", "sequence_token")
def sequence_token_log_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO-token: value of the sequence ratio, gradient of each token's own log-prob."""
    seq = sequence_log_ratio(logp, old_logp, mask)
    return jnp.where(mask.astype(bool), sg(seq) + logp - sg(logp), 0.0)


def clamp_keep_gradient(x: jax.Array, bound: float = MAX_LOG_RATIO) -> jax.Array:
    """`x` with its value clipped to `[-bound, bound]` and the gradient of `x` itself (straight through).

    `jnp.clip` has zero gradient outside its range: an unclipped PPO term with A < 0 (or a k3 penalty)
    would then stop pushing back exactly the tokens that moved furthest. Here they keep the gradient
    of the clamped value's direction, of magnitude at most `e^bound`.
    """
    return x + sg(jnp.clip(x, -bound, bound) - x)


def clamped_ratio(log_ratio: jax.Array) -> jax.Array:
    """`exp(log_ratio)` with `|log_ratio|` clamped to `MAX_LOG_RATIO` (finite in float32), gradient kept."""
    return jnp.exp(clamp_keep_gradient(log_ratio))


@register("objective", "ppo_clip", dual_clip=True)
def ppo_clip(log_ratio, advantages, logp=None, mask=None, eps_low=0.2, eps_high=0.2, dual_clip_c=None):
    """PPO clipped surrogate as a loss, with clip-higher and optional dual clip.

    Returns `(loss [B, N], metrics)`; metrics are per-token indicators: `clip_frac_low` (A < 0 and
    r < 1 - eps_low), `clip_frac_high` (A > 0 and r > 1 + eps_high), `clip_frac_dual` (A < 0 and r > c).
    """
    del logp, mask
    ratio = clamped_ratio(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(-ratio * advantages, -clipped * advantages)
    negative = advantages < 0
    metrics = {
        "clip_frac_low": (negative & (ratio < 1.0 - eps_low)).astype(jnp.float32),
        "clip_frac_high": ((advantages > 0) & (ratio > 1.0 + eps_high)).astype(jnp.float32),
    }
    if dual_clip_c is not None:
        cap = -dual_clip_c * advantages
        metrics["clip_frac_dual"] = (negative & (loss > cap)).astype(jnp.float32)
        loss = jnp.where(negative, jnp.minimum(loss, cap), loss)
    return loss, metrics


@register("objective", "reinforce")
def reinforce(log_ratio, advantages, logp=None, mask=None, eps_low=0.0, eps_high=0.0, dual_clip_c=None):
    """Unclipped importance-weighted policy gradient `-r A` (no clip metrics)."""
    del logp, mask, eps_low, eps_high, dual_clip_c
    return -clamped_ratio(log_ratio) * advantages, {}


@register("objective", "cispo")
def cispo(log_ratio, advantages, logp, mask=None, eps_low=1.0, eps_high=0.28, dual_clip_c=None):
    """CISPO: `-sg[clip(r, 1-eps_low, 1+eps_high)] * A * logp`.

    Written as `... * exp(logp - sg[logp])`, whose value is 1 and whose gradient is that of `logp`, so the
    loss value reads like PPO's (`-w A` on policy) while the gradient is CISPO's `-w A grad(logp)`.
    """
    del mask, dual_clip_c
    ratio = clamped_ratio(log_ratio)
    weight = sg(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    loss = -weight * advantages * jnp.exp(logp - sg(logp))
    metrics = {"clip_frac_low": (ratio < 1.0 - eps_low).astype(jnp.float32),
               "clip_frac_high": (ratio > 1.0 + eps_high).astype(jnp.float32)}
    return loss, metrics


@register("objective", "gmpo", own_ratio=True)
def gmpo(log_ratio, advantages, logp=None, mask=None, eps_low=0.4, eps_high=0.4, dual_clip_c=None):
    """GMPO: `-A * exp(mean_t(sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t, -eps_low, eps_high))))`.

    `log_ratio` must be the token log ratio; `eps_*` bound it in log space. The sequence's value is
    broadcast to its tokens (use a sequence-mean aggregation). `clip_frac` counts tokens whose log ratio
    was clipped on the pessimistic side.
    """
    del logp, dual_clip_c
    sign = jnp.sign(advantages)
    clipped = jnp.clip(log_ratio, -eps_low, eps_high)
    pessimistic = sign * jnp.minimum(sign * log_ratio, sign * clipped)
    seq_ratio = clamped_ratio(_sequence_mean(pessimistic, mask))
    loss = -advantages * seq_ratio[:, None]
    was_clipped = sign * clipped < sign * log_ratio
    metrics = {"clip_frac_low": (was_clipped & (log_ratio < -eps_low)).astype(jnp.float32),
               "clip_frac_high": (was_clipped & (log_ratio > eps_high)).astype(jnp.float32)}
    return loss, metrics
