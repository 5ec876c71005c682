"""The second wave's advantage estimators (jaxrl.advantage_shaping, issue 35) against plain-loop numpy
references written from the papers' formulas (float64), plus their configs and bad-input errors."""

import itertools
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import advantage_shaping as shaping
from jaxrl import advantages as adv
from jaxrl import registry
from jaxrl.advantages import AdvantageConfig
from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config
from jaxrl.losses import LossConfig

RTOL, ATOL = 2e-5, 2e-5

# Everything under test runs jitted (static sizes and configs): one compile per function and shape, instead of
# compiling each primitive eagerly.
bnpo = jax.jit(shaping.bnpo, static_argnums=1)
passk = jax.jit(shaping.passk, static_argnums=(1, 2))
empg = jax.jit(shaping.empg, static_argnames=("k", "k_future", "zeta"))
semantic_entropy = jax.jit(shaping.semantic_entropy, static_argnums=1)
compute = jax.jit(adv.compute, static_argnums=(0, 3))
compact, compacted_mask, expand = jax.jit(adv.compact), jax.jit(adv.compacted_mask), jax.jit(adv.expand)


def close(actual, expected, rtol=RTOL, atol=ATOL):
    actual = np.asarray(actual)
    assert actual.dtype == np.float32, actual.dtype
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def f32(x):
    return jnp.asarray(x, jnp.float32)


def binary_rewards(seed, groups, g):
    """Random 0/1 rewards in `groups` groups of `g`, with at least one mixed group and one all-equal group."""
    rng = np.random.default_rng(seed)
    r = rng.integers(0, 2, groups * g).astype(np.float64)
    r[:g] = 0.0
    r[g:2 * g] = [1.0] + [0.0] * (g - 1)
    return r


def ref_grpo(r, g, eps=1e-6):
    out = np.zeros(len(r))
    for s in range(0, len(r), g):
        xs = r[s:s + g]
        mean = sum(xs) / g
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / max(g - 1, 1))
        for j in range(g):
            out[s + j] = 0.0 if all(x == xs[0] for x in xs) else (xs[j] - mean) / (std + eps)
    return out


# --------------------------------------------------------------------------- BNPO


def ref_bnpo(r, g):
    """BNPO from the paper: p = group mean; Beta(a, b) fitted to the batch's p by moments (sample variance);
    alpha = max(1 + a/3, 1), beta = max(1 + b/3, 1); A = (r - p) / Beta pdf(p; alpha, beta)."""
    ps = [sum(r[s:s + g]) / g for s in range(0, len(r), g)]
    n = len(ps)
    mu = sum(ps) / n
    var = sum((p - mu) ** 2 for p in ps) / (n - 1) if n > 1 else 0.0
    if var > 0:
        a = mu * (mu * (1 - mu) / var - 1)
        b = (1 - mu) * (mu * (1 - mu) / var - 1)
        alpha, beta = max(1 + a / 3, 1.0), max(1 + b / 3, 1.0)
    else:
        alpha = beta = 1.0
    log_b = math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
    out = np.zeros(len(r))
    for q, p in enumerate(ps):
        for j in range(g):
            x = r[q * g + j]
            if p in (0.0, 1.0):
                continue  # all equal: r - p = 0
            pdf = math.exp((alpha - 1) * math.log(p) + (beta - 1) * math.log(1 - p) - log_b)
            out[q * g + j] = (x - p) / pdf
    return out, alpha, beta


@pytest.mark.parametrize("seed,groups,g", [(0, 6, 8)])
def test_bnpo_against_reference(seed, groups, g):
    r = binary_rewards(seed, groups, g)
    expected, alpha, beta = ref_bnpo(r, g)
    assert alpha > 1 or beta > 1, "the case must exercise a non-uniform Beta"
    close(bnpo(f32(r), g), expected, rtol=1e-4)


def test_bnpo_uniform_beta_is_reinforce_with_the_group_mean():
    # every group 3 of 8 right: the success rates have variance 0, no Beta is fitted, alpha = beta = 1
    rng = np.random.default_rng(0)
    r = np.concatenate([rng.permutation([1.0] * 3 + [0.0] * 5) for _ in range(6)])
    close(bnpo(f32(r), 8), r - 3 / 8)
    a, b = shaping.beta_moments(f32([0.5, 0.5, 0.5]))
    assert float(a) == 0.0 and float(b) == 0.0


