"""The loss library (`jaxrl.losses`) against independent float64 numpy references.

Every reference below is written from the formula in the docstrings / papers (loops where natural), not
from the jax code. Values are compared on small random inputs with ragged masks (one row fully masked,
garbage in the padding); gradients of every differentiable input (`logp`, `entropy`, `values`) are
compared with central finite differences of the numpy reference, and must be exactly zero on masked
tokens. Random log ratios stay within +-0.6 and at least `KINK_MARGIN` away from every clip boundary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import advantages as adv_lib
from jaxrl import registry
from jaxrl.configlib import ConfigError
from jaxrl.losses import (AGGREGATIONS, KL_ESTIMATORS, PRESETS, Controls, LossConfig,
                          LossInputs, adapt_entropy_coef, adapt_temperature, aggregate, build_loss,
                          cispo, clip_cov_mask, combine, entropy_term, gmpo, kl_cov_mask, kl_cov_term,
                          kl_estimate, kl_full, kl_k1, kl_k2, kl_k3, kl_term, logp_advantage_covariance,
                          mean_over_updates, normalizers, policy_term, ppo_clip, prepare_batch, reduce_metrics,
                          reinforce, sequence_log_ratio, sequence_token_log_ratio, token_log_ratio, token_mean,
                          rollout_correction, top_entropy_mask, truncation_mask, value_loss, value_term)

EPS_LOW, EPS_HIGH, DUAL_C, GMPO_EPS = 0.2, 0.28, 1.5, 0.4
# Every kink of the pieces under test, in log-ratio space: ppo clip (0.8, 1.28, symmetric 1.2), dual clip
# (1.5), gmpo's log-space clip (+-0.4), |log ratio| of KL-Cov (0), CISPO's lower bound with eps_low 0.28.
LOG_KINKS = np.array([0.0, math.log(1 - EPS_LOW), math.log(1 + EPS_HIGH), math.log(1 + EPS_LOW),
                      math.log(DUAL_C), GMPO_EPS, -GMPO_EPS, math.log(1 - EPS_HIGH)])
KINK_MARGIN = 3e-3
LENGTHS = (6, 3, 0, 1, 5)  # ragged, with an empty row
B, N = len(LENGTHS), 6
FD_STEP, GRAD_ATOL = 1e-5, 2e-4


# --------------------------------------------------------------------------- helpers


def f32(x):
    return np.asarray(x, np.float32)


def f64(x):
    """float64 copy of the float32 value the jax code sees."""
    return np.asarray(np.asarray(x, np.float32), np.float64)


def ragged_mask(lengths, n):
    return f32(np.arange(n)[None, :] < np.asarray(lengths)[:, None])


def near_kink(log_ratio):
    return np.min(np.abs(np.asarray(log_ratio)[..., None] - LOG_KINKS), axis=-1) < KINK_MARGIN


def sample_log_ratios(rng, shape, limit=0.6):
    lr = rng.uniform(-limit, limit, shape)
    while near_kink(lr).any():
        lr = np.where(near_kink(lr), rng.uniform(-limit, limit, shape), lr)
    return lr


def np_seq_means(x, m):
    out = np.zeros(x.shape[0])
    for i in range(x.shape[0]):
        n = m[i].sum()
        out[i] = sum(x[i, t] for t in range(x.shape[1]) if m[i, t] > 0) / n if n > 0 else 0.0
    return out


def make_batch(seed, lengths=LENGTHS, n=N, token_adv=False, seq_kinks=False):
    """Random float32 inputs. Valid tokens: log ratios in +-0.6 away from the kinks; padding: garbage.
    With `seq_kinks`, sequence-mean log ratios are also kept away from the kinks (retrying seeds)."""
    for attempt in range(1000):
        rng = np.random.default_rng(1000 * seed + attempt)
        b = len(lengths)
        m = ragged_mask(lengths, n)
        old = rng.normal(-1.5, 0.5, (b, n))
        logp = old + sample_log_ratios(rng, (b, n))
        logp = np.where(m > 0, logp, rng.normal(0.0, 3.0, (b, n)))  # padding garbage
        if token_adv:
            a = rng.normal(0.0, 1.0, (b, n))
        else:
            a = np.repeat(rng.normal(0.0, 1.0, (b, 1)), n, axis=1)
        a = np.where(np.abs(a) < 0.05, 0.5, a)
        a = np.where(m > 0, a, rng.normal(0.0, 1.0, (b, n)))  # garbage advantages in the padding too
        out = dict(mask=m, logp=f32(logp), old=f32(old), adv=f32(a),
                   entropy=f32(rng.uniform(0.1, 2.0, (b, n))), ref=f32(logp + rng.normal(0.0, 0.3, (b, n))))
        lr = f64(out["logp"]) - f64(out["old"])
        if near_kink(np.where(m > 0, lr, 1.0)).any():
            continue
        if seq_kinks and near_kink(np_seq_means(lr, m)[np.asarray(lengths) > 0]).any():
            continue
        return out
    raise AssertionError("no batch away from the kinks")


def plant(d, cells):
    """Set chosen valid tokens to `(log ratio, advantage)` so each regime is surely covered."""
    logp, adv = d["logp"].copy(), d["adv"].copy()
    for (i, t), (lr, a) in cells.items():
        assert d["mask"][i, t] > 0 and not near_kink(lr)
        logp[i, t] = d["old"][i, t] + np.float32(lr)
        adv[i, t] = a
    return {**d, "logp": f32(logp), "adv": f32(adv)}


def jgrad(fn, **kwargs):
    """jax.grad, jitted (one compilation instead of one per primitive: keeps the file fast)."""
    return jax.jit(jax.grad(fn, **kwargs))


def fd_grad(fn, x, step=FD_STEP):
    """Central finite differences of the float64 scalar function `fn` at `x`."""
    x = np.array(x, np.float64)
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += step
        xm[idx] -= step
        g[idx] = (fn(xp) - fn(xm)) / (2 * step)
    return g


def assert_grad(jax_fn, np_fn, x, mask, atol=GRAD_ATOL):
    """jax.grad (float32) of `jax_fn` == finite differences of `np_fn` (float64); exactly 0 where masked."""
    g = np.asarray(jgrad(jax_fn)(jnp.asarray(f32(x))))
    ref = fd_grad(np_fn, f64(x))
    np.testing.assert_allclose(g, ref, atol=atol, rtol=1e-3)
    assert np.all(g[np.asarray(mask) == 0] == 0.0), g[np.asarray(mask) == 0]
    assert np.abs(g[np.asarray(mask) > 0]).max() > 1e-3  # the check is not vacuous
    return g


# --------------------------------------------------------------------------- numpy references


def np_aggregate(per_token, mask, mode, whole_mask=None, norm_length=1.0):
    l, m = np.asarray(per_token, np.float64), np.asarray(mask, np.float64)
    wm = m if whole_mask is None else np.asarray(whole_mask, np.float64)
    total = sum(l[i, t] * m[i, t] for i in range(l.shape[0]) for t in range(l.shape[1]))
    n_tokens = wm.sum()
    n_seqs = sum(1 for row in wm if row.sum() > 0)
    if mode == "token-mean":
        return total / max(n_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        acc = 0.0
        for i in range(l.shape[0]):
            if m[i].sum() > 0:
                acc += (l[i] * m[i]).sum() / m[i].sum()
        return acc / max(n_seqs, 1)
    if mode == "seq-mean-token-sum":
        return total / max(n_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        return total / (wm.shape[0] * norm_length)
    raise AssertionError(mode)


def np_log_ratio(logp, old, m, kind):
    tok = np.where(m > 0, logp - old, 0.0)
    if kind == "token":
        return tok
    seq = np_seq_means(tok, m)
    return np.where(m > 0, seq[:, None], 0.0)  # sequence and sequence_token have the same value


def np_ppo(log_ratio, a, eps_low, eps_high, dual_c=None):
    """-min(r A, clip(r) A), and for A < 0 with the dual clip -max(min(r A, clip(r) A), c A)."""
    out = np.zeros_like(log_ratio)
    for idx in np.ndindex(log_ratio.shape):
        r, adv = math.exp(log_ratio[idx]), a[idx]
        objective = min(r * adv, min(max(r, 1 - eps_low), 1 + eps_high) * adv)
        if dual_c is not None and adv < 0:
            objective = max(objective, dual_c * adv)
        out[idx] = -objective
    return out


def np_gmpo(log_ratio, a, m, eps_low, eps_high):
    """Per-sequence loss -A * (prod_t pessimistic r_t)^(1/|o|), broadcast over its tokens."""
    out = np.zeros_like(log_ratio)
    lo, hi = math.exp(-eps_low), math.exp(eps_high)
    for i in range(log_ratio.shape[0]):
        valid = [t for t in range(log_ratio.shape[1]) if m[i, t] > 0]
        if not valid:
            continue
        adv = a[i, valid[0]]
        terms = []
        for t in valid:
            r = math.exp(log_ratio[i, t])
            rc = min(max(r, lo), hi)
            terms.append(min(r, rc) if adv > 0 else max(r, rc))
        geo = float(np.prod(terms)) ** (1.0 / len(valid))
        out[i, :] = -adv * geo
    return out


def np_policy_loss(logp, old, a, m, ratio="token", objective="ppo_clip", agg="token-mean", eps_low=EPS_LOW,
                   eps_high=EPS_HIGH, dual_c=None, weights=None, norm_length=1.0):
    lr = np_log_ratio(logp, old, m, ratio)
    if objective == "ppo_clip":
        per = np_ppo(lr, a, eps_low, eps_high, dual_c)
    elif objective == "reinforce":
        per = -np.exp(lr) * a
    elif objective == "gmpo":
        per = np_gmpo(lr, a, m, eps_low, eps_high)
    else:
        raise AssertionError(objective)
    if weights is not None:
        per = per * weights
    return np_aggregate(per, m, agg, norm_length=norm_length)


def np_k1(logp, ref):
    return logp - ref


def np_k2(logp, ref):
    return 0.5 * (logp - ref) ** 2


def np_k3(logp, ref):
    r = np.exp(ref - logp)  # q / p
    return r - np.log(r) - 1.0


def np_value_loss(v, v_old, ret, clip_eps):
    out = np.zeros_like(v)
    for idx in np.ndindex(v.shape):
        unclipped = (v[idx] - ret[idx]) ** 2
        if clip_eps is None:
            out[idx] = 0.5 * unclipped
            continue
        vc = v_old[idx] + min(max(v[idx] - v_old[idx], -clip_eps), clip_eps)
        out[idx] = 0.5 * max(unclipped, (vc - ret[idx]) ** 2)
    return out


def np_covariance(logp, a, m):
    valid = m > 0
    n = max(valid.sum(), 1)
    mean_l = logp[valid].sum() / n
    mean_a = a[valid].sum() / n
    return np.where(valid, (logp - mean_l) * (a - mean_a), 0.0)


def np_grpo(rewards, g, eps=1e-6):
    out = np.zeros(len(rewards))
    for start in range(0, len(rewards), g):
        grp = np.asarray(rewards[start:start + g], np.float64)
        out[start:start + g] = (grp - grp.mean()) / (grp.std(ddof=1) + eps)  # torch.std, as TRL / verl
    return out


def norm_of(mask, norm_length=1.0):
    return normalizers(jnp.asarray(mask), norm_length)


def inputs_of(d, **extra):
    return LossInputs(logp=jnp.asarray(d["logp"]), old_logp=jnp.asarray(d["old"]), advantages=jnp.asarray(d["adv"]),
                      mask=jnp.asarray(d["mask"]), **extra)


CONTROLS = Controls(entropy_coef=jnp.float32(0.03), temperature=jnp.float32(1.0))


# --------------------------------------------------------------------------- aggregation


def test_aggregate_all_modes_match_numpy_with_gradient():
    d = make_batch(0)
    m = d["mask"]
    per = f32(np.random.default_rng(1).normal(size=(B, N)))
    assert set(AGGREGATIONS) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm"}
    for mode in AGGREGATIONS:
        norm = norm_of(m, 7.0)
        got = float(aggregate(jnp.asarray(per), jnp.asarray(m), mode, norm))
        np.testing.assert_allclose(got, np_aggregate(f64(per), m, mode, norm_length=7.0), rtol=1e-6, atol=1e-7)
        assert_grad(lambda x: aggregate(x, jnp.asarray(m), mode, norm),
                    lambda x: np_aggregate(x, m, mode, norm_length=7.0), per, m)
    n = norm_of(m, 7.0)
    assert float(n.num_tokens) == 15 and float(n.num_seqs) == 4 and float(n.num_rows) == 5
    assert n.norm_length == 7.0


def test_seq_mean_token_sum_norm_does_not_depend_on_lengths():
    rng = np.random.default_rng(2)
    per = f32(rng.normal(size=(B, N)))
    short = ragged_mask(LENGTHS, N)
    per = np.where(short > 0, per, 0.0).astype(np.float32)  # loss 0 outside the short mask
    long = ragged_mask((6, 6, 2, 4, 6), N)  # same non-zero tokens, longer responses
    v_short = float(aggregate(jnp.asarray(per), jnp.asarray(short), "seq-mean-token-sum-norm", norm_of(short, 6.0)))
    v_long = float(aggregate(jnp.asarray(per), jnp.asarray(long), "seq-mean-token-sum-norm", norm_of(long, 6.0)))
    assert v_short == pytest.approx(v_long, rel=1e-6)
    assert v_short * B * 6.0 == pytest.approx(float(per.sum()), rel=1e-5)  # normaliser = rows x norm_length
    t_short = float(aggregate(jnp.asarray(per), jnp.asarray(short), "token-mean", norm_of(short)))
    t_long = float(aggregate(jnp.asarray(per), jnp.asarray(long), "token-mean", norm_of(long)))
    assert abs(t_short - t_long) > 1e-3
    assert t_short * 15 == pytest.approx(t_long * 24, rel=1e-5)


def test_empty_sequences_are_not_counted_by_sequence_means():
    rng = np.random.default_rng(3)
    per = f32(rng.normal(size=(B, N)))
    m = ragged_mask(LENGTHS, N)
    keep = np.asarray(LENGTHS) > 0
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        with_empty = float(aggregate(jnp.asarray(per), jnp.asarray(m), mode, norm_of(m)))
        without = float(aggregate(jnp.asarray(per[keep]), jnp.asarray(m[keep]), mode, norm_of(m[keep])))
        assert with_empty == pytest.approx(without, rel=1e-6)
    # the sequence count is 4, not 5
    assert float(aggregate(jnp.asarray(per), jnp.asarray(m), "seq-mean-token-sum", norm_of(m))) == pytest.approx(
        float((per * m).sum()) / 4, rel=1e-6)


def test_split_into_row_groups_adds_up_to_the_whole_batch():
    rng = np.random.default_rng(4)
    lengths = (7, 0, 3, 5, 1, 7, 2, 0)
    m = ragged_mask(lengths, 7)
    per = f32(rng.normal(size=m.shape))
    whole = norm_of(m, 5.0)
    for mode in AGGREGATIONS:
        full = float(aggregate(jnp.asarray(per), jnp.asarray(m), mode, whole))
        parts = sum(float(aggregate(jnp.asarray(per[r:r + 2]), jnp.asarray(m[r:r + 2]), mode, whole))
                    for r in range(0, 8, 2))
        assert parts == pytest.approx(full, rel=1e-6), mode
        np.testing.assert_allclose(full, np_aggregate(f64(per), m, mode, norm_length=5.0), rtol=1e-6)


def test_aggregate_unknown_mode_lists_choices():
    m = jnp.ones((2, 3))
    with pytest.raises(ValueError) as err:
        aggregate(jnp.ones((2, 3)), m, "token-sum", normalizers(m))
    for mode in AGGREGATIONS:
        assert mode in str(err.value)


def test_token_mean_and_reduce_metrics():
    m = ragged_mask(LENGTHS, N)
    x = f32(np.random.default_rng(5).normal(size=(B, N)))
    assert float(token_mean(jnp.asarray(x), jnp.asarray(m), norm_of(m))) == pytest.approx(
        float((x * m).sum() / m.sum()), rel=1e-6)
    a = {"loss": jnp.float32(1.5), "ratio_max": jnp.float32(2.0), "ratio_min": jnp.float32(0.5)}
    b = {"loss": jnp.float32(0.25), "ratio_max": jnp.float32(3.0), "ratio_min": jnp.float32(0.7)}
    out = reduce_metrics(a, b)
    assert float(out["loss"]) == 1.75 and float(out["ratio_max"]) == 3.0 and float(out["ratio_min"]) == 0.5


def test_mean_over_updates_drops_updates_without_tokens():
    # an update whose minibatch had no loss tokens reports the masked max/min of nothing
    empty = policy_term("ppo_clip", "token", "token-mean")(
        inputs_of({**make_batch(8), "mask": np.zeros((B, N), np.float32)}), norm_of(np.zeros((B, N))), CONTROLS)[1]
    assert float(empty["ratio_max"]) == -np.inf and float(empty["ratio_min"]) == np.inf
    full = {name: jnp.float32(1.0) for name in empty} | {"ratio_max": jnp.float32(1.3),
                                                          "ratio_min": jnp.float32(0.6)}
    out = mean_over_updates([full, empty, {**full, "ratio_max": jnp.float32(1.1)}])
    assert float(out["ratio_max"]) == pytest.approx(1.3) and float(out["ratio_min"]) == pytest.approx(0.6)
    assert float(out["policy_loss"]) == pytest.approx((2.0 + float(empty["policy_loss"])) / 3)
    # weighted by each update's loss tokens, an update without tokens drops out of the means too
    weighted = mean_over_updates([full, empty, {**full, "policy_loss": jnp.float32(3.0)}], [30, 0, 10])
    assert float(weighted["policy_loss"]) == pytest.approx((30 * 1.0 + 10 * 3.0) / 40)
    assert float(weighted["ratio_max"]) == pytest.approx(1.3)
    assert float(mean_over_updates([full, full], [0, 0])["policy_loss"]) == pytest.approx(1.0)


# --------------------------------------------------------------------------- ratios


def test_log_ratios_values_and_gradients():
    d = make_batch(6)
    m, lp, old = d["mask"], d["logp"], d["old"]
    w = f32(np.random.default_rng(7).normal(size=(B, N)))
    tok = np.asarray(token_log_ratio(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(m)))
    seq = np.asarray(sequence_log_ratio(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(m)))
    seq_tok = np.asarray(sequence_token_log_ratio(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(m)))
    np.testing.assert_allclose(tok, np_log_ratio(f64(lp), f64(old), m, "token"), atol=1e-6)
    np.testing.assert_allclose(seq, np_log_ratio(f64(lp), f64(old), m, "sequence"), atol=1e-6)
    np.testing.assert_allclose(seq_tok, seq, atol=1e-6)  # GSPO-token has GSPO's value
    assert np.all(tok[m == 0] == 0) and np.all(seq[m == 0] == 0) and np.all(seq_tok[m == 0] == 0)
    for fn, kind in ((token_log_ratio, "token"), (sequence_log_ratio, "sequence")):
        assert_grad(lambda x: jnp.sum(fn(x, jnp.asarray(old), jnp.asarray(m)) * w),
                    lambda x: float((np_log_ratio(x, f64(old), m, kind) * w).sum()), lp, m)
    # GSPO-token: each token's gradient is that of its own log-prob
    g = np.asarray(jgrad(lambda x: jnp.sum(sequence_token_log_ratio(x, jnp.asarray(old), jnp.asarray(m)) * w))(
        jnp.asarray(lp)))
    np.testing.assert_allclose(g, w * m, atol=1e-6)
    # old_logp is a constant
    g_old = jgrad(lambda o: jnp.sum(sequence_log_ratio(jnp.asarray(lp), o, jnp.asarray(m))))(jnp.asarray(old))
    assert np.all(np.asarray(g_old) == 0)


def test_gspo_token_matches_gspo_value_and_gradient():
    d = make_batch(8, seq_kinks=True)  # constant per-sequence advantages
    m = d["mask"]
    norm = norm_of(m)
    terms = {r: policy_term("ppo_clip", r, "seq-mean-token-mean", EPS_LOW, EPS_HIGH)
             for r in ("sequence", "sequence_token")}

    def loss(ratio):
        return lambda x: terms[ratio](inputs_of({**d, "logp": x}), norm, CONTROLS)[0]

    ref = np_policy_loss(f64(d["logp"]), f64(d["old"]), f64(d["adv"]), m, "sequence", agg="seq-mean-token-mean")
    for r in terms:
        assert float(loss(r)(jnp.asarray(d["logp"]))) == pytest.approx(ref, rel=1e-5, abs=1e-6)
    g_seq = assert_grad(loss("sequence"), lambda x: np_policy_loss(x, f64(d["old"]), f64(d["adv"]), m, "sequence",
                                                                      agg="seq-mean-token-mean"), d["logp"], m)
    g_tok = np.asarray(jgrad(loss("sequence_token"))(jnp.asarray(d["logp"])))
    np.testing.assert_allclose(g_tok, g_seq, atol=1e-6)
    # some sequences clipped (zero gradient), some not: the comparison covers both regimes
    seq_r = np.exp(np_seq_means(f64(d["logp"]) - f64(d["old"]), m))
    assert np.any((seq_r < 1 - EPS_LOW) | (seq_r > 1 + EPS_HIGH)) and np.any(
        (seq_r > 1 - EPS_LOW) & (seq_r < 1 + EPS_HIGH))


def test_gspo_token_differs_from_gspo_with_token_level_advantages():
    d = make_batch(9, token_adv=True, seq_kinks=True)
    m = d["mask"]
    norm = norm_of(m)
    grads = {}
    for r in ("sequence", "sequence_token"):
        term = policy_term("reinforce", r, "seq-mean-token-mean")
        grads[r] = np.asarray(jgrad(lambda x: term(inputs_of({**d, "logp": x}), norm, CONTROLS)[0])(
            jnp.asarray(d["logp"])))
    assert np.abs(grads["sequence"] - grads["sequence_token"]).max() > 1e-3


def test_gspo_equals_token_ppo_for_length_one_sequences():
    lengths = (1, 1, 0, 1, 1)
    d = make_batch(10, lengths=lengths)
    m = d["mask"]
    norm = norm_of(m)
    fns = {}
    for r in ("sequence", "token"):
        term = policy_term("ppo_clip", r, "seq-mean-token-mean", EPS_LOW, EPS_HIGH)
        fns[r] = (lambda t: lambda x: t(inputs_of({**d, "logp": x}), norm, CONTROLS)[0])(term)
    v = {r: float(f(jnp.asarray(d["logp"]))) for r, f in fns.items()}
    assert v["sequence"] == pytest.approx(v["token"], rel=1e-6)
    assert v["token"] == pytest.approx(np_policy_loss(f64(d["logp"]), f64(d["old"]), f64(d["adv"]), m, "token",
                                                      agg="seq-mean-token-mean"), rel=1e-5)
    g_seq = np.asarray(jgrad(fns["sequence"])(jnp.asarray(d["logp"])))
    g_tok = assert_grad(fns["token"], lambda x: np_policy_loss(x, f64(d["old"]), f64(d["adv"]), m, "token",
                                                               agg="seq-mean-token-mean"), d["logp"], m)
    np.testing.assert_allclose(g_seq, g_tok, atol=1e-6)


# --------------------------------------------------------------------------- objectives


def test_ppo_clip_values_metrics_and_gradient_with_clip_higher():
    d = make_batch(11, lengths=(6, 6, 0, 2, 6, 6, 4, 6), token_adv=True)
    # 1.2 < r < 1.28 with A > 0, r > 1.28 with A > 0, r < 0.8 with A < 0
    d = plant(d, {(0, 1): (0.21, 0.9), (5, 2): (0.23, 1.3), (1, 0): (0.45, 0.7), (6, 3): (-0.45, -1.1)})
    m, a = d["mask"], d["adv"]
    lr = np_log_ratio(f64(d["logp"]), f64(d["old"]), m, "token")
    loss, metrics = ppo_clip(jnp.asarray(f32(lr)), jnp.asarray(a), eps_low=EPS_LOW, eps_high=EPS_HIGH)
    np.testing.assert_allclose(np.asarray(loss), np_ppo(lr, f64(a), EPS_LOW, EPS_HIGH), rtol=1e-5, atol=1e-6)
    r = np.exp(lr)
    np.testing.assert_array_equal(np.asarray(metrics["clip_frac_low"]), (a < 0) & (r < 1 - EPS_LOW))
    np.testing.assert_array_equal(np.asarray(metrics["clip_frac_high"]), (a > 0) & (r > 1 + EPS_HIGH))
    assert "clip_frac_dual" not in metrics
    # asymmetric: A > 0 tokens with 1.2 < r < 1.28 are not clipped (they would be with eps_high = 0.2)
    between = (m > 0) & (a > 0) & (r > 1 + EPS_LOW) & (r < 1 + EPS_HIGH)
    assert between.any()
    sym, _ = ppo_clip(jnp.asarray(f32(lr)), jnp.asarray(a), eps_low=EPS_LOW, eps_high=EPS_LOW)
    assert np.all(np.asarray(loss)[between] < np.asarray(sym)[between])
    assert np.any(np.asarray(metrics["clip_frac_low"])[m > 0]) and np.any(np.asarray(metrics["clip_frac_high"])[m > 0])
    # gradient through the policy term (token-mean), exactly zero on clipped tokens
    norm = norm_of(m)
    term = policy_term("ppo_clip", "token", "token-mean", EPS_LOW, EPS_HIGH)
    fn = lambda x: term(inputs_of({**d, "logp": x}), norm, CONTROLS)[0]
    ref = lambda x: np_policy_loss(x, f64(d["old"]), f64(a), m)
    assert float(fn(jnp.asarray(d["logp"]))) == pytest.approx(ref(f64(d["logp"])), rel=1e-5)
    g = assert_grad(fn, ref, d["logp"], m)
    clipped = (m > 0) & (((a < 0) & (r < 1 - EPS_LOW)) | ((a > 0) & (r > 1 + EPS_HIGH)))
    assert np.all(g[clipped] == 0)


def test_ppo_dual_clip_only_caps_negative_advantages():
    d = make_batch(12, lengths=(6, 6, 0, 2, 6, 6, 4, 6), token_adv=True)
    d = plant(d, {(0, 1): (0.5, -0.9), (5, 2): (0.45, -1.3), (1, 0): (0.5, 0.7), (6, 3): (0.3, -1.1)})
    m, a = d["mask"], d["adv"]
    lr = np_log_ratio(f64(d["logp"]), f64(d["old"]), m, "token")
    r = np.exp(lr)
    plain, _ = ppo_clip(jnp.asarray(f32(lr)), jnp.asarray(a), eps_low=EPS_LOW, eps_high=EPS_HIGH)
    dual, metrics = ppo_clip(jnp.asarray(f32(lr)), jnp.asarray(a), eps_low=EPS_LOW, eps_high=EPS_HIGH,
                             dual_clip_c=DUAL_C)
    plain, dual = np.asarray(plain), np.asarray(dual)
    np.testing.assert_allclose(dual, np_ppo(lr, f64(a), EPS_LOW, EPS_HIGH, DUAL_C), rtol=1e-5, atol=1e-6)
    pos = a > 0
    np.testing.assert_array_equal(dual[pos], plain[pos])
    neg = a < 0
    np.testing.assert_allclose(dual[neg], np.minimum(plain[neg], -DUAL_C * a[neg]), rtol=1e-6)
    flagged = np.asarray(metrics["clip_frac_dual"]) > 0
    np.testing.assert_array_equal(flagged, neg & (r > DUAL_C))
    assert (flagged & (m > 0)).sum() >= 2
    assert np.all(dual[flagged] == pytest.approx(-DUAL_C * a[flagged]))
    # gradient: zero on the capped tokens, finite differences elsewhere
    norm = norm_of(m)
    term = policy_term("ppo_clip", "token", "token-mean", EPS_LOW, EPS_HIGH, dual_clip_c=DUAL_C)
    g = assert_grad(lambda x: term(inputs_of({**d, "logp": x}), norm, CONTROLS)[0],
                    lambda x: np_policy_loss(x, f64(d["old"]), f64(a), m, dual_c=DUAL_C), d["logp"], m)
    assert np.all(g[flagged] == 0)


def test_reinforce_value_and_gradient():
    d = make_batch(13, token_adv=True)
    m, a = d["mask"], d["adv"]
    lr = np_log_ratio(f64(d["logp"]), f64(d["old"]), m, "token")
    loss, metrics = reinforce(jnp.asarray(f32(lr)), jnp.asarray(a))
    np.testing.assert_allclose(np.asarray(loss), -np.exp(lr) * f64(a), rtol=1e-5, atol=1e-6)
    assert metrics == {}
    norm = norm_of(m)
    term = policy_term("reinforce", "token", "seq-mean-token-sum")
    assert_grad(lambda x: term(inputs_of({**d, "logp": x}), norm, CONTROLS)[0],
                lambda x: np_policy_loss(x, f64(d["old"]), f64(a), m, objective="reinforce",
                                         agg="seq-mean-token-sum"), d["logp"], m)


@pytest.mark.parametrize("log_ratio", [19.0, 21.0, 60.0])
def test_far_off_policy_tokens_keep_their_gradient(log_ratio):
    """Beyond the e^20 cap the value is capped but a token is still pushed back (not a zero gradient)."""
    old = jnp.float32(-30.0)
    grad_of = lambda loss: float(jgrad(loss)(old + log_ratio))
    capped = math.exp(min(log_ratio, 20.0))
    negative = jnp.float32(-1.0)  # A < 0, r large: PPO's unclipped branch -r A is active
    ppo = grad_of(lambda lp: ppo_clip(token_log_ratio(lp, old, jnp.float32(1.0)), negative)[0])
    assert ppo == pytest.approx(capped, rel=1e-5)
    assert grad_of(lambda lp: reinforce(lp - old, negative)[0]) == pytest.approx(capped, rel=1e-5)
    # k3 to a reference far above: d k3 / d logp = 1 - exp(ref - logp), capped at e^20
    k3_grad = float(jgrad(lambda lp: kl_k3(lp, old))(old - log_ratio))
    assert k3_grad == pytest.approx(1.0 - capped, rel=1e-5)
    assert np.isfinite(float(kl_k3(old - log_ratio, old)))


def test_cispo_value_and_gradient_never_drop_a_token():
    d = make_batch(14, lengths=(6, 6, 0, 2, 6, 6), token_adv=True)
    m, a, lp = d["mask"], d["adv"], d["logp"]
    lr = np_log_ratio(f64(lp), f64(d["old"]), m, "token")
    w = np.clip(np.exp(lr), 1 - EPS_LOW, 1 + EPS_HIGH)
    fn = lambda x: cispo(jnp.asarray(f32(lr)), jnp.asarray(a), x, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    loss, metrics = fn(jnp.asarray(lp))
    np.testing.assert_allclose(np.asarray(loss), -w * f64(a), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(metrics["clip_frac_low"]), np.exp(lr) < 1 - EPS_LOW)
    np.testing.assert_array_equal(np.asarray(metrics["clip_frac_high"]), np.exp(lr) > 1 + EPS_HIGH)
    # per-token gradient wrt logp is -w A, also where the ratio is clipped
    g = np.asarray(jgrad(lambda x: jnp.sum(fn(x)[0] * m))(jnp.asarray(lp)))
    np.testing.assert_allclose(g, -w * f64(a) * m, rtol=1e-5, atol=1e-6)
    # through the policy term: -w A m / num_tokens; ppo_clip drops the clipped tokens, cispo does not
    norm = norm_of(m)
    g_cispo = np.asarray(jgrad(lambda x: policy_term("cispo", "token", "token-mean", EPS_LOW, EPS_HIGH)(
        inputs_of({**d, "logp": x}), norm, CONTROLS)[0])(jnp.asarray(lp)))
    np.testing.assert_allclose(g_cispo, -w * f64(a) * m / m.sum(), rtol=1e-5, atol=1e-7)
    assert np.all(g_cispo[m == 0] == 0)
    g_ppo = np.asarray(jgrad(lambda x: policy_term("ppo_clip", "token", "token-mean", EPS_LOW, EPS_HIGH)(
        inputs_of({**d, "logp": x}), norm, CONTROLS)[0])(jnp.asarray(lp)))
    r = np.exp(lr)
    clipped = (m > 0) & (((a < 0) & (r < 1 - EPS_LOW)) | ((a > 0) & (r > 1 + EPS_HIGH)))
    assert clipped.sum() >= 2
    assert np.all(g_ppo[clipped] == 0) and np.all(np.abs(g_cispo[clipped]) > 1e-4)


def test_gmpo_value_gradient_and_length_one():
    d = make_batch(15)  # constant per-sequence advantages
    m, a = d["mask"], d["adv"]
    lr = np_log_ratio(f64(d["logp"]), f64(d["old"]), m, "token")
    loss, metrics = gmpo(jnp.asarray(f32(lr)), jnp.asarray(a), mask=jnp.asarray(m), eps_low=GMPO_EPS,
                         eps_high=GMPO_EPS)
    ref = np_gmpo(lr, f64(a), m, GMPO_EPS, GMPO_EPS)
    np.testing.assert_allclose(np.asarray(loss)[m > 0], ref[m > 0], rtol=1e-5, atol=1e-6)
    sign = np.sign(a)
    np.testing.assert_array_equal(np.asarray(metrics["clip_frac_high"])[m > 0], ((sign > 0) & (lr > GMPO_EPS))[m > 0])
    np.testing.assert_array_equal(np.asarray(metrics["clip_frac_low"])[m > 0], ((sign < 0) & (lr < -GMPO_EPS))[m > 0])
    assert np.any(np.asarray(metrics["clip_frac_high"])[m > 0] + np.asarray(metrics["clip_frac_low"])[m > 0])
    norm = norm_of(m)
    term = policy_term("gmpo", "token", "seq-mean-token-mean", GMPO_EPS, GMPO_EPS)
    fn = lambda x: term(inputs_of({**d, "logp": x}), norm, CONTROLS)[0]
    np_fn = lambda x: np_policy_loss(x, f64(d["old"]), f64(a), m, objective="gmpo", agg="seq-mean-token-mean",
                                     eps_low=GMPO_EPS, eps_high=GMPO_EPS)
    assert float(fn(jnp.asarray(d["logp"]))) == pytest.approx(np_fn(f64(d["logp"])), rel=1e-5)
    assert_grad(fn, np_fn, d["logp"], m)
    # length-1 sequences with |log ratio| < eps: -A r
    m1 = ragged_mask((1, 1, 1, 0, 1), N)
    lr1 = f32(np.where(m1 > 0, np.array([0.1, -0.3, 0.35, 0.0, -0.05])[:, None], 0.0))
    a1 = f32(np.repeat(np.array([1.5, -0.7, -2.0, 0.3, 0.9])[:, None], N, axis=1))
    loss1, _ = gmpo(jnp.asarray(lr1), jnp.asarray(a1), mask=jnp.asarray(m1), eps_low=GMPO_EPS, eps_high=GMPO_EPS)
    np.testing.assert_allclose(np.asarray(loss1)[m1 > 0], (-f64(a1) * np.exp(f64(lr1)))[m1 > 0], rtol=1e-6)


def test_policy_term_metrics_and_custom_objective():
    d = make_batch(16, token_adv=True)
    m, a = d["mask"], d["adv"]
    norm = norm_of(m)

    def my_objective(log_ratio, advantages, logp, mask, eps_low, eps_high, dual_clip_c):
        return -jnp.tanh(jnp.exp(log_ratio) * advantages), {"my_flag": (advantages > 0).astype(jnp.float32)}

    term = policy_term(my_objective, aggregation="token-mean")
    value, metrics = term(inputs_of(d, entropy=jnp.asarray(d["entropy"])), norm, CONTROLS)

    def ref(x):
        r = np.exp(np_log_ratio(x, f64(d["old"]), m, "token"))
        return np_aggregate(-np.tanh(r * f64(a)), m, "token-mean")

    assert float(value) == pytest.approx(ref(f64(d["logp"])), rel=1e-5)
    assert_grad(lambda x: term(inputs_of({**d, "logp": x}), norm, CONTROLS)[0], ref, d["logp"], m)
    r = np.exp(np_log_ratio(f64(d["logp"]), f64(d["old"]), m, "token"))
    valid = m > 0
    assert float(metrics["my_flag"]) == pytest.approx(((a > 0) & valid).sum() / valid.sum(), rel=1e-6)
    assert float(metrics["ratio_mean"]) == pytest.approx(r[valid].mean(), rel=1e-5)
    assert float(metrics["ratio_max"]) == pytest.approx(r[valid].max(), rel=1e-5)
    assert float(metrics["ratio_min"]) == pytest.approx(r[valid].min(), rel=1e-5)
    kl_old = np_k3(f64(d["old"]), f64(d["logp"]))  # KL(old || current) sampled from old
    assert float(metrics["approx_kl_old"]) == pytest.approx(kl_old[valid].mean(), rel=1e-4)
    assert float(metrics["entropy"]) == pytest.approx(f64(d["entropy"])[valid].mean(), rel=1e-5)
    assert float(metrics["policy_loss"]) == float(value)
    assert float(metrics["masked_frac"]) == 0.0
    # token weights multiply the per-token loss, and masked_frac counts the valid zero-weight tokens
    weights = f32(np.random.default_rng(17).choice([0.0, 0.5, 1.0], size=(B, N)))
    value_w, metrics_w = term(inputs_of(d, token_weights=jnp.asarray(weights)), norm, CONTROLS)
    assert float(value_w) == pytest.approx(
        np_aggregate(-np.tanh(r * f64(a)) * weights, m, "token-mean"), rel=1e-5)
    assert float(metrics_w["masked_frac"]) == pytest.approx(((weights == 0) & valid).sum() / valid.sum(), rel=1e-6)
    assert set(registry.names("objective")) >= {"ppo_clip", "reinforce", "cispo", "gmpo"}
    assert set(registry.names("ratio")) >= {"token", "sequence", "sequence_token"}
    with pytest.raises(ValueError, match="ppo_clip"):
        policy_term("ppo")
    with pytest.raises(ValueError, match="sequence_token"):
        policy_term("ppo_clip", ratio="seq")


def test_policy_metrics_describe_only_tokens_of_nonzero_weight_with_whole_batch_counts():
    """Clip, ratio and KL metrics are over the valid tokens the loss counts (weight != 0), normalised by the
    whole batch's count of them, so micro-batches add up to the whole; masked_frac and entropy stay over all
    valid tokens. A token of weight 0 that is clipped (or far off-policy) must not show in them."""
    d = make_batch(19, token_adv=True)
    m, a = d["mask"], d["adv"]
    lr = np.where(m > 0, np.log(f64([[1.6, 1.6, 1.0, 1.0, 0.5, 0.5]] * B)), 0.0)  # ratios 1.6 / 1 / 0.5
    d = {**d, "logp": f32(f64(d["old"]) + lr)}
    weights = f32(np.tile([0.0, 0.0, 1.0, 0.5, 1.0, 2.0], (B, 1)))  # the ratio-1.6 tokens are not in the loss
    counted = (m > 0) & (weights != 0)
    norm = normalizers(jnp.asarray(m), token_weights=jnp.asarray(weights))
    assert float(norm.num_counted_tokens) == counted.sum() and float(norm.num_tokens) == m.sum()
    term = policy_term("ppo_clip", eps_low=EPS_LOW, eps_high=EPS_HIGH)
    inputs = inputs_of(d, entropy=jnp.asarray(d["entropy"]), token_weights=jnp.asarray(weights))
    _, metrics = term(inputs, norm, CONTROLS)
    r = np.exp(f64(d["logp"]) - f64(d["old"]))
    assert float(metrics["ratio_mean"]) == pytest.approx(r[counted].mean(), rel=1e-5)
    assert float(metrics["ratio_max"]) == pytest.approx(r[counted].max(), rel=1e-5)
    assert float(metrics["ratio_min"]) == pytest.approx(r[counted].min(), rel=1e-5)
    assert float(metrics["clip_frac_high"]) == 0.0  # every r > 1 + eps_high token has weight 0
    assert float(metrics["clip_frac_low"]) == pytest.approx(((a < 0) & (r < 1 - EPS_LOW))[counted].mean(), rel=1e-6)
    kl_old = np_k3(f64(d["old"]), f64(d["logp"]))
    assert float(metrics["approx_kl_old"]) == pytest.approx(kl_old[counted].mean(), rel=1e-4)
    assert float(metrics["masked_frac"]) == pytest.approx(((weights == 0) & (m > 0)).sum() / m.sum(), rel=1e-6)
    assert float(metrics["entropy"]) == pytest.approx(f64(d["entropy"])[m > 0].mean(), rel=1e-5)
    # two micro-batches with the whole batch's counts add up to the whole batch's metrics
    rows = [slice(0, 2), slice(2, B)]
    parts = [term(LossInputs(**{k: (None if v is None else v[s]) for k, v in vars(inputs).items()}), norm,
                  CONTROLS)[1] for s in rows]
    for name, value in reduce_metrics(*parts).items():
        assert float(value) == pytest.approx(float(metrics[name]), rel=1e-5, abs=1e-7), name
    # counts taken without the weights: the metrics describe all valid tokens, as before
    _, unweighted = term(inputs, norm_of(m), CONTROLS)
    assert float(unweighted["ratio_mean"]) == pytest.approx(r[m > 0].mean(), rel=1e-5)


def test_terms_run_under_jit():
    d = make_batch(18, token_adv=True)
    m = d["mask"]
    norm = norm_of(m, 6.0)
    term = policy_term("ppo_clip", "token", "seq-mean-token-sum-norm", EPS_LOW, EPS_HIGH)
    inputs = inputs_of(d, entropy=jnp.asarray(d["entropy"]), ref_logp=jnp.asarray(d["ref"]))
    eager, eager_metrics = term(inputs, norm, CONTROLS)
    jitted, jit_metrics = jax.jit(term)(inputs, norm, CONTROLS)
    assert float(jitted) == pytest.approx(float(eager), rel=1e-6)
    assert set(jit_metrics) == set(eager_metrics)
    for name in eager_metrics:
        assert float(jit_metrics[name]) == pytest.approx(float(eager_metrics[name]), rel=1e-5, abs=1e-7), name
    loss = combine(term, kl_term(0.1, "k3", "ref", "seq-mean-token-sum-norm"),
                   entropy_term(None, "seq-mean-token-sum-norm"))

    def total(logp, entropy):
        return loss(inputs.replace(logp=logp, entropy=entropy), norm, CONTROLS)[0]

    def np_total(logp, entropy):
        agg = "seq-mean-token-sum-norm"
        return (np_policy_loss(logp, f64(d["old"]), f64(d["adv"]), m, agg=agg, norm_length=6.0)
                + 0.1 * np_aggregate(np_k3(logp, f64(d["ref"])), m, agg, norm_length=6.0)
                - 0.03 * np_aggregate(entropy, m, agg, norm_length=6.0))

    assert float(jax.jit(total)(inputs.logp, inputs.entropy)) == pytest.approx(
        np_total(f64(d["logp"]), f64(d["entropy"])), rel=1e-5)
    g_logp, g_entropy = jax.jit(jax.grad(total, argnums=(0, 1)))(inputs.logp, inputs.entropy)
    for g, ref in ((g_logp, fd_grad(lambda x: np_total(x, f64(d["entropy"])), f64(d["logp"]))),
                   (g_entropy, fd_grad(lambda x: np_total(f64(d["logp"]), x), f64(d["entropy"])))):
        np.testing.assert_allclose(np.asarray(g), ref, atol=GRAD_ATOL, rtol=1e-3)
        assert np.all(np.asarray(g)[m == 0] == 0)


# --------------------------------------------------------------------------- truncated importance sampling


def np_truncated_is(old, sampler, m, level, mode, cap):
    w, capped = np.zeros_like(old), np.zeros_like(old)
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if m[i, t] > 0]
        seq_rho = float(np.prod([math.exp(old[i, t] - sampler[i, t]) for t in valid]))
        for t in valid:
            rho = math.exp(old[i, t] - sampler[i, t]) if level == "token" else seq_rho
            if rho > cap:
                capped[i, t] = 1.0
                w[i, t] = 0.0 if mode == "mask" else cap
            else:
                w[i, t] = rho
    return w, capped


def test_truncated_is_weights_against_numpy():
    rng = np.random.default_rng(19)
    m = ragged_mask(LENGTHS, N)
    old = f32(rng.normal(-1.0, 0.5, (B, N)))
    sampler = f32(old - rng.uniform(-0.8, 1.2, (B, N)))  # token ratios in (0.45, 3.3), some above the cap
    sampler = np.where(m > 0, sampler, f32(old - 5.0))  # padding would be capped if it were counted
    cap = 1.5
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            w, keep, metrics = rollout_correction(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(m), level=level,
                                                  mode=mode, cap=cap)
            ref_w, ref_capped = np_truncated_is(f64(old), f64(sampler), m, level, mode, cap)
            np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5, atol=1e-7)
            name = "is_masked_frac" if mode == "mask" else "is_truncated_frac"
            assert float(metrics[name]) == pytest.approx(ref_capped[m > 0].mean(), rel=1e-6)
            np.testing.assert_array_equal(np.asarray(keep), m * (1 - ref_capped) if mode == "mask" else m)
            assert 0 < ref_capped.sum() < m.sum(), (level, mode)
            g = jgrad(lambda o, s: jnp.sum(rollout_correction(o, s, jnp.asarray(m), level=level, mode=mode,
                                                              cap=cap)[0]), argnums=(0, 1))(
                jnp.asarray(old), jnp.asarray(sampler))
            assert all(np.all(np.asarray(x) == 0) for x in g)
    with pytest.raises(ValueError, match="token, sequence"):
        rollout_correction(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(m), level="batch")
    with pytest.raises(ValueError, match="truncate, mask"):
        rollout_correction(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(m), level="token", mode="drop")


# --------------------------------------------------------------------------- masks


def test_truncation_mask():
    m = ragged_mask(LENGTHS, N)
    truncated = np.array([True, False, True, False, True])
    out = np.asarray(truncation_mask(jnp.asarray(m), jnp.asarray(truncated)))
    expected = m.copy()
    for i, t in enumerate(truncated):
        if t:
            expected[i] = 0
    np.testing.assert_array_equal(out, expected)
    assert out.dtype == np.float32


def np_top_entropy(entropy, m, fraction):
    valid = [(entropy[i, t], i, t) for i in range(m.shape[0]) for t in range(m.shape[1]) if m[i, t] > 0]
    k = max(math.ceil(Fraction(str(fraction)) * len(valid)), 1)
    out = np.zeros_like(m)
    for _, i, t in sorted(valid, reverse=True)[:k]:
        out[i, t] = 1.0
    return out, k


@pytest.mark.parametrize("fraction", [0.2, 0.25, 0.5, 0.01, 1.0])
def test_top_entropy_mask_keeps_the_highest_entropy_valid_tokens(fraction):
    rng = np.random.default_rng(20)
    m = ragged_mask((6, 3, 0, 1, 5, 4, 6, 2), N)  # 27 valid tokens
    entropy = f32(rng.uniform(0.0, 1.0, m.shape))
    entropy = np.where(m > 0, entropy, f32(10.0))  # masked tokens have the highest entropy: never kept
    out = np.asarray(top_entropy_mask(jnp.asarray(entropy), jnp.asarray(m), fraction))
    ref, k = np_top_entropy(f64(entropy), m, fraction)
    np.testing.assert_array_equal(out, ref)
    assert out.sum() == k and np.all(out[m == 0] == 0)
    jitted = jax.jit(top_entropy_mask, static_argnums=2)(jnp.asarray(entropy), jnp.asarray(m), fraction)
    np.testing.assert_array_equal(np.asarray(jitted), ref)


def test_top_entropy_mask_count_is_exact_for_fraction_0_3():
    m = ragged_mask((10, 10, 0, 10, 10, 5, 5, 0), 10)  # 50 valid tokens
    entropy = f32(np.random.default_rng(21).uniform(size=m.shape))
    out = np.asarray(top_entropy_mask(jnp.asarray(entropy), jnp.asarray(m), 0.3))
    assert out.sum() == 15  # ceil(0.3 * 50)


def test_logp_advantage_covariance_against_numpy():
    d = make_batch(22, token_adv=True)
    m = d["mask"]
    cov = np.asarray(logp_advantage_covariance(jnp.asarray(d["logp"]), jnp.asarray(d["adv"]), jnp.asarray(m)))
    ref = np_covariance(f64(d["logp"]), f64(d["adv"]), m)
    np.testing.assert_allclose(cov, ref, rtol=1e-5, atol=1e-6)
    assert np.all(cov[m == 0] == 0)
    g = jgrad(lambda x: jnp.sum(logp_advantage_covariance(x, jnp.asarray(d["adv"]), jnp.asarray(m))))(
        jnp.asarray(d["logp"]))
    assert np.all(np.asarray(g) == 0)


def cov_batch(seed):
    rng = np.random.default_rng(seed)
    m = ragged_mask((10, 7, 0, 10, 3, 10, 10, 8), 10)  # 58 valid tokens
    logp = f32(rng.normal(-1.5, 1.5, m.shape))
    adv = f32(np.repeat(rng.choice([-1.5, 1.5], size=(m.shape[0], 1)), 10, axis=1) + rng.normal(0, 0.3, m.shape))
    return logp, adv, m


def test_clip_cov_mask_detaches_exactly_k_candidates():
    logp, adv, m = cov_batch(23)
    cov = np_covariance(f64(logp), f64(adv), m)
    low, high = 0.5, 3.0
    candidate = (m > 0) & (cov > low) & (cov < high)
    assert candidate.sum() >= 10
    selections = set()
    for ratio, k in ((0.1, 5), (1e-4, 1), (0.05, 2)):  # k = max(floor(ratio * 58), 1)
        for seed in range(4):
            w = np.asarray(clip_cov_mask(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(m),
                                         jax.random.key(seed), ratio, low, high))
            detached = w == 0
            assert set(np.unique(w)) <= {0.0, 1.0}
            assert detached.sum() == k
            assert np.all(candidate[detached])
            if ratio == 0.1:
                selections.add(tuple(np.flatnonzero(detached)))
    assert len(selections) > 1  # different keys pick different tokens
    # fewer candidates than k: every candidate goes
    w = np.asarray(clip_cov_mask(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(m), jax.random.key(0), 1.0,
                                 low, high))
    np.testing.assert_array_equal(w == 0, candidate)
    # no candidate in the range: nothing detached
    w = np.asarray(clip_cov_mask(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(m), jax.random.key(0), 0.1,
                                 100.0, 200.0))
    assert np.all(w == 1.0)


def test_kl_cov_mask_selects_top_k_covariance():
    logp, adv, m = cov_batch(24)
    cov = np_covariance(f64(logp), f64(adv), m)
    valid = np.flatnonzero(m.reshape(-1) > 0)
    for ratio in (0.1, 0.3, 1e-4):
        k = max(math.floor(Fraction(str(ratio)) * len(valid)), 1)
        top = valid[np.argsort(-cov.reshape(-1)[valid], kind="stable")[:k]]
        expected = np.zeros(m.size)
        expected[top] = 1.0
        out = np.asarray(kl_cov_mask(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(m), ratio))
        np.testing.assert_array_equal(out.reshape(-1), expected)
    # all valid covariances negative: a padding token (covariance 0) is still never selected
    lp2, a2, m2 = f32([[0.0, 1.0, 5.0]]), f32([[1.0, 0.0, 9.0]]), f32([[1, 1, 0]])
    out = np.asarray(kl_cov_mask(jnp.asarray(lp2), jnp.asarray(a2), jnp.asarray(m2), 0.5))
    assert out[0, 2] == 0 and out.sum() == 1


# --------------------------------------------------------------------------- regularizers


def test_sampled_kl_estimators_against_numpy():
    d = make_batch(25)
    m, lp, ref = d["mask"], d["logp"], d["ref"]
    refs = {"k1": np_k1, "k2": np_k2, "k3": np_k3}
    fns = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
    for name, np_fn in refs.items():
        value = np.asarray(fns[name](jnp.asarray(lp), jnp.asarray(ref)))
        np.testing.assert_allclose(value, np_fn(f64(lp), f64(ref)), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(kl_estimate(jnp.asarray(lp), jnp.asarray(ref), name)), value)
        assert_grad(lambda x: jnp.sum(fns[name](x, jnp.asarray(ref)) * m),
                    lambda x: float((np_fn(x, f64(ref)) * m).sum()), lp, m)
    k3 = np.asarray(kl_k3(jnp.asarray(lp), jnp.asarray(ref)))
    assert np.all(k3 >= 0)
    assert np.all(np.asarray(kl_k3(jnp.asarray(lp), jnp.asarray(lp))) == 0)
    for big in (200.0, -200.0):
        v = kl_k3(jnp.float32(0.0), jnp.float32(big))
        assert np.isfinite(float(v)) and float(v) > 0
        assert np.isfinite(float(jgrad(lambda x: kl_k3(x, jnp.float32(big)))(jnp.float32(0.0))))
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "full", "abs"}
    with pytest.raises(ValueError, match="k1, k2, k3") as err:
        kl_estimate(jnp.asarray(lp), jnp.asarray(ref), "k4")
    assert "kl_full" in str(err.value)
    with pytest.raises(ValueError, match="kl_full"):
        kl_estimate(jnp.asarray(lp), jnp.asarray(ref), "full")


def test_k3_is_accurate_and_nonnegative_for_tiny_log_ratios():
    """Near the target (|log ratio| ~ 1e-4: a policy close to its reference or old self) k3 ~ x^2 / 2 must not
    drown in the rounding of `exp(x)` in float32."""
    rng = np.random.default_rng(31)
    lp = f32(rng.normal(-2.0, 1.0, 4096))
    ref = f32(lp + rng.choice([-1.0, 1.0], 4096) * rng.uniform(5e-5, 5e-4, 4096))
    x = f64(ref) - f64(lp)
    k3 = np.asarray(kl_k3(jnp.asarray(lp), jnp.asarray(ref)), np.float64)
    assert np.all(k3 >= 0)
    np.testing.assert_allclose(k3, np.expm1(x) - x, rtol=2e-2)


def test_kl_full_against_numpy():
    rng = np.random.default_rng(26)
    logits_p, logits_q = rng.normal(size=(3, 4, 7)), rng.normal(size=(3, 4, 7)) * 2
    lp = f32(logits_p - np.log(np.exp(logits_p).sum(-1, keepdims=True)))
    lq = f32(logits_q - np.log(np.exp(logits_q).sum(-1, keepdims=True)))
    out = np.asarray(kl_full(jnp.asarray(lp), jnp.asarray(lq)))
    ref = np.zeros((3, 4))
    for idx in np.ndindex(3, 4):
        p, q = np.exp(f64(lp)[idx]), np.exp(f64(lq)[idx])
        ref[idx] = sum(p[v] * math.log(p[v] / q[v]) for v in range(7))
    assert out.shape == (3, 4)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-6)
    assert np.all(out > 0)
    np.testing.assert_allclose(np.asarray(kl_full(jnp.asarray(lp), jnp.asarray(lp))), 0.0, atol=1e-7)


def value_batch(seed, clip_eps=0.2):
    rng = np.random.default_rng(seed)
    m = ragged_mask(LENGTHS, N)
    old_v = rng.normal(0, 1, (B, N))
    for _ in range(100):
        v = old_v + rng.uniform(-0.5, 0.5, (B, N))
        ret = old_v + rng.normal(0, 0.5, (B, N))
        v, old_v, ret = f64(v), f64(old_v), f64(ret)
        vc = old_v + np.clip(v - old_v, -clip_eps, clip_eps)
        inside = np.abs(v - old_v) < clip_eps  # then both branches coincide: no kink
        away = (np.abs(np.abs(v - old_v) - clip_eps) > 3e-3) & (
            inside | (np.abs((v - ret) ** 2 - (vc - ret) ** 2) > 3e-3))
        if away.all():
            return f32(v), f32(old_v), f32(ret), m
    raise AssertionError("no value batch away from the kinks")


def test_value_loss_clipped_and_unclipped():
    v, old_v, ret, m = value_batch(27)
    for clip_eps in (0.2, None):
        loss, metrics = value_loss(jnp.asarray(v), jnp.asarray(old_v), jnp.asarray(ret), clip_eps)
        ref = np_value_loss(f64(v), f64(old_v), f64(ret), clip_eps)
        np.testing.assert_allclose(np.asarray(loss), ref, rtol=1e-5, atol=1e-6)
        if clip_eps is None:
            assert np.all(np.asarray(metrics["value_clip_frac"]) == 0)
        else:
            vc = f64(old_v) + np.clip(f64(v) - f64(old_v), -clip_eps, clip_eps)
            expected = (vc - f64(ret)) ** 2 > (f64(v) - f64(ret)) ** 2
            active = np.abs(f64(v) - f64(old_v)) > clip_eps  # elsewhere both branches are equal (see below)
            np.testing.assert_array_equal((np.asarray(metrics["value_clip_frac"]) > 0)[active], expected[active])
            assert 0 < expected[active].sum() < active.sum()
        assert_grad(lambda x: jnp.sum(value_loss(x, jnp.asarray(old_v), jnp.asarray(ret), clip_eps)[0] * m),
                    lambda x: float((np_value_loss(x, f64(old_v), f64(ret), clip_eps) * m).sum()), v, m)
    g = jgrad(lambda o, r: jnp.sum(value_loss(jnp.asarray(v), o, r)[0]), argnums=(0, 1))(
        jnp.asarray(old_v), jnp.asarray(ret))
    assert all(np.all(np.asarray(x) == 0) for x in g)


def test_value_clip_frac_is_zero_when_no_value_moves_beyond_the_clip():
    rng = np.random.default_rng(0)
    old_v = f32(rng.normal(0, 1, 10000))
    v = f32(old_v + rng.uniform(-0.1, 0.1, 10000))  # |v - v_old| <= 0.1 < clip_eps = 0.2
    ret = f32(old_v + rng.normal(0, 0.5, 10000))
    _, metrics = value_loss(jnp.asarray(v), jnp.asarray(old_v), jnp.asarray(ret), 0.2)
    assert float(metrics["value_clip_frac"].sum()) == 0.0


def test_adapt_entropy_coef():
    up = float(adapt_entropy_coef(jnp.float32(0.05), jnp.float32(0.2), target=0.5, step=0.01, max_coef=0.1))
    down = float(adapt_entropy_coef(jnp.float32(0.05), jnp.float32(0.9), target=0.5, step=0.01, max_coef=0.1))
    assert up == pytest.approx(0.06) and down == pytest.approx(0.04)
    assert float(adapt_entropy_coef(jnp.float32(0.095), jnp.float32(0.1), 0.5, 0.01, 0.1)) == pytest.approx(0.1)
    assert float(adapt_entropy_coef(jnp.float32(0.005), jnp.float32(0.9), 0.5, 0.01, 0.1)) == 0.0
    coef = jnp.float32(0.0)
    for entropy in (0.1, 0.1, 0.2, 0.1, 0.1, 0.1, 0.9, 0.1, 0.1):  # stays in [0, max] whatever the sequence
        coef = adapt_entropy_coef(coef, jnp.float32(entropy), 0.5, 0.02, 0.1)
        assert 0.0 <= float(coef) <= 0.1 + 1e-7
    assert float(coef) == pytest.approx(0.1)


def test_adapt_temperature():
    for t, h, target, rate in ((1.0, 0.5, 1.0, 0.5), (1.0, 1.5, 1.0, 0.5), (1.9, 0.0, 1.0, 0.5), (0.6, 3.0, 1.0, 1.0)):
        got = float(adapt_temperature(jnp.float32(t), jnp.float32(h), target, rate, 0.5, 2.0))
        expected = min(max(t * math.exp(rate * (target - h)), 0.5), 2.0)
        assert got == pytest.approx(expected, rel=1e-6)
    assert float(adapt_temperature(jnp.float32(1.0), jnp.float32(0.5), 1.0, 0.5)) > 1.0  # below target: hotter
    assert float(adapt_temperature(jnp.float32(1.0), jnp.float32(1.5), 1.0, 0.5)) < 1.0
    assert float(adapt_temperature(jnp.float32(1.9), jnp.float32(0.0), 1.0, 0.5)) == 2.0


# --------------------------------------------------------------------------- terms and composition


def test_what_each_kl_estimate_pulls_toward_as_a_loss():
    """Expected over the policy's own samples, k2's gradient is that of KL(pi || ref), k3's that of KL(ref ||
    pi), and k1's is zero, which is why k1 is refused as a loss term."""
    theta, ref = jnp.asarray([0.3, -1.0, 0.5, 1.2, 0.0]), jax.nn.log_softmax(jnp.asarray([0.0, 0.4, -0.2, 0.1, 0.7]))

    def expected_gradient(estimate):
        def loss(t):
            logp = jax.nn.log_softmax(t)
            return jnp.sum(jax.lax.stop_gradient(jnp.exp(logp)) * estimate(logp, ref))  # samples ~ pi, held fixed
        return jax.grad(loss)(theta)

    reverse = jax.grad(lambda t: jnp.sum(jax.nn.softmax(t) * (jax.nn.log_softmax(t) - ref)))(theta)
    forward = jax.grad(lambda t: jnp.sum(jnp.exp(ref) * (ref - jax.nn.log_softmax(t))))(theta)
    np.testing.assert_allclose(expected_gradient(kl_k2), reverse, atol=1e-6)
    np.testing.assert_allclose(expected_gradient(kl_k3), forward, atol=1e-6)
    np.testing.assert_allclose(expected_gradient(kl_k1), 0.0, atol=1e-6)
    with pytest.raises(ValueError, match="k1 KL estimate as a loss term"):
        kl_term(0.1, "k1")
    with pytest.raises(ValueError, match="k1 KL estimate as a loss term"):
        LossConfig(kl_coef=0.1, kl_estimator="k1").validate()
    LossConfig(kl_coef=0.1, kl_estimator="k1", kl_in_reward=True).validate()  # a penalty in the reward: fine
    kl_term(0.0, "k1")  # no weight, no pull: allowed


