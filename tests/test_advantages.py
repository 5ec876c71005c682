"""Advantage estimators against plain-loop numpy references (float64), hand-computed cases and invariants."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import advantages as adv
from jaxrl.advantages import AdvantageConfig
from jaxrl import registry
from jaxrl.losses import LossConfig

RTOL, ATOL = 1e-5, 1e-5
SHAPES = [(8, 5, 4), (12, 7, 3), (6, 1, 2)]  # (B, N, G)


def close(actual, expected, rtol=RTOL, atol=ATOL):
    actual = np.asarray(actual)
    assert actual.dtype == np.float32, actual.dtype
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def make_batch(seed, b, n, g, binary=False):
    """Random rewards, a ragged prefix mask (row 1 empty, row 0 full), entropy, values, penalty."""
    rng = np.random.default_rng(seed)
    rewards = rng.integers(0, 2, b).astype(np.float64) if binary else rng.normal(size=b)
    lengths = rng.integers(0, n + 1, b)
    lengths[0], lengths[1] = n, 0
    mask = (np.arange(n)[None, :] < lengths[:, None]).astype(np.float64)
    return {
        "rewards": rewards, "mask": mask, "lengths": lengths.astype(np.float64),
        "entropy": rng.uniform(0.05, 2.0, (b, n)), "values": rng.normal(size=(b, n)),
        "greedy": np.repeat(rng.normal(size=b // g), g), "penalty": rng.uniform(0.0, 0.3, (b, n)),
        "components": rng.normal(size=(b, 3)),
    }


def f32(x):
    return jnp.asarray(x, jnp.float32)


def jit(fn, *static):
    return jax.jit(fn, static_argnames=static)


# The reference comparisons run the estimators under jit (static group_size / flags), which also checks
# that they trace; the hand-computed cases run them eagerly.
grpo = jit(adv.grpo, "group_size", "std_scope")
rloo = jit(adv.rloo, "group_size")
reinforce_pp = jit(adv.reinforce_pp, "group_size")
opo = jit(adv.opo, "group_size")
outcome_token_rewards = jit(adv.outcome_token_rewards)
gae = jit(adv.gae)
decoupled_gae = jit(adv.decoupled_gae)
length_adaptive_lambda = jit(adv.length_adaptive_lambda)
entropy_augmented = jit(adv.entropy_augmented)
gtpo = jit(adv.gtpo, "group_size")
grpo_s = jit(adv.grpo_s, "group_size")
normalize_components = jit(adv.normalize_components, "group_size", "weights", "std_scope")
broadcast_to_tokens = jit(adv.broadcast_to_tokens)


# --------------------------------------------------------------------------- numpy references (loops)


def ref_mean_std(xs, ddof=0):
    """Mean and std (population by default; ddof=1: the sample std, 0 for a single value)."""
    xs = list(xs)
    mean = sum(xs) / len(xs)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / max(len(xs) - ddof, 1))


def ref_grpo(r, g, scope="group", eps=1e-6):
    """GRPO as TRL / verl / OpenRLHF compute it: group mean, sample std (torch.std, ddof 1)."""
    out = np.zeros(len(r))
    _, batch_std = ref_mean_std(r, ddof=1)
    for start in range(0, len(r), g):
        mean, std = ref_mean_std(r[start:start + g], ddof=1)
        for i in range(start, start + g):
            scale = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scope]
            out[i] = (r[i] - mean) / scale
    return out


def ref_rloo(r, g):
    out = np.zeros(len(r))
    for start in range(0, len(r), g):
        for i in range(start, start + g):
            others = [r[k] for k in range(start, start + g) if k != i]
            out[i] = r[i] - sum(others) / len(others)
    return out


def ref_reinforce_pp(r, g=None, mask=None, eps=1e-6):
    x = np.array(r, dtype=np.float64)
    if g is not None:
        for start in range(0, len(r), g):
            mean, _ = ref_mean_std(r[start:start + g])
            for i in range(start, start + g):
                x[i] = r[i] - mean
    if mask is None:
        pool = list(x)
    else:  # every valid token carries its sequence's value
        pool = [x[i] for i in range(len(x)) for t in range(mask.shape[1]) if mask[i, t]]
    mean, std = ref_mean_std(pool)
    empty = np.zeros(len(x), bool) if mask is None else ~np.asarray(mask, bool).any(axis=1)
    return np.array([0.0 if e else (v - mean) / (std + eps) for v, e in zip(x, empty)])


def ref_opo(r, lengths, g, eps=1e-6):
    out = np.zeros(len(r))
    for start in range(0, len(r), g):
        idx = range(start, start + g)
        baseline = sum(lengths[i] * r[i] for i in idx) / max(sum(lengths[i] for i in idx), eps)
        for i in idx:
            out[i] = r[i] - baseline
    return out


def ref_outcome(r, mask):
    out = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[i, t]]
        if valid:
            out[i, valid[-1]] = r[i]
    return out


def ref_gae(token_rewards, values, mask, gamma, lam):
    b, n = mask.shape
    lam = np.broadcast_to(np.asarray(lam, np.float64), (b,))
    advantages, returns = np.zeros((b, n)), np.zeros((b, n))
    for i in range(b):
        length = int(mask[i].sum())
        running = 0.0
        for t in reversed(range(length)):
            next_value = values[i, t + 1] if t + 1 < length else 0.0
            delta = token_rewards[i, t] + gamma * next_value - values[i, t]
            running = delta + gamma * lam[i] * running
            advantages[i, t] = running
            returns[i, t] = running + values[i, t]
    return advantages, returns


def ref_length_lambda(lengths, alpha):
    return np.array([0.0 if l == 0 else min(1.0, max(0.0, 1 - 1 / (alpha * l))) for l in lengths])


def ref_entropy_augmented(a, h, alpha, kappa):
    out = np.zeros(a.shape)
    for i in range(a.shape[0]):
        for t in range(a.shape[1]):
            out[i, t] = a[i, t] + min(alpha * h[i, t], abs(a[i, t]) / kappa)
    return out


def ref_gtpo(r, h, mask, g, alpha1=1.0, alpha2=1.0, eps=1e-6):
    b, n = mask.shape
    h = np.maximum(h, eps)
    out = np.zeros((b, n))
    for start in range(0, b, g):
        rows = range(start, start + g)
        pos = [i for i in rows if r[i] > 0]
        neg = [i for i in rows if not r[i] > 0]
        shaped = {}
        for t in range(n):
            d = sum(mask[k, t] for k in pos)
            hn = sum(mask[k, t] for k in neg)
            pos_sum = sum(h[k, t] * mask[k, t] for k in pos)
            neg_sum = sum(mask[k, t] / h[k, t] for k in neg)
            for i in rows:
                if not mask[i, t]:
                    continue
                if i in pos:
                    shaped[i, t] = alpha1 * r[i] + alpha2 * h[i, t] / pos_sum * d
                else:
                    shaped[i, t] = -alpha1 - alpha2 * (1 / h[i, t]) / neg_sum * hn
        if not shaped:
            continue
        mean, std = ref_mean_std(shaped.values())
        for (i, t), x in shaped.items():
            out[i, t] = (x - mean) / (std + eps)
    return out


def ref_grpo_s(r, h, mask, g, beta1=1.0, beta2=1.0, eps=1e-6):
    b, n = mask.shape
    hbar = []
    for i in range(b):
        valid = [h[i, t] for t in range(n) if mask[i, t]]
        hbar.append(max(sum(valid) / len(valid) if valid else 0.0, eps))
    shaped = np.zeros(b)
    for start in range(0, b, g):
        rows = range(start, start + g)
        pos = [i for i in rows if r[i] > 0]
        neg = [i for i in rows if not r[i] > 0]
        for i in pos:
            shaped[i] = beta1 * r[i] + beta2 * hbar[i] / sum(hbar[k] for k in pos) * len(pos)
        for j in neg:
            shaped[j] = -beta1 - beta2 * (1 / hbar[j]) / sum(1 / hbar[k] for k in neg) * len(neg)
    return ref_grpo(shaped, g, "group", eps)


def ref_components(c, g, weights, scope):
    total = np.zeros(c.shape[0])
    for k in range(c.shape[1]):
        total += weights[k] * ref_grpo(c[:, k], g, scope)
    return total


def ref_group_centered(x, g):
    x = np.asarray(x, np.float64)
    return np.concatenate([x[i:i + g] - x[i:i + g].mean() for i in range(0, len(x), g)])


def ref_broadcast(a, mask):
    return np.array([[a[i] * mask[i, t] for t in range(mask.shape[1])] for i in range(mask.shape[0])])


# --------------------------------------------------------------------------- group estimators


def test_grpo_hand_computed():
    r = f32([1, 0, 0, 1, 1, 1, 1, 1])
    # group [1,0,0,1]: mean 0.5, sample std sqrt(1/3)
    close(adv.grpo(r, 4), np.array([1, -1, -1, 1, 0, 0, 0, 0]) * 0.5 / (math.sqrt(1 / 3) + 1e-6))
    close(adv.dr_grpo(r, 4), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    # batch std of [1,0,0,1,1,1,1,1]: mean 0.75, sample std sqrt(1.5 / 7)
    close(adv.grpo(r, 4, std_scope="batch"), np.array([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (
        math.sqrt(1.5 / 7) + 1e-6))


def test_grpo_std_is_the_sample_std_of_trl_verl_openrlhf():
    """One correct of 8: torch's `(r - r.mean()) / (r.std() + eps)` (ddof 1), not the population std's
    sqrt(8/7) larger advantages. A group of one sample has no spread: advantage 0, not NaN."""
    r = np.array([1, 0, 0, 0, 0, 0, 0, 0], np.float64)
    expected = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    close(adv.grpo(f32(r), 8), expected)
    close(adv.grpo(f32(r), 8, std_scope="batch"), expected)  # one group: its std is the batch's
    close(adv.grpo(f32([1, 0, 0.5]), 1), [0, 0, 0])
    close(adv.grpo(f32([1]), 1, std_scope="batch"), [0])


@pytest.mark.parametrize("b,n,g", SHAPES)
@pytest.mark.parametrize("scope", ["group", "batch", "none"])
def test_grpo_against_reference(b, n, g, scope):
    r = make_batch(b + n, b, n, g)["rewards"]
    close(grpo(f32(r), g, std_scope=scope), ref_grpo(r, g, scope))


def test_group_shape_errors():
    r = f32(np.arange(12))
    for fn in (lambda: adv.grpo(r, 5), lambda: adv.rloo(r, 5), lambda: adv.dr_grpo(r, 5),
               lambda: adv.opo(r, r, 5), lambda: adv.reinforce_pp(r, group_size=5),
               lambda: adv.grpo(r.reshape(3, 4), 4),
               lambda: adv.gtpo(r, jnp.ones((12, 2)), jnp.ones((12, 2)), 5),
               lambda: adv.grpo_s(r, jnp.ones((12, 2)), jnp.ones((12, 2)), 5)):
        with pytest.raises(ValueError, match=r"do not split into groups of"):
            fn()
    with pytest.raises(ValueError, match="std_scope"):
        adv.grpo(r, 4, std_scope="rows")
    with pytest.raises(ValueError, match="group_size >= 2"):
        adv.rloo(r, 1)


@pytest.mark.parametrize("b,n,g", SHAPES)
def test_rloo_against_reference_and_scaled_mean(b, n, g):
    r = make_batch(b * 3 + n, b, n, g)["rewards"]
    out = rloo(f32(r), g)
    close(out, ref_rloo(r, g))
    close(out, g / (g - 1) * ref_grpo(r, g, "none"))


def test_equal_group_gives_zero():
    r = f32([0.3] * 4 + [2.0] * 4)
    lengths = f32([1, 5, 2, 9, 3, 3, 0, 4])
    for out in (adv.grpo(r, 4), adv.grpo(r, 4, std_scope="none"), adv.rloo(r, 4), adv.opo(r, lengths, 4)):
        close(out, np.zeros(8), atol=1e-6)


def test_constant_shaped_group_gives_exactly_zero():
    """A group whose samples all got the same non-binary reward (format or length shaping) carries no signal.
    In float32, `x - mean(x)` of eight 0.7s is one ulp, not 0; divided by a std of the same size it used to
    become +0.056 for every sample (+0.66 for sixteen 12.7s)."""
    r = f32([0.7] * 8 + [12.7] * 8 + [0.1, 0.9, 0.3, 0.3, 0.2, 0.6, 0.8, 0.4])
    for out in (adv.grpo(r, 8), adv.grpo(r, 8, std_scope="batch"), adv.rloo(r, 8),
                adv.normalize_components(r[:, None], 8)):
        assert np.all(np.asarray(out)[:16] == 0.0)
        assert np.all(np.asarray(out)[16:] != 0.0)
    assert np.all(np.asarray(adv.grpo(f32([12.7] * 16), 16)) == 0.0)
    mask = f32(np.ones((8, 3)))
    assert np.all(np.asarray(adv.gtpo(f32([0.0] * 8), f32(np.full((8, 3), 0.7)), mask, 8)) == 0.0)


def test_whitening_gives_zero_to_rows_without_weight():
    out = adv.reinforce_pp(f32([1.0, -1.0, 5.0]), mask=f32([[1, 1, 1], [1, 0, 0], [0, 0, 0]]))
    close(out, np.array([0.5, -1.5, 0.0]) / np.array([math.sqrt(0.75) + 1e-6, math.sqrt(0.75) + 1e-6, 1.0]))


@pytest.mark.parametrize("b,n,g", SHAPES)
@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("token_level", [False, True])
def test_reinforce_pp_against_reference(b, n, g, baseline, token_level):
    batch = make_batch(b + 7, b, n, g)
    r, mask = batch["rewards"], batch["mask"]
    out = reinforce_pp(f32(r), group_size=g if baseline else None, mask=f32(mask) if token_level else None)
    close(out, ref_reinforce_pp(r, g if baseline else None, mask if token_level else None), rtol=2e-5)


def test_reinforce_pp_token_stats_weight_by_length():
    # x = [1, -1] with lengths [3, 1]: token mean 0.5, token std sqrt(0.75)
    out = adv.reinforce_pp(f32([1.0, -1.0]), mask=f32([[1, 1, 1], [1, 0, 0]]))
    close(out, np.array([0.5, -1.5]) / (math.sqrt(0.75) + 1e-6))


def test_remax():
    batch = make_batch(3, 8, 4, 4)
    close(adv.remax(f32(batch["rewards"]), f32(batch["greedy"])), batch["rewards"] - batch["greedy"])


@pytest.mark.parametrize("b,n,g", SHAPES)
def test_opo_against_reference(b, n, g):
    batch = make_batch(b + 11, b, n, g)
    close(opo(f32(batch["rewards"]), f32(batch["lengths"]), g),
          ref_opo(batch["rewards"], batch["lengths"], g))


def test_opo_hand_computed_and_equal_lengths():
    # b = (1*1 + 3*0) / 4 = 0.25; an all-empty group falls back to a zero baseline (eps denominator)
    close(adv.opo(f32([1, 0, 2, 5]), f32([1, 3, 0, 0]), 2), [0.75, -0.25, 2, 5])
    r = make_batch(5, 12, 4, 4)["rewards"]
    close(adv.opo(f32(r), jnp.full(12, 7.0), 4), adv.dr_grpo(f32(r), 4))


# --------------------------------------------------------------------------- token-level, critic


@pytest.mark.parametrize("b,n,g", SHAPES)
def test_outcome_token_rewards_against_reference(b, n, g):
    batch = make_batch(b + 13, b, n, g)
    out = outcome_token_rewards(f32(batch["rewards"]), jnp.asarray(batch["mask"], bool))
    close(out, ref_outcome(batch["rewards"], batch["mask"]))
    assert not np.asarray(out)[1].any()  # the empty row stays zero


def test_gae_hand_unrolled_three_tokens():
    rewards = f32([[0.0, 0.0, 1.0, 7.0]])  # the 4th token is padding: its reward and value are ignored
    values = f32([[0.5, 0.6, 0.7, 5.0]])
    mask = f32([[1, 1, 1, 0]])
    a, ret = adv.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # delta = [0.9*0.6-0.5, 0.9*0.7-0.6, 1-0.7] = [0.04, 0.03, 0.3]; gamma*lam = 0.72
    a2 = 0.3
    a1 = 0.03 + 0.72 * a2
    a0 = 0.04 + 0.72 * a1
    close(a, [[a0, a1, a2, 0.0]])
    close(ret, [[a0 + 0.5, a1 + 0.6, a2 + 0.7, 0.0]])


@pytest.mark.parametrize("b,n,g", SHAPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7), (0.99, "per_row")])
def test_gae_against_reference(b, n, g, gamma, lam):
    batch = make_batch(b + 17, b, n, g)
    rng = np.random.default_rng(b)
    token_rewards = rng.normal(size=(b, n))
    if lam == "per_row":
        lam = rng.uniform(0, 1, b)
    a, ret = gae(f32(token_rewards), f32(batch["values"]), f32(batch["mask"]), gamma=gamma,
                     lam=f32(lam) if isinstance(lam, np.ndarray) else lam)
    ref_a, ref_ret = ref_gae(token_rewards, batch["values"], batch["mask"], gamma, lam)
    close(a, ref_a)
    close(ret, ref_ret)


@pytest.mark.parametrize("b,n,g", SHAPES)
def test_decoupled_gae_against_reference(b, n, g):
    batch = make_batch(b + 19, b, n, g)
    token_rewards = ref_outcome(batch["rewards"], batch["mask"])
    lam_actor = np.random.default_rng(1).uniform(0, 1, b)
    a, ret = decoupled_gae(f32(token_rewards), f32(batch["values"]), f32(batch["mask"]), gamma=0.95,
                               lam_actor=f32(lam_actor), lam_critic=0.9)
    close(a, ref_gae(token_rewards, batch["values"], batch["mask"], 0.95, lam_actor)[0])
    close(ret, ref_gae(token_rewards, batch["values"], batch["mask"], 0.95, 0.9)[1])


def test_decoupled_gae_monte_carlo_limit():
    batch = make_batch(23, 8, 6, 4)
    mask, values, r = batch["mask"], batch["values"], batch["rewards"]
    a, ret = decoupled_gae(outcome_token_rewards(f32(r), f32(mask)), f32(values), f32(mask),
                               gamma=1.0, lam_actor=1.0, lam_critic=1.0)
    close(ret, r[:, None] * mask)
    close(a, (r[:, None] - values) * mask)


def test_length_adaptive_lambda():
    lengths = np.array([0, 10, 20, 40, 100, 1000, 5.0])
    out = adv.length_adaptive_lambda(f32(lengths), alpha=0.05)
    close(out, [0, 0, 0, 0.5, 0.8, 0.98, 0])
    close(out, ref_length_lambda(lengths, 0.05))
    close(length_adaptive_lambda(f32(lengths), alpha=0.3), ref_length_lambda(lengths, 0.3))


# --------------------------------------------------------------------------- entropy shaping


@pytest.mark.parametrize("kappa", [1.0, 2.0, 5.0])
def test_entropy_augmented_reference_sign_and_gradient(kappa):
    rng = np.random.default_rng(int(kappa))
    a = rng.normal(size=(6, 5))
    a[0, :2] = 0.0
    h = rng.uniform(0, 3, (6, 5))
    out = entropy_augmented(f32(a), f32(h), alpha=0.4, kappa=kappa)
    close(out, ref_entropy_augmented(a, h, 0.4, kappa))
    out = np.asarray(out)
    assert (out[a < 0] <= 0).all() and (out[a > 0] > 0).all() and (out[a == 0] == 0).all()
    grad = jax.grad(lambda e: adv.entropy_augmented(f32(a), e, alpha=0.4, kappa=kappa).sum())(f32(h))
    assert not np.asarray(grad).any()


@pytest.mark.parametrize("b,n,g", SHAPES)
def test_gtpo_against_reference(b, n, g):
    batch = make_batch(b + 29, b, n, g, binary=True)
    r, h, mask = batch["rewards"], batch["entropy"], batch["mask"]
    out = gtpo(f32(r), f32(h), f32(mask), g, alpha1=1.0, alpha2=0.7)
    close(out, ref_gtpo(r, h, mask, g, alpha2=0.7), rtol=2e-5, atol=2e-5)
    assert not np.asarray(out)[mask == 0].any()


def test_gtpo_clamps_entropy_and_stops_gradient():
    r, mask = f32([1, 0, 0, 1]), f32([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    h = np.array([[0.0, 0.5, 1.0], [0.2, 0.0, 0.4], [1.0, 1.0, 1.0], [0.3, 0.3, 0.3]])
    out = gtpo(r, f32(h), mask, 4, eps=1e-3)
    assert np.isfinite(np.asarray(out)).all()
    close(out, ref_gtpo(np.asarray(r), h, np.asarray(mask), 4, eps=1e-3), rtol=1e-4, atol=1e-4)
    grad = jax.jit(jax.grad(lambda e: adv.gtpo(r, e, mask, 4).sum()))(f32(h))
    assert not np.asarray(grad).any()


def test_gtpo_rewards_correct_rows_in_mixed_group():
    rng = np.random.default_rng(31)
    r, mask = f32([1, 0, 1, 0]), jnp.ones((4, 6))
    out = np.asarray(gtpo(r, f32(rng.uniform(0.5, 1.5, (4, 6))), mask, 4))
    assert (out[[0, 2]] > 0).all() and (out[[1, 3]] < 0).all()


@pytest.mark.parametrize("b,n,g", SHAPES)
def test_grpo_s_against_reference(b, n, g):
    batch = make_batch(b + 37, b, n, g, binary=True)
    r, h, mask = batch["rewards"], batch["entropy"], batch["mask"]
    out = grpo_s(f32(r), f32(h), f32(mask), g, beta1=1.0, beta2=0.5)
    close(out, ref_grpo_s(r, h, mask, g, beta2=0.5), rtol=2e-5, atol=2e-5)


def test_grpo_s_uniform_entropy_is_grpo_for_binary_rewards():
    r = f32([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1])
    mask = jnp.ones((12, 3))
    close(grpo_s(r, jnp.full((12, 3), 0.7), mask, 4), grpo(r, 4), atol=2e-5)


# --------------------------------------------------------------------------- components, tokens


@pytest.mark.parametrize("b,n,g", SHAPES)
@pytest.mark.parametrize("scope", ["group", "batch", "none"])
def test_normalize_components_against_reference(b, n, g, scope):
    c = make_batch(b + 41, b, n, g)["components"]
    close(normalize_components(f32(c), g, std_scope=scope), ref_components(c, g, [1, 1, 1], scope))
    weights = [0.5, 2.0, -1.0]
    close(normalize_components(f32(c), g, weights=tuple(weights), std_scope=scope),
          ref_components(c, g, weights, scope))


def test_normalize_components_shape_errors():
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        adv.normalize_components(jnp.ones(8), 4)
    with pytest.raises(ValueError, match="do not match 2 components"):
        adv.normalize_components(jnp.ones((8, 2)), 4, weights=[1.0])


def test_broadcast_to_tokens():
    batch = make_batch(43, 6, 4, 2)
    a, mask = batch["rewards"], batch["mask"]
    close(broadcast_to_tokens(f32(a), jnp.asarray(mask, bool)), ref_broadcast(a, mask))
    full = np.random.default_rng(0).normal(size=(6, 4))
    close(adv.broadcast_to_tokens(f32(full), f32(mask)), full * mask)


# --------------------------------------------------------------------------- compute


def jit_compute():
    return jax.jit(adv.compute, static_argnums=(0, 3), static_argnames="component_weights")


def test_config_is_hashable_and_validates():
    assert hash(AdvantageConfig()) == hash(AdvantageConfig())
    needs = {name: registry.resolve("advantage", name, "x").needs for name in registry.names("advantage")}
    assert {name for name, n in needs.items() if "critic" in n} == {"gae"}
    assert {name for name, n in needs.items() if "entropy" in n} == {"gtpo", "grpo_s", "empg"}
    assert {name for name, n in needs.items() if "greedy_rollouts" in n} == {"remax"}
    LossConfig(advantage=AdvantageConfig(per_component=True)).check_pieces()
    with pytest.raises(ValueError, match="per_component.*'grpo'.*'rloo'"):
        LossConfig(advantage=AdvantageConfig(estimator="rloo", per_component=True)).check_pieces()
    with pytest.raises(ValueError, match="per_component"):
        adv.compute(AdvantageConfig(estimator="opo", per_component=True), jnp.ones(4), jnp.ones((4, 2)), 2)


def direct(name, batch, g, config):
    """The estimator called directly, as `compute` should dispatch it (token-level, masked)."""
    r, mask, h = batch["rewards"], batch["mask"], batch["entropy"]
    if name == "grpo":
        return grpo(r, g, std_scope=config.std_scope)
    if name == "rloo":
        return rloo(r, g)
    if name == "reinforce_pp":
        return reinforce_pp(r, group_size=g if config.group_baseline else None, mask=mask)
    if name == "remax":
        return adv.remax(r, batch["greedy"])
    if name == "opo":
        return opo(r, mask.sum(1), g)
    if name == "gtpo":
        return gtpo(r, h, mask, g, alpha2=config.entropy_weight)
    if name == "grpo_s":
        return grpo_s(r, h, mask, g, beta2=config.entropy_weight)
    raise AssertionError(name)


def compute_inputs(batch):
    return {"entropy": batch["entropy"], "values": batch["values"], "greedy_rewards": batch["greedy"]}


@pytest.mark.parametrize("config", [
    AdvantageConfig("grpo"), AdvantageConfig("grpo", std_scope="batch"), AdvantageConfig("rloo"),
    AdvantageConfig("reinforce_pp"), AdvantageConfig("reinforce_pp", group_baseline=False),
    AdvantageConfig("remax"), AdvantageConfig("opo"), AdvantageConfig("gtpo", entropy_weight=0.5),
    AdvantageConfig("grpo_s", entropy_weight=2.0)], ids=lambda c: c.estimator)
def test_compute_matches_direct_call(config):
    g = 4
    batch = {k: f32(v) for k, v in make_batch(53, 8, 5, g, binary=True).items()}
    a, ret = jit_compute()(config, batch["rewards"], batch["mask"], g, **compute_inputs(batch))
    assert ret is None and a.shape == (8, 5)
    close(a, np.asarray(broadcast_to_tokens(direct(config.estimator, batch, g, config), batch["mask"])))


@pytest.mark.parametrize("alpha", [None, 0.05])
def test_compute_gae(alpha):
    batch = {k: f32(v) for k, v in make_batch(59, 8, 5, 4).items()}
    r, mask, values = batch["rewards"], batch["mask"], batch["values"]
    config = AdvantageConfig("gae", gamma=0.99, lam_actor=0.9, lam_critic=0.97, length_adaptive_alpha=alpha)
    a, ret = jit_compute()(config, r, mask, 4, values=values)
    lam = 0.9 if alpha is None else length_adaptive_lambda(mask.sum(1), alpha)
    ref_a, ref_ret = decoupled_gae(outcome_token_rewards(r, mask), values, mask, gamma=0.99,
                                       lam_actor=lam, lam_critic=0.97)
    close(a, np.asarray(ref_a))
    close(ret, np.asarray(ref_ret))


def test_compute_token_penalty():
    g = 4
    raw = make_batch(61, 8, 5, g)
    batch = {k: f32(v) for k, v in raw.items()}
    r, mask, penalty = batch["rewards"], batch["mask"], batch["penalty"]  # penalty also on padding
    seq_penalty = np.array([sum(raw["penalty"][i, t] for t in range(5) if raw["mask"][i, t])
                            for i in range(8)])
    a, _ = jit_compute()(AdvantageConfig("rloo"), r, mask, g, token_penalty=penalty)
    close(a, ref_broadcast(ref_rloo(raw["rewards"] - seq_penalty, g), raw["mask"]))
    # grpo: the penalty is centred in its group but not divided by the rewards' std
    for scope in ("group", "batch", "none"):
        a, _ = jit_compute()(AdvantageConfig("grpo", std_scope=scope), r, mask, g, token_penalty=penalty)
        expected = ref_grpo(raw["rewards"], g, scope) - ref_group_centered(seq_penalty, g)
        close(a, ref_broadcast(expected, raw["mask"]))
    a, _ = jit_compute()(AdvantageConfig("grpo", std_scope="none"), r, mask, g, token_penalty=penalty)
    close(a, ref_broadcast(ref_grpo(raw["rewards"] - seq_penalty, g, "none"), raw["mask"]))  # Dr. GRPO: as before
    for name in ("gtpo", "grpo_s"):
        with pytest.raises(ValueError, match=f"'{name}' splits each group by binary outcome rewards"):
            jit_compute()(AdvantageConfig(name), r, mask, g, entropy=batch["entropy"], token_penalty=penalty)
    a, ret = jit_compute()(AdvantageConfig("gae", gamma=1.0, lam_actor=0.8, lam_critic=1.0), r, mask, g,
                           values=batch["values"], token_penalty=penalty)
    token_rewards = ref_outcome(raw["rewards"], raw["mask"]) - raw["penalty"] * raw["mask"]
    close(a, ref_gae(token_rewards, raw["values"], raw["mask"], 1.0, 0.8)[0])
    close(ret, ref_gae(token_rewards, raw["values"], raw["mask"], 1.0, 1.0)[1])
    # returns-to-go of the penalised reward: R - sum of penalties from t on
    expected = np.array([[(raw["rewards"][i] - raw["penalty"][i, t:][raw["mask"][i, t:] > 0].sum())
                          * raw["mask"][i, t] for t in range(5)] for i in range(8)])
    close(ret, expected)


def test_a_kl_penalty_in_the_reward_keeps_its_scale_in_a_group_of_one_outcome():
    """Every answer of the group right: dividing the penalised rewards by their std would make the advantages
    the KL's noise at unit scale whatever kl_coef; they stay kl_coef times the centred penalty."""
    rewards, mask = jnp.ones(4), jnp.ones((4, 3))
    kl = jnp.asarray([[0.1, 0.2, 0.0], [0.3, 0.0, 0.0], [0.0, 0.0, 0.1], [0.2, 0.2, 0.2]])
    small, _ = jit_compute()(AdvantageConfig("grpo"), rewards, mask, 4, token_penalty=0.01 * kl)
    large, _ = jit_compute()(AdvantageConfig("grpo"), rewards, mask, 4, token_penalty=0.1 * kl)
    close(large, 10 * np.asarray(small))
    close(small[:, 0], -0.01 * ref_group_centered(kl.sum(axis=1), 4))


