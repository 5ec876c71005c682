"""Advantage estimators and modifiers of the loss library's second wave (issue 35): BNPO, PSR / NSR /
W-REINFORCE, pass@k training, EMPG and SEED-GRPO.

Each is a pure function over the shapes of `jaxrl.advantages` (B sequences in groups of G contiguous rows,
N completion tokens, `mask [B, N]` possibly with holes), plus a registered estimator (registry kind
`advantage`) that a config selects with `rl.loss.advantage.estimator: NAME`; their knobs are the
`AdvantageConfig` fields of the "issue 35" block. Sequence-level ones return `[B]` (broadcast over the model
tokens by `advantages.compute`); EMPG returns `[B, N]`. All are computed in float32 and are jit-safe.

| estimator | preset | what |
|---|---|---|
| `bnpo` | `bnpo` | rewards minus the group mean, divided by a Beta density with parameters fitted to the batch |
| `psr`, `nsr`, `w_reinforce` | `w_reinforce` | +1 on correct / -1 on wrong samples, no baseline; W-REINFORCE weighs the positives by `psr_weight` |
| `passk` | `passk` | the analytic group advantages of pass@k training (`passk_k`) |
| `empg` | `empg` | GRPO advantages scaled per step by a self-normalised function of the step's entropy, plus a future-clarity bonus |
| `seed_grpo` | `seed_grpo` | GRPO advantages scaled down by the group's semantic entropy over its extracted final answers |

The entropy-advantage term of "Reasoning with Exploration: An Entropy Perspective" (arXiv 2506.14758) is
`advantages.entropy_augmented` (`rl.loss.advantage.entropy_bonus_alpha`), checked against its own reference
in tests/test_advantages_wave2.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.special import betaln, xlogy

from jaxrl.advantages import (AdvantageConfig, AdvantageInputs, _all_equal, _group_centered, _groups, _require,
                              _safe_div, grpo)
from jaxrl.registry import register

__all__ = ["answer_clusters", "bnpo", "empg", "passk", "psr_nsr", "seed_grpo", "semantic_entropy", "beta_moments"]


# --------------------------------------------------------------------------- BNPO


def beta_moments(p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Method-of-moments Beta parameters `(a, b)` of the success rates `p [P]` (sample variance, ddof 1):
    `a = mu (mu (1 - mu) / var - 1)`, `b = (1 - mu) (mu (1 - mu) / var - 1)`. Scalars; NaN-free: where the
    moments do not determine a Beta (fewer than 2 groups, or variance 0) both are 0."""
    p = jnp.asarray(p, jnp.float32)
    count = p.shape[0]
    mu = p.mean()
    var = ((p - mu) ** 2).sum() / max(count - 1, 1)
    ok = (count > 1) & (var > 0)
    common = jnp.where(ok, mu * (1.0 - mu) / jnp.where(ok, var, 1.0) - 1.0, 0.0)
    return common * mu, common * (1.0 - mu)


def bnpo(rewards: jax.Array, group_size: int) -> jax.Array:
    """Beta normalisation policy optimisation (BNPO, Xiao et al. 2025, "BNPO: Beta Normalization Policy
    Optimization", arXiv 2506.02864), binary rewards.

    `p(q)` = the group's mean reward (the Monte Carlo estimate of the prompt's success rate). The success rates
    of the batch's P prompts are modelled as Beta(a, b), fitted by the method of moments (`beta_moments`);
    the paper's variance-minimising normaliser is the Beta density with `alpha = 1 + a / 3`,
    `beta = 1 + b / 3`, and `A_i = (r_i - p(q)) / f_Beta(p(q); alpha, beta)`.

    Choices: alpha and beta are clamped to >= 1 (so the density is finite on [0, 1]), as the authors' code
    does (github.com/changyi7231/BNPO); with fewer than 2 groups or equal success rates everywhere the
    moments determine no Beta and alpha = beta = 1 (density 1: REINFORCE with the group-mean baseline). A
    group whose rewards are all equal (p = 0 or 1, where the density may be 0) gets exactly 0. The paper's
    advantage decomposition for multi-component rewards is not implemented. rewards `[B]` in {0, 1} -> `[B]`.
    """
    grouped = _groups(rewards, group_size)
    p = grouped.mean(axis=1)  # [P]
    a, b = beta_moments(p)
    alpha = jnp.maximum(1.0 + a / 3.0, 1.0)
    beta = jnp.maximum(1.0 + b / 3.0, 1.0)
    log_density = xlogy(alpha - 1.0, p) + xlogy(beta - 1.0, 1.0 - p) - betaln(alpha, beta)
    equal = _all_equal(grouped, jnp.ones_like(grouped), axis=1)
    density = jnp.exp(log_density)[:, None]
    out = jnp.where(equal, 0.0, (grouped - p[:, None]) / jnp.where(equal, 1.0, density))
    return out.reshape(-1)