@pytest.mark.parametrize("estimator", ["k2", "k3"])
@pytest.mark.parametrize("target", ["ref", "old"])
def test_kl_term_sampled(estimator, target):
    d = make_batch(28)
    m = d["mask"]
    norm = norm_of(m)
    np_est = {"k1": np_k1, "k2": np_k2, "k3": np_k3}[estimator]
    target_logp = d["ref"] if target == "ref" else d["old"]
    term = kl_term(0.3, estimator, target, "seq-mean-token-mean")
    fn = lambda x: term(inputs_of({**d, "logp": x}, ref_logp=jnp.asarray(d["ref"])), norm, CONTROLS)
    value, metrics = fn(jnp.asarray(d["logp"]))
    ref = lambda x: 0.3 * np_aggregate(np_est(x, f64(target_logp)), m, "seq-mean-token-mean")
    assert float(value) == pytest.approx(ref(f64(d["logp"])), rel=1e-5, abs=1e-7)
    assert set(metrics) == {f"kl_{target}"}
    est = np_est(f64(d["logp"]), f64(target_logp))
    assert float(metrics[f"kl_{target}"]) == pytest.approx(est[m > 0].mean(), rel=1e-5, abs=1e-7)
    assert_grad(lambda x: fn(x)[0], ref, d["logp"], m)