def test_compute_entropy_bonus():
    g = 4
    batch = {k: f32(v) for k, v in make_batch(67, 8, 5, g).items()}
    r, mask, h = batch["rewards"], batch["mask"], batch["entropy"]
    config = AdvantageConfig("grpo", entropy_bonus_alpha=0.3, entropy_bonus_kappa=3.0)
    a, _ = jit_compute()(config, r, mask, g, entropy=h)
    base = broadcast_to_tokens(grpo(r, g), mask)
    close(a, np.asarray(entropy_augmented(base, h, alpha=0.3, kappa=3.0)) * np.asarray(mask))
    assert not np.asarray(a)[np.asarray(mask) == 0].any()


def test_compute_per_component():
    g = 4
    raw = make_batch(71, 8, 5, g)
    batch = {k: f32(v) for k, v in raw.items()}
    config = AdvantageConfig("grpo", per_component=True, std_scope="group")
    weights = (1.0, 0.5, 2.0)
    a, _ = jit_compute()(config, batch["rewards"], batch["mask"], g, components=batch["components"],
                         component_weights=weights)
    close(a, ref_broadcast(ref_components(raw["components"], g, weights, "group"), raw["mask"]))
    # a token penalty is subtracted, centred in its group but unnormalised, from the normalised advantage:
    # kl_coef keeps its meaning
    a, _ = jit_compute()(config, batch["rewards"], batch["mask"], g, components=batch["components"],
                         component_weights=weights, token_penalty=batch["penalty"])
    seq_penalty = ref_group_centered((raw["penalty"] * raw["mask"]).sum(1), g)
    close(a, ref_broadcast(ref_components(raw["components"], g, weights, "group") - seq_penalty, raw["mask"]))
    tenfold, _ = jit_compute()(config, batch["rewards"], batch["mask"], g, components=batch["components"],
                               component_weights=weights, token_penalty=10 * batch["penalty"])
    close(tenfold, ref_broadcast(ref_components(raw["components"], g, weights, "group") - 10 * seq_penalty,
                                 raw["mask"]))


