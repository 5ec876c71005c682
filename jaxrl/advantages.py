"""Advantage estimators as small pure functions, plus `compute`, the dispatcher the trainer calls.

Shapes: B sequences, N completion tokens, G samples per prompt (`group_size`, a static Python int).
Groups are contiguous: the G samples of one prompt are adjacent rows, so B = num_prompts * G.
`mask [B, N]` is the completion mask (float or bool). In a single-turn rollout it is a contiguous prefix of
1s per row (possibly all zeros: an empty completion). In a multi-turn episode it has *holes*: the
observation tokens (tool results) sit between the model turns with mask 0. Every estimator here gives, on
the model tokens, what it gives on the *compacted* rows (observation tokens dropped, model tokens shifted
left), and 0 on the holes: sums and means over the mask need nothing more; `outcome_token_rewards` puts
the reward on the episode's last model token; GAE's delta and recursion bootstrap from the next *model*
token (`_gae_scan`), and the terminal is after the last one; `gtpo`'s per-position statistics are taken
at compacted positions (`compact` / `expand`). Everything is computed in float32 and is jit-safe: no
Python control flow on traced values, only on static arguments (`group_size`, flags, the config).

Sequence-level estimators return `[B]` (broadcast over tokens with `broadcast_to_tokens`); token-level
ones (`gae`, `gtpo`, `reinforce_pp` with a token penalty) return `[B, N]`, already multiplied by the mask.

Per-turn credit (`AdvantageConfig.turn_credit`, multi-turn episodes): with "final" (the default) the
sequence reward `rewards [B]` is used as in a single-turn run. With "discounted", `token_rewards [B, N]`
(each turn's reward on its last model token, the outcome on the episode's last model token) and
`turn_ids [B, N]` (the model turn of each token, -1 on observation tokens and padding) give each model
token of turn k the return `G_k = sum_{j >= k} turn_gamma^(j - k) R_j` (`turn_returns`), with `R_j` the
sum of turn j's token rewards; the group baseline is taken from the episode returns `G_0`:
- grpo: `A = (G_k - mean_group(G_0)) / (std(G_0) + eps)`, std as `std_scope` says (group / batch / none);
- rloo: `A = G_k - (sum_group(G_0) - G_0) / (G - 1)`, the leave-one-out mean of the others' `G_0`;
- reinforce_pp: the return `G_k` (minus `mean_group(G_0)` with `group_baseline`), whitened over the
  batch's model tokens;
- gae: `token_rewards` in place of `outcome_token_rewards`, discounted per token by `gamma`
  (`turn_gamma` must stay 1).
Estimators registered without `turn_credit=True` refuse "discounted" (`LossConfig.check_pieces`).
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
    # grpo_s; bnpo, psr, nsr, w_reinforce, passk, empg, seed_grpo of jaxrl.advantage_shaping; and those of
    # modules under `imports:`) or `module:function`.
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
    # Multi-turn episodes: "final" broadcasts the sequence reward (as a single-turn run does); "discounted"
    # gives each model turn k the return sum_{j >= k} turn_gamma^(j - k) R_j of its own and later turns'
    # rewards (needs the rollout's token_rewards and turn_ids; estimators registered with turn_credit=True).
    turn_credit: Literal["final", "discounted"] = "final"
    turn_gamma: float = dataclasses.field(default=1.0, metadata={"ge": 0, "le": 1})
    # Issue 35, advantage and entropy methods (jaxrl.advantage_shaping); each used only by its estimator.
    psr_weight: float = dataclasses.field(default=0.1, metadata={"ge": 0})  # w_reinforce: lambda on correct samples
    passk_k: int = dataclasses.field(default=4, metadata={"ge": 1})  # passk: the k of pass@k (< group_size)
    empg_k: float = dataclasses.field(default=1.0, metadata={"gt": 0})  # empg: scaling temperature k
    empg_k_future: float = dataclasses.field(default=1.0, metadata={"gt": 0})  # empg: future-clarity k'
    empg_zeta: float = dataclasses.field(default=0.1, metadata={"ge": 0})  # empg: future-clarity weight zeta
    empg_steps: Literal["turns", "tokens"] = "turns"  # empg: a step is a model turn, or each model token
    seed_alpha: float = dataclasses.field(default=1.0, metadata={"ge": 0, "le": 1})  # seed_grpo: alpha


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


def compact(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Each row's masked-in entries of `x [B, N]` shifted left in order, zeros after. -> `[B, N]` float32.

    With a multi-turn mask this drops the observation tokens (the holes); `compacted_mask` is the mask of
    the result and `expand` the way back.
    """
    x = jnp.asarray(x, jnp.float32)
    valid = jnp.asarray(mask) > 0
    dest = jnp.where(valid, jnp.cumsum(valid, axis=1) - 1, x.shape[1])  # out of range: dropped
    rows = jnp.arange(x.shape[0])[:, None]
    return jnp.zeros_like(x).at[rows, dest].set(x, mode="drop")