def test_kl_term_full_and_missing_inputs():
    d = make_batch(29)
    m = d["mask"]
    norm = norm_of(m)
    kl = f32(np.random.default_rng(30).uniform(0, 0.5, (B, N)))
    value, metrics = kl_term(0.2, "full")(inputs_of(d, kl_full=jnp.asarray(kl)), norm, CONTROLS)
    assert float(value) == pytest.approx(0.2 * np_aggregate(f64(kl), m, "token-mean"), rel=1e-5)
    assert float(metrics["kl_ref"]) == pytest.approx(f64(kl)[m > 0].mean(), rel=1e-5)
    with pytest.raises(ValueError, match="LossInputs.kl_full"):
        kl_term(0.2, "full")(inputs_of(d), norm, CONTROLS)
    with pytest.raises(ValueError, match="LossInputs.ref_logp"):
        kl_term(0.2, "k3", "ref")(inputs_of(d), norm, CONTROLS)
    with pytest.raises(ValueError, match="LossInputs.entropy"):
        entropy_term(0.1)(inputs_of(d), norm, CONTROLS)
    with pytest.raises(ValueError, match="LossInputs.kl_cov_mask"):
        kl_cov_term(1.0)(inputs_of(d), norm, CONTROLS)
    with pytest.raises(ValueError, match="LossInputs.values"):
        value_term()(inputs_of(d), norm, CONTROLS)
    with pytest.raises(ValueError, match="LossInputs.old_values"):
        value_term()(inputs_of(d, values=jnp.asarray(d["logp"])), norm, CONTROLS)
    with pytest.raises(ValueError, match="ref, old"):
        kl_term(0.1, "k3", "reference")
    with pytest.raises(ValueError, match="LossInputs.ref_logp"):
        build_loss(LossConfig(kl_coef=0.1))(inputs_of(d), norm, CONTROLS)


