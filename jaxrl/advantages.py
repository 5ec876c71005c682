"""Advantage estimators as small pure functions, plus `compute`, the dispatcher the trainer calls.

Shapes: B sequences, N completion tokens, G samples per prompt (`group_size`, a static Python int).
Groups are contiguous: the G samples of one prompt are adjacent rows, so B = num_prompts * G.
`mask [B, N]` is the completion mask (float or bool): per row a contiguous prefix of 1s, possibly all
zeros (an empty completion). Everything is computed in float32 and is jit-safe: no Python control flow
on traced values, only on static arguments (`group_size`, flags, the config).

Sequence-level estimators return `[B]` (broadcast over tokens with `broadcast_to_tokens`); token-level
ones (`gae`, `gtpo`, `reinforce_pp` with a token penalty) return `[B, N]`, already multiplied by the mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.registry import register
from jaxrl import registry

StdScope = Literal["group", "batch", "none"]


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """Which estimator `compute` runs, and its knobs (those of other estimators are ignored)."""

    # A registered estimator (jaxrl.registry kind `advantage`: grpo, rloo, reinforce_pp, remax, opo, gae, gtpo,
    # grpo_s, and those of modules under `imports:`) or `module:function`.
    estimator: str = "grpo"
    std_scope: StdScope = "group"  # grpo / per-component: divide by the group's std, the batch's, or not
    group_baseline: bool = True  # reinforce_pp: subtract the group mean before batch whitening
    per_component: bool = False  # grpo only: normalise each reward component, then sum
    gamma: float = dataclasses.field(default=1.0, metadata={"ge": 0, "le": 1})
    lam_actor: float = dataclasses.field(default=0.95, metadata={"ge": 0, "le": 1})
    lam_critic: float = dataclasses.field(default=1.0, metadata={"ge": 0, "le": 1})
    # VAPO: lam_actor = 1 - 1 / (alpha * length) per sequence (None: the constant lam_actor).
    length_adaptive_alpha: float | None = dataclasses.field(default=None, metadata={"gt": 0})
    # gae: whiten the advantages over the batch's completion tokens (zero mean, unit std), as verl's and
    # OpenRLHF's PPO do; the value targets are left as they are.
    whiten: bool = False
    entropy_bonus_alpha: float = dataclasses.field(default=0.0, metadata={"ge": 0})  # 0 = off
    entropy_bonus_kappa: float = dataclasses.field(default=2.0, metadata={"gt": 0})
    entropy_weight: float = dataclasses.field(default=1.0, metadata={"ge": 0})  # gtpo alpha2 / grpo_s beta2
    eps: float = dataclasses.field(default=1e-6, metadata={"gt": 0})


# --------------------------------------------------------------------------- helpers


def _groups(x: jax.Array, group_size: int) -> jax.Array:
    """`[B]` -> `[B / G, G]` float32; the shape check shared by every group estimator."""
    x = jnp.asarray(x)
    if x.ndim != 1 or group_size < 1 or x.shape[0] % group_size:
        raise ValueError(f"rewards of shape {x.shape} do not split into groups of {group_size}")
    return x.astype(jnp.float32).reshape(-1, group_size)


def _row_groups(x: jax.Array, group_size: int) -> jax.Array:
    """`[B, N]` -> `[B / G, G, N]` float32 (rows already checked through the rewards' `_groups`)."""
    x = jnp.asarray(x, jnp.float32)
    return x.reshape(-1, group_size, x.shape[-1])


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """`num / den`, and 0 where `den == 0` (empty sets, fully masked positions)."""
    ok = den != 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def _all_equal(x: jax.Array, weights: jax.Array, axis) -> jax.Array:
    """Whether the entries of `x` with weight > 0 are all equal, over `axis` (kept as size 1). bool."""
    valid = weights > 0
    hi = jnp.max(jnp.where(valid, x, -jnp.inf), axis, keepdims=True)
    return hi == jnp.min(jnp.where(valid, x, jnp.inf), axis, keepdims=True)


def _centered(x: jax.Array, weights: jax.Array, axis) -> jax.Array:
    """`x - mean(x)` with weighted statistics over `axis`; exactly 0 where the weighted entries are equal.

    In float32 the mean of eight 0.7s is not 0.7: the residue of one ulp, divided by a std of the same size,
    used to become an advantage of 0.06-0.7 for every sample of a group whose samples all got the same
    shaped reward. Elsewhere the arithmetic is the plain `x - mean`, bit for bit.
    """
    total = jnp.maximum(weights.sum(axis, keepdims=True), 1e-12)
    mean = (weights * x).sum(axis, keepdims=True) / total
    return jnp.where(_all_equal(x, weights, axis), 0.0, x - mean)


def _group_centered(x: jax.Array, group_size: int) -> jax.Array:
    """`x [B]` minus the mean of its group. -> `[B]`."""
    grouped = _groups(x, group_size)
    return _centered(grouped, jnp.ones_like(grouped), axis=1).reshape(-1)


def _whiten(x: jax.Array, weights: jax.Array, axis, eps: float) -> jax.Array:
    """`(x - mean) / (std + eps)` with weighted population statistics over `axis`; 0 where the weight is 0."""
    centered = _centered(x, weights, axis)
    total = jnp.maximum(weights.sum(axis, keepdims=True), 1e-12)
    std = jnp.sqrt((weights * centered ** 2).sum(axis, keepdims=True) / total)
    return jnp.where(weights > 0, centered / (std + eps), 0.0)


def _next(x: jax.Array) -> jax.Array:
    """`[B, N]` shifted one step left in time, zero-filled: `out[:, t] = x[:, t + 1]`."""
    return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


# --------------------------------------------------------------------------- group baselines, [B] -> [B]


def grpo(rewards: jax.Array, group_size: int, *, std_scope: StdScope = "group", eps: float = 1e-6
         ) -> jax.Array:
    """Group-relative advantage (GRPO, Shao et al. 2024, arXiv 2402.03300).

    `A_i = (r_i - mean_group(r)) / (std + eps)`, with std the sample std (ddof 1, as TRL, verl and OpenRLHF
    compute it with `torch.std`) of the group ("group"), of all B rewards ("batch": Lite-PPO's group mean
    with batch std, Liu et al. 2025 "Tricks or Traps", arXiv 2508.08221), or no division ("none": Dr. GRPO).
    A single sample (group_size 1, or B = 1 for "batch") has std 0. rewards `[B]` -> `[B]`.
    """
    grouped = _groups(rewards, group_size)
    centered = _group_centered(rewards, group_size).reshape(grouped.shape)
    if std_scope == "group":
        centered = centered / (grouped.std(axis=1, keepdims=True, ddof=min(1, group_size - 1)) + eps)
    elif std_scope == "batch":
        centered = centered / (grouped.std(ddof=min(1, grouped.size - 1)) + eps)
    elif std_scope != "none":
        raise ValueError(f"std_scope must be 'group', 'batch' or 'none', got {std_scope!r}")
    return centered.reshape(-1)


def dr_grpo(rewards: jax.Array, group_size: int) -> jax.Array:
    """Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): `r_i - mean_group(r)`, no std. `[B]` -> `[B]`."""
    return grpo(rewards, group_size, std_scope="none")


def rloo(rewards: jax.Array, group_size: int) -> jax.Array:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740).

    `A_i = r_i - (sum_group(r) - r_i) / (G - 1)`, i.e. `G / (G - 1) * (r_i - mean_group(r))`.
    rewards `[B]` -> `[B]`; needs G >= 2.
    """
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2, got {group_size}")
    grouped = _groups(rewards, group_size)
    others = (grouped.sum(axis=1, keepdims=True) - grouped) / (group_size - 1)
    return jnp.where(_all_equal(grouped, jnp.ones_like(grouped), axis=1), 0.0, grouped - others).reshape(-1)


def reinforce_pp(rewards: jax.Array, *, group_size: int | None = None, mask: jax.Array | None = None,
                 token_penalty: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): global batch whitening of the return.

    `x = r` (or `r - mean_group(r)` when `group_size` is given: "REINFORCE++-baseline"), then
    `A = (x - mean) / (std + eps)` with population stats over the B sequences, or, given `mask [B, N]`,
    over the valid tokens (row i weighted by its length: the stats of x broadcast to tokens, as OpenRLHF
    computes them; a row without valid tokens gets 0). rewards `[B]` -> `[B]`.

    With `token_penalty [B, N]` (the per-token KL folded into the reward; needs `mask`), each token's
    return is the paper's `x - sum_{i >= t} penalty_i`, the penalty still to come, whitened over the
    valid tokens -> `[B, N]`, times the mask.
    """
    if group_size is None:
        x = _groups(rewards, 1).reshape(-1)  # groups of 1: just the 1-D check and the float32 cast
    else:
        grouped = _groups(rewards, group_size)
        x = _centered(grouped, jnp.ones_like(grouped), axis=1).reshape(-1)
    if token_penalty is None:
        weights = jnp.ones_like(x) if mask is None else jnp.asarray(mask, jnp.float32).sum(axis=1)
        return _whiten(x, weights, axis=0, eps=eps)
    if mask is None:
        raise ValueError("reinforce_pp with a token_penalty needs the completion mask")
    mask = jnp.asarray(mask, jnp.float32)
    returns = x[:, None] - penalty_to_go(token_penalty, mask)
    return _whiten(returns, mask, axis=None, eps=eps) * mask