# --------------------------------------------------------------------------- PSR / NSR / W-REINFORCE


def ref_psr_nsr(r, positive, negative):
    return np.array([positive if x > 0 else -negative for x in r])


@pytest.mark.parametrize("name,weights", [("psr", (1.0, 0.0)), ("nsr", (0.0, 1.0)), ("w_reinforce", (0.1, 1.0))])
def test_psr_nsr_w_reinforce_against_reference(name, weights):
    r = binary_rewards(3, 4, 4)
    mask = np.ones((16, 3))
    out, _ = compute(AdvantageConfig(estimator=name), f32(r), f32(mask), 4)
    close(out, ref_psr_nsr(r, *weights)[:, None] * mask)
    out, _ = compute(AdvantageConfig(estimator="w_reinforce", psr_weight=0.5), f32(r), f32(mask), 4)
    close(out, ref_psr_nsr(r, 0.5, 1.0)[:, None] * mask)


# --------------------------------------------------------------------------- pass@k


def ref_passk_analytic(r, g, k):
    """The paper's closed form (binomials from math.comb)."""
    out = np.zeros(len(r))
    for s in range(0, len(r), g):
        xs = r[s:s + g]
        neg = sum(1 for x in xs if x <= 0)
        mean = 1 - math.comb(neg, k) / math.comb(g, k)
        sigma = math.sqrt(mean * (1 - mean))
        for j, x in enumerate(xs):
            if sigma == 0:
                continue
            if x > 0:
                out[s + j] = (1 - mean) / sigma
            else:
                out[s + j] = (1 - mean - math.comb(neg - 1, k - 1) / math.comb(g - 1, k - 1)) / sigma
    return out


def ref_passk_subsets(r, g, k):
    """Pass@k training by enumeration (the paper's full-sampling limit): every k-subset of the group is one
    sample with reward max(r); its advantage (R_s - mean) / std over the subsets (population std); each
    response's advantage is the mean over the subsets that contain it."""
    out = np.zeros(len(r))
    for s in range(0, len(r), g):
        xs = r[s:s + g]
        subsets = list(itertools.combinations(range(g), k))
        rewards = [max(xs[i] for i in sub) for sub in subsets]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
        for j in range(g):
            mine = [(rw - mean) / std if std > 0 else 0.0 for sub, rw in zip(subsets, rewards) if j in sub]
            out[s + j] = sum(mine) / len(mine)
    return out


@pytest.mark.parametrize("g,k", [(8, 3), (5, 4)])
def test_passk_against_closed_form_and_subset_enumeration(g, k):
    r = binary_rewards(g * 10 + k, 5, g)
    out = passk(f32(r), g, k)
    close(out, ref_passk_analytic(r, g, k))
    close(out, ref_passk_subsets(r, g, k))


def test_passk_with_k_1_is_grpo_with_the_population_std():
    r = binary_rewards(7, 4, 8)
    expected = np.zeros_like(r)
    for s in range(0, len(r), 8):
        xs = r[s:s + 8]
        std = xs.std()
        expected[s:s + 8] = 0.0 if std == 0 else (xs - xs.mean()) / std
    close(passk(f32(r), 8, 1), expected)


def test_passk_k_out_of_range_names_the_field():
    for k in (4, 5):
        with pytest.raises(ValueError, match=rf"rl\.loss\.advantage\.passk_k must be in \[1, group_size - 1 = 3\] .*got {k}"):
            compute(AdvantageConfig(estimator="passk", passk_k=k), jnp.ones(8), jnp.ones((8, 2)), 4)
    with pytest.raises(ConfigError, match="passk_k"):
        LossConfig.from_preset("passk", advantage={"passk_k": 0})


# --------------------------------------------------------------------------- EMPG