def compacted_mask(mask: jax.Array) -> jax.Array:
    """The mask of `compact(x, mask)`: per row a prefix of as many 1s as `mask` has. `[B, N]` float32."""
    lengths = (jnp.asarray(mask) > 0).sum(axis=1)
    return (jnp.arange(mask.shape[1])[None, :] < lengths[:, None]).astype(jnp.float32)


def expand(y: jax.Array, mask: jax.Array) -> jax.Array:
    """The inverse of `compact`: the k-th masked-in position of each row gets `y[:, k]`, the others 0."""
    valid = jnp.asarray(mask) > 0
    index = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    return jnp.where(valid, jnp.take_along_axis(jnp.asarray(y, jnp.float32), index, axis=1), 0.0)


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
    """`[B]` outcome rewards placed on each row's last valid token of `mask [B, N]` (the episode's last model
    token, not the end of each turn); zero elsewhere. A row with no valid token stays all zero. -> `[B, N]`.
    """
    mask = jnp.asarray(mask, jnp.float32)
    to_go = jnp.flip(jnp.cumsum(jnp.flip(mask, axis=1), axis=1), axis=1)  # valid tokens at or after t
    last = mask * (to_go == 1.0)  # 1 exactly at the last valid token
    return jnp.asarray(rewards, jnp.float32)[:, None] * last


def _gae_scan(token_rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float,
              discount: jax.Array) -> jax.Array:
    """GAE backwards in time over the valid tokens only; `[B, N]` float32, 0 on invalid tokens.

    At a valid token t, with t' the next valid token (none: the terminal, where V and A are 0):
    `delta_t = r_t + gamma * V_t' - V_t` and `A_t = delta_t + discount * A_t'`; discount `[B]` (gamma * lam).
    Invalid tokens (holes, padding) pass the carry through unchanged, so a multi-turn row gives what its
    compacted row gives. On a prefix mask the arithmetic is that of the plain recursion, bit for bit.
    """

    def step(carry, xs):
        next_value, next_adv = carry
        r_t, v_t, m_t = xs
        adv = (r_t + gamma * next_value - v_t) + discount * next_adv
        keep = m_t > 0
        return (jnp.where(keep, v_t, next_value), jnp.where(keep, adv, next_adv)), jnp.where(keep, adv, 0.0)

    zeros = jnp.zeros(mask.shape[0], jnp.float32)
    _, adv = jax.lax.scan(step, (zeros, zeros), (token_rewards.T, values.T, mask.T), reverse=True)
    return adv.T


