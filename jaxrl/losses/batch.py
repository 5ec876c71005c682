"""Batch-level preparation: everything a loss needs that depends on the whole rollout batch.

`prepare_batch` runs once per rollout batch, before it is split into mini- and micro-batches: advantages
(any estimator of `jaxrl.advantages`, with a KL penalty optionally folded into the reward), the loss mask
(overlong filtering, and the tokens the rollout correction or M2PO reject), per-token weights (importance
weights against the sampler, `jaxrl.losses.correction`; forking-token and Clip-Cov selections) and the KL-Cov
selection. Inputs are `[B, N]` (`[B]` for rewards); pure and jit-able with
`config` and `group_size` static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl import advantages as adv
from jaxrl.losses.config import LossConfig
from jaxrl.losses.masks import (clip_cov_mask, kl_cov_mask, logp_advantage_covariance, top_entropy_mask,
                                truncation_mask)
from jaxrl.losses.correction import m2po_mask, mismatch_metrics, rollout_correction
from jaxrl.losses.regularizers import kl_estimate
from jaxrl.registry import resolve

def _mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    m = mask.astype(jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(m.sum(), 1.0)


def gpg_alpha(advantages: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """GPG's accurate gradient estimation (Chu et al. 2025, arXiv 2504.02546): advantages `[B, N]` times
    `alpha = B / (B - M)`, B the rows with loss tokens, M those among them whose advantage is 0 on every loss token
    (a group whose rewards are all equal), so the mean over all rows counts as one over the rows that carry a
    gradient. Returns `(scaled advantages, alpha)`; alpha is 1 when no row carries a gradient."""
    m = mask.astype(jnp.float32)
    rows = m.sum(axis=1) > 0
    zero = rows & (jnp.sum(jnp.abs(advantages) * m, axis=1) == 0)
    b, zeros = rows.sum().astype(jnp.float32), zero.sum().astype(jnp.float32)
    alpha = jnp.where(b > zeros, b / jnp.maximum(b - zeros, 1.0), 1.0)
    return advantages * alpha, alpha


def prepare_batch(config: LossConfig, *, rewards: jax.Array, completion_mask: jax.Array, old_logp: jax.Array,
                  group_size: int, key: jax.Array, truncated: jax.Array | None = None,
                  entropy: jax.Array | None = None, ref_logp: jax.Array | None = None,
                  sampler_logp: jax.Array | None = None, values: jax.Array | None = None,
                  greedy_rewards: jax.Array | None = None, components: jax.Array | None = None,
                  component_weights: tuple[float, ...] | None = None, token_rewards: jax.Array | None = None,
                  turn_ids: jax.Array | None = None, answer_ids: jax.Array | None = None
                  ) -> tuple[dict[str, jax.Array], dict]:
    """Advantages, masks and weights of a rollout batch.

    Args:
      rewards: `[B]` sequence rewards, groups of `group_size` contiguous.
      completion_mask: `[B, N]` generated tokens: the model's tokens only (a multi-turn episode's observation
        tokens are holes in it; every piece here gives on the model tokens what it gives on the compacted rows).
      old_logp, entropy, ref_logp, sampler_logp, values: `[B, N]`: `old_logp` under the policy about to be
        updated (recomputed by the trainer), `sampler_logp` under the policy version that sampled each token
        (temperature-scaled, unfiltered), and the entropy, the reference's and the critic's; each needed only by
        the pieces that use it. With `sampler_logp`, the sampler/trainer agreement metrics are always reported
        (`correction.mismatch_metrics`).
      truncated: `[B]` bool, completions that hit the length limit (for `mask_truncated`).
      greedy_rewards, components, component_weights: for the `remax` and per-component estimators.
      token_rewards, turn_ids: `[B, N]` (float32, int32) each turn's reward on its last model token and the
        model turn of each token (-1 on observation tokens and padding), for multi-turn episodes; used by
        `rl.loss.advantage.turn_credit: discounted` (`jaxrl.advantages.turn_returns`).
      answer_ids: `[B]` int32, each sample's final-answer cluster in its group (estimators registered with
        answers=True: seed_grpo).
      key: PRNG key (Clip-Cov's random selection).

    Returns:
      `(fields, metrics)`: fields `advantages [B, N]`, `loss_mask [B, N]`, and when used `token_weights`,
      `kl_cov_mask`, `returns` (all `[B, N]` float32); scalar metrics of the batch. The advantages are computed on
      the completion mask; the tokens the rollout correction (MIS, the veto) or M2PO's mask reject are then
      removed from `loss_mask`, so every aggregation normalises over the kept tokens only.
    """
    mask = completion_mask.astype(jnp.float32)
    metrics: dict[str, jax.Array] = {}
    loss_mask = mask
    if config.mask_truncated:
        if truncated is None:
            raise ValueError("mask_truncated needs the rollout's truncated flags")
        loss_mask = truncation_mask(mask, truncated)
        metrics["truncated_masked_frac"] = 1.0 - loss_mask.sum() / jnp.maximum(mask.sum(), 1.0)

    token_penalty = None
    if config.kl_in_reward and config.kl_coef:
        if ref_logp is None:
            raise ValueError("kl_in_reward needs the reference policy's log-probs (ref_logp)")
        kl = kl_estimate(old_logp, ref_logp, config.kl_estimator) * mask
        token_penalty = config.kl_coef * kl
        metrics["kl_ref"] = _mean(kl, mask)

    advantages, returns = adv.compute(config.advantage, rewards, mask, group_size, entropy=entropy,
                                      values=values, greedy_rewards=greedy_rewards, components=components,
                                      component_weights=component_weights, token_penalty=token_penalty,
                                      token_rewards=token_rewards, turn_ids=turn_ids, answer_ids=answer_ids)
    second_moment = resolve("objective", config.objective, "rl.loss.objective").info.get("second_moment_mask")
    needs_sampler = config.is_level != "none" or config.is_veto is not None or second_moment
    if needs_sampler and sampler_logp is None:
        raise ValueError(f"is_level {config.is_level!r}, is_veto and objective 'm2po' need the sampler's log-probs "
                         "(sampler_logp)")
    is_weights = None
    if sampler_logp is not None:  # issue 33: agreement metrics, then the correction (a whole-batch quantity)
        metrics.update(mismatch_metrics(old_logp, sampler_logp, mask))
        if config.is_level != "none" or config.is_veto is not None:
            is_weights, keep, is_metrics = rollout_correction(
                old_logp, sampler_logp, loss_mask, level=config.is_level, mode=config.is_mode, floor=config.is_floor,
                cap=config.is_cap, veto=config.is_veto)
            loss_mask = loss_mask * keep
            metrics.update(is_metrics)
        if second_moment:
            keep, m2_metrics = m2po_mask(old_logp - sampler_logp, loss_mask, config.m2po_tau)
            loss_mask = loss_mask * keep
            metrics.update(m2_metrics)
    if config.gpg_correction:  # issue 35: GPG's alpha, a whole-batch count (before the batch is split)
        advantages, metrics["gpg_alpha"] = gpg_alpha(advantages, loss_mask)
    fields = {"advantages": advantages, "loss_mask": loss_mask}
    if returns is not None:
        fields["returns"] = returns

    weights = jnp.ones_like(mask)
    if config.is_level != "none":
        weights = weights * is_weights
    if config.top_entropy_fraction is not None:
        if entropy is None:
            raise ValueError("top_entropy_fraction needs the rollout's per-token entropy")
        weights = weights * top_entropy_mask(entropy, loss_mask, config.top_entropy_fraction)
    if config.clip_cov_ratio:
        weights = weights * clip_cov_mask(old_logp, advantages, loss_mask, key, config.clip_cov_ratio,
                                          config.clip_cov_low, config.clip_cov_high)
    if config.is_level != "none" or config.top_entropy_fraction is not None or config.clip_cov_ratio:
        fields["token_weights"] = weights
        metrics["weight_zero_frac"] = _mean((weights == 0).astype(jnp.float32), loss_mask)
    if config.kl_cov_ratio:
        fields["kl_cov_mask"] = kl_cov_mask(old_logp, advantages, loss_mask, config.kl_cov_ratio)
        metrics["kl_cov_frac"] = _mean(fields["kl_cov_mask"], loss_mask)

    metrics["advantage_mean"] = _mean(advantages, loss_mask)
    metrics["advantage_std"] = jnp.sqrt(_mean(jnp.square(advantages - metrics["advantage_mean"]), loss_mask))
    metrics["logp_adv_cov"] = _mean(logp_advantage_covariance(old_logp, advantages, loss_mask), loss_mask)
    metrics["loss_tokens"] = loss_mask.sum()
    return fields, metrics
