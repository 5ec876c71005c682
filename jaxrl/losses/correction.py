"""Rollout correction: importance weights between the policy about to be updated and the one that sampled.

Every rollout carries two `[B, N]` log-probs of its sampled tokens: `old_logp`, under the policy about to be
updated (recomputed by the trainer: the "proximal" policy of decoupled PPO, AReaL, Fu et al. 2025, arXiv
2505.24298), and `sampler_logp`, under the policy version that sampled each token (several versions older with
bounded staleness; a bf16 sampler against an fp32 trainer; the temperature-scaled *unfiltered* distribution, see
`jaxrl.sampling.Rollout`). The importance weight `w = exp(old_logp - sampler_logp)` corrects staleness and the
sampler/trainer mismatch at once; the objective's ratio stays `pi_theta / pi_old`. All of it runs in
`prepare_batch`, once per rollout batch, before the batch is split: the weights and rejections are whole-batch
quantities.

`rl.loss` fields (`LossConfig`):

| field | values | meaning |
|---|---|---|
| `is_level` | `none`, `token`, `sequence`, `geometric` | token: each token's own ratio; sequence: the product of the sequence's token ratios; geometric: `exp(mean log ratio)` over the sequence's loss tokens; the sequence levels broadcast to the sequence's tokens |
| `is_mode` | `truncate`, `mask` | truncate (TIS): clip the weight into `[is_floor, is_cap]`; mask (MIS): reject the token (sequence) whose weight is outside |
| `is_cap` | `> 1`, `.inf` allowed | the upper bound (`.inf`: none) |
| `is_floor` | `[0, 1)` | the lower bound (0: none) |
| `is_veto` | None or `(0, 1)` | reject a whole sequence when any of its loss tokens' token ratio is below `is_veto` or above `1 / is_veto` |

The veto is two-sided: verl's `rollout_token_veto_threshold` rejects on the lower side only (a token the trainer
finds far less likely than the sampler did); the upper side also rejects a token the sampler drew at a
probability far below the trainer's, whose weight would otherwise be huge (or silently truncated).

Rejected tokens (MIS, the veto, M2PO's mask in `m2po_mask`) leave the loss: `prepare_batch` removes them from
`loss_mask`, so every aggregation normalises over the kept tokens only (a row that loses every token drops out
of the sequence means; `seq-mean-token-sum-norm` divides by a constant and is unchanged). Truncated tokens stay,
with their clipped weight.

Recipes (documented configs, not presets: `rl.loss.preset` names one objective, and a correction composes with
any of them; `configs/off_policy.yaml` is the bounded-staleness recipe):

    rl.loss.is_level=token rl.loss.is_cap=2.0                        # TIS (Yao et al. 2025): token, truncate at 2
    rl.loss.is_level=geometric rl.loss.is_mode=mask rl.loss.is_cap=1.002 rl.loss.is_floor=0.998   # geometric MIS
    rl.loss.is_level=sequence rl.loss.is_mode=mask rl.loss.is_cap=2.0 rl.loss.is_floor=0.5        # sequence MIS
    rl.loss.is_veto=1.0e-4                                            # with any of them: the token veto

Metrics (`prepare_batch`; the loop logs them as `batch/<name>`), whenever `sampler_logp` is given, over the
completion tokens: `logp_gap_mean`, `logp_gap_max` (`|old_logp - sampler_logp|`), `sampler_kl` (k3 estimate of
KL(sampler || trainer), `mismatch_metrics`), `ppl_ratio` (per sequence trainer perplexity / sampler perplexity,
averaged over sequences, as verl's `rollout_corr/ppl_ratio`); with a correction on (over the loss tokens
before rejection): `is_masked_frac`, `is_truncated_frac`, `is_vetoed_frac` (a share of *sequences*),
`is_weight_mean` (over the kept tokens).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

sg = jax.lax.stop_gradient

ISLevel = Literal["none", "token", "sequence", "geometric"]
ISMode = Literal["truncate", "mask"]
IS_LEVELS: tuple[str, ...] = ("none", "token", "sequence", "geometric")
IS_MODES: tuple[str, ...] = ("truncate", "mask")
# |log weight| bound before exp (float32 overflows near 88; verl's SAFETY_BOUND): the comparisons against the
# bounds use the unclamped log weight.
MAX_LOG_WEIGHT = 20.0


def _row_sum(x: jax.Array, m: jax.Array) -> jax.Array:
    return jnp.sum(x * m, axis=1, keepdims=True)


def log_is_weights(old_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array, level: str) -> jax.Array:
    """`[B, N]` log importance weight of each valid token at `level` (0 on invalid tokens, no gradient).

    token: `old - sampler`; sequence: its sum over the row's valid tokens; geometric: its mean over them."""
    m = mask.astype(jnp.float32)
    valid = m > 0
    log_w = jnp.where(valid, sg(old_logp) - sg(sampler_logp), 0.0)
    if level == "sequence":
        log_w = jnp.broadcast_to(_row_sum(log_w, m), log_w.shape)
    elif level == "geometric":
        log_w = jnp.broadcast_to(_row_sum(log_w, m) / jnp.maximum(m.sum(axis=1, keepdims=True), 1.0), log_w.shape)
    elif level != "token":
        raise ValueError(f"unknown importance-sampling level {level!r}; valid choices: token, sequence, geometric")
    return jnp.where(valid, log_w, 0.0)