def ref_reinforce_pp_with_penalty(r, mask, penalty, g=None, eps=1e-6):
    """REINFORCE++ eq.: token return `x_i - sum_{s >= t} penalty_is` (x: reward, group-centred for the
    baseline variant), whitened over all valid tokens of the batch."""
    x = np.array(r, dtype=np.float64)
    if g is not None:
        for start in range(0, len(r), g):
            mean, _ = ref_mean_std(r[start:start + g])
            x[start:start + g] = r[start:start + g] - mean
    b, n = mask.shape
    returns = {(i, t): x[i] - sum(penalty[i, s] for s in range(t, n) if mask[i, s])
               for i in range(b) for t in range(n) if mask[i, t]}
    mean, std = ref_mean_std(list(returns.values()))
    return np.array([[(returns[i, t] - mean) / (std + eps) if (i, t) in returns else 0.0 for t in range(n)]
                     for i in range(b)])


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_penalty_still_to_come(baseline):
    g = 4
    raw = make_batch(73, 12, 6, g)
    batch = {k: f32(v) for k, v in raw.items()}
    config = AdvantageConfig("reinforce_pp", group_baseline=baseline)
    a, _ = jit_compute()(config, batch["rewards"], batch["mask"], g, token_penalty=batch["penalty"])
    expected = ref_reinforce_pp_with_penalty(raw["rewards"], raw["mask"], raw["penalty"], g if baseline else None)
    close(a, expected, rtol=2e-5)
    # within a row, earlier tokens face more penalty: a full row's advantages rise along the sequence
    assert np.all(np.diff(np.asarray(a)[0]) > 0)
    with pytest.raises(ValueError, match="needs the completion mask"):
        adv.reinforce_pp(batch["rewards"], token_penalty=batch["penalty"])