def test_entropy_term_fixed_and_adaptive_coefficient():
    d = make_batch(31)
    m = d["mask"]
    norm = norm_of(m)
    for coef, expected_coef in ((0.1, 0.1), (None, 0.03)):
        term = entropy_term(coef, "seq-mean-token-mean")
        fn = lambda h: term(inputs_of(d, entropy=h), norm, CONTROLS)[0]
        ref = lambda h: -expected_coef * np_aggregate(h, m, "seq-mean-token-mean")
        assert float(fn(jnp.asarray(d["entropy"]))) == pytest.approx(ref(f64(d["entropy"])), rel=1e-5)
        assert_grad(fn, ref, d["entropy"], m)
    # the adaptive coefficient is traced: a new value under jit needs no retrace and changes the loss
    term = jax.jit(entropy_term(None))
    inputs = inputs_of(d, entropy=jnp.asarray(d["entropy"]))
    a = float(term(inputs, norm, CONTROLS)[0])
    b = float(term(inputs, norm, CONTROLS.replace(entropy_coef=jnp.float32(0.06)))[0])
    assert b == pytest.approx(2 * a, rel=1e-6)


def test_kl_cov_term_value_and_gradient():
    d = make_batch(32)
    m = d["mask"]
    norm = norm_of(m)
    sel = f32(np.random.default_rng(33).integers(0, 2, (B, N)))
    sel[0, 0] = sel[4, 2] = 1.0
    term = kl_cov_term(0.7, "token-mean")
    fn = lambda x: term(inputs_of({**d, "logp": x}, kl_cov_mask=jnp.asarray(sel)), norm, CONTROLS)[0]
    ref = lambda x: np_aggregate(0.7 * np.abs(x - f64(d["old"])) * sel, m, "token-mean")
    assert float(fn(jnp.asarray(d["logp"]))) == pytest.approx(ref(f64(d["logp"])), rel=1e-5)
    g = assert_grad(fn, ref, d["logp"], m)
    assert np.all(g[sel == 0] == 0)


