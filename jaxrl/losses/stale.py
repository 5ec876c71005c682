"""Objectives designed for stale data (issue 33): M2PO, SAPO, and AIPO's asymmetric IS clip as a config.

Each is registered as kind `objective` with the call of `jaxrl.losses.policy`: `(log_ratio, advantages, logp,
mask, eps_low, eps_high, dual_clip_c) -> (loss [B, N], metrics [B, N])`, all `[B, N]` float32 (the mask may have
holes); only `logp` carries gradients. Objectives registered with `config={kwarg: field}` get those `LossConfig`
fields bound as keyword arguments by `build_loss`.

| method | config | per-token loss (r = pi / pi_old, A = advantage) |
|---|---|---|
| M2PO | `preset: m2po` (objective `m2po`, `m2po_tau`) | `-r A`, no clip; tokens of the largest squared log IS ratio masked over the whole batch until its second moment is <= tau (`correction.m2po_mask`, in `prepare_batch`) |
| SAPO | `preset: sapo` (objective `sapo`, `sapo_tau_pos`, `sapo_tau_neg`) | `-(4 / tau) sigmoid(tau (r - 1)) A`, tau by the sign of A |
| AIPO | `preset: aipo` (objective `cispo` with no lower bound, `is_level: token`, `is_cap`) | `-sg[min(r, rho)] A log pi` weighted by `min(pi_old / pi_sampler, rho)` |
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses.policy import clamped_ratio
from jaxrl.registry import register

sg = jax.lax.stop_gradient


@register("objective", "m2po", second_moment_mask=True)
def m2po(log_ratio, advantages, logp=None, mask=None, eps_low=None, eps_high=None, dual_clip_c=None):
    """M2PO: the unclipped importance-weighted policy gradient `-r A` on the tokens its mask keeps (the preset
    adds the untruncated token weight `pi_old / pi_sampler`, so the loss is `-(pi_theta / pi_sampler) A`).

    Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?",
    arXiv 2510.01161: `J = 1/sum|o_i| sum_i sum_t M_it r_it A_it` with no PPO clip, where the mask M bounds the
    second moment of the log IS ratio against the behaviour policy: over the whole batch, the tokens of the
    largest `(log pi_theta / pi_behav)^2` are masked until the mean of the kept ones is <= tau_M2 (0.04, the
    authors' scripts). The mask is a whole-batch quantity: `prepare_batch` computes it once, before the batch is
    split, with `pi_theta` the policy about to be updated (`old_logp`) and `pi_behav` the sampler's
    (`sampler_logp`), and removes the masked tokens from `loss_mask`. Choices: masked tokens leave the token-mean
    denominator (jaxrl's rule for every rejection; the paper divides by all tokens, a difference of its 0.06% of
    masked tokens); the mask is fixed for all updates of one batch (the official code recomputes its bound per
    micro-batch against the current policy, and a later revision constrains only the tokens PPO's clip would
    act on). `clip_eps_*` are not used.
    """
    del logp, mask, eps_low, eps_high, dual_clip_c
    return -clamped_ratio(log_ratio) * advantages, {}


@register("objective", "sapo", config={"tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg"})
def sapo(log_ratio, advantages, logp=None, mask=None, eps_low=None, eps_high=None, dual_clip_c=None, *,
         tau_pos: float = 1.0, tau_neg: float = 1.05):
    """SAPO: a smooth, temperature-controlled gate instead of PPO's hard clip.

    Gao et al. 2025 (Qwen), "Soft Adaptive Policy Optimization", arXiv 2511.20347: the token's surrogate is
    `f(r) A` with `f(r) = (4 / tau) sigmoid(tau (r - 1))`, `tau = tau_pos` for A > 0 and `tau_neg` otherwise
    (defaults 1.0 and 1.05, the paper's as AReaL's and ms-swift's docs give them; tau_neg > tau_pos damps the negative tokens' updates faster). Its
    gradient is `4 s (1 - s) r A grad log pi` with `s = sigmoid(tau (r - 1))`: exactly the policy gradient on
    policy (r = 1), decaying smoothly as r leaves 1 in either direction. The loss value at r = 1 is `-2 A / tau`.
    The paper averages each sequence's tokens, then the sequences (`aggregation: seq-mean-token-mean`, the
    preset's). Metric `sapo_gate`: the gradient weight `4 s (1 - s)` (1 on policy). `clip_eps_*` are not used.
    """
    del logp, mask, eps_low, eps_high, dual_clip_c
    ratio = clamped_ratio(log_ratio)
    tau = jnp.where(advantages > 0, tau_pos, tau_neg)
    s = jax.nn.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * s * advantages
    return loss, {"sapo_gate": sg(4.0 * s * (1.0 - s))}