def ref_empg(a, h, mask, step_ids, k, kf, zeta, eps=1e-8):
    """EMPG from the paper: step entropy = mean token entropy of the step; batch min-max normalisation;
    g = exp(-k Hn) / mean over steps; A_mod = g A + zeta exp(-kf Hn_next) (0 after the last step); minus the
    mean over the batch's steps. Steps of row i in order of their ids."""
    b, n = mask.shape
    steps = []  # (row, id, mean entropy)
    for i in range(b):
        ids = sorted({int(step_ids[i, t]) for t in range(n) if mask[i, t] > 0 and step_ids[i, t] >= 0})
        for s in ids:
            hs = [h[i, t] for t in range(n) if mask[i, t] > 0 and step_ids[i, t] == s]
            steps.append((i, s, sum(hs) / len(hs)))
    lo, hi = min(x[2] for x in steps), max(x[2] for x in steps)
    norm = {(i, s): (e - lo) / (hi - lo + eps) for i, s, e in steps}
    mean_scale = sum(math.exp(-k * v) for v in norm.values()) / len(norm)
    mod = {}
    for (i, s), v in norm.items():
        bonus = zeta * math.exp(-kf * norm[(i, s + 1)]) if (i, s + 1) in norm else 0.0
        mod[(i, s)] = math.exp(-k * v) / mean_scale * a[i] + bonus
    centre = sum(mod.values()) / len(mod)
    out = np.zeros((b, n))
    for i in range(b):
        for t in range(n):
            if mask[i, t] > 0 and step_ids[i, t] >= 0:
                out[i, t] = mod[(i, int(step_ids[i, t]))] - centre
    return out