def test_value_term_value_and_gradient():
    v, old_v, ret, m = value_batch(34)
    d = make_batch(34)
    norm = norm_of(m)
    term = value_term(0.5, 0.2)
    fn = lambda x: term(inputs_of(d, values=x, old_values=jnp.asarray(old_v), returns=jnp.asarray(ret)), norm,
                        CONTROLS)
    ref = lambda x: 0.5 * np_aggregate(np_value_loss(x, f64(old_v), f64(ret), 0.2), m, "token-mean")
    value, metrics = fn(jnp.asarray(v))
    assert float(value) == pytest.approx(ref(f64(v)), rel=1e-5)
    assert float(metrics["value_loss"]) == pytest.approx(2 * float(value), rel=1e-6)
    assert 0 < float(metrics["value_clip_frac"]) < 1
    assert_grad(lambda x: fn(x)[0], ref, v, m)


def test_combine_sums_terms_and_rejects_metric_clashes():
    d = make_batch(35)
    m = d["mask"]
    norm = norm_of(m)
    inputs = inputs_of(d, entropy=jnp.asarray(d["entropy"]), ref_logp=jnp.asarray(d["ref"]))
    terms = [policy_term(), kl_term(0.1, "k2"), entropy_term(0.01)]
    total, metrics = combine(*terms)(inputs, norm, CONTROLS)
    parts = [t(inputs, norm, CONTROLS) for t in terms]
    assert float(total) == pytest.approx(sum(float(v) for v, _ in parts), rel=1e-6)
    assert float(metrics["loss"]) == float(total)
    assert {"policy_loss", "kl_ref", "entropy", "ratio_max"} <= set(metrics)
    with pytest.raises(ValueError, match="kl_ref"):
        combine(kl_term(0.1, "k2"), kl_term(0.1, "k3"))(inputs, norm, CONTROLS)
    # two targets report two metrics: no clash
    _, metrics = combine(kl_term(0.1, "k2", "ref"), kl_term(0.1, "k3", "old"))(inputs, norm, CONTROLS)
    assert {"kl_ref", "kl_old", "loss"} == set(metrics)