# --------------------------------------------------------------------------- PSR / NSR / W-REINFORCE


def psr_nsr(rewards: jax.Array, *, positive_weight: float = 1.0, negative_weight: float = 1.0) -> jax.Array:
    """Positive and negative sample reinforcement (Zhu et al. 2025, "The Surprising Effectiveness of Negative
    Reinforcement in LLM Reasoning", arXiv 2506.01347).

    The RLVR objective with rewards +1 / -1 splits into PSR (raise the log-likelihood of correct samples) and
    NSR (lower that of wrong ones); their weighted sum `L = lambda * L_PSR + L_NSR` is W-REINFORCE. As an
    advantage, with no baseline: `A_i = positive_weight` if `r_i > 0` (correct), else `-negative_weight`.
    PSR is (1, 0), NSR (0, 1), W-REINFORCE (lambda, 1). rewards `[B]` (correct iff > 0) -> `[B]`.
    """
    r = _groups(rewards, 1).reshape(-1)
    return jnp.where(r > 0, jnp.float32(positive_weight), -jnp.float32(negative_weight))


# --------------------------------------------------------------------------- pass@k training


def _binomial_ratio(top: jax.Array, bottom: int, k: int) -> jax.Array:
    """`C(top, k) / C(bottom, k)` for integer-valued `top [..] <= bottom` and static `k >= 0`, as the product
    `prod_{j < k} (top - j) / (bottom - j)`: exactly 0 where `top < k` (a factor is 0), 1 for k = 0."""
    out = jnp.ones_like(top)
    for j in range(k):
        out = out * (top - j) / (bottom - j)
    return out


def passk(rewards: jax.Array, group_size: int, k: int) -> jax.Array:
    """Pass@k training with the analytic advantage (Chen et al. 2025, "Pass@k Training for Adaptively
    Balancing Exploration and Exploitation of Large Reasoning Models", arXiv 2508.10751), binary rewards.

    In a group of N = G samples with N_neg wrong ones, the mean pass@k reward of the group's k-subsets is
    `R = 1 - C(N_neg, k) / C(N, k)`, its std `sigma = sqrt(R (1 - R))`, and
      correct samples: `A_pos = (1 - R) / sigma`
      wrong samples:   `A_neg = (1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / sigma`.
    k = 1 gives GRPO with the population std. Where sigma = 0 (every k-subset passes, or none does) the
    numerators are 0 too, and the advantage is exactly 0 (no eps). rewards `[B]` (correct iff > 0) -> `[B]`;
    needs 1 <= k < G: with k = G the group is its only k-subset, every sample shares its pass@k, and every
    advantage is 0 (no learning signal), so it is refused.
    """
    if not 1 <= k < group_size:
        raise ValueError(f"rl.loss.advantage.passk_k must be in [1, group_size - 1 = {group_size - 1}] (k = G "
                         f"leaves every advantage 0), got {k}")
    grouped = _groups(rewards, group_size)
    correct = grouped > 0
    negatives = (~correct).sum(axis=1, keepdims=True).astype(jnp.float32)  # [P, 1]
    mean = 1.0 - _binomial_ratio(negatives, group_size, k)
    neg_share = _binomial_ratio(negatives - 1.0, group_size - 1, k - 1)
    sigma = jnp.sqrt(jnp.maximum(mean * (1.0 - mean), 0.0))
    numerator = jnp.where(correct, 1.0 - mean, 1.0 - mean - neg_share)
    return _safe_div(numerator, jnp.broadcast_to(sigma, numerator.shape)).reshape(-1)


# --------------------------------------------------------------------------- EMPG


