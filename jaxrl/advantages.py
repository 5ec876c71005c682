"""Advantage estimators: pure functions from rewards to per-sequence advantages."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grpo_advantages(
    rewards: jax.Array, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> jax.Array:
    """Group-relative advantages (GRPO, Shao et al. 2024).

    Args:
      rewards: `[num_prompts * group_size]` float, the samples of one prompt contiguous.
      group_size: G, samples per prompt.
      normalize_std: divide by the group's standard deviation (False gives Dr. GRPO's unscaled form).
      eps: added to the std so that groups with equal rewards give 0, not NaN.

    Returns:
      `[num_prompts * group_size]` float32: `(r - mean_group(r)) / (std_group(r) + eps)`.
    """
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards of shape {rewards.shape} do not split into groups of {group_size}")
    grouped = rewards.astype(jnp.float32).reshape(-1, group_size)
    centered = grouped - grouped.mean(axis=1, keepdims=True)
    if normalize_std:
        centered = centered / (grouped.std(axis=1, keepdims=True) + eps)  # population std, as in TRL/verl
    return centered.reshape(-1)