def full_objective_np(logp, entropy, values, d, sel, weights, old_v, ret, cfg):
    m, old, a, ref = d["mask"], f64(d["old"]), f64(d["adv"]), f64(d["ref"])
    agg = cfg.aggregation
    policy = np_policy_loss(logp, old, a, m, agg=agg, eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high,
                            weights=weights)
    kl = cfg.kl_coef * np_aggregate(np_k3(logp, ref), m, agg)
    ent = -cfg.entropy_coef * np_aggregate(entropy, m, agg)
    kl_cov = np_aggregate(cfg.kl_cov_coef * np.abs(logp - old) * sel, m, agg)
    value = cfg.value_coef * np_aggregate(np_value_loss(values, old_v, ret, cfg.value_clip_eps), m, "token-mean")
    return policy + kl + ent + kl_cov + value


def test_build_loss_matches_numpy_objective():
    cfg = LossConfig(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, aggregation="seq-mean-token-mean", kl_coef=0.05,
                     kl_estimator="k3", kl_target="ref", entropy_coef=0.01, kl_cov_ratio=0.2, kl_cov_coef=0.7,
                     value_coef=0.5, value_clip_eps=0.2)
    cfg.validate()
    d = make_batch(36, token_adv=True)
    m = d["mask"]
    v, old_v, ret, _ = value_batch(37)
    rng = np.random.default_rng(38)
    sel = f32(rng.integers(0, 2, (B, N)))
    weights = f32(rng.choice([0.0, 0.5, 1.0], size=(B, N), p=[0.2, 0.3, 0.5]))
    norm = norm_of(m)
    loss = build_loss(cfg, with_critic=True)
    controls = Controls.initial(cfg, temperature=1.0)
    assert float(controls.entropy_coef) == pytest.approx(0.01)

    def fn(logp, entropy, values):
        inputs = inputs_of({**d, "logp": logp}, entropy=entropy, ref_logp=jnp.asarray(d["ref"]),
                           token_weights=jnp.asarray(weights),
                           kl_cov_mask=jnp.asarray(sel), values=values, old_values=jnp.asarray(old_v),
                           returns=jnp.asarray(ret))
        return loss(inputs, norm, controls)

    args = (jnp.asarray(d["logp"]), jnp.asarray(d["entropy"]), jnp.asarray(v))
    total, metrics = fn(*args)
    np_args = [f64(d["logp"]), f64(d["entropy"]), f64(v)]
    ref = lambda lp, h, vv: full_objective_np(lp, h, vv, d, sel, weights, f64(old_v), f64(ret), cfg)
    assert float(total) == pytest.approx(ref(*np_args), rel=1e-5)
    assert float(metrics["loss"]) == float(total)
    assert {"policy_loss", "kl_ref", "value_loss", "value_clip_frac", "entropy", "clip_frac_low"} <= set(metrics)
    jitted_total, _ = jax.jit(fn)(*args)
    assert float(jitted_total) == pytest.approx(float(total), rel=1e-6)
    for i in range(3):
        def jax_i(x, i=i):
            a = list(args)
            a[i] = x
            return fn(*a)[0]

        def np_i(x, i=i):
            a = list(np_args)
            a[i] = x
            return ref(*a)

        assert_grad(jax_i, np_i, args[i], m)
    # without the critic, no value term; kl_in_reward drops the KL term
    no_critic = build_loss(cfg)(inputs_of(d, entropy=args[1], ref_logp=jnp.asarray(d["ref"]),
                                          token_weights=jnp.asarray(weights), kl_cov_mask=jnp.asarray(sel)),
                                norm, controls)
    assert "value_loss" not in no_critic[1]
    value_part = cfg.value_coef * np_aggregate(np_value_loss(f64(v), f64(old_v), f64(ret), 0.2), m, "token-mean")
    assert float(no_critic[0]) == pytest.approx(ref(*np_args) - value_part, rel=1e-5)
    in_reward = build_loss(dataclasses.replace(cfg, kl_in_reward=True, kl_estimator="k1"))(
        inputs_of(d, entropy=args[1], token_weights=jnp.asarray(weights), kl_cov_mask=jnp.asarray(sel)),
        norm, controls)
    assert "kl_ref" not in in_reward[1]