def penalty_to_go(token_penalty: jax.Array, mask: jax.Array) -> jax.Array:
    """`out[b, t] = sum_{i >= t} penalty[b, i] * mask[b, i]`: the penalty a token's choice still faces
    (undiscounted). token_penalty, mask `[B, N]` -> `[B, N]`, times the mask."""
    mask = jnp.asarray(mask, jnp.float32)
    masked = jnp.asarray(token_penalty, jnp.float32) * mask
    return jnp.flip(jnp.cumsum(jnp.flip(masked, axis=1), axis=1), axis=1) * mask


def remax(rewards: jax.Array, greedy_rewards: jax.Array) -> jax.Array:
    """ReMax (Li et al. 2023, arXiv 2310.10505): `A_i = r_i - r_greedy(prompt_i)`.

    greedy_rewards `[B]`: the reward of the prompt's greedy completion, repeated per sample. -> `[B]`.
    """
    return jnp.asarray(rewards, jnp.float32) - jnp.asarray(greedy_rewards, jnp.float32)


def opo(rewards: jax.Array, lengths: jax.Array, group_size: int, *, eps: float = 1e-6) -> jax.Array:
    """On-policy RL with the optimal baseline (OPO, Hao et al. 2025, arXiv 2505.23585).

    `b = sum_group(l * r) / max(sum_group(l), eps)`, `A_i = r_i - b`: the length-weighted group mean,
    the variance-minimising baseline under token-mean losses. rewards, lengths `[B]` -> `[B]`.
    """
    grouped = _groups(rewards, group_size)
    lengths = _groups(lengths, group_size)
    baseline = (lengths * grouped).sum(axis=1, keepdims=True) / jnp.maximum(
        lengths.sum(axis=1, keepdims=True), eps)
    return (grouped - baseline).reshape(-1)


