"""Policy-update objectives of the second wave: GPG, BAPO, DCPO, ASPO and CPGD (issue 35).

Each is registered as kind `objective` (see `jaxrl.registry`) with the call of `jaxrl.losses.policy`:
`(log_ratio, advantages, logp, mask, eps_low, eps_high, dual_clip_c) -> (loss [B, N], metrics [B, N])`, all
`[B, N]` float32 (B sequences, N completion tokens; the mask may have holes). Only `logp` carries gradients.
The config that selects each (`rl.loss.*`; presets in `jaxrl.losses.config`):

| method | config | per-token loss (r = pi / pi_old, A = advantage) |
|---|---|---|
| GPG | `preset: gpg` (objective `gpg`, `gpg_correction`) | `-A log pi`, no ratio, no clip |
| BAPO | `preset: bapo` (objective `bapo`, `bapo_*`) | PPO clip with bounds `[c_low, c_high]` chosen per mini-batch |
| DCPO | `preset: dcpo` (objective `dcpo`) | PPO clip, bounds from each token's old probability |
| ASPO | `preset: aspo` (objective `aspo`, `dual_clip_c`) | flipped ratio `1/r` for A > 0, soft dual clip |
| CPGD | `preset: cpgd` (objective `cpgd`, `drift_coef`) | clipped log-ratio policy gradient + `drift_coef x KL(pi_old || pi)` |

Where a paper leaves a choice open, the function's docstring says which choice is made here.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrl.losses.policy import clamp_keep_gradient, clamped_ratio
from jaxrl.registry import register

sg = jax.lax.stop_gradient

# DCPO's upper bound is capped at this ratio (the official code's `max(clip_ratio_c, 10)`, lime-RL/DCPO
# verl/trainer/ppo/core_algos.py `get_clip_low_high`): without it a token of old probability 1e-6 could grow
# its probability by a factor ~450 in one update.
DCPO_MAX_RATIO = 10.0


def _unit_weight(logp: jax.Array) -> jax.Array:
    """`exp(logp - sg[logp])`: value 1, gradient that of `logp` (a REINFORCE term whose value reads as a weight)."""
    return jnp.exp(logp - sg(logp))


@register("objective", "gpg", ratio_free=True)
def gpg(log_ratio, advantages, logp, mask=None, eps_low=None, eps_high=None, dual_clip_c=None):
    """GPG: `-A log pi` per token, the plain policy gradient: no importance ratio, no clip.

    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning", arXiv
    2504.02546: the objective `(1 / sum_i |o_i|) sum_i sum_t -A_it log pi(o_it)` with `A = alpha (r - mean_group r)
    / F_norm`. The advantage side is configuration: `advantage.std_scope: none` (F_norm = 1, the official code's
    `adjust_gd` setting) and `gpg_correction: true`, the accurate gradient estimation `alpha = B / (B - M)`
    (`jaxrl.losses.batch.gpg_alpha`, over the whole rollout batch). The loss value is the paper's `-A log pi`
    (not `-A`): its gradient is `-A grad log pi` whatever `old_logp`, so several updates on one batch are not
    importance-corrected, as in the paper. `eps_*` and `dual_clip_c` must leave the (absent) ratio unclipped:
    `LossConfig.check_pieces` refuses a clip.
    """
    del log_ratio, mask, eps_low, eps_high, dual_clip_c
    return -advantages * logp, {}


@register("objective", "dcpo", own_ratio=True, dual_clip=True)
def dcpo(log_ratio, advantages, logp, mask=None, eps_low=0.16, eps_high=0.2, dual_clip_c=None):
    """DCPO's dynamic-adaptive clipping: PPO's clipped surrogate with per-token bounds from the old probability.

    Yang et al. 2025, "DCPO: Dynamic Clipping Policy Optimization", arXiv 2509.02333, Sec. 4.1: bounding
    `|(r - 1) p| <= eps` with `p = r q` (q the token's probability under the old policy) gives
    `0.5 + 0.5 sqrt(max(1 - 4 eps_low / q, 0)) <= r <= 0.5 + 0.5 sqrt(1 + 4 eps_high / q)`; the loss is
    `max(-r A, -clip(r, low(q), high(q)) A)`, with PPO's dual clip `min(., -c A)` for `A < 0` when `dual_clip_c`
    is set. Choice: the upper bound is capped at `DCPO_MAX_RATIO` = 10 (the official code's cap; the formula
    alone is unbounded as q -> 0). `log_ratio` must be the token log ratio: q is recovered as
    `exp(logp - log_ratio)`. Metrics as `ppo_clip`'s, plus `clip_bound_low` / `clip_bound_high` (the bounds).
    """
    q = jnp.exp(sg(logp - log_ratio))
    low = 0.5 + 0.5 * jnp.sqrt(jnp.maximum(1.0 - 4.0 * eps_low / q, 0.0))
    high = jnp.minimum(0.5 + 0.5 * jnp.sqrt(1.0 + 4.0 * eps_high / q), DCPO_MAX_RATIO)
    loss, metrics = clipped_surrogate(log_ratio, advantages, low, high, dual_clip_c)
    metrics.update(clip_bound_low=low, clip_bound_high=high)
    return loss, metrics


def clipped_surrogate(log_ratio, advantages, low, high, dual_clip_c=None):
    """PPO's `max(-r A, -clip(r, low, high) A)` with explicit ratio bounds (scalars or `[B, N]`), and the dual
    clip `min(., -c A)` for `A < 0`. Returns `(loss, metrics)` with `ppo_clip`'s per-token indicators."""
    ratio = clamped_ratio(log_ratio)
    loss = jnp.maximum(-ratio * advantages, -jnp.clip(ratio, low, high) * advantages)
    negative = advantages < 0
    metrics = {"clip_frac_low": (negative & (ratio < low)).astype(jnp.float32),
               "clip_frac_high": ((advantages > 0) & (ratio > high)).astype(jnp.float32)}
    if dual_clip_c is not None:
        cap = -dual_clip_c * advantages
        metrics["clip_frac_dual"] = (negative & (loss > cap)).astype(jnp.float32)
        loss = jnp.where(negative, jnp.minimum(loss, cap), loss)
    return loss, metrics


@register("objective", "bapo", own_ratio=True, dual_clip=True, adaptive_clip=True)
def bapo(log_ratio, advantages, logp=None, mask=None, eps_low=0.4, eps_high=0.2, dual_clip_c=None):
    """BAPO: PPO's clipped surrogate whose bounds `[1 - eps_low, 1 + eps_high]` come from `bapo_clip_bounds`
    over the whole mini-batch (`policy_term` passes them as `[B, N]` arrays: `LossInputs.clip_low/high`).

    Xi et al. 2025, "BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs via Balanced Policy
    Optimization with Adaptive Clipping", arXiv 2510.18927. `clip_eps_low/high` are not used (the `bapo_*`
    fields set the bounds' ranges); the dual clip applies as in `ppo_clip`. Metrics as `ppo_clip`'s.
    """
    del logp, mask
    return clipped_surrogate(log_ratio, advantages, 1.0 - eps_low, 1.0 + eps_high, dual_clip_c)


def bapo_clip_bounds(log_ratio: jax.Array, advantages: jax.Array, mask: jax.Array, *, target: float = 0.5,
                     low_start: float = 0.6, low_max: float = 0.9, high_start: float = 1.2, high_max: float = 3.0,
                     step_low: float = 0.05, step_high: float = 0.05):
    """BAPO's adaptive clip bounds of one optimizer step: scalars `(c_low, c_high, positive_share)`.

    A token's contribution is `|r A|` when PPO's clip leaves it its gradient (A > 0 and r <= c_high, or A < 0
    and r >= c_low), else 0; `positive_share` is the positive tokens' part of the total (1 when nothing
    contributes). Starting from `(low_start, high_start)`, each step raises `c_low` by `step_low` (while it stays
    <= `low_max`) and `c_high` by `step_high` (while <= `high_max`), until the share reaches `target` or neither
    bound can move. Both moves raise the share: a higher `c_low` drops negative tokens of low ratio, a higher
    `c_high` admits positive tokens of high ratio. All `[B, N]` inputs are those of the *whole* optimized batch
    (every micro-batch and data shard), with `mask` the tokens the loss counts, so the bounds do not depend on
    how the batch is split.

    Choices: the contribution counts only the tokens whose gradient is not clipped away (the balance of the
    gradient the paper rebalances; the official verl recipe sums `min(r, c_high) A` and `max(r, c_low) |A|`
    instead, under which a higher `c_low` raises the negative sum); both bounds move in the same step (the
    recipe moves the lower one to its maximum first). Defaults: `target` 0.5 and the ranges [0.6, 0.9],
    [1.2, 3.0] are the values the official repository's README (WooooDyy/BAPO) gives as the paper's; the steps
    0.05 are its recipe's (`recipe/bapo/config/bapo_trainer.yaml`).
    """
    m = mask.astype(jnp.float32)
    ratio = sg(clamped_ratio(log_ratio))
    a = sg(advantages)
    n_low = math.floor((low_max - low_start) / step_low + 1e-9) if step_low > 0 else 0
    n_high = math.floor((high_max - high_start) / step_high + 1e-9) if step_high > 0 else 0
    k = jnp.arange(max(n_low, n_high) + 1, dtype=jnp.float32)
    c_low = low_start + jnp.minimum(k, n_low) * step_low  # [K]
    c_high = high_start + jnp.minimum(k, n_high) * step_high
    magnitude = (jnp.abs(ratio * a) * m)[None]  # [1, B, N]
    kept_pos = (a > 0)[None] & (ratio[None] <= c_high[:, None, None])
    kept_neg = (a < 0)[None] & (ratio[None] >= c_low[:, None, None])
    pos = jnp.sum(jnp.where(kept_pos, magnitude, 0.0), axis=(1, 2))
    neg = jnp.sum(jnp.where(kept_neg, magnitude, 0.0), axis=(1, 2))
    total = pos + neg
    share = jnp.where(total > 0, pos / jnp.where(total > 0, total, 1.0), 1.0)
    met = share >= target
    chosen = jnp.where(met.any(), jnp.argmax(met), k.size - 1)
    return c_low[chosen], c_high[chosen], share[chosen]


@register("objective", "aspo", own_ratio=True, dual_clip=True)
def aspo(log_ratio, advantages, logp, mask=None, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0):
    """ASPO: positive-advantage tokens weighted by the flipped ratio `1/r`, with a soft dual clip.

    Wang et al. 2025, "ASPO: Asymmetric Importance Sampling Policy Optimization", arXiv 2510.06062 (official code
    wizard-III/Archer2.0, `compute_policy_loss_archer`). With `rp = min(r, 1 + eps_high)`, `rn = max(r, 1 - eps_low)`:
    - `A > 0`: `-A (rp / sg[rp]) / sg[rp]`: value `-A / rp`, gradient `-A (1 / r) grad log pi` inside the clip
      (`pi_old / pi` instead of PPO's `pi / pi_old`: low-probability tokens get the larger update), zero above it;
    - `A < 0`: `-A rn` (PPO's clipped term, gradient `-A r grad log pi` inside, zero below `1 - eps_low`);
    - soft dual clip (with `dual_clip_c = c`): where the weight `1 / rp` (A > 0) or `rn` (A < 0) exceeds c, the
      token's loss becomes `-A c exp(logp - sg[logp])`: value `-A c`, gradient `-A c grad log pi`, a detached
      weight c instead of the hard dual clip's zero gradient.
    Choice: one pair of bounds for all tokens (Archer2.0 adds entropy-dependent bounds, which are its own part,
    not ASPO's). Metrics: `clip_frac_low`, `clip_frac_high`, `clip_frac_dual` (soft-clipped tokens).
    """
    del mask
    ratio = clamped_ratio(log_ratio)
    positive, negative = advantages > 0, advantages < 0
    rp = jnp.minimum(ratio, 1.0 + eps_high)
    rn = jnp.maximum(ratio, 1.0 - eps_low)
    pos_loss = -advantages * (rp / sg(rp)) / sg(rp)
    neg_loss = -advantages * rn
    metrics = {"clip_frac_low": (negative & (ratio < 1.0 - eps_low)).astype(jnp.float32),
               "clip_frac_high": (positive & (ratio > 1.0 + eps_high)).astype(jnp.float32)}
    if dual_clip_c is not None:
        soft = -advantages * dual_clip_c * _unit_weight(logp)
        pos_dual = 1.0 / sg(rp) > dual_clip_c
        neg_dual = sg(rn) > dual_clip_c
        pos_loss = jnp.where(pos_dual, soft, pos_loss)
        neg_loss = jnp.where(neg_dual, soft, neg_loss)
        metrics["clip_frac_dual"] = ((positive & pos_dual) | (negative & neg_dual)).astype(jnp.float32)
    loss = jnp.where(positive, pos_loss, jnp.where(negative, neg_loss, 0.0))
    return loss, metrics


@register("objective", "cpgd", log_clip=True)
def cpgd(log_ratio, advantages, logp=None, mask=None, eps_low=0.2, eps_high=0.2, dual_clip_c=None):
    """CPGD's clipped log-ratio policy gradient: `max(-A ln r, -A clip(ln r, ln(1 - eps_low), ln(1 + eps_high)))`.

    Liu et al. 2025, "CPGD: Toward Stable Rule-based Reinforcement Learning for Language Models", arXiv
    2505.12504: the policy-gradient objective `min(ln r A, clip(ln r, ln(1-eps), ln(1+eps)) A)` (gradient
    `A grad log pi` inside the clip, with no ratio factor that could amplify it, zero outside on the side that
    would move further), minus `alpha KL(pi_old || pi)`: that drift term is `policy_drift` (`drift_coef`,
    `compose.drift_term`). `eps_low` must be < 1. Metrics as `ppo_clip`'s (in log-ratio space).
    """
    del logp, mask, dual_clip_c
    lo, hi = math.log1p(-eps_low), math.log1p(eps_high)
    loss = jnp.maximum(-log_ratio * advantages, -jnp.clip(log_ratio, lo, hi) * advantages)
    metrics = {"clip_frac_low": ((advantages < 0) & (log_ratio < lo)).astype(jnp.float32),
               "clip_frac_high": ((advantages > 0) & (log_ratio > hi)).astype(jnp.float32)}
    return loss, metrics


def policy_drift(logp: jax.Array, old_logp: jax.Array) -> jax.Array:
    """CPGD's policy drift per token, `[B, N]`: `r - 1 - ln r` with `r = pi / pi_old`, an estimate of
    `KL(pi_old || pi)` from tokens sampled by pi_old (its mean over them is the KL; it is >= 0 and 0 at r = 1).

    Choice (arXiv 2505.12504 states the drift as `KL(pi_old, pi_theta)`, the per-token estimator is ours): this
    is the k3 estimator with the roles of the two policies exchanged; its gradient, `(r - 1) grad log pi`, pulls
    every token back toward the old policy. `|ln r|` is clamped to 20 (gradient kept, `clamp_keep_gradient`).
    """
    log_ratio = clamp_keep_gradient(logp - sg(old_logp))
    return jnp.expm1(log_ratio) - log_ratio