def empg(advantages: jax.Array, entropy: jax.Array, mask: jax.Array, *, step_ids: jax.Array | None = None,
         k: float = 1.0, k_future: float = 1.0, zeta: float = 0.1, eps: float = 1e-8) -> jax.Array:
    """Entropy-modulated policy gradients (EMPG, Wang et al. 2025, "Harnessing Uncertainty: Entropy-Modulated
    Policy Gradients for Long-Horizon LLM Agents", arXiv 2509.09265).

    A step's entropy `H` is the mean token entropy over its tokens (stop-gradient). Over all steps of the
    batch, `Ht = (H - min H) / (max H - min H + eps)` (eps 1e-8 as the paper's pseudocode), then
      `g = exp(-k Ht) / mean_steps(exp(-k Ht))`  (self-calibrating scaling: mean 1 over the batch's steps)
      `f = exp(-k_future Ht)`                    (future clarity)
      `A_mod(i, t) = g(H_it) A_i + zeta f(H_i,t+1)`, with f = 0 after the row's last step,
    and finally `A_mod` minus its mean over the batch's steps ("final batch-level normalisation (e.g.
    zero-mean)"; we subtract the mean, each step weighted once, and do not divide by a std).

    Steps: `step_ids [B, N]` int (a multi-turn episode's model turn of each token, -1 on observation tokens
    and padding; None: the whole completion is one step, the paper's think-act cycle). Each token gets its
    step's `A_mod`. advantages `[B]` (e.g. GRPO's), entropy, mask `[B, N]` -> `[B, N]`, times the mask.
    """
    mask = jnp.asarray(mask, jnp.float32)
    batch, length = mask.shape
    valid = mask > 0
    if step_ids is None:
        step_ids = jnp.zeros((batch, length), jnp.int32)
    step_ids = jnp.asarray(step_ids, jnp.int32)
    valid = valid & (step_ids >= 0) & (step_ids < length)
    slot = jnp.where(valid, step_ids, length)  # out of range: dropped
    rows = jnp.arange(batch)[:, None]
    h = jax.lax.stop_gradient(jnp.asarray(entropy, jnp.float32))
    sums = jnp.zeros((batch, length), jnp.float32).at[rows, slot].add(jnp.where(valid, h, 0.0), mode="drop")
    counts = jnp.zeros((batch, length), jnp.float32).at[rows, slot].add(valid.astype(jnp.float32), mode="drop")
    has = counts > 0  # [B, steps]
    step_h = _safe_div(sums, counts)
    lo = jnp.min(jnp.where(has, step_h, jnp.inf))
    hi = jnp.max(jnp.where(has, step_h, -jnp.inf))
    normed = jnp.where(has, (step_h - lo) / (hi - lo + eps), 0.0)
    n_steps = jnp.maximum(has.sum(), 1)
    scale = jnp.exp(-k * normed)
    g = scale / (jnp.where(has, scale, 0.0).sum() / n_steps)
    clarity = jnp.exp(-k_future * normed)
    next_clarity = jnp.concatenate([clarity[:, 1:], jnp.zeros_like(clarity[:, :1])], axis=1)
    has_next = jnp.concatenate([has[:, 1:], jnp.zeros_like(has[:, :1])], axis=1)
    modulated = g * jnp.asarray(advantages, jnp.float32)[:, None] + zeta * jnp.where(has_next, next_clarity, 0.0)
    modulated = jnp.where(has, modulated, 0.0)
    modulated = modulated - modulated.sum() / n_steps
    per_token = jnp.take_along_axis(modulated, jnp.clip(step_ids, 0, length - 1), axis=1)
    return jnp.where(valid, per_token, 0.0)


def token_steps(mask: jax.Array) -> jax.Array:
    """Each model token its own step: the compacted position of the k-th masked-in token is k, -1 elsewhere
    (so a multi-turn row's next step skips the observation tokens). mask `[B, N]` -> `[B, N]` int32."""
    valid = jnp.asarray(mask) > 0
    return jnp.where(valid, jnp.cumsum(valid, axis=1) - 1, -1).astype(jnp.int32)


# --------------------------------------------------------------------------- SEED-GRPO


def answer_clusters(answers, group_size: int):
    """Host side: `[B]` int32 cluster ids of the completions' final answers within each group of
    `group_size` (the group index of the first sample with the same answer; a sample without an answer
    (None) is its own cluster). answers: B strings or None (normalised: equal strings = same meaning)."""
    import numpy as np

    out = np.zeros(len(answers), np.int32)
    for start in range(0, len(answers), group_size):
        first: dict[str, int] = {}
        for j, answer in enumerate(answers[start:start + group_size]):
            out[start + j] = j if answer is None else first.setdefault(answer, j)
    return out


def semantic_entropy(answer_ids: jax.Array, group_size: int) -> jax.Array:
    """SEED-GRPO's Monte Carlo semantic entropy of each group: `SE = -(1/K) sum_k log p(C_k)` over the K
    answer clusters of the group, with `p(C_k) = |C_k| / G` (the cluster's share of the group's samples).
    In [0, log G]: 0 for one answer, log G for G distinct ones. answer_ids `[B]` -> `[B / G]`."""
    ids = jnp.asarray(answer_ids).reshape(-1, group_size)
    same = ids[:, :, None] == ids[:, None, :]  # [P, G, G]
    size = same.sum(axis=-1).astype(jnp.float32)  # the size of each sample's cluster
    earlier = jnp.tril(jnp.ones((group_size, group_size), bool), k=-1)
    first = ~(same & earlier).any(axis=-1)  # each cluster counted once, at its first sample
    clusters = first.sum(axis=1).astype(jnp.float32)
    return -jnp.where(first, jnp.log(size / group_size), 0.0).sum(axis=1) / clusters