def test_penalty_to_go():
    penalty = f32([[1.0, 2.0, 4.0, 8.0], [1.0, 2.0, 4.0, 8.0]])
    mask = f32([[1, 1, 1, 1], [1, 1, 0, 0]])
    close(adv.penalty_to_go(penalty, mask), np.array([[15.0, 14.0, 12.0, 8.0], [3.0, 2.0, 0.0, 0.0]]))


@pytest.mark.parametrize("config,message", [
    (AdvantageConfig("gae"), r"advantage estimator 'gae' needs values from a critic \(set rl.critic.model\)"),
    (AdvantageConfig("remax"), "advantage estimator 'remax' needs greedy_rewards"),
    (AdvantageConfig("gtpo"), "advantage estimator 'gtpo' needs entropy"),
    (AdvantageConfig("grpo_s"), "advantage estimator 'grpo_s' needs entropy"),
    (AdvantageConfig("grpo", per_component=True), "advantage estimator 'grpo' needs components"),
    (AdvantageConfig("rloo", entropy_bonus_alpha=0.1), "advantage estimator 'rloo' needs entropy"),
])
def test_compute_missing_inputs(config, message):
    with pytest.raises(ValueError, match=message):
        adv.compute(config, jnp.ones(4), jnp.ones((4, 3)), 2)


def test_gae_whitening_normalises_advantages_over_completion_tokens():
    """`whiten=True`: the GAE advantages minus their mean over the batch's completion tokens, over their std
    (a NumPy reference); padding stays 0 and the value targets are untouched."""
    g = 4
    raw = make_batch(7, 8, 6, g)
    batch = {k: f32(v) for k, v in raw.items()}
    plain = AdvantageConfig("gae", gamma=1.0, lam_actor=1.0, lam_critic=1.0)
    a, ret = jit_compute()(plain, batch["rewards"], batch["mask"], g, values=batch["values"])
    w, ret_w = jit_compute()(dataclasses.replace(plain, whiten=True), batch["rewards"], batch["mask"], g,
                             values=batch["values"])
    m = raw["mask"] > 0
    tokens = np.asarray(a, np.float64)[m]
    expected = np.where(m, (np.asarray(a, np.float64) - tokens.mean()) / (tokens.std() + plain.eps), 0.0)
    close(w, expected)
    close(ret_w, np.asarray(ret))
    assert abs(np.asarray(w)[m].mean()) < 1e-5 and abs(np.asarray(w)[m].std() - 1) < 1e-4