# --------------------------------------------------------------------------- critic-based, [B, N]


def outcome_token_rewards(rewards: jax.Array, mask: jax.Array) -> jax.Array:
    """`[B]` outcome rewards placed on each row's last valid token of `mask [B, N]`; zero elsewhere.

    A row with no valid token stays all zero. -> `[B, N]` float32.
    """
    mask = jnp.asarray(mask, jnp.float32)
    last = mask * (1.0 - _next(mask))  # 1 exactly at the end of the valid prefix
    return jnp.asarray(rewards, jnp.float32)[:, None] * last


def _gae_scan(delta: jax.Array, next_mask: jax.Array, discount: jax.Array) -> jax.Array:
    """`A_t = delta_t + discount * m_{t+1} * A_{t+1}` backwards in time; discount `[B]`."""

    def step(carry, xs):
        delta_t, next_mask_t = xs
        adv = delta_t + discount * next_mask_t * carry
        return adv, adv

    _, adv = jax.lax.scan(step, jnp.zeros(delta.shape[0], jnp.float32), (delta.T, next_mask.T),
                          reverse=True)
    return adv.T


def decoupled_gae(token_rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float = 1.0,
                  lam_actor: float | jax.Array = 0.95, lam_critic: float | jax.Array = 1.0
                  ) -> tuple[jax.Array, jax.Array]:
    """GAE with separate lambdas for the policy and the value targets (VC-PPO, Yuan et al. 2025,
    arXiv 2503.01491).

    `delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t` (the value after the last valid token is 0),
    `A_t = delta_t + gamma * lam * m_{t+1} * A_{t+1}`. Returns `(advantages [B, N] from lam_actor,
    returns [B, N] = A + V from lam_critic)`, both times the mask. Each lambda: a float or `[B]`.
    """
    mask = jnp.asarray(mask, jnp.float32)
    values = jnp.asarray(values, jnp.float32)
    next_mask = _next(mask)
    delta = jnp.asarray(token_rewards, jnp.float32) + gamma * _next(values) * next_mask - values

    def advantages(lam):
        discount = gamma * jnp.broadcast_to(jnp.asarray(lam, jnp.float32), (mask.shape[0],))
        return _gae_scan(delta, next_mask, discount)

    returns = (advantages(lam_critic) + values) * mask
    return advantages(lam_actor) * mask, returns