def seed_grpo(advantages: jax.Array, answer_ids: jax.Array, group_size: int, *, alpha: float = 1.0) -> jax.Array:
    """SEED-GRPO (Chen et al. 2025, "SEED-GRPO: Semantic Entropy Enhanced GRPO for Uncertainty-Aware Policy
    Optimization", arXiv 2505.12346): `A_hat_i = A_i * f(alpha * SE(q) / SE_max)` with the group's semantic
    entropy `SE` (`semantic_entropy`), `SE_max = log G` (G distinct answers) and the linear
    `f(x) = 1 - x`: a group that agrees keeps its advantages, a group of G distinct answers is scaled by
    `1 - alpha`.

    Choices: semantic clusters are equal normalised extracted final answers (`answer_clusters`; exact
    equivalence, no NLI model), and `p(C_k)` is the cluster's share of the group (the group's samples are
    draws from the policy) rather than a sum of sequence probabilities, which the sample does not normalise;
    of the paper's scaling functions only the linear one is built, with `0 <= alpha <= 1` so that the scale
    stays in [0, 1] (the sign of an advantage never flips). G = 1: scale 1.
    advantages `[B]`, answer_ids `[B]` -> `[B]`.
    """
    se = semantic_entropy(answer_ids, group_size)
    se_max = jnp.log(jnp.float32(group_size)) if group_size > 1 else jnp.float32(1.0)
    scale = 1.0 - alpha * se / se_max
    return (jnp.asarray(advantages, jnp.float32).reshape(-1, group_size) * scale[:, None]).reshape(-1)


# --------------------------------------------------------------------------- registered estimators


@register("advantage", "bnpo", needs=("binary_rewards",))
def _bnpo_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """BNPO (`bnpo`); binary rewards, no KL in the reward."""
    return bnpo(inputs.rewards, inputs.group_size)


@register("advantage", "psr", needs=("binary_rewards",))
def _psr_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """Positive sample reinforcement only: +1 on correct samples, 0 on wrong ones (`psr_nsr`)."""
    return psr_nsr(inputs.rewards, positive_weight=1.0, negative_weight=0.0)


@register("advantage", "nsr", needs=("binary_rewards",))
def _nsr_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """Negative sample reinforcement only: -1 on wrong samples, 0 on correct ones (`psr_nsr`)."""
    return psr_nsr(inputs.rewards, positive_weight=0.0, negative_weight=1.0)


@register("advantage", "w_reinforce", needs=("binary_rewards",))
def _w_reinforce_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """W-REINFORCE: `psr_weight` (lambda) on correct samples, -1 on wrong ones (`psr_nsr`)."""
    return psr_nsr(inputs.rewards, positive_weight=config.psr_weight, negative_weight=1.0)


@register("advantage", "passk", needs=("binary_rewards",))
def _passk_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """Pass@k training's analytic advantages with k = `passk_k` (`passk`)."""
    return passk(inputs.rewards, inputs.group_size, config.passk_k)


def _grpo_base(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """GRPO's advantage (`std_scope`), minus the token penalty's group-centred sum as the `grpo` estimator
    does. -> `[B]`."""
    base = grpo(inputs.rewards, inputs.group_size, std_scope=config.std_scope, eps=config.eps)
    penalty = inputs.token_penalty
    return base if penalty is None else base - _group_centered(penalty.sum(axis=1), inputs.group_size)


@register("advantage", "empg", needs=("entropy",))
def _empg_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """EMPG on GRPO advantages; steps per `empg_steps`: "turns" (a multi-turn episode's model turns, a
    single-turn completion is one step) or "tokens" (each model token a step)."""
    entropy = _require(inputs.entropy, config.estimator, "entropy")
    if config.empg_steps == "tokens":
        steps = token_steps(inputs.mask)
    else:
        steps = inputs.turn_ids  # None for single-turn rollouts: one step per completion
    return empg(_grpo_base(inputs, config), entropy, inputs.mask, step_ids=steps, k=config.empg_k,
                k_future=config.empg_k_future, zeta=config.empg_zeta)


@register("advantage", "seed_grpo", answers=True)
def _seed_grpo_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> jax.Array:
    """SEED-GRPO on GRPO advantages (`seed_grpo`); needs each sample's answer cluster (`answer_ids`, from a
    reward registered with answers=True)."""
    answer_ids = _require(inputs.answer_ids, config.estimator,
                          "answer_ids (the extracted answers' clusters; a reward registered with answers=True)")
    return seed_grpo(_grpo_base(inputs, config), answer_ids, inputs.group_size, alpha=config.seed_alpha)