def rollout_correction(old_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array, *,
                       level: str = "token", mode: str = "truncate", floor: float = 0.0,
                       cap: float = 2.0, veto: float | None = None
                       ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Importance weights `pi_old / pi_sampler` with truncation (TIS) or rejection (MIS) and the veto.

    Args:
      old_logp, sampler_logp: `[B, N]` log-probs of the sampled tokens under the policy about to be updated and
        under the policy that sampled them (no gradient flows through either).
      mask: `[B, N]` the loss tokens (may have holes).
      level: `none` (weights 1; only the veto applies), `token`, `sequence` or `geometric`.
      mode: `truncate` clips the weight into `[floor, cap]`; `mask` rejects what lies outside.
      floor, cap: the bounds, `0 <= floor < 1 < cap` (`cap` may be inf, `floor` 0: no bound).
      veto: rejects a sequence when one of its tokens' ratio is `< veto` or `> 1 / veto` (None: off).

    Returns:
      `(weights [B, N], keep [B, N], metrics)`: float32 weights (0 on invalid and rejected tokens), the float32
      mask of the valid tokens kept, and scalars `is_masked_frac`, `is_truncated_frac` (shares of the valid
      tokens), `is_vetoed_frac` (share of the sequences with valid tokens), `is_weight_mean` (over the kept).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; valid choices: {', '.join(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; valid choices: {', '.join(IS_MODES)}")
    m = mask.astype(jnp.float32)
    valid = m > 0
    tokens = jnp.maximum(m.sum(), 1.0)
    if level == "none":
        weights, outside = jnp.ones_like(m), jnp.zeros_like(valid)
    else:
        log_w = log_is_weights(old_logp, sampler_logp, m, level)
        log_floor = -math.inf if floor <= 0 else math.log(floor)
        log_cap = math.log(cap) if math.isfinite(cap) else math.inf
        outside = valid & ((log_w < log_floor) | (log_w > log_cap))
        weights = jnp.exp(jnp.clip(jnp.clip(log_w, log_floor, log_cap), -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT))
    keep = valid & ~outside if mode == "mask" and level != "none" else valid
    metrics = {"is_masked_frac": jnp.sum((outside & (mode == "mask")).astype(jnp.float32)) / tokens,
               "is_truncated_frac": jnp.sum((outside & (mode == "truncate")).astype(jnp.float32)) / tokens}
    rows = m.sum(axis=1) > 0
    if veto is not None:
        token_lr = jnp.where(valid, sg(old_logp) - sg(sampler_logp), 0.0)
        bound = -math.log(veto)  # > 0
        extreme = valid & ((token_lr < -bound) | (token_lr > bound))
        vetoed = jnp.any(extreme, axis=1) & rows
        keep = keep & ~vetoed[:, None]
        metrics["is_vetoed_frac"] = vetoed.sum() / jnp.maximum(rows.sum(), 1).astype(jnp.float32)
    else:
        metrics["is_vetoed_frac"] = jnp.float32(0.0)
    keep = keep.astype(jnp.float32)
    weights = weights * keep
    metrics["is_weight_mean"] = jnp.sum(weights) / jnp.maximum(keep.sum(), 1.0)
    return weights, keep, metrics


def mismatch_metrics(old_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Sampler/trainer agreement over the valid tokens of `mask [B, N]` (scalars, no gradient):

    - `logp_gap_mean`, `logp_gap_max`: mean and max of `|old_logp - sampler_logp|` (0 without tokens);
    - `sampler_kl`: k3 estimate of KL(sampler || trainer), the token mean of `w - 1 - log w` with
      `w = pi_old / pi_sampler` on tokens drawn by the sampler (>= 0; verl's `rollout_corr/k3_kl`);
    - `ppl_ratio`: each sequence's trainer perplexity over its sampler perplexity,
      `exp(mean_t sampler_logp - mean_t old_logp)`, averaged over the sequences with tokens (verl's
      `rollout_corr/ppl_ratio`; the inverse of the geometric weight; > 1: the trainer finds the samples less
      likely than the sampler did).
    """
    m = mask.astype(jnp.float32)
    valid = m > 0
    lr = jnp.where(valid, sg(old_logp) - sg(sampler_logp), 0.0)
    tokens = jnp.maximum(m.sum(), 1.0)
    gap = jnp.abs(lr)
    clamped = jnp.clip(lr, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)
    k3 = jnp.where(valid, jnp.expm1(clamped) - clamped, 0.0)
    lengths = m.sum(axis=1)
    rows = lengths > 0
    seq_log = -jnp.sum(lr, axis=1) / jnp.maximum(lengths, 1.0)  # mean sampler_logp - mean old_logp
    ppl = jnp.where(rows, jnp.exp(jnp.clip(seq_log, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)), 0.0)
    return {"logp_gap_mean": jnp.sum(gap) / tokens,
            "logp_gap_max": jnp.max(jnp.where(valid, gap, 0.0)),
            "sampler_kl": jnp.sum(k3) / tokens,
            "ppl_ratio": jnp.sum(ppl) / jnp.maximum(rows.sum(), 1).astype(jnp.float32)}


def m2po_mask(log_ratio: jax.Array, mask: jax.Array, tau: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """M2PO's second-moment mask over a whole batch (Zheng et al. 2025, "Prosperity before Collapse: How Far Can
    Off-Policy RL Reach with Stale Data on LLMs?", arXiv 2510.01161, Algorithm 1).

    Over the valid tokens of `mask [B, N]`, the squared log ratios `log_ratio [B, N]` (`log pi_theta / pi_behav`)
    are sorted in descending order and the largest are masked, one after another, until the mean of the kept
    ones is `<= tau` (none is masked when the mean of all already is). Returns `(keep [B, N] float32,
    metrics)`: `m2po_masked_frac` (share of the valid tokens masked), `m2po_m2` and `m2po_m2_kept` (the second
    moment before and after).
    """
    m = mask.astype(jnp.float32)
    valid = (m > 0).reshape(-1)
    sq = jnp.square(sg(log_ratio)).reshape(-1)
    n = valid.sum()
    order = jnp.argsort(jnp.where(valid, sq, jnp.inf))  # ascending; invalid last
    sorted_sq = jnp.where(valid[order], sq[order], 0.0)
    counts = jnp.arange(1, sq.size + 1, dtype=jnp.float32)
    prefix_mean = jnp.cumsum(sorted_sq) / counts  # non-decreasing over the valid prefix
    keep_count = jnp.sum((prefix_mean <= tau) & (counts <= n))
    rank = jnp.zeros(sq.size, jnp.int32).at[order].set(jnp.arange(sq.size, dtype=jnp.int32))
    keep = (valid & (rank < keep_count)).reshape(m.shape).astype(jnp.float32)
    total = jnp.maximum(n, 1).astype(jnp.float32)
    kept_sq = jnp.sum(sq.reshape(m.shape) * keep)
    metrics = {"m2po_masked_frac": (n - keep_count).astype(jnp.float32) / total,
               "m2po_m2": jnp.sum(jnp.where(valid, sq, 0.0)) / total,
               "m2po_m2_kept": kept_sq / jnp.maximum(keep_count, 1).astype(jnp.float32)}
    return keep, metrics