def gae(token_rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float = 1.0,
        lam: float | jax.Array = 0.95) -> tuple[jax.Array, jax.Array]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv 1506.02438).

    token_rewards, values, mask `[B, N]`; lam a float or `[B]`. With
    `delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t` and `A_t = delta_t + gamma * lam * m_{t+1} * A_{t+1}`
    (terminal after the last valid token), returns `(A [B, N], A + V [B, N])`, both times the mask.
    """
    return decoupled_gae(token_rewards, values, mask, gamma=gamma, lam_actor=lam, lam_critic=lam)


def length_adaptive_lambda(lengths: jax.Array, alpha: float = 0.05) -> jax.Array:
    """VAPO's length-adaptive GAE lambda (Yue et al. 2025, arXiv 2504.05118).

    `lam = 1 - 1 / (alpha * l)` clipped to [0, 1]; length 0 gives 0. lengths `[B]` -> `[B]`.
    """
    lengths = jnp.asarray(lengths, jnp.float32)
    scaled = alpha * lengths
    lam = 1.0 - _safe_div(jnp.ones_like(scaled), scaled)
    return jnp.where(scaled > 0, jnp.clip(lam, 0.0, 1.0), 0.0)


# --------------------------------------------------------------------------- entropy shaping


def entropy_augmented(advantages: jax.Array, entropy: jax.Array, *, alpha: float = 0.4,
                      kappa: float = 2.0) -> jax.Array:
    """Entropy-based advantage bonus (Cheng et al. 2025, "Reasoning with Exploration: An Entropy
    Perspective", arXiv 2506.14758).

    `A + min(alpha * stop_gradient(H), |A| / kappa)`; the cap keeps the sign of a negative A for
    kappa >= 1. advantages, entropy `[B, N]` -> `[B, N]`.
    """
    advantages = jnp.asarray(advantages, jnp.float32)
    bonus = alpha * jax.lax.stop_gradient(jnp.asarray(entropy, jnp.float32))
    return advantages + jnp.minimum(bonus, jnp.abs(advantages) / kappa)


def gtpo(rewards: jax.Array, entropy: jax.Array, mask: jax.Array, group_size: int, *,
         alpha1: float = 1.0, alpha2: float = 1.0, eps: float = 1e-6) -> jax.Array:
    """Group token policy optimisation (GTPO, Tan et al. 2025, arXiv 2508.04349): entropy-shaped
    token rewards, normalised per group.

    Our reading for binary rewards. Within a group, O+ = {i: r_i > 0}, O- = the rest; H = max(H, eps),
    stop-gradient. At position t, d_t / h_t = the number of O+ / O- rows valid at t. Shaped reward:
      i in O+: `alpha1 * r_i + alpha2 * H_it / sum_{k in O+} (H_kt m_kt) * d_t`
      j in O-: `-alpha1 - alpha2 * (1 / H_jt) / sum_{k in O-} (m_kt / H_kt) * h_t`
    Advantage: `(x - mean) / (std + eps)` over all valid tokens of the group, times the mask.
    rewards `[B]`, entropy, mask `[B, N]` -> `[B, N]`.
    """
    r = _groups(rewards, group_size)[..., None]  # [P, G, 1]
    m = _row_groups(mask, group_size)
    h = jnp.maximum(jax.lax.stop_gradient(_row_groups(entropy, group_size)), eps)
    pos = (r > 0).astype(jnp.float32)
    neg = 1.0 - pos
    d = (pos * m).sum(axis=1, keepdims=True)  # [P, 1, N]
    n = (neg * m).sum(axis=1, keepdims=True)
    pos_share = _safe_div(h, (pos * m * h).sum(axis=1, keepdims=True)) * d
    neg_share = _safe_div(1.0 / h, (neg * m / h).sum(axis=1, keepdims=True)) * n
    shaped = jnp.where(pos > 0, alpha1 * r + alpha2 * pos_share, -alpha1 - alpha2 * neg_share)
    return (_whiten(shaped, m, axis=(1, 2), eps=eps) * m).reshape(mask.shape)


def grpo_s(rewards: jax.Array, entropy: jax.Array, mask: jax.Array, group_size: int, *,
           beta1: float = 1.0, beta2: float = 1.0, eps: float = 1e-6) -> jax.Array:
    """Sequence-level GTPO (GRPO-S, Tan et al. 2025, arXiv 2508.04349).

    Hbar_i = mean entropy over row i's valid tokens, clamped >= eps (stop-gradient; an empty row gets
    eps). With O+ = {i: r_i > 0} (n rows) and O- = the rest (m rows) of the group:
      i in O+: `beta1 * r_i + beta2 * Hbar_i / sum_{k in O+} Hbar_k * n`
      j in O-: `-beta1 - beta2 * (1 / Hbar_j) / sum_{k in O-} (1 / Hbar_k) * m`
    then GRPO-normalised within the group (`grpo`: `(x - mean) / (std + eps)`, sample std). -> `[B]`.
    """
    r = _groups(rewards, group_size)
    m = jnp.asarray(mask, jnp.float32)
    mean_h = _safe_div((jax.lax.stop_gradient(jnp.asarray(entropy, jnp.float32)) * m).sum(axis=1),
                       m.sum(axis=1))
    h = jnp.maximum(mean_h, eps).reshape(r.shape)
    pos = (r > 0).astype(jnp.float32)
    neg = 1.0 - pos
    pos_share = _safe_div(h, (pos * h).sum(axis=1, keepdims=True)) * pos.sum(axis=1, keepdims=True)
    neg_share = _safe_div(1.0 / h, (neg / h).sum(axis=1, keepdims=True)) * neg.sum(axis=1, keepdims=True)
    shaped = jnp.where(pos > 0, beta1 * r + beta2 * pos_share, -beta1 - beta2 * neg_share)
    return grpo(shaped.reshape(-1), group_size, std_scope="group", eps=eps)


# --------------------------------------------------------------------------- multi-reward, tokens


def normalize_components(components: jax.Array, group_size: int, *, weights: Sequence[float] | None = None,
                         std_scope: StdScope = "group", eps: float = 1e-6) -> jax.Array:
    """Per-component normalisation: `A = sum_k w_k * grpo(c[:, k], std_scope)`.

    Each reward component is normalised on its own, so that no component's scale drowns the others
    (GRPO over a multi-term reward). components `[B, K]`, weights K floats (default 1) -> `[B]`.
    """
    components = jnp.asarray(components, jnp.float32)
    if components.ndim != 2:
        raise ValueError(f"components must be [B, K], got shape {components.shape}")
    num = components.shape[1]
    weights = jnp.ones(num, jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)
    if weights.shape != (num,):
        raise ValueError(f"weights of shape {weights.shape} do not match {num} components")
    normalized = jax.vmap(lambda c: grpo(c, group_size, std_scope=std_scope, eps=eps),
                          in_axes=1, out_axes=1)(components)
    return normalized @ weights


def broadcast_to_tokens(advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """`[B]` advantages broadcast over the tokens (or `[B, N]` as is), times the mask. -> `[B, N]`."""
    advantages = jnp.asarray(advantages, jnp.float32)
    mask = jnp.asarray(mask, jnp.float32)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    elif advantages.ndim != 2:
        raise ValueError(f"advantages must be [B] or [B, N], got shape {advantages.shape}")
    return jnp.broadcast_to(advantages, mask.shape) * mask


# --------------------------------------------------------------------------- dispatcher


@struct.dataclass
class AdvantageInputs:
    """What every advantage estimator receives (built-in or a user's, see `jaxrl.registry` kind `advantage`).

    `rewards [B]` outcome rewards (groups of `group_size` contiguous rows), `mask [B, N]` completion mask
    (float32), and, each None unless the run computes it: `entropy [B, N]` policy entropy, `values [B, N]` critic
    values, `greedy_rewards [B]` the reward of each prompt's greedy completion, `components [B, K]` the reward
    components with `component_weights` (K floats), `token_penalty [B, N]` a per-token penalty (the KL folded
    into the reward, times the mask) that the estimator must apply itself.
    """

    rewards: jax.Array
    mask: jax.Array
    group_size: int = struct.field(pytree_node=False)
    entropy: jax.Array | None = None
    values: jax.Array | None = None
    greedy_rewards: jax.Array | None = None
    components: jax.Array | None = None
    component_weights: tuple[float, ...] | None = struct.field(pytree_node=False, default=None)
    token_penalty: jax.Array | None = None


def _require(value, estimator: str, what: str):
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {what}")
    return value


def _penalised(rewards: jax.Array, penalty: jax.Array | None) -> jax.Array:
    """Each sequence's reward minus its masked penalty sum (rloo, remax, opo)."""
    return rewards if penalty is None else rewards - penalty.sum(axis=1)


@register("advantage", "grpo", per_component=True)
def _grpo_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """GRPO, or per-component normalisation (`per_component`); a token penalty's sum, minus its group mean,
    is subtracted from the normalised advantage (dividing it by the rewards' std would cancel kl_coef: in a
    group of one outcome that std is the penalty's own)."""
    g = inputs.group_size
    if config.per_component:
        components = jnp.asarray(_require(inputs.components, config.estimator, "components (per_component)"),
                                 jnp.float32)
        normalized = normalize_components(components, g, weights=inputs.component_weights,
                                          std_scope=config.std_scope, eps=config.eps)
    else:
        normalized = grpo(inputs.rewards, g, std_scope=config.std_scope, eps=config.eps)
    penalty = inputs.token_penalty
    return normalized if penalty is None else normalized - _group_centered(penalty.sum(axis=1), g)


@register("advantage", "reinforce_pp")
def _reinforce_pp_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """REINFORCE++: each token's return loses the penalty still to come."""
    return reinforce_pp(inputs.rewards, group_size=inputs.group_size if config.group_baseline else None,
                        mask=inputs.mask, token_penalty=inputs.token_penalty, eps=config.eps)


@register("advantage", "rloo")
def _rloo_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    return rloo(_penalised(inputs.rewards, inputs.token_penalty), inputs.group_size)


@register("advantage", "remax", needs=("greedy_rollouts",))
def _remax_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    greedy = _require(inputs.greedy_rewards, config.estimator, "greedy_rewards")
    return remax(_penalised(inputs.rewards, inputs.token_penalty), greedy)


@register("advantage", "opo")
def _opo_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    return opo(_penalised(inputs.rewards, inputs.token_penalty), inputs.mask.sum(axis=1), inputs.group_size,
               eps=config.eps)


def _no_penalty(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    if inputs.token_penalty is not None:
        raise ValueError(f"advantage estimator {config.estimator!r} splits each group by binary outcome rewards: "
                         "it takes no token penalty (kl_in_reward)")
    return _require(inputs.entropy, config.estimator, "entropy")


@register("advantage", "gtpo", needs=("entropy", "binary_rewards"))
def _gtpo_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    return gtpo(inputs.rewards, _no_penalty(inputs, config), inputs.mask, inputs.group_size,
                alpha2=config.entropy_weight, eps=config.eps)


@register("advantage", "grpo_s", needs=("entropy", "binary_rewards"))
def _grpo_s_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    return grpo_s(inputs.rewards, _no_penalty(inputs, config), inputs.mask, inputs.group_size,
                  beta2=config.entropy_weight, eps=config.eps)


@register("advantage", "gae", needs=("critic",))
def _gae_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """GAE on outcome token rewards (minus the token penalty), optionally whitened over the batch."""
    values = _require(inputs.values, config.estimator, "values from a critic (set rl.critic.model)")
    token_rewards = outcome_token_rewards(inputs.rewards, inputs.mask)
    if inputs.token_penalty is not None:
        token_rewards = token_rewards - inputs.token_penalty
    lam_actor = config.lam_actor
    if config.length_adaptive_alpha is not None:
        lam_actor = length_adaptive_lambda(inputs.mask.sum(axis=1), config.length_adaptive_alpha)
    advantages, returns = decoupled_gae(token_rewards, values, inputs.mask, gamma=config.gamma,
                                        lam_actor=lam_actor, lam_critic=config.lam_critic)
    if config.whiten:
        advantages = _whiten(advantages, inputs.mask, axis=None, eps=config.eps) * inputs.mask
    return advantages, returns


def compute(
    config: AdvantageConfig,
    rewards: jax.Array,
    mask: jax.Array,
    group_size: int,
    *,
    entropy: jax.Array | None = None,
    values: jax.Array | None = None,
    greedy_rewards: jax.Array | None = None,
    components: jax.Array | None = None,
    component_weights: Sequence[float] | None = None,
    token_penalty: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Token-level advantages `[B, N]` (and value targets `[B, N]` for gae, else None) for a rollout.

    Args:
      config: which estimator and its knobs (static under jit).
      rewards: `[B]` outcome rewards; mask: `[B, N]` completion mask; group_size: G (static).
      entropy: `[B, N]` policy entropy (gtpo, grpo_s, and the entropy bonus); values: `[B, N]` critic
        values (gae); greedy_rewards: `[B]` (remax); components: `[B, K]` reward terms and
        component_weights K floats (per_component).
      token_penalty: `[B, N]` per-token penalty (e.g. a KL penalty in the reward): subtracted from the
        token rewards for gae; for reinforce_pp, each token's return loses the penalty from that token on;
        for grpo and per_component, the normalised advantage loses its masked sum minus the group's mean
        sum (not divided by the rewards' std, which would cancel its scale); for rloo, remax and opo, each
        sequence's reward loses its masked sum; gtpo and grpo_s take none.

    Returns:
      `(advantages [B, N], returns [B, N] | None)`, both times the mask; the entropy bonus
      (`entropy_bonus_alpha > 0`) is applied to the token-level advantages last.
    """
    name = config.estimator
    entry = registry.resolve("advantage", name, "rl.loss.advantage.estimator")
    if config.per_component and not entry.info.get("per_component"):
        raise ValueError(f"per_component normalisation is not defined for advantage estimator {name!r}")
    mask = jnp.asarray(mask, jnp.float32)
    penalty = None if token_penalty is None else jnp.asarray(token_penalty, jnp.float32) * mask
    inputs = AdvantageInputs(jnp.asarray(rewards, jnp.float32), mask, group_size, entropy=entropy, values=values,
                             greedy_rewards=greedy_rewards, components=components,
                             component_weights=None if component_weights is None else tuple(component_weights),
                             token_penalty=penalty)
    out = entry.fn(inputs=inputs, config=config)
    advantages, returns = out if isinstance(out, tuple) else (out, None)
    advantages = broadcast_to_tokens(jnp.asarray(advantages, jnp.float32), mask)
    if config.entropy_bonus_alpha > 0:
        entropy = _require(entropy, name, "entropy (entropy_bonus_alpha > 0)")
        advantages = entropy_augmented(advantages, entropy, alpha=config.entropy_bonus_alpha,
                                       kappa=config.entropy_bonus_kappa) * mask
    return advantages, returns