def decoupled_gae(token_rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float = 1.0,
                  lam_actor: float | jax.Array = 0.95, lam_critic: float | jax.Array = 1.0
                  ) -> tuple[jax.Array, jax.Array]:
    """GAE with separate lambdas for the policy and the value targets (VC-PPO, Yuan et al. 2025,
    arXiv 2503.01491).

    `delta_t = r_t + gamma * V_t' - V_t` and `A_t = delta_t + gamma * lam * A_t'`, where t' is the next
    valid token (skipping the holes of a multi-turn mask; after the last valid token V and A are 0).
    Returns `(advantages [B, N] from lam_actor, returns [B, N] = A + V from lam_critic)`, both times the
    mask. Each lambda: a float or `[B]`. Rewards on invalid tokens are ignored.
    """
    mask = jnp.asarray(mask, jnp.float32)
    values = jnp.asarray(values, jnp.float32)
    token_rewards = jnp.asarray(token_rewards, jnp.float32)

    def advantages(lam):
        discount = gamma * jnp.broadcast_to(jnp.asarray(lam, jnp.float32), (mask.shape[0],))
        return _gae_scan(token_rewards, values, mask, gamma, discount)

    returns = (advantages(lam_critic) + values) * mask
    return advantages(lam_actor) * mask, returns


