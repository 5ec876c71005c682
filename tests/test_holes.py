"""Completion masks with holes (multi-turn observation tokens): every advantage estimator and loss piece,
against independent float64 numpy references that drop the hole tokens (compact the rows) and compute the
piece from its paper's formula; per-turn credit (`turn_credit`) against numpy references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import advantages as adv
from jaxrl import registry
from jaxrl.advantages import AdvantageConfig
from jaxrl.losses import (AGGREGATIONS, Controls, LossConfig, LossInputs, aggregate, build_loss, clip_cov_mask,
                          kl_cov_mask, normalizers, prepare_batch, rollout_correction, top_entropy_mask,
                          truncation_mask)

TOL = 1e-5
B, N, G = 8, 14, 4


# --------------------------------------------------------------------------- episodes and the numpy side


def episodes(seed, b=B, n=N):
    """A multi-turn batch layout: `mask [b, n]` (model tokens) and `turn_ids [b, n]` (-1 off model tokens).

    Row 0 has no holes (a single-turn prefix), row 1 no model tokens, row 2 starts with an observation; the
    others alternate model turns (1-3 tokens) and observations (1-3 tokens), then padding."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, n))
    turns = -np.ones((b, n), np.int32)
    for i in range(b):
        if i == 0:
            length = rng.integers(3, n)
            mask[i, :length], turns[i, :length] = 1, 0
            continue
        if i == 1:
            continue
        end = rng.integers(n // 2, n + 1)
        t, turn = (rng.integers(1, 3) if i == 2 else 0), 0
        while t < end:
            k = min(rng.integers(1, 4), end - t)
            mask[i, t:t + k], turns[i, t:t + k] = 1, turn
            turn += 1
            t += k + rng.integers(1, 4)
    assert ((mask > 0) == (turns >= 0)).all()
    return mask, turns


def rows(x, mask):
    """The compacted rows: list of 1-D float64 arrays of `x`'s model tokens."""
    return [np.asarray(x, np.float64)[i][mask[i] > 0] for i in range(mask.shape[0])]


def expand(row_values, mask):
    """Per-row values on the model tokens, 0 on the holes -> `[B, N]`."""
    out = np.zeros(mask.shape)
    for i, values in enumerate(row_values):
        out[i][mask[i] > 0] = values
    return out


def close(actual, expected, tol=TOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol)


def data(seed, b=B, n=N, binary=False):
    rng = np.random.default_rng(seed + 100)
    mask, turns = episodes(seed, b, n)
    rewards = rng.integers(0, 2, b).astype(float) if binary else rng.normal(size=b)
    token_rewards = np.where(mask > 0, rng.normal(size=(b, n)) * (rng.uniform(size=(b, n)) < 0.4), 0.0)
    return dict(mask=mask, turns=turns, rewards=rewards, token_rewards=token_rewards,
                entropy=rng.uniform(0.05, 2.0, (b, n)), values=rng.normal(size=(b, n)),
                penalty=rng.uniform(0.0, 0.3, (b, n)), greedy=np.repeat(rng.normal(size=b // G), G),
                components=rng.normal(size=(b, 3)), logp=-rng.uniform(0.1, 3.0, (b, n)),
                old_logp=-rng.uniform(0.1, 3.0, (b, n)), sampler_logp=-rng.uniform(0.1, 3.0, (b, n)),
                ref_logp=-rng.uniform(0.1, 3.0, (b, n)))


# --------------------------------------------------------------------------- numpy estimators (formulas)


def np_grpo(r, g, scope="group", eps=1e-6):
    r = np.asarray(r, np.float64).reshape(-1, g)
    centered = r - r.mean(axis=1, keepdims=True)
    if scope == "group":
        centered = centered / (r.std(axis=1, ddof=1, keepdims=True) + eps)
    elif scope == "batch":
        centered = centered / (r.std(ddof=1) + eps)
    return centered.reshape(-1)


def np_rloo(r, g):
    r = np.asarray(r, np.float64).reshape(-1, g)
    return (r - (r.sum(axis=1, keepdims=True) - r) / (g - 1)).reshape(-1)


def np_whiten(values_rows, eps=1e-6):
    flat = np.concatenate(values_rows)
    mean, std = flat.mean(), flat.std()
    return [(v - mean) / (std + eps) for v in values_rows]


def np_gae(reward_rows, value_rows, gamma, lams):
    """Plain GAE loop over each compacted row (terminal after the last token). -> list of (A, A + V)."""
    out = []
    for r, v, lam in zip(reward_rows, value_rows, lams):
        a = np.zeros(len(r))
        nxt_v = nxt_a = 0.0
        for t in reversed(range(len(r))):
            a[t] = r[t] + gamma * nxt_v - v[t] + gamma * lam * nxt_a
            nxt_v, nxt_a = v[t], a[t]
        out.append(a)
    return out


def np_outcome_rows(rewards, mask):
    rows_ = []
    for i in range(mask.shape[0]):
        r = np.zeros(int(mask[i].sum()))
        if len(r):
            r[-1] = rewards[i]
        rows_.append(r)
    return rows_


def np_gtpo(rewards, ent_rows, g, eps=1e-6):
    """GTPO on compacted rows: position t of each row is its t-th model token."""
    out = []
    for p in range(len(rewards) // g):
        idx = range(p * g, (p + 1) * g)
        pos = {i: rewards[i] > 0 for i in idx}
        h = {i: np.maximum(ent_rows[i], eps) for i in idx}
        shaped = {}
        for i in idx:
            s = np.zeros(len(h[i]))
            for t in range(len(h[i])):
                same = [k for k in idx if pos[k] == pos[i] and len(h[k]) > t]
                if pos[i]:
                    s[t] = rewards[i] + h[i][t] / sum(h[k][t] for k in same) * len(same)
                else:
                    s[t] = -1 - (1 / h[i][t]) / sum(1 / h[k][t] for k in same) * len(same)
            shaped[i] = s
        flat = np.concatenate([shaped[i] for i in idx])
        mean, std = (flat.mean(), flat.std()) if len(flat) else (0.0, 0.0)
        out += [(shaped[i] - mean) / (std + eps) for i in idx]
    return out


def np_grpo_s(rewards, ent_rows, g, eps=1e-6):
    hbar = np.array([max(e.mean() if len(e) else 0.0, eps) for e in ent_rows]).reshape(-1, g)
    r = np.asarray(rewards).reshape(-1, g)
    shaped = np.zeros_like(r)
    for p in range(r.shape[0]):
        pos = r[p] > 0
        for j in range(g):
            if pos[j]:
                shaped[p, j] = r[p, j] + hbar[p, j] / hbar[p][pos].sum() * pos.sum()
            else:
                shaped[p, j] = -1 - (1 / hbar[p, j]) / (1 / hbar[p][~pos]).sum() * (~pos).sum()
    return np_grpo(shaped.reshape(-1), g)


def reference(name, cfg, d):
    """Numpy advantages `[B, N]` (and returns) of estimator `name` on the compacted rows, expanded back."""
    mask, g = d["mask"], G
    lengths = mask.sum(axis=1)
    pen_rows = rows(d["penalty"], mask)
    pen_sums = np.array([p.sum() for p in pen_rows])
    returns = None
    if name == "grpo":
        if cfg.per_component:
            seq = sum(np_grpo(d["components"][:, k], g, cfg.std_scope) for k in range(3))
        else:
            seq = np_grpo(d["rewards"], g, cfg.std_scope)
        seq = seq - (pen_sums - np.repeat(pen_sums.reshape(-1, g).mean(axis=1), g))
        a_rows = [np.full(int(n_), s) for n_, s in zip(lengths, seq)]
    elif name == "rloo":
        a_rows = [np.full(int(n_), s) for n_, s in zip(lengths, np_rloo(d["rewards"] - pen_sums, g))]
    elif name == "remax":
        a_rows = [np.full(int(n_), s) for n_, s in zip(lengths, d["rewards"] - pen_sums - d["greedy"])]
    elif name == "opo":
        r = (d["rewards"] - pen_sums).reshape(-1, g)
        l_ = lengths.reshape(-1, g)
        base = (l_ * r).sum(axis=1, keepdims=True) / np.maximum(l_.sum(axis=1, keepdims=True), 1e-6)
        a_rows = [np.full(int(n_), s) for n_, s in zip(lengths, (r - base).reshape(-1))]
    elif name == "reinforce_pp":
        x = d["rewards"] - (np.repeat(d["rewards"].reshape(-1, g).mean(axis=1), g) if cfg.group_baseline else 0)
        ret = [x_ - np.cumsum(p[::-1])[::-1] for x_, p in zip(x, pen_rows)]  # penalty to go
        a_rows = np_whiten(ret)
    elif name == "gae":
        r_rows = [o - p for o, p in zip(np_outcome_rows(d["rewards"], mask), pen_rows)]
        v_rows = rows(d["values"], mask)
        if cfg.length_adaptive_alpha is None:
            lams = [cfg.lam_actor] * len(lengths)
        else:
            lams = [float(np.clip(1 - 1 / (cfg.length_adaptive_alpha * n_), 0, 1)) if n_ else 0.0 for n_ in lengths]
        a_rows = np_gae(r_rows, v_rows, cfg.gamma, lams)
        crit = np_gae(r_rows, v_rows, cfg.gamma, [cfg.lam_critic] * len(lengths))
        returns = expand([a + v for a, v in zip(crit, v_rows)], mask)
        if cfg.whiten:
            a_rows = np_whiten(a_rows)
    elif name == "gtpo":
        a_rows = np_gtpo(d["rewards"], rows(d["entropy"], mask), g)
    elif name == "grpo_s":
        a_rows = [np.full(int(n_), s) for n_, s in zip(lengths, np_grpo_s(d["rewards"], rows(d["entropy"], mask), g))]
    else:
        raise KeyError(name)
    return expand(a_rows, mask), returns


# estimator -> configs to test (with the token penalty unless the estimator takes none)
CASES = {
    "grpo": [dict(), dict(std_scope="batch"), dict(std_scope="none"), dict(per_component=True)],
    "rloo": [dict()],
    "remax": [dict()],
    "opo": [dict()],
    "reinforce_pp": [dict(), dict(group_baseline=False)],
    "gae": [dict(gamma=0.9, lam_actor=0.8, lam_critic=1.0), dict(whiten=True, lam_actor=1.0),
            dict(gamma=0.95, length_adaptive_alpha=0.3, whiten=True)],
    "gtpo": [dict()],
    "grpo_s": [dict()],
}
NO_PENALTY = {"gtpo", "grpo_s"}


# Issue 35's estimators (jaxrl.advantage_shaping): their hole checks are in test_advantages_wave2.py.
WAVE2 = {"bnpo", "psr", "nsr", "w_reinforce", "passk", "empg", "seed_grpo"}


def test_every_builtin_estimator_has_a_hole_reference():
    builtin = {n for n in registry.names("advantage") if registry.resolve("advantage", n, "x").builtin}
    assert builtin <= set(CASES) | WAVE2, sorted(builtin - set(CASES) - WAVE2)


def _compute(cfg, d, penalty=True, **extra):
    name = cfg.estimator
    return adv.compute(cfg, jnp.asarray(d["rewards"], jnp.float32), jnp.asarray(d["mask"], jnp.float32), G,
                       entropy=jnp.asarray(d["entropy"], jnp.float32), values=jnp.asarray(d["values"], jnp.float32),
                       greedy_rewards=jnp.asarray(d["greedy"], jnp.float32),
                       components=jnp.asarray(d["components"], jnp.float32),
                       token_penalty=jnp.asarray(d["penalty"], jnp.float32) if penalty and name not in NO_PENALTY
                       else None, **extra)


@pytest.mark.parametrize("name,fields", [(n, f) for n, cases in CASES.items() for f in cases])
@pytest.mark.parametrize("seed", [0, 1])
def test_estimators_with_holes_match_compacted_numpy(name, fields, seed):
    d = data(seed, binary=name in NO_PENALTY)
    if name in NO_PENALTY:
        d["penalty"] = np.zeros_like(d["penalty"])
    cfg = AdvantageConfig(estimator=name, **fields)
    advantages, returns = _compute(cfg, d)
    expected, expected_returns = reference(name, cfg, d)
    close(advantages, expected)
    assert not np.asarray(advantages)[d["mask"] == 0].any()
    if expected_returns is not None:
        close(returns, expected_returns)


def test_entropy_bonus_with_holes():
    d = data(3)
    d["penalty"] = np.zeros_like(d["penalty"])
    cfg = AdvantageConfig(estimator="rloo", entropy_bonus_alpha=0.4, entropy_bonus_kappa=2.0)
    advantages, _ = _compute(cfg, d, penalty=False)
    base, _ = reference("rloo", cfg, d)
    expected = (base + np.minimum(0.4 * d["entropy"], np.abs(base) / 2.0)) * d["mask"]
    close(advantages, expected)


def test_outcome_token_rewards_on_the_episodes_last_model_token():
    d = data(4)
    expected = expand(np_outcome_rows(d["rewards"], d["mask"]), d["mask"])
    close(adv.outcome_token_rewards(jnp.asarray(d["rewards"], jnp.float32), jnp.asarray(d["mask"])), expected)


def test_compact_and_expand_round_trip():
    d = data(5)
    m = jnp.asarray(d["mask"], jnp.float32)
    x = jnp.asarray(d["values"], jnp.float32)
    c = adv.compact(x, m)
    lengths = d["mask"].sum(axis=1).astype(int)
    for i, r in enumerate(rows(d["values"], d["mask"])):
        close(np.asarray(c)[i, :lengths[i]], r)
        assert not np.asarray(c)[i, lengths[i]:].any()
    close(adv.compacted_mask(m), (np.arange(N)[None] < lengths[:, None]).astype(float))
    close(adv.expand(c, m), d["values"] * d["mask"])


def _old_decoupled_gae(token_rewards, values, mask, gamma, lam_actor, lam_critic):
    """The prefix-mask GAE this module had before holes (kept here to prove the new scan bit-identical)."""
    mask = jnp.asarray(mask, jnp.float32)
    values = jnp.asarray(values, jnp.float32)
    nxt = lambda x: jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)  # noqa: E731
    next_mask = nxt(mask)
    delta = jnp.asarray(token_rewards, jnp.float32) + gamma * nxt(values) * next_mask - values

    def advantages(lam):
        discount = gamma * jnp.broadcast_to(jnp.asarray(lam, jnp.float32), (mask.shape[0],))

        def step(carry, xs):
            a = xs[0] + discount * xs[1] * carry
            return a, a
        return jax.lax.scan(step, jnp.zeros(mask.shape[0], jnp.float32), (delta.T, next_mask.T), reverse=True)[1].T

    return advantages(lam_actor) * mask, (advantages(lam_critic) + values) * mask


@pytest.mark.parametrize("jit", [False, True])
def test_gae_and_outcome_rewards_are_bit_identical_on_prefix_masks(jit):
    rng = np.random.default_rng(7)
    b, n = 16, 23
    lengths = rng.integers(0, n + 1, b)
    mask = jnp.asarray((np.arange(n)[None] < lengths[:, None]).astype(np.float32))
    rewards = jnp.asarray(rng.normal(size=b), jnp.float32)
    values = jnp.asarray(rng.normal(size=(b, n)), jnp.float32)
    lam = jnp.asarray(rng.uniform(0.5, 1.0, b), jnp.float32)
    old_tok = rewards[:, None] * (mask * (1.0 - jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], 1)))
    new_tok = adv.outcome_token_rewards(rewards, mask)
    np.testing.assert_array_equal(np.asarray(new_tok), np.asarray(old_tok))
    tok = new_tok - 0.01 * jnp.asarray(rng.uniform(size=(b, n)), jnp.float32) * mask
    for gamma, la, lc in [(1.0, 1.0, 1.0), (0.97, 0.95, 1.0), (0.9, lam, 0.8)]:
        new = functools.partial(adv.decoupled_gae, gamma=gamma, lam_actor=la, lam_critic=lc)
        old = functools.partial(_old_decoupled_gae, gamma=gamma, lam_actor=la, lam_critic=lc)
        if jit:
            new, old = jax.jit(new), jax.jit(old)
        for x, y in zip(new(tok, values, mask), old(tok, values, mask)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------- per-turn credit


def np_turn_returns(token_rewards, turns, mask, gamma):
    tok = np.zeros(mask.shape)
    g0 = np.zeros(mask.shape[0])
    for i in range(mask.shape[0]):
        valid = (mask[i] > 0) & (turns[i] >= 0)
        if not valid.any():
            continue
        k_max = turns[i][valid].max()
        r = np.array([token_rewards[i][valid & (turns[i] == j)].sum() for j in range(k_max + 1)])
        g = np.array([sum(gamma ** (j - k) * r[j] for j in range(k, k_max + 1)) for k in range(k_max + 1)])
        tok[i][valid] = g[turns[i][valid]]
        g0[i] = g[0]
    return tok, g0


@pytest.mark.parametrize("gamma", [1.0, 0.8, 0.0])
def test_turn_returns_against_numpy(gamma):
    d = data(8)
    tok, g0 = adv.turn_returns(jnp.asarray(d["token_rewards"], jnp.float32), jnp.asarray(d["turns"]),
                               jnp.asarray(d["mask"]), gamma)
    etok, eg0 = np_turn_returns(d["token_rewards"], d["turns"], d["mask"], gamma)
    close(tok, etok)
    close(g0, eg0)


def _turn_reference(name, cfg, d, penalty):
    mask, g = d["mask"], G
    tok, g0 = np_turn_returns(d["token_rewards"], d["turns"], mask, cfg.turn_gamma)
    pen = d["penalty"] * mask if penalty else np.zeros(mask.shape)
    pen_sums = pen.sum(axis=1)
    g0_groups = g0.reshape(-1, g)
    mean = np.repeat(g0_groups.mean(axis=1), g)[:, None]
    if name == "grpo":
        std = {"group": np.repeat(g0_groups.std(axis=1, ddof=1), g)[:, None], "batch": g0.std(ddof=1),
               "none": None}[cfg.std_scope]
        a = tok - mean if std is None else (tok - mean) / (std + cfg.eps)
        a = a - (pen_sums - np.repeat(pen_sums.reshape(-1, g).mean(axis=1), g))[:, None]
    elif name == "rloo":
        x = g0 - pen_sums
        loo = ((np.repeat(x.reshape(-1, g).sum(axis=1), g) - x) / (g - 1))[:, None]
        a = tok - pen_sums[:, None] - loo
    elif name == "reinforce_pp":
        togo = np.flip(np.cumsum(np.flip(pen, 1), 1), 1)
        x = tok - (mean if cfg.group_baseline else 0.0) - togo
        a = expand(np_whiten(rows(x, mask)), mask)
    elif name == "gae":
        r_rows = [r - p for r, p in zip(rows(d["token_rewards"], mask), rows(pen, mask))]
        a = expand(np_gae(r_rows, rows(d["values"], mask), cfg.gamma, [cfg.lam_actor] * B), mask)
    return a * mask


TURN_CASES = [("grpo", dict()), ("grpo", dict(std_scope="batch", turn_gamma=0.7)), ("grpo", dict(std_scope="none")),
              ("rloo", dict(turn_gamma=0.5)), ("reinforce_pp", dict(turn_gamma=0.9)),
              ("reinforce_pp", dict(group_baseline=False)), ("gae", dict(gamma=0.9, lam_actor=0.95))]


@pytest.mark.parametrize("name,fields", TURN_CASES)
@pytest.mark.parametrize("penalty", [False, True])
def test_discounted_turn_credit_against_numpy(name, fields, penalty):
    d = data(9)
    cfg = AdvantageConfig(estimator=name, turn_credit="discounted", **fields)
    LossConfig(advantage=cfg).check_pieces()
    advantages, _ = _compute(cfg, d, penalty=penalty, token_rewards=jnp.asarray(d["token_rewards"], jnp.float32),
                             turn_ids=jnp.asarray(d["turns"]))
    close(advantages, _turn_reference(name, cfg, d, penalty))


def test_discounted_credit_differs_from_final_and_final_ignores_token_rewards():
    d = data(10)
    extra = dict(token_rewards=jnp.asarray(d["token_rewards"], jnp.float32), turn_ids=jnp.asarray(d["turns"]))
    final, _ = _compute(AdvantageConfig(), d, penalty=False)
    final_given, _ = _compute(AdvantageConfig(), d, penalty=False, **extra)
    np.testing.assert_array_equal(np.asarray(final), np.asarray(final_given))
    disc, _ = _compute(AdvantageConfig(turn_credit="discounted"), d, penalty=False, **extra)
    assert not np.allclose(np.asarray(disc), np.asarray(final))


def test_single_turn_discounted_equals_final_grpo():
    """One turn, reward on the last token, turn_gamma 1: the per-turn return is the sequence reward."""
    d = data(11)
    mask = d["mask"].copy()
    mask[:] = (np.arange(N)[None] < mask.sum(axis=1)[:, None])  # prefix masks, same lengths
    turns = np.where(mask > 0, 0, -1)
    token_rewards = expand(np_outcome_rows(d["rewards"], mask), mask)
    d.update(mask=mask)
    final, _ = _compute(AdvantageConfig(), d, penalty=False)
    disc, _ = _compute(AdvantageConfig(turn_credit="discounted"), d, penalty=False,
                       token_rewards=jnp.asarray(token_rewards, jnp.float32), turn_ids=jnp.asarray(turns))
    has = mask.sum(axis=1) > 0
    # row 1 has no model token: its G_0 is 0, not its reward; compare the groups without it
    keep = np.repeat(has.reshape(-1, G).all(axis=1), G)
    close(np.asarray(disc)[keep], np.asarray(final)[keep])


def test_turn_credit_errors_name_the_field():
    d = data(12)
    with pytest.raises(ValueError, match="rl.loss.advantage.turn_credit"):
        _compute(AdvantageConfig(estimator="opo", turn_credit="discounted"), d)
    with pytest.raises(ValueError, match="turn_ids"):
        _compute(AdvantageConfig(turn_credit="discounted"), d, penalty=False,
                 token_rewards=jnp.asarray(d["token_rewards"], jnp.float32))
    for fields, field in [(dict(estimator="gtpo", turn_credit="discounted"), "turn_credit"),
                          (dict(estimator="remax", turn_credit="discounted"), "turn_credit"),
                          (dict(per_component=True, turn_credit="discounted"), "turn_credit"),
                          (dict(estimator="gae", turn_credit="discounted", turn_gamma=0.9), "turn_gamma"),
                          (dict(turn_gamma=0.9), "turn_gamma")]:
        with pytest.raises(registry.RegistryError, match=f"rl.loss.advantage.{field}"):
            LossConfig(advantage=AdvantageConfig(**fields)).check_pieces()


# --------------------------------------------------------------------------- loss pieces


def np_aggregate(per_token, mask, mode, norm_length=1.0):
    r = rows(per_token, mask)
    nonempty = [x for x in r if len(x)]
    total = sum(x.sum() for x in r)
    if mode == "token-mean":
        return total / max(sum(len(x) for x in r), 1)
    if mode == "seq-mean-token-mean":
        return sum(x.mean() for x in nonempty) / max(len(nonempty), 1)
    if mode == "seq-mean-token-sum":
        return total / max(len(nonempty), 1)
    return total / (mask.shape[0] * norm_length)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_every_aggregation_mode_with_holes(mode):
    d = data(13)
    m = jnp.asarray(d["mask"], jnp.float32)
    x = d["values"]
    value = aggregate(jnp.asarray(x, jnp.float32), m, mode, normalizers(m, norm_length=9.0))
    close(value, np_aggregate(x, d["mask"], mode, 9.0))


def _ratio_rows(name, d):
    lr = rows(d["logp"] - d["old_logp"], d["mask"])
    return lr if name == "token" else [np.full(len(x), x.mean() if len(x) else 0.0) for x in lr]


@pytest.mark.parametrize("name", ["token", "sequence", "sequence_token"])
def test_ratios_with_holes(name):
    d = data(14)
    fn = registry.resolve("ratio", name, "ratio").fn
    out = fn(jnp.asarray(d["logp"], jnp.float32), jnp.asarray(d["old_logp"], jnp.float32), jnp.asarray(d["mask"]))
    close(out, expand(_ratio_rows(name, d), d["mask"]))


def np_objective(name, lr_rows, a_rows, eps_low, eps_high, dual):
    out = []
    for lr, a in zip(lr_rows, a_rows):
        r = np.exp(lr)
        if name == "ppo_clip":
            loss = np.maximum(-r * a, -np.clip(r, 1 - eps_low, 1 + eps_high) * a)
            if dual is not None:
                loss = np.where(a < 0, np.minimum(loss, -dual * a), loss)
        elif name == "reinforce":
            loss = -r * a
        elif name == "cispo":
            loss = -np.clip(r, 1 - eps_low, 1 + eps_high) * a
        elif name == "gmpo":
            s = np.sign(a)
            pess = s * np.minimum(s * lr, s * np.clip(lr, -eps_low, eps_high))
            loss = -a * np.exp(pess.mean()) if len(lr) else a
        out.append(loss)
    return out


@pytest.mark.parametrize("name,dual", [("ppo_clip", None), ("ppo_clip", 3.0), ("reinforce", None),
                                       ("cispo", None), ("gmpo", None)])
def test_objectives_with_holes(name, dual):
    d = data(15)
    mask = d["mask"]
    a = d["values"]  # token-level advantages of both signs
    lr = np.where(mask > 0, d["logp"] - d["old_logp"], 0.0) * 0.3
    fn = registry.resolve("objective", name, "objective").fn
    loss, _ = fn(jnp.asarray(lr, jnp.float32), jnp.asarray(a, jnp.float32), jnp.asarray(d["logp"], jnp.float32),
                 jnp.asarray(mask, jnp.float32), 0.2, 0.28, dual)
    expected = expand(np_objective(name, rows(lr, mask), rows(a, mask), 0.2, 0.28, dual), mask)
    close(np.asarray(loss) * mask, expected)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_truncated_is_weights_with_holes(level, mode):
    d = data(16)
    mask = d["mask"]
    w, _, _ = rollout_correction(jnp.asarray(d["old_logp"], jnp.float32), jnp.asarray(d["sampler_logp"], jnp.float32),
                                 jnp.asarray(mask), level=level, mode=mode, cap=1.5)
    out = []
    for lw in rows(d["old_logp"] - d["sampler_logp"], mask):
        if level == "sequence":
            lw = np.full(len(lw), lw.sum())
        out.append(np.where(lw > np.log(1.5), 0.0 if mode == "mask" else 1.5, np.exp(lw)))
    close(w, expand(out, mask))


def test_truncation_and_batch_selections_with_holes():
    d = data(17, b=8, n=20)
    mask, logp, ent = d["mask"], d["old_logp"], d["entropy"]
    truncated = np.arange(8) % 3 == 0
    close(truncation_mask(jnp.asarray(mask), jnp.asarray(truncated)), mask * ~truncated[:, None])
    count = int(mask.sum())
    flat_ent = np.concatenate(rows(ent, mask))
    # top entropy: the ceil(0.3 * count) highest-entropy model tokens
    k = int(np.ceil(0.3 * count))
    keep = np.zeros(count)
    keep[np.argsort(-flat_ent, kind="stable")[:k]] = 1
    got = top_entropy_mask(jnp.asarray(ent, jnp.float32), jnp.asarray(mask), 0.3)
    close(got, expand(np.split(keep, np.cumsum(mask.sum(axis=1)).astype(int)[:-1]), mask))
    # covariance of log-prob and advantage over the model tokens
    a = d["values"]
    lp_rows, a_rows = rows(logp, mask), rows(a, mask)
    flat_lp, flat_a = np.concatenate(lp_rows), np.concatenate(a_rows)
    cov_rows = [(x - flat_lp.mean()) * (y - flat_a.mean()) for x, y in zip(lp_rows, a_rows)]
    flat_cov = np.concatenate(cov_rows)
    split = np.cumsum(mask.sum(axis=1)).astype(int)[:-1]
    # KL-Cov: the floor(0.1 * count) largest covariances
    kk = max(int(np.floor(0.1 * count)), 1)
    sel = np.zeros(count)
    sel[np.argsort(-flat_cov, kind="stable")[:kk]] = 1
    got = kl_cov_mask(jnp.asarray(logp, jnp.float32), jnp.asarray(a, jnp.float32), jnp.asarray(mask), 0.1)
    close(got, expand(np.split(sel, split), mask))
    # Clip-Cov: a random floor(0.1 * count) of the candidates (low < cov < high); the random draw is per
    # position of the row layout, so the reference takes the same draws at the model tokens
    key = jax.random.PRNGKey(3)
    priority = np.concatenate(rows(np.asarray(jax.random.uniform(key, mask.shape)), mask))
    candidate = (flat_cov > -0.05) & (flat_cov < 0.5)
    assert candidate.sum() > kk
    detached = np.zeros(count)
    detached[np.argsort(-np.where(candidate, priority, -1.0), kind="stable")[:kk]] = 1
    got = clip_cov_mask(jnp.asarray(logp, jnp.float32), jnp.asarray(a, jnp.float32), jnp.asarray(mask), key, 0.1,
                        -0.05, 0.5)
    close(got, expand(np.split(1 - detached, split), mask) + (mask == 0))


def test_prepare_batch_metrics_with_holes():
    d = data(18)
    mask = d["mask"]
    truncated = np.arange(B) % 4 == 3
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k2", kl_in_reward=True, mask_truncated=True, is_level="token",
                     is_cap=1.5, top_entropy_fraction=0.5, kl_cov_ratio=0.2,
                     advantage=AdvantageConfig(estimator="rloo"))
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    fields, metrics = jax.jit(functools.partial(prepare_batch, cfg, group_size=G))(
        rewards=f(d["rewards"]), completion_mask=jnp.asarray(mask > 0), old_logp=f(d["old_logp"]),
        key=jax.random.PRNGKey(0), truncated=jnp.asarray(truncated), entropy=f(d["entropy"]),
        ref_logp=f(d["ref_logp"]), sampler_logp=f(d["sampler_logp"]))
    kl_rows = [0.5 * x ** 2 for x in rows(d["old_logp"] - d["ref_logp"], mask)]
    pen = expand([0.1 * k for k in kl_rows], mask)
    r = d["rewards"] - pen.sum(axis=1)
    a = expand([np.full(len(k), s) for k, s in zip(kl_rows, np_rloo(r, G))], mask)
    close(fields["advantages"], a)
    loss_mask = mask * ~truncated[:, None]
    close(fields["loss_mask"], loss_mask)
    flat_kl = np.concatenate(kl_rows)
    close(metrics["kl_ref"], flat_kl.mean())
    close(metrics["truncated_masked_frac"], 1 - loss_mask.sum() / mask.sum())
    flat_a = np.concatenate(rows(a, loss_mask))
    close(metrics["advantage_mean"], flat_a.mean())
    close(metrics["advantage_std"], flat_a.std())
    flat_lp = np.concatenate(rows(d["old_logp"], loss_mask))
    close(metrics["logp_adv_cov"], ((flat_lp - flat_lp.mean()) * (flat_a - flat_a.mean())).mean())
    close(metrics["loss_tokens"], loss_mask.sum())
    lw = np.concatenate(rows(d["old_logp"] - d["sampler_logp"], loss_mask))
    close(metrics["is_weight_mean"], np.minimum(np.exp(lw), 1.5).mean())
    close(metrics["is_truncated_frac"], (lw > np.log(1.5)).mean())
    weights = np.asarray(fields["token_weights"])
    assert not weights[loss_mask == 0].any()
    close(metrics["weight_zero_frac"], (np.concatenate(rows(weights, loss_mask)) == 0).mean())
    assert np.asarray(fields["kl_cov_mask"])[loss_mask == 0].sum() == 0


# --------------------------------------------------------------------------- the whole loss


def _compact_batch(x, mask):
    return adv.compact(jnp.asarray(x, jnp.float32), jnp.asarray(mask, jnp.float32))


LOSSES = [dict(preset="grpo"), dict(preset="dr_grpo", norm_length=10), dict(preset="gspo"),
          dict(preset="cispo", entropy_coef=0.01), dict(preset="gmpo"), dict(preset="kl_cov"),
          dict(preset="dapo", ratio="sequence_token", kl_coef=0.05, kl_estimator="k2"),
          dict(preset="dapo", aggregation="seq-mean-token-sum", dual_clip_c=3.0),
          dict(preset="ppo")]


@pytest.mark.parametrize("fields", LOSSES, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_build_loss_with_holes_equals_the_compacted_batch(fields):
    """The composed loss, its metrics and its gradient wrt the log-probs and values: a batch with holes
    gives what the compacted batch (model tokens shifted left, prefix masks) gives."""
    d = data(19)
    mask = d["mask"]
    rest = {k: v for k, v in fields.items() if k != "preset"}
    cfg = LossConfig.from_preset(fields["preset"], **rest)
    critic = fields.get("preset") == "ppo"
    loss_fn = build_loss(cfg, with_critic=critic)
    controls = Controls.initial(cfg, 1.0)
    rng = np.random.default_rng(20)
    arrays = dict(logp=d["logp"], old_logp=d["logp"] + rng.normal(0, 0.1, (B, N)), advantages=d["values"],
                  entropy=d["entropy"], ref_logp=d["ref_logp"], kl_cov_mask=(rng.uniform(size=(B, N)) < 0.3) * mask,
                  values=d["values"] * 0.5, old_values=d["values"] * 0.4, returns=d["penalty"])

    def run(layout_mask, transform):
        x = {k: transform(v) for k, v in arrays.items()}
        m = jnp.asarray(layout_mask, jnp.float32)
        norm = normalizers(m, norm_length=cfg.norm_length or 1.0)

        def f(logp, values):
            inputs = LossInputs(logp=logp, old_logp=x["old_logp"], advantages=x["advantages"], mask=m,
                                entropy=x["entropy"], ref_logp=x["ref_logp"], kl_cov_mask=x["kl_cov_mask"],
                                values=values if critic else None, old_values=x["old_values"] if critic else None,
                                returns=x["returns"] if critic else None)
            return loss_fn(inputs, norm, controls)
        (loss, metrics), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x["logp"], x["values"])
        return loss, metrics, grads

    holes = run(mask, lambda v: jnp.asarray(v, jnp.float32))
    compacted_mask = adv.compacted_mask(jnp.asarray(mask))
    packed = run(compacted_mask, lambda v: _compact_batch(v, mask))
    close(holes[0], packed[0])
    assert set(holes[1]) == set(packed[1])
    for name in holes[1]:
        close(holes[1][name], packed[1][name])
    for g_holes, g_packed in zip(holes[2], packed[2]):
        close(np.asarray(g_holes) * (mask == 0), 0.0)
        close(adv.compact(g_holes, jnp.asarray(mask)), g_packed)


def test_prepare_batch_passes_per_turn_credit_under_jit():
    d = data(21)
    cfg = LossConfig(advantage=AdvantageConfig(estimator="rloo", turn_credit="discounted", turn_gamma=0.6))
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    fields, _ = jax.jit(functools.partial(prepare_batch, cfg, group_size=G))(
        rewards=f(d["rewards"]), completion_mask=jnp.asarray(d["mask"] > 0), old_logp=f(d["old_logp"]),
        key=jax.random.PRNGKey(0), token_rewards=f(d["token_rewards"]), turn_ids=jnp.asarray(d["turns"], jnp.int32))
    close(fields["advantages"], _turn_reference("rloo", cfg.advantage, d, penalty=False))