def holey_batch(seed, b=8, n=9):
    """A multi-turn-like batch: mask with holes (observation tokens), turn ids -1 on holes and padding."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, n))
    turns = -np.ones((b, n), np.int64)
    for i in range(b):
        t, turn = 0, 0
        while t < n:
            run = int(rng.integers(1, 4))
            mask[i, t:t + run], turns[i, t:t + run] = 1.0, turn
            t += run + int(rng.integers(0, 3))  # a hole of 0-2 observation tokens
            turn += 1
        cut = int(rng.integers(1, n + 1))
        mask[i, cut:], turns[i, cut:] = 0.0, -1
    mask[1], turns[1] = 0.0, -1  # an empty row
    return mask, turns, rng.uniform(0.05, 2.5, (b, n)), rng.normal(size=b)


@pytest.mark.parametrize("seed,k,kf,zeta", [(0, 2.0, 0.5, 0.3)])
def test_empg_against_reference_turns_one_step_and_tokens(seed, k, kf, zeta):
    mask, turns, h, a = holey_batch(seed)
    fn = empg
    # model turns as steps
    out = fn(f32(a), f32(h), f32(mask), step_ids=jnp.asarray(turns), k=k, k_future=kf, zeta=zeta)
    close(out, ref_empg(a, h, mask, turns, k, kf, zeta), rtol=1e-4, atol=1e-5)
    # the whole completion one step (single-turn): no next step, no bonus
    one = np.where(mask > 0, 0, -1)
    close(fn(f32(a), f32(h), f32(mask), k=k, k_future=kf, zeta=zeta), ref_empg(a, h, mask, one, k, kf, zeta),
          rtol=1e-4, atol=1e-5)
    # each model token a step; the next step skips the holes
    tokens = np.where(mask > 0, np.cumsum(mask, axis=1) - 1, -1)
    np.testing.assert_array_equal(np.asarray(shaping.token_steps(f32(mask))), tokens)
    out = fn(f32(a), f32(h), f32(mask), step_ids=shaping.token_steps(f32(mask)), k=k, k_future=kf, zeta=zeta)
    close(out, ref_empg(a, h, mask, tokens, k, kf, zeta), rtol=1e-4, atol=1e-5)


def test_empg_scaling_has_mean_one_and_stops_the_entropy_gradient():
    mask, turns, h, a = holey_batch(2)
    ones = np.ones_like(a)
    # with A = 1 and no bonus, A_mod before centring is g: its mean over steps is 1, so the centred value is
    # g - 1, whose mean over steps is 0
    out = empg(f32(ones), f32(h), f32(mask), step_ids=jnp.asarray(turns), zeta=0.0)
    ref = ref_empg(ones, h, mask, turns, 1.0, 1.0, 0.0)
    close(out, ref, rtol=1e-4, atol=1e-5)
    grad = jax.jit(jax.grad(lambda e: shaping.empg(f32(a), e, f32(mask), step_ids=jnp.asarray(turns)).sum()))(f32(h))
    assert not np.asarray(grad).any()
    # confident (low-entropy) steps are amplified: with every A = 1 the lowest-entropy step gets the most
    flat = np.asarray(empg(f32(ones), f32(h), f32(mask), zeta=0.0))
    means = [(h[i] * mask[i]).sum() / mask[i].sum() for i in range(8) if mask[i].sum()]
    rows = [i for i in range(8) if mask[i].sum()]
    assert rows[int(np.argmin(means))] == rows[int(np.argmax([flat[i][mask[i] > 0][0] for i in rows]))]


def test_empg_estimator_uses_grpo_and_the_configured_steps():
    mask, turns, h, _ = holey_batch(3)
    r = binary_rewards(4, 2, 4)
    base = ref_grpo(r, 4)
    for steps, ids in (("turns", turns), ("tokens", np.where(mask > 0, np.cumsum(mask, axis=1) - 1, -1))):
        cfg = AdvantageConfig(estimator="empg", empg_steps=steps, empg_zeta=0.2)
        out, _ = compute(cfg, f32(r), f32(mask), 4, entropy=f32(h), turn_ids=jnp.asarray(turns))
        close(out, ref_empg(base, h, mask, ids, 1.0, 1.0, 0.2), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="'empg' needs entropy"):
        compute(AdvantageConfig(estimator="empg"), f32(r), f32(mask), 4)


# --------------------------------------------------------------------------- SEED-GRPO


def ref_semantic_entropy(answers):
    """-(1/K) sum_k log(|C_k| / G) over the clusters of equal answers (None: a cluster of its own)."""
    g = len(answers)
    keys = [a if a is not None else ("none", j) for j, a in enumerate(answers)]
    sizes = Counter(keys).values()
    return -sum(math.log(s / g) for s in sizes) / len(sizes)


def test_answer_clusters_and_semantic_entropy_against_reference():
    answers = ["4", "4", None, "5", "4", None, "7", "5",   # mixed, two without an answer
               "1", "1", "1", "1", "1", "1", "1", "1",     # one answer: SE 0
               "a", "b", "c", "d", "e", "f", "g", "h"]     # all distinct: SE log 8
    ids = shaping.answer_clusters(answers, 8)
    assert ids.tolist()[:8] == [0, 0, 2, 3, 0, 5, 6, 3] and ids.dtype == np.int32
    se = semantic_entropy(jnp.asarray(ids), 8)
    expected = [ref_semantic_entropy(answers[s:s + 8]) for s in (0, 8, 16)]
    close(se, expected)
    assert expected[1] == 0.0 and abs(expected[2] - math.log(8)) < 1e-12


@pytest.mark.parametrize("alpha", [0.3])
def test_seed_grpo_against_reference(alpha):
    rng = np.random.default_rng(int(alpha * 10))
    g, groups = 6, 5
    r = binary_rewards(11, groups, g)
    answers = [str(x) if x != 9 else None for x in rng.integers(0, 4, g * groups)]
    answers[g * 4:] = ["2"] * g  # one group that agrees: its advantages unchanged
    ids = shaping.answer_clusters(answers, g)
    base = ref_grpo(r, g)
    expected = np.array([base[i] * (1 - alpha * ref_semantic_entropy(answers[i // g * g:(i // g + 1) * g])
                                    / math.log(g)) for i in range(len(r))])
    mask = np.ones((len(r), 2))
    cfg = AdvantageConfig(estimator="seed_grpo", seed_alpha=alpha)
    out, _ = compute(cfg, f32(r), f32(mask), g, answer_ids=jnp.asarray(ids))
    close(out, expected[:, None] * mask)
    close(np.asarray(out)[g * 4:], base[g * 4:, None] * mask[g * 4:])
    with pytest.raises(ValueError, match="'seed_grpo' needs answer_ids"):
        compute(cfg, f32(r), f32(mask), g)


# --------------------------------------------------------------------------- entropy advantage (2506.14758)


def test_entropy_advantage_term_matches_the_paper():
    """"Reasoning with Exploration: An Entropy Perspective" (arXiv 2506.14758): A + min(alpha * H_detached,
    |A| / kappa), per token, on top of any estimator's advantage: rl.loss.advantage.entropy_bonus_alpha /
    entropy_bonus_kappa (already in jaxrl.advantages; checked here against a loop reference)."""
    rng = np.random.default_rng(5)
    r = rng.normal(size=8)
    mask = (np.arange(5)[None] < rng.integers(0, 6, 8)[:, None]).astype(float)
    h = rng.uniform(0, 3, (8, 5))
    base = ref_grpo(r, 4)
    expected = np.zeros((8, 5))
    for i in range(8):
        for t in range(5):
            if mask[i, t]:
                expected[i, t] = base[i] + min(0.4 * h[i, t], abs(base[i]) / 2.0)
    cfg = AdvantageConfig(entropy_bonus_alpha=0.4, entropy_bonus_kappa=2.0)
    out, _ = compute(cfg, f32(r), f32(mask), 4, entropy=f32(h))
    close(out, expected)


# --------------------------------------------------------------------------- holes, configs and errors


HOLES = {"bnpo": {}, "psr": {}, "nsr": {}, "w_reinforce": {}, "passk": {"passk_k": 2}, "empg": {},
         "seed_grpo": {"seed_alpha": 0.5}}


def test_every_new_estimator_is_covered_here():
    new = {n for n in registry.names("advantage")
           if registry.resolve("advantage", n, "x").source.startswith("jaxrl.advantage_shaping:")}
    assert new == set(HOLES)


@pytest.mark.parametrize("name", sorted(HOLES))
def test_holes_give_what_the_compacted_rows_give(name):
    """A multi-turn mask's holes: the model tokens get what the compacted rows get (token steps for empg:
    with model turns as steps, the turn ids already say which tokens are one step)."""
    mask, _, h, _ = holey_batch(6)
    r = binary_rewards(8, 2, 4)
    ids = jnp.asarray([0, 1, 1, 0, 0, 0, 2, 3], jnp.int32)
    cfg = AdvantageConfig(estimator=name, empg_steps="tokens", **HOLES[name])
    holey, _ = compute(cfg, f32(r), f32(mask), 4, entropy=f32(h), answer_ids=ids)
    dense, _ = compute(cfg, f32(r), compacted_mask(f32(mask)), 4, entropy=compact(f32(h), f32(mask)),
                           answer_ids=ids)
    close(holey, expand(dense, f32(mask)))
    assert not np.asarray(holey)[mask == 0].any()


@pytest.mark.parametrize("preset,estimator", [("bnpo", "bnpo"), ("w_reinforce", "w_reinforce"),
                                              ("passk", "passk"), ("empg", "empg"), ("seed_grpo", "seed_grpo")])
def test_presets_select_their_estimators(preset, estimator):
    cfg = LossConfig.from_preset(preset)
    cfg.validate()
    assert cfg.advantage.estimator == estimator
    assert cfg.needs_entropy == (preset == "empg") and cfg.needs_answers == (preset == "seed_grpo")
    assert LossConfig.from_preset("dapo").advantage == AdvantageConfig(), "new fields default off"


@pytest.mark.parametrize("fields,message", [
    ({"psr_weight": -0.1}, "psr_weight"),
    ({"empg_k": 0.0}, "empg_k"),
    ({"empg_zeta": -1.0}, "empg_zeta"),
    ({"empg_steps": "words"}, "empg_steps"),
    ({"seed_alpha": 1.5}, "seed_alpha"),
    ({"estimator": "w-reinforce"}, "rl.loss.advantage.estimator.*'w-reinforce'"),
])
def test_out_of_domain_fields_name_the_field(fields, message):
    with pytest.raises((ConfigError, registry.RegistryError), match=message):
        LossConfig.from_preset("dapo", advantage=fields).check_pieces()


@pytest.mark.parametrize("preset", ["bnpo", "w_reinforce", "passk"])
def test_binary_estimators_refuse_kl_in_the_reward(preset):
    with pytest.raises(ConfigError, match="kl_in_reward"):
        LossConfig.from_preset(preset, kl_coef=0.01, kl_estimator="k1", kl_in_reward=True)


def test_binary_and_answer_estimators_refuse_rewards_without_them():
    with pytest.raises(ConfigError, match="binary outcome rewards"):
        load_config(Config, "configs/default.yaml", ["rl.loss.preset=bnpo", "reward.format_weight=0.1"])
    with pytest.raises(ConfigError, match="answers=True"):
        load_config(Config, "configs/default.yaml", ["rl.loss.preset=seed_grpo", "reward.function=code"])
    load_config(Config, "configs/default.yaml", ["rl.loss.preset=seed_grpo"])  # arithmetic has answers