def gae(token_rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float = 1.0,
        lam: float | jax.Array = 0.95) -> tuple[jax.Array, jax.Array]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv 1506.02438).

    token_rewards, values, mask `[B, N]`; lam a float or `[B]`. With t' the next valid token,
    `delta_t = r_t + gamma * V_t' - V_t` and `A_t = delta_t + gamma * lam * A_t'` (terminal after the last
    valid token), returns `(A [B, N], A + V [B, N])`, both times the mask (see `decoupled_gae`).
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
    stop-gradient. Positions are those of the compacted rows (a multi-turn row's t-th model token is at
    position t; `compact`). At position t, d_t / h_t = the number of O+ / O- rows valid at t. Shaped reward:
      i in O+: `alpha1 * r_i + alpha2 * H_it / sum_{k in O+} (H_kt m_kt) * d_t`
      j in O-: `-alpha1 - alpha2 * (1 / H_jt) / sum_{k in O-} (m_kt / H_kt) * h_t`
    Advantage: `(x - mean) / (std + eps)` over all valid tokens of the group, times the mask.
    rewards `[B]`, entropy, mask `[B, N]` -> `[B, N]`.
    """
    r = _groups(rewards, group_size)[..., None]  # [P, G, 1]
    m = _row_groups(compacted_mask(mask), group_size)
    h = jnp.maximum(jax.lax.stop_gradient(_row_groups(compact(entropy, mask), group_size)), eps)
    pos = (r > 0).astype(jnp.float32)
    neg = 1.0 - pos
    d = (pos * m).sum(axis=1, keepdims=True)  # [P, 1, N]
    n = (neg * m).sum(axis=1, keepdims=True)
    pos_share = _safe_div(h, (pos * m * h).sum(axis=1, keepdims=True)) * d
    neg_share = _safe_div(1.0 / h, (neg * m / h).sum(axis=1, keepdims=True)) * n
    shaped = jnp.where(pos > 0, alpha1 * r + alpha2 * pos_share, -alpha1 - alpha2 * neg_share)
    return expand((_whiten(shaped, m, axis=(1, 2), eps=eps) * m).reshape(mask.shape), mask)


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


# --------------------------------------------------------------------------- per-turn credit


def turn_returns(token_rewards: jax.Array, turn_ids: jax.Array, mask: jax.Array, turn_gamma: float = 1.0
                 ) -> tuple[jax.Array, jax.Array]:
    """Discounted per-turn returns of multi-turn episodes.

    token_rewards `[B, N]` (each turn's reward on its last model token, the outcome on the episode's last),
    turn_ids `[B, N]` int (the model turn of each token, 0, 1, ...; -1 on observation tokens and padding),
    mask `[B, N]`. `R_j` = the sum of the token rewards of turn j (tokens with `turn_ids == j` and mask 1;
    rewards elsewhere are ignored), `G_k = sum_{j >= k} turn_gamma^(j - k) R_j`.

    Returns `(returns [B, N]`: `G_k` on each model token of turn k, 0 elsewhere; `episode_returns [B]`: `G_0`,
    0 for a row without model tokens`)`. Tokens whose turn id is not in [0, N) count as no turn's.
    """
    rewards = jnp.asarray(token_rewards, jnp.float32)
    turn_ids = jnp.asarray(turn_ids, jnp.int32)
    batch, length = rewards.shape
    valid = (turn_ids >= 0) & (turn_ids < length) & (jnp.asarray(mask) > 0)
    rows = jnp.arange(batch)[:, None]
    per_turn = jnp.zeros_like(rewards).at[rows, jnp.where(valid, turn_ids, length)].add(
        jnp.where(valid, rewards, 0.0), mode="drop")  # [B, turns <= N]

    def step(later, r_j):
        g = r_j + turn_gamma * later
        return g, g

    _, by_turn = jax.lax.scan(step, jnp.zeros(batch, jnp.float32), per_turn.T, reverse=True)
    by_turn = by_turn.T
    returns = jnp.take_along_axis(by_turn, jnp.clip(turn_ids, 0, length - 1), axis=1)
    return jnp.where(valid, returns, 0.0), by_turn[:, 0]


def _turn_baseline(episode_returns: jax.Array, group_size: int, leave_one_out: bool = False) -> jax.Array:
    """`[B]` group baseline from the episode returns `G_0`: the group mean (or, `leave_one_out`, the mean of
    the other samples); exactly each row's own `G_0` where the group's `G_0` are all equal."""
    grouped = _groups(episode_returns, group_size)
    if leave_one_out:
        baseline = (grouped.sum(axis=1, keepdims=True) - grouped) / (group_size - 1)
    else:
        baseline = jnp.broadcast_to(grouped.mean(axis=1, keepdims=True), grouped.shape)
    return jnp.where(_all_equal(grouped, jnp.ones_like(grouped), axis=1), grouped, baseline).reshape(-1)


def grpo_turns(returns: jax.Array, episode_returns: jax.Array, group_size: int, *,
               std_scope: StdScope = "group", eps: float = 1e-6) -> jax.Array:
    """GRPO with per-turn returns: `A_t = (G_k(t) - mean_group(G_0)) / (std(G_0) + eps)`.

    std: the sample std (ddof 1) of the group's `G_0` ("group"), of all B `G_0` ("batch"), or none ("none"),
    as in `grpo`. returns `[B, N]` (`turn_returns`), episode_returns `[B]` -> `[B, N]` (not masked).
    """
    grouped = _groups(episode_returns, group_size)
    centered = jnp.asarray(returns, jnp.float32) - _turn_baseline(episode_returns, group_size)[:, None]
    if std_scope == "group":
        std = jnp.repeat(grouped.std(axis=1, ddof=min(1, group_size - 1)), group_size)[:, None]
    elif std_scope == "batch":
        std = grouped.std(ddof=min(1, grouped.size - 1))
    elif std_scope == "none":
        return centered
    else:
        raise ValueError(f"std_scope must be 'group', 'batch' or 'none', got {std_scope!r}")
    return centered / (std + eps)


def rloo_turns(returns: jax.Array, episode_returns: jax.Array, group_size: int) -> jax.Array:
    """RLOO with per-turn returns: `A_t = G_k(t) - (sum_group(G_0) - G_0) / (G - 1)`. -> `[B, N]`."""
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2, got {group_size}")
    baseline = _turn_baseline(episode_returns, group_size, leave_one_out=True)
    return jnp.asarray(returns, jnp.float32) - baseline[:, None]


def reinforce_pp_turns(returns: jax.Array, episode_returns: jax.Array, mask: jax.Array, *,
                       group_size: int | None = None, token_penalty: jax.Array | None = None,
                       eps: float = 1e-6) -> jax.Array:
    """REINFORCE++ with per-turn returns: `x_t = G_k(t)` (minus `mean_group(G_0)` when `group_size` is given),
    minus the penalty still to come (`penalty_to_go`), whitened over the valid tokens. -> `[B, N]`, masked."""
    mask = jnp.asarray(mask, jnp.float32)
    x = jnp.asarray(returns, jnp.float32)
    if group_size is not None:
        x = x - _turn_baseline(episode_returns, group_size)[:, None]
    if token_penalty is not None:
        x = x - penalty_to_go(token_penalty, mask)
    return _whiten(x, mask, axis=None, eps=eps) * mask


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
    into the reward, times the mask) that the estimator must apply itself, and for multi-turn episodes
    `token_rewards [B, N]` (each turn's reward on its last model token) and `turn_ids [B, N]` int32 (the
    model turn of each token, -1 on observation tokens and padding).

    The mask may have holes (multi-turn observation tokens): an estimator must give on the model tokens what
    it gives on the compacted rows (`compact`, `expand`).
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
    token_rewards: jax.Array | None = None
    turn_ids: jax.Array | None = None
    answer_ids: jax.Array | None = None  # [B] int32: each sample's final-answer cluster in its group (seed_grpo)


def _require(value, estimator: str, what: str):
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {what}")
    return value


def _penalised(rewards: jax.Array, penalty: jax.Array | None) -> jax.Array:
    """Each sequence's reward minus its masked penalty sum (rloo, remax, opo); `[B]` or `[B, N]` rewards."""
    if penalty is None:
        return rewards
    total = penalty.sum(axis=1)
    return rewards - (total if rewards.ndim == 1 else total[:, None])