def test_build_loss_adaptive_entropy_reads_controls():
    cfg = LossConfig(entropy_target=0.5, entropy_coef=0.02)
    d = make_batch(39)
    m = d["mask"]
    norm = norm_of(m)
    loss = build_loss(cfg)
    inputs = inputs_of(d, entropy=jnp.asarray(d["entropy"]))
    base = float(policy_term("ppo_clip", "token", "token-mean", 0.2, 0.28)(inputs, norm, CONTROLS)[0])
    for coef in (0.0, 0.05):
        total = float(loss(inputs, norm, CONTROLS.replace(entropy_coef=jnp.float32(coef)))[0])
        assert total == pytest.approx(base - coef * np_aggregate(f64(d["entropy"]), m, "token-mean"), rel=1e-5)
    # Skywork-OR1: no bonus while the last measured entropy was above the target (the coefficient is kept)
    above = Controls.initial(cfg, 1.0).replace(entropy_coef=jnp.float32(0.05), entropy_below_target=jnp.float32(0))
    assert float(loss(inputs, norm, above)[0]) == pytest.approx(base, rel=1e-6)


def test_loss_is_finite_with_extreme_padding():
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01, kl_cov_ratio=0.1, aggregation="seq-mean-token-mean")
    d = make_batch(40, token_adv=True)
    m = d["mask"]
    lp = np.where(m > 0, d["logp"], f32(-1e4)).astype(np.float32)
    old = np.where(m > 0, d["old"], f32(30.0)).astype(np.float32)
    inputs = inputs_of({**d, "logp": lp, "old": old}, entropy=jnp.asarray(d["entropy"]),
                       ref_logp=jnp.asarray(np.where(m > 0, d["ref"], f32(50.0))), kl_cov_mask=jnp.ones((B, N)))
    loss = build_loss(cfg)
    total, metrics = loss(inputs, norm_of(m), CONTROLS)
    assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())
    g = np.asarray(jgrad(lambda x: loss(inputs.replace(logp=x), norm_of(m), CONTROLS)[0])(jnp.asarray(lp)))
    assert np.isfinite(g).all() and np.all(g[m == 0] == 0)
    clean = inputs_of(d, entropy=jnp.asarray(d["entropy"]), ref_logp=jnp.asarray(d["ref"]),
                      kl_cov_mask=jnp.ones((B, N)))
    assert float(total) == pytest.approx(float(loss(clean, norm_of(m), CONTROLS)[0]), rel=1e-5)