def _discounted(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array] | None:
    """`turn_returns` of the batch when `config.turn_credit` is "discounted", else None."""
    if config.turn_credit != "discounted":
        return None
    what = "{} (rl.loss.advantage.turn_credit: discounted)"
    token_rewards = _require(inputs.token_rewards, config.estimator, what.format("token_rewards"))
    turn_ids = _require(inputs.turn_ids, config.estimator, what.format("turn_ids"))
    return turn_returns(token_rewards, turn_ids, inputs.mask, config.turn_gamma)


@register("advantage", "grpo", per_component=True, turn_credit=True)
def _grpo_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """GRPO, or per-component normalisation (`per_component`), or per-turn returns (`grpo_turns`); a token
    penalty's sum, minus its group mean, is subtracted from the normalised advantage (dividing it by the
    rewards' std would cancel kl_coef: in a group of one outcome that std is the penalty's own)."""
    g = inputs.group_size
    turns = _discounted(inputs, config)
    if turns is not None:
        if config.per_component:
            raise ValueError("rl.loss.advantage.turn_credit: discounted per-turn returns are not defined with "
                             "per_component normalisation")
        normalized = grpo_turns(*turns, g, std_scope=config.std_scope, eps=config.eps)
        penalty = inputs.token_penalty
        return normalized if penalty is None else normalized - _group_centered(penalty.sum(axis=1), g)[:, None]
    if config.per_component:
        components = jnp.asarray(_require(inputs.components, config.estimator, "components (per_component)"),
                                 jnp.float32)
        normalized = normalize_components(components, g, weights=inputs.component_weights,
                                          std_scope=config.std_scope, eps=config.eps)
    else:
        normalized = grpo(inputs.rewards, g, std_scope=config.std_scope, eps=config.eps)
    penalty = inputs.token_penalty
    return normalized if penalty is None else normalized - _group_centered(penalty.sum(axis=1), g)


@register("advantage", "reinforce_pp", turn_credit=True)
def _reinforce_pp_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """REINFORCE++: each token's return loses the penalty still to come."""
    turns = _discounted(inputs, config)
    if turns is not None:
        return reinforce_pp_turns(*turns, inputs.mask, group_size=inputs.group_size if config.group_baseline
                                  else None, token_penalty=inputs.token_penalty, eps=config.eps)
    return reinforce_pp(inputs.rewards, group_size=inputs.group_size if config.group_baseline else None,
                        mask=inputs.mask, token_penalty=inputs.token_penalty, eps=config.eps)


@register("advantage", "rloo", turn_credit=True)
def _rloo_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    turns = _discounted(inputs, config)
    if turns is not None:
        returns, episode_returns = turns
        penalty = inputs.token_penalty
        return rloo_turns(_penalised(returns, penalty), _penalised(episode_returns, penalty), inputs.group_size)
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


@register("advantage", "gae", needs=("critic",), turn_credit=True)
def _gae_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """GAE on outcome token rewards, or with turn_credit "discounted" on the rollout's token rewards (each
    turn's reward where it was given, discounted per token by `gamma`); minus the token penalty; optionally
    whitened over the batch."""
    values = _require(inputs.values, config.estimator, "values from a critic (set rl.critic.model)")
    if config.turn_credit == "discounted":
        token_rewards = _require(inputs.token_rewards, config.estimator,
                                 "token_rewards (rl.loss.advantage.turn_credit: discounted)") * inputs.mask
    else:
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


def _turn_credit_names() -> str:
    return ", ".join(name for name in registry.names("advantage")
                     if registry.resolve("advantage", name, "rl.loss.advantage.estimator").info.get("turn_credit"))


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
    token_rewards: jax.Array | None = None,
    turn_ids: jax.Array | None = None,
    answer_ids: jax.Array | None = None,
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
      token_rewards, turn_ids: `[B, N]` per-turn rewards and model-turn ids of multi-turn episodes, used
        with `config.turn_credit == "discounted"` (see the module docstring); ignored with "final".
      answer_ids: `[B]` int32 cluster of each sample's extracted final answer within its group
        (`advantage_shaping.answer_clusters`), for estimators registered with answers=True (seed_grpo).

    Returns:
      `(advantages [B, N], returns [B, N] | None)`, both times the mask; the entropy bonus
      (`entropy_bonus_alpha > 0`) is applied to the token-level advantages last.
    """
    name = config.estimator
    entry = registry.resolve("advantage", name, "rl.loss.advantage.estimator")
    if config.per_component and not entry.info.get("per_component"):
        raise ValueError(f"per_component normalisation is not defined for advantage estimator {name!r}")
    if config.turn_credit != "final" and not entry.info.get("turn_credit"):
        raise ValueError(f"rl.loss.advantage.turn_credit: {config.turn_credit!r} per-turn credit is not defined "
                         f"for advantage estimator {name!r}; estimators that define it: {_turn_credit_names()}")
    mask = jnp.asarray(mask, jnp.float32)
    penalty = None if token_penalty is None else jnp.asarray(token_penalty, jnp.float32) * mask
    inputs = AdvantageInputs(jnp.asarray(rewards, jnp.float32), mask, group_size, entropy=entropy, values=values,
                             greedy_rewards=greedy_rewards, components=components,
                             component_weights=None if component_weights is None else tuple(component_weights),
                             token_penalty=penalty,
                             token_rewards=None if token_rewards is None else jnp.asarray(token_rewards, jnp.float32),
                             turn_ids=None if turn_ids is None else jnp.asarray(turn_ids, jnp.int32),
                             answer_ids=None if answer_ids is None else jnp.asarray(answer_ids, jnp.int32))
    out = entry.fn(inputs=inputs, config=config)
    advantages, returns = out if isinstance(out, tuple) else (out, None)
    advantages = broadcast_to_tokens(jnp.asarray(advantages, jnp.float32), mask)
    if config.entropy_bonus_alpha > 0:
        entropy = _require(entropy, name, "entropy (entropy_bonus_alpha > 0)")
        advantages = entropy_augmented(advantages, entropy, alpha=config.entropy_bonus_alpha,
                                       kappa=config.entropy_bonus_kappa) * mask
    return advantages, returns


# The second wave's estimators (issue 35) live in their own module and register themselves on import; it
# imports this one's helpers, so it is imported last.
import jaxrl.advantage_shaping  # noqa: E402,F401