# --------------------------------------------------------------------------- LossConfig


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_from_preset_gives_the_presets_fields(name):
    cfg = LossConfig.from_preset(name)
    cfg.validate()
    assert cfg.preset == name
    default = LossConfig()
    for field in dataclasses.fields(LossConfig):
        if field.name == "preset":
            continue
        value = getattr(cfg, field.name)
        if field.name not in PRESETS[name]:
            assert value == getattr(default, field.name), field.name
        elif field.name == "advantage":
            for key, expected in PRESETS[name]["advantage"].items():
                assert getattr(value, key) == expected, key
        else:
            assert value == PRESETS[name][field.name], field.name


def test_from_preset_overrides_and_errors():
    cfg = LossConfig.from_preset("gspo", clip_eps_high=5e-4)
    assert cfg.clip_eps_high == 5e-4 and cfg.clip_eps_low == 3e-4 and cfg.ratio == "sequence"
    assert cfg.aggregation == "seq-mean-token-mean"
    assert LossConfig.from_preset("grpo", kl_coef=0.0).kl_coef == 0.0
    with pytest.raises(ConfigError) as err:
        LossConfig.from_preset("ppo2")
    assert isinstance(err.value, ValueError)
    for name in PRESETS:
        assert repr(name) in str(err.value)
    with pytest.raises(ConfigError, match="ratio must be 'token'"):
        LossConfig.from_preset("gmpo", ratio="sequence")
    with pytest.raises(ConfigError, match="clip_eps_low"):
        LossConfig.from_preset("dapo", clip_eps_low=-0.1)


@pytest.mark.parametrize("fields, message", [
    (dict(objective="gmpo", ratio="sequence"), "ratio must be 'token'"),
    (dict(objective="gmpo", ratio="sequence_token"), "ratio must be 'token'"),
    (dict(objective="cispo", dual_clip_c=3.0), "dual_clip_c"),
    (dict(kl_estimator="full", kl_coef=0.1, kl_in_reward=True), "full"),
    (dict(kl_estimator="full", kl_coef=0.1, kl_target="old"), "full"),
    (dict(advantage=adv_lib.AdvantageConfig("gtpo"), kl_coef=0.1, kl_in_reward=True), "'gtpo' splits each group"),
    (dict(clip_cov_ratio=0.1, clip_cov_low=2.0, clip_cov_high=2.0), "clip_cov_low"),
    (dict(clip_cov_ratio=0.1, clip_cov_low=3.0, clip_cov_high=1.0), "clip_cov_low"),
])
def test_validate_rejects_inconsistent_configs(fields, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**fields).validate()


def test_validate_accepts_consistent_configs():
    LossConfig(objective="gmpo", ratio="token").validate()
    LossConfig(dual_clip_c=3.0).validate()
    LossConfig(kl_estimator="full", kl_coef=0.1).validate()
    LossConfig(clip_cov_low=2.0, clip_cov_high=2.0).validate()  # Clip-Cov off: bounds unused


# --------------------------------------------------------------------------- prepare_batch


def rollout(seed, g=4, prompts=2, n=5):
    rng = np.random.default_rng(seed)
    b = g * prompts
    lengths = rng.integers(1, n + 1, b)
    lengths[1] = 0
    m = ragged_mask(lengths, n)
    old = f32(rng.normal(-1.5, 1.0, (b, n)))
    return dict(rewards=f32(rng.integers(0, 2, b) + rng.normal(0, 0.1, b)), completion_mask=m, old_logp=old,
                entropy=f32(rng.uniform(0.0, 2.0, (b, n))), ref_logp=f32(old + rng.normal(0, 0.3, (b, n))),
                sampler_logp=f32(old + rng.normal(0, 0.4, (b, n))), truncated=lengths == n,
                key=jax.random.key(seed))


def prepare(cfg, batch, g=4, **drop):
    fn = jax.jit(functools.partial(prepare_batch, cfg, group_size=g))
    kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in batch.items() if k not in drop}
    return fn(**kwargs)


def test_prepare_batch_grpo_advantages():
    batch = rollout(41)
    cfg = LossConfig.from_preset("grpo")
    fields, metrics = prepare(cfg, batch)
    m = batch["completion_mask"]
    expected = np.asarray(adv_lib.grpo(jnp.asarray(batch["rewards"]), 4))[:, None] * m
    np.testing.assert_allclose(np.asarray(fields["advantages"]), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(fields["advantages"]), np_grpo(f64(batch["rewards"]), 4)[:, None] * m,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(fields["loss_mask"]), m)
    assert set(fields) == {"advantages", "loss_mask"}
    assert float(metrics["loss_tokens"]) == m.sum()


def test_prepare_batch_mask_truncated():
    batch = rollout(42)
    assert 0 < batch["truncated"].sum() < len(batch["truncated"])
    fields, metrics = prepare(LossConfig(mask_truncated=True), batch)
    m = batch["completion_mask"]
    expected = m * (~batch["truncated"])[:, None]
    np.testing.assert_array_equal(np.asarray(fields["loss_mask"]), expected)
    assert float(metrics["truncated_masked_frac"]) == pytest.approx(1 - expected.sum() / m.sum(), rel=1e-6)
    with pytest.raises(ValueError, match="truncated"):
        prepare(LossConfig(mask_truncated=True), batch, truncated=None)


def test_prepare_batch_kl_in_reward():
    batch = rollout(43)
    cfg = LossConfig(kl_coef=0.3, kl_estimator="k3", kl_in_reward=True)
    fields, metrics = prepare(cfg, batch)
    m = batch["completion_mask"]
    penalty = 0.3 * (np_k3(f64(batch["old_logp"]), f64(batch["ref_logp"])) * m).sum(axis=1)
    penalty = penalty - np.repeat(penalty.reshape(-1, 4).mean(axis=1), 4)  # centred in its group, not scaled
    expected = (np_grpo(f64(batch["rewards"]), 4) - penalty)[:, None] * m
    np.testing.assert_allclose(np.asarray(fields["advantages"]), expected, rtol=1e-4, atol=1e-4)
    plain, _ = prepare(LossConfig(), batch)
    assert np.abs(np.asarray(plain["advantages"]) - expected).max() > 1e-2
    kl = np_k3(f64(batch["old_logp"]), f64(batch["ref_logp"]))
    assert float(metrics["kl_ref"]) == pytest.approx(kl[m > 0].mean(), rel=1e-5)
    with pytest.raises(ValueError, match="ref_logp"):
        prepare(cfg, batch, ref_logp=None)


def test_prepare_batch_token_weights_and_kl_cov_mask():
    batch = rollout(44, prompts=4, n=8)
    m = batch["completion_mask"]
    # truncated importance sampling
    cfg = LossConfig(is_level="sequence", is_mode="mask", is_cap=1.5)
    fields, metrics = prepare(cfg, batch)
    ref_w, ref_capped = np_truncated_is(f64(batch["old_logp"]), f64(batch["sampler_logp"]), m, "sequence",
                                        "mask", 1.5)
    np.testing.assert_allclose(np.asarray(fields["token_weights"]), ref_w, rtol=1e-5, atol=1e-7)
    assert 0 < ref_capped.sum() < m.sum()
    assert float(metrics["is_masked_frac"]) == pytest.approx(ref_capped[m > 0].mean(), rel=1e-6)
    np.testing.assert_array_equal(np.asarray(fields["loss_mask"]), m * (1 - ref_capped))  # rejected: out of the loss
    with pytest.raises(ValueError, match="sampler_logp"):
        prepare(cfg, batch, sampler_logp=None)
    # forking tokens
    fields, _ = prepare(LossConfig(top_entropy_fraction=0.25), batch)
    ref_top, _ = np_top_entropy(f64(batch["entropy"]), m, 0.25)
    np.testing.assert_array_equal(np.asarray(fields["token_weights"]), ref_top)
    with pytest.raises(ValueError, match="entropy"):
        prepare(LossConfig(top_entropy_fraction=0.25), batch, entropy=None)
    # Clip-Cov: detached tokens are candidates by the covariance of old_logp and the advantages
    cfg = LossConfig(clip_cov_ratio=0.05, clip_cov_low=0.1, clip_cov_high=5.0)
    fields, _ = prepare(cfg, batch)
    w = np.asarray(fields["token_weights"])
    cov = np_covariance(f64(batch["old_logp"]), np.asarray(fields["advantages"], np.float64), m)
    candidate = (m > 0) & (cov > 0.1) & (cov < 5.0)
    k = max(math.floor(0.05 * m.sum()), 1)
    assert candidate.sum() >= k
    assert (w == 0).sum() == k and np.all(candidate[w == 0])
    # combined: the product of the selections
    fields, _ = prepare(LossConfig(is_level="token", is_cap=1.5, top_entropy_fraction=0.25), batch)
    ref_tok, _ = np_truncated_is(f64(batch["old_logp"]), f64(batch["sampler_logp"]), m, "token", "truncate", 1.5)
    np.testing.assert_allclose(np.asarray(fields["token_weights"]), ref_tok * ref_top, rtol=1e-5, atol=1e-7)
    # KL-Cov
    fields, metrics = prepare(LossConfig(objective="reinforce", kl_cov_ratio=0.1), batch)
    assert "token_weights" not in fields
    cov = np_covariance(f64(batch["old_logp"]), np.asarray(fields["advantages"], np.float64), m)
    valid = np.flatnonzero(m.reshape(-1) > 0)
    k = max(math.floor(Fraction("0.1") * len(valid)), 1)
    expected = np.zeros(m.size)
    expected[valid[np.argsort(-cov.reshape(-1)[valid], kind="stable")[:k]]] = 1.0
    np.testing.assert_array_equal(np.asarray(fields["kl_cov_mask"]).reshape(-1), expected)
    assert float(metrics["kl_cov_frac"]) == pytest.approx(k / len(valid), rel=1e-6)


@pytest.mark.parametrize("build, choices", [
    (lambda: policy_term("ppo"), ("ppo_clip", "reinforce", "cispo", "gmpo")),
    (lambda: policy_term("ppo_clip", ratio="seq"), ("token", "sequence", "sequence_token")),
    (lambda: kl_term(0.1, target="reference"), ("ref", "old")),
    (lambda: kl_term(0.1, estimator="full", target="old"), ("target='ref'",)),
])
def test_unknown_piece_names_list_the_valid_choices(build, choices):
    with pytest.raises(ValueError) as err:
        build()
    for choice in choices:
        assert choice in str(err.value)


def test_unknown_names_inside_terms_list_the_valid_choices():
    mask = jnp.ones((2, 3))
    inputs = LossInputs(logp=-jnp.ones((2, 3)), old_logp=-jnp.ones((2, 3)), advantages=jnp.ones((2, 3)), mask=mask)
    controls = Controls(jnp.float32(0.0), jnp.float32(1.0))
    with pytest.raises(ValueError) as err:
        kl_term(0.1, estimator="k4", target="old")(inputs, normalizers(mask), controls)
    assert all(name in str(err.value) for name in ("k1", "k2", "k3"))
    with pytest.raises(ValueError) as err:
        policy_term(aggregation="mean")(inputs, normalizers(mask), controls)
    assert all(name in str(err.value) for name in AGGREGATIONS)
