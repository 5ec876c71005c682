"""Issue 35's policy-update pieces (`jaxrl.losses.updates`, the KL `abs` estimator, GPG's advantage correction,
BAPO's whole-batch bounds) against independent float64 numpy references written from the papers' formulas.

Values are compared on small random inputs with ragged masks (one row fully masked, garbage in the padding);
gradients w.r.t. `logp` against central finite differences of the numpy reference, or against the gradient the
paper states where the loss value is not the function being differentiated (ASPO's stop-gradients).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl import models, registry
from jaxrl.configlib import ConfigError
from jaxrl.losses import (PRESETS, Controls, LossConfig, LossInputs, bapo_clip_bounds, build_loss, dcpo, drift_term,
                          gpg_alpha, kl_abs, kl_estimate, kl_term, normalizers, policy_drift, policy_term)
from jaxrl.losses.compose import adaptive_clip_fields
from jaxrl.losses.updates import DCPO_MAX_RATIO
from jaxrl.train import _adaptive_clip_fields, completion_logprobs, init_train_state, make_rl_gradients

LENGTHS = (6, 3, 0, 1, 5, 4)
B, N = len(LENGTHS), 6
CONTROLS = Controls(jnp.float32(0.0), jnp.float32(1.0))
FD_STEP = 1e-5


def f32(x):
    return np.asarray(x, np.float32)


def f64(x):
    return np.asarray(np.asarray(x, np.float32), np.float64)


def ragged_mask(lengths=LENGTHS, n=N):
    return f32(np.arange(n)[None, :] < np.asarray(lengths)[:, None])


def batch(seed, limit=0.6, kinks=(), margin=3e-3):
    """Random float32 `(mask, logp, old, adv)`: log ratios in +-limit, at least `margin` from every log-space
    kink in `kinks` (a function of the old log-prob, or constants); garbage in the padding."""
    for attempt in range(1000):
        rng = np.random.default_rng(100 * seed + attempt)
        m = ragged_mask()
        old = rng.normal(-1.2, 0.8, (B, N))
        lr = rng.uniform(-limit, limit, (B, N))
        logp = np.where(m > 0, old + lr, rng.normal(0.0, 3.0, (B, N)))
        adv = np.repeat(rng.normal(0.0, 1.0, (B, 1)), N, axis=1)
        adv = np.where(np.abs(adv) < 0.05, 0.5, adv)
        adv = np.where(m > 0, adv, rng.normal(0.0, 1.0, (B, N)))
        d = dict(mask=m, logp=f32(logp), old=f32(old), adv=f32(adv))
        lr64 = f64(d["logp"]) - f64(d["old"])
        bad = False
        for kink in kinks:
            k = kink(f64(d["old"])) if callable(kink) else kink
            bad |= bool(np.any((np.abs(lr64 - k) < margin) & (m > 0)))
        if not bad:
            return d
    raise AssertionError("no batch away from the kinks")


def fd_token_mean_grad(per_token, x, m, step=FD_STEP):
    """Central finite differences of `token_mean(per_token(x))` w.r.t. x: each token's loss depends on its own
    log-prob only (true of every piece here), so all tokens are perturbed at once."""
    x = f64(x)
    return (per_token(x + step) - per_token(x - step)) / (2 * step) * m / m.sum()


def token_mean_np(per_token, m):
    return float((per_token * m).sum() / m.sum())


def term_value_and_grad(term, d, **extra):
    """The term's value and its gradient w.r.t. logp (token-mean aggregation over the batch's mask)."""
    norm = normalizers(jnp.asarray(d["mask"]))

    def value(logp):
        inputs = LossInputs(logp=logp, old_logp=jnp.asarray(d["old"]), advantages=jnp.asarray(d["adv"]),
                            mask=jnp.asarray(d["mask"]), **extra)
        return term(inputs, norm, CONTROLS)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(value, has_aux=True))(jnp.asarray(d["logp"]))
    return float(loss), metrics, np.asarray(grad)


def check_grad(grad, ref, mask, atol=2e-4):
    np.testing.assert_allclose(grad, ref, atol=atol, rtol=1e-3)
    assert np.all(grad[mask == 0] == 0.0)
    assert np.abs(grad[mask > 0]).max() > 1e-3


# --------------------------------------------------------------------------- GPG


def np_gpg(logp, adv):
    """GPG per token: -A log pi."""
    return -adv * logp


def test_gpg_value_and_gradient_ignore_the_old_policy():
    d = batch(1)
    m = d["mask"]
    loss, metrics, grad = term_value_and_grad(policy_term("gpg", aggregation="token-mean"), d)
    assert loss == pytest.approx(token_mean_np(np_gpg(f64(d["logp"]), f64(d["adv"])), m), rel=1e-5)
    check_grad(grad, -f64(d["adv"]) * m / m.sum(), m)  # d/dlogp of -A logp / count: no ratio factor
    _, _, moved = term_value_and_grad(policy_term("gpg", aggregation="token-mean"), {**d, "old": d["old"] - 0.5})
    np.testing.assert_allclose(moved, grad, rtol=1e-6)
    assert not any(name.startswith("clip_frac") for name in metrics)


def np_gpg_alpha(adv, m):
    rows = [i for i in range(adv.shape[0]) if m[i].sum() > 0]
    zero = [i for i in rows if all(adv[i, t] == 0 for t in range(adv.shape[1]) if m[i, t] > 0)]
    return len(rows) / (len(rows) - len(zero)) if len(rows) > len(zero) else 1.0


def test_gpg_alpha_counts_the_rows_without_gradient():
    m = ragged_mask()
    rng = np.random.default_rng(3)
    adv = f32(np.repeat(rng.normal(size=(B, 1)), N, 1) * m)
    adv[1] = 0.0  # a group whose rewards were all equal
    adv[4] = 0.0
    adv[2] = 7.0  # garbage on the empty row: not a row of the batch
    scaled, alpha = gpg_alpha(jnp.asarray(adv), jnp.asarray(m))
    expected = np_gpg_alpha(f64(adv), m)
    assert expected == pytest.approx(5 / 3)
    assert float(alpha) == pytest.approx(expected, rel=1e-6)
    np.testing.assert_allclose(np.asarray(scaled), f64(adv) * expected, rtol=1e-6)
    _, none = gpg_alpha(jnp.zeros((B, N)), jnp.asarray(m))
    assert float(none) == 1.0


def test_gpg_preset_scales_the_advantages_in_prepare_batch():
    from jaxrl.losses import prepare_batch
    rng = np.random.default_rng(4)
    g, prompts, n = 4, 3, 5
    rewards = np.array([1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 1], np.float32)  # the second group has no spread
    m = f32(np.ones((g * prompts, n)))
    fields, metrics = jax.jit(lambda r: prepare_batch(LossConfig.from_preset("gpg"), rewards=r,
                                                      completion_mask=jnp.asarray(m),
                                                      old_logp=jnp.asarray(f32(rng.normal(size=(12, n)))),
                                                      group_size=g, key=jax.random.key(0)))(jnp.asarray(rewards))
    centred = rewards.reshape(prompts, g) - rewards.reshape(prompts, g).mean(axis=1, keepdims=True)
    expected = centred.reshape(-1)[:, None] * m * (12 / 8)  # F_norm = 1, alpha = B / (B - M) = 12 / 8
    np.testing.assert_allclose(np.asarray(fields["advantages"]), expected, rtol=1e-5, atol=1e-6)
    assert float(metrics["gpg_alpha"]) == pytest.approx(1.5)


@pytest.mark.parametrize("fields, field", [
    (dict(objective="gpg"), "clip_eps_low"),
    (dict(objective="gpg", clip_eps_low=1.0), "clip_eps_high"),
    (dict(objective="gpg", clip_eps_low=1.0, clip_eps_high=math.inf, dual_clip_c=3.0), "dual_clip_c"),
    (dict(objective="gpg", clip_eps_low=1.0, clip_eps_high=math.inf, ratio="sequence"), "ratio"),
    (dict(gpg_correction=True), "gpg_correction"),
    (dict(objective="cpgd", clip_eps_low=1.0), "clip_eps_low"),
    (dict(objective="bapo", bapo_low_start=0.8, bapo_low_max=0.7), "bapo_low_max"),
    (dict(objective="bapo", bapo_high_start=2.0, bapo_high_max=1.5), "bapo_high_max"),
    (dict(objective="aspo", ratio="sequence"), "ratio"),
    (dict(objective="dcpo", ratio="sequence_token"), "ratio"),
])
def test_combinations_that_make_no_sense_name_the_field(fields, field):
    with pytest.raises(registry.RegistryError) as err:
        LossConfig(**fields).validate()
    assert err.value.field == f"rl.loss.{field}"
    assert str(err.value).startswith(f"rl.loss.{field}:")


@pytest.mark.parametrize("overrides, field", [
    (dict(bapo_target=1.5), "bapo_target"), (dict(bapo_target=0.0), "bapo_target"),
    (dict(bapo_low_start=1.0), "bapo_low_start"), (dict(bapo_high_max=0.9), "bapo_high_max"),
    (dict(bapo_step_low=0.0), "bapo_step_low"), (dict(drift_coef=-0.1), "drift_coef"),
    (dict(dual_clip_c=1.0), "dual_clip_c"), (dict(kl_estimator="abs2"), "kl_estimator"),
])
def test_parameters_outside_their_domain_name_the_field(overrides, field):
    preset = "cpgd" if field == "drift_coef" else "aspo" if field == "dual_clip_c" else "bapo"
    with pytest.raises(ConfigError, match=field):
        LossConfig.from_preset(preset, **overrides)


def test_new_presets_validate_and_unknown_objectives_list_them():
    for name in ("gpg", "bapo", "dcpo", "aspo", "cpgd"):
        cfg = LossConfig.from_preset(name)
        cfg.validate()
        assert cfg.objective == name
    assert LossConfig.from_preset("gpg").clip_eps_high == math.inf
    with pytest.raises(registry.RegistryError) as err:
        LossConfig(objective="gpg2").validate()
    for name in ("gpg", "bapo", "dcpo", "aspo", "cpgd"):
        assert repr(name) in str(err.value)
    with pytest.raises(ConfigError, match="preset"):
        LossConfig.from_preset("bapo2")
    assert set(PRESETS) >= {"gpg", "bapo", "dcpo", "aspo", "cpgd"}


# --------------------------------------------------------------------------- DCPO


def np_dcpo_bounds(old, eps_low, eps_high):
    q = np.exp(old)
    low = 0.5 + 0.5 * np.sqrt(np.maximum(1 - 4 * eps_low / q, 0.0))
    high = np.minimum(0.5 + 0.5 * np.sqrt(1 + 4 * eps_high / q), 10.0)
    return low, high


def np_dcpo(logp, old, adv, eps_low, eps_high, c=None):
    low, high = np_dcpo_bounds(old, eps_low, eps_high)
    out = np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        r, a = math.exp(logp[idx] - old[idx]), adv[idx]
        objective = min(r * a, min(max(r, low[idx]), high[idx]) * a)
        if c is not None and a < 0:
            objective = max(objective, c * a)
        out[idx] = -objective
    return out


def test_dcpo_bounds_values_and_gradient():
    el, eh, c = 0.16, 0.2, 1.5
    kinks = (lambda old: np.log(np_dcpo_bounds(old, el, eh)[0]), lambda old: np.log(np_dcpo_bounds(old, el, eh)[1]),
             math.log(c))
    d = batch(5, limit=1.2, kinks=kinks)
    m = d["mask"]
    low, high = np_dcpo_bounds(f64(d["old"]), el, eh)
    assert np.ptp(low[m > 0]) > 0.05 and np.ptp(high[m > 0]) > 0.05  # bounds differ token by token
    lr = f64(d["logp"]) - f64(d["old"])
    r = np.exp(lr)
    assert ((r < low) & (d["adv"] < 0) & (m > 0)).any() and ((r > high) & (d["adv"] > 0) & (m > 0)).any()
    for dual in (None, c):
        term = policy_term("dcpo", aggregation="token-mean", eps_low=el, eps_high=eh, dual_clip_c=dual)
        loss, metrics, grad = term_value_and_grad(term, d)
        per_token = lambda x: np_dcpo(x, f64(d["old"]), f64(d["adv"]), el, eh, dual)
        assert loss == pytest.approx(token_mean_np(per_token(f64(d["logp"])), m), rel=1e-5)
        check_grad(grad, fd_token_mean_grad(per_token, d["logp"], m), m)
        assert float(metrics["clip_bound_low"]) == pytest.approx(token_mean_np(low, m), rel=1e-5)
    # A token of old probability 1e-6 may not move beyond the cap.
    _, bound = dcpo(jnp.zeros(1), jnp.ones(1), jnp.full(1, math.log(1e-6)), None, el, eh)
    assert float(bound["clip_bound_high"][0]) == DCPO_MAX_RATIO
    assert float(bound["clip_bound_low"][0]) == 0.5


# --------------------------------------------------------------------------- ASPO


def np_aspo_value_and_grad(logp, old, adv, el, eh, c):
    """ASPO per token: its value and the gradient w.r.t. logp that the paper states (Sec. 3: the positive
    tokens' weight is pi_old / pi; the soft dual clip keeps the gradient with a weight c)."""
    value, grad = np.zeros_like(logp), np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        r, a = math.exp(logp[idx] - old[idx]), adv[idx]
        if a > 0:
            rp = min(r, 1 + eh)
            if c is not None and 1 / rp > c:
                value[idx], grad[idx] = -a * c, -a * c
            else:
                value[idx] = -a / rp
                grad[idx] = -a / r if r <= 1 + eh else 0.0  # weight 1 / r inside the clip
        elif a < 0:
            rn = max(r, 1 - el)
            if c is not None and rn > c:
                value[idx], grad[idx] = -a * c, -a * c
            else:
                value[idx] = -a * rn
                grad[idx] = -a * r if r >= 1 - el else 0.0
    return value, grad


def test_aspo_flips_the_ratio_of_positive_tokens_with_a_soft_dual_clip():
    el, eh, c = 0.2, 0.2, 3.0
    d = batch(7, limit=1.6, kinks=(math.log(1 - el), math.log(1 + eh), math.log(c), -math.log(c)))
    # plant one token of each regime: (row, token) -> (log ratio, advantage)
    cells = {(0, 0): (-1.5, 1.0), (0, 1): (0.5, 0.8), (0, 2): (0.05, 1.2), (1, 0): (1.4, -1.0), (1, 1): (-0.5, -0.7)}
    logp, adv = d["logp"].copy(), d["adv"].copy()
    for (i, t), (lr_, a_) in cells.items():
        logp[i, t], adv[i, t] = d["old"][i, t] + np.float32(lr_), a_
    d = {**d, "logp": f32(logp), "adv": f32(adv)}
    m = d["mask"]
    lr = f64(d["logp"]) - f64(d["old"])
    a = f64(d["adv"])
    regimes = [(a > 0) & (lr < -math.log(c)), (a > 0) & (lr > math.log(1 + eh)), (a < 0) & (lr > math.log(c)),
               (a < 0) & (lr < math.log(1 - el)), (a > 0) & (np.abs(lr) < 0.15)]
    assert all((regime & (m > 0)).any() for regime in regimes), [int((g & (m > 0)).sum()) for g in regimes]
    for dual in (c, None):
        loss, metrics, grad = term_value_and_grad(
            policy_term("aspo", aggregation="token-mean", eps_low=el, eps_high=eh, dual_clip_c=dual), d)
        value, g = np_aspo_value_and_grad(f64(d["logp"]), f64(d["old"]), a, el, eh, dual)
        assert loss == pytest.approx(token_mean_np(value, m), rel=1e-5)
        check_grad(grad, g * m / m.sum(), m)
        if dual is not None:
            soft = ((a > 0) & (lr < -math.log(c))) | ((a < 0) & (lr > math.log(c)))
            assert float(metrics["clip_frac_dual"]) == pytest.approx(token_mean_np(soft.astype(float), m))
    # On policy (r = 1) a positive token's gradient is PPO's: -A grad log pi.
    _, _, on = term_value_and_grad(policy_term("aspo", aggregation="token-mean"), {**d, "logp": d["old"]})
    np.testing.assert_allclose(on, -a * m / m.sum(), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- CPGD


def np_cpgd(logp, old, adv, el, eh):
    out = np.zeros_like(logp)
    lo, hi = math.log(1 - el), math.log(1 + eh)
    for idx in np.ndindex(logp.shape):
        lr, a = logp[idx] - old[idx], adv[idx]
        out[idx] = -min(lr * a, min(max(lr, lo), hi) * a)
    return out


def np_drift(logp, old):
    """KL(pi_old || pi) per token sampled from pi_old: r - 1 - ln r."""
    lr = logp - old
    return np.exp(lr) - 1 - lr


def test_cpgd_clipped_log_ratio_gradient_and_policy_drift():
    el, eh = 0.2, 0.2
    d = batch(9, kinks=(math.log(1 - el), math.log(1 + eh), 0.0))
    m, old, a = d["mask"], f64(d["old"]), f64(d["adv"])
    lr = f64(d["logp"]) - old
    assert (((a > 0) & (lr > math.log(1.2))) | ((a < 0) & (lr < math.log(0.8)))).any()
    loss, _, grad = term_value_and_grad(policy_term("cpgd", aggregation="token-mean", eps_low=el, eps_high=eh), d)
    per_token = lambda x: np_cpgd(x, old, a, el, eh)
    assert loss == pytest.approx(token_mean_np(per_token(f64(d["logp"])), m), rel=1e-5)
    check_grad(grad, fd_token_mean_grad(per_token, d["logp"], m), m)
    inside = (lr > math.log(0.8)) & (lr < math.log(1.2))
    np.testing.assert_allclose(grad[inside & (m > 0)], (-a * m / m.sum())[inside & (m > 0)], rtol=1e-5)  # no ratio
    # the drift term, and the preset's whole loss
    drift, metrics, dgrad = term_value_and_grad(drift_term(0.3), d)
    drift_per_token = lambda x: 0.3 * np_drift(x, old)
    assert drift == pytest.approx(token_mean_np(drift_per_token(f64(d["logp"])), m), rel=1e-5)
    assert float(metrics["policy_drift"]) == pytest.approx(token_mean_np(np_drift(f64(d["logp"]), old), m), rel=1e-5)
    check_grad(dgrad, fd_token_mean_grad(drift_per_token, d["logp"], m), m)
    assert np.all(np.asarray(policy_drift(jnp.asarray(d["logp"]), jnp.asarray(d["old"])))[m > 0] >= 0)
    total, _, tgrad = term_value_and_grad(build_loss(LossConfig.from_preset("cpgd")), d)
    both = lambda x: per_token(x) + 0.1 * np_drift(x, old)
    assert total == pytest.approx(token_mean_np(both(f64(d["logp"])), m), rel=1e-5)
    check_grad(tgrad, fd_token_mean_grad(both, d["logp"], m), m)


# --------------------------------------------------------------------------- BAPO


def np_bapo_bounds(lr, adv, m, target, a_lo, b_lo, a_hi, b_hi, d_lo, d_hi):
    """BAPO's search, as a loop: raise c_low and c_high step by step (each while it fits) until the positive
    tokens' share of the gradient-carrying |r A| reaches the target."""
    def share(c_low, c_high):
        pos = neg = 0.0
        for idx in np.ndindex(lr.shape):
            if m[idx] == 0:
                continue
            r, a = math.exp(lr[idx]), adv[idx]
            if a > 0 and r <= c_high:
                pos += abs(r * a) * m[idx]
            elif a < 0 and r >= c_low:
                neg += abs(r * a) * m[idx]
        return pos / (pos + neg) if pos + neg > 0 else 1.0

    c_low, c_high = a_lo, a_hi
    rho = share(c_low, c_high)
    while rho < target:
        moved = False
        if c_low + d_lo <= b_lo + 1e-9:
            c_low, moved = c_low + d_lo, True
        if c_high + d_hi <= b_hi + 1e-9:
            c_high, moved = c_high + d_hi, True
        if not moved:
            break
        rho = share(c_low, c_high)
    return c_low, c_high, rho


BAPO_ARGS = dict(target=0.5, low_start=0.6, low_max=0.9, high_start=1.2, high_max=3.0, step_low=0.05, step_high=0.1)


@pytest.mark.parametrize("seed, shift, case", [(11, -1.5, "start"), (12, -0.5, "moved"), (11, 0.0, "moved"),
                                               (14, 3.0, "max")])
def test_bapo_clip_bounds_against_numpy(seed, shift, case):
    """shift moves the advantages: mostly positive (the start bounds meet the target), balanced (the bounds must
    move, here to c_low 0.75 / c_high 1.5 and 0.9 / 2.2), or so negative that they reach their maxima."""
    rng = np.random.default_rng(seed)
    m = ragged_mask()
    lr = f32(rng.uniform(-1.2, 1.2, (B, N)))
    adv = f32(rng.normal(-shift, 1.0, (B, N)))
    c_low, c_high, rho = bapo_clip_bounds(jnp.asarray(lr), jnp.asarray(adv), jnp.asarray(m), **BAPO_ARGS)
    ref = np_bapo_bounds(f64(lr), f64(adv), m, *BAPO_ARGS.values())
    np.testing.assert_allclose([float(c_low), float(c_high), float(rho)], ref, rtol=1e-5, atol=1e-6)
    if case == "start":
        assert ref[:2] == (0.6, 1.2) and ref[2] >= 0.5
    elif case == "max":
        assert ref[0] == pytest.approx(0.9) and ref[1] == pytest.approx(3.0) and ref[2] < 0.5
    else:
        assert (ref[0] > 0.6 or ref[1] > 1.2) and ref[1] < 3.0 and ref[2] >= 0.5


MODEL = models.ModelConfig(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                           intermediate_size=32)
TB, LP, TN = 8, 4, 6


def test_bapo_loss_with_whole_batch_bounds_adds_up_over_row_splits():
    """BAPO's bounds come from the whole batch (`adaptive_clip_fields`) and travel with its rows: the losses and
    gradients of two row splits, each with the whole batch's counts, add up to the whole batch's."""
    d = batch(19, limit=1.0)
    adv = f32(np.where(d["mask"] > 0, d["adv"] - 0.8, d["adv"]))  # mostly negative: the bounds move
    d = {**d, "adv": adv}
    cfg = LossConfig.from_preset("bapo")
    fields = adaptive_clip_fields(cfg, jnp.asarray(d["logp"]), jnp.asarray(d["old"]), jnp.asarray(adv),
                                  jnp.asarray(d["mask"]))
    lr = f64(d["logp"]) - f64(d["old"])
    ref = np_bapo_bounds(lr, f64(adv), d["mask"], cfg.bapo_target, cfg.bapo_low_start, cfg.bapo_low_max,
                         cfg.bapo_high_start, cfg.bapo_high_max, cfg.bapo_step_low, cfg.bapo_step_high)
    assert ref[:2] != (0.6, 1.2)
    np.testing.assert_allclose(np.asarray(fields["clip_low"]), ref[0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(fields["clip_high"]), ref[1], rtol=1e-6)
    loss_fn, norm = build_loss(cfg), normalizers(jnp.asarray(d["mask"]))

    def loss_of(logp, rest):
        old, a, mask, low, high = rest
        inputs = LossInputs(logp=logp, old_logp=old, advantages=a, mask=mask, clip_low=low, clip_high=high)
        return loss_fn(inputs, norm, CONTROLS)[0]

    grad_fn = jax.jit(jax.value_and_grad(loss_of))
    arrays = (d["old"], adv, d["mask"], fields["clip_low"], fields["clip_high"])

    def on(rows):
        return grad_fn(jnp.asarray(d["logp"][rows]), tuple(jnp.asarray(x)[rows] for x in arrays))

    whole, g_whole = on(np.arange(B))
    parts = [np.arange(B)[j::2] for j in (0, 1)]
    split = [on(rows) for rows in parts]
    assert float(whole) == pytest.approx(float(split[0][0] + split[1][0]), rel=1e-5)
    for rows, (_, g) in zip(parts, split):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_whole)[rows], rtol=1e-5, atol=1e-8)
    r, m = np.exp(lr), d["mask"]
    surrogate = np.maximum(-r * adv, -np.clip(r, ref[0], ref[1]) * adv)
    surrogate = np.where(adv < 0, np.minimum(surrogate, -3.0 * adv), surrogate)
    assert float(whole) == pytest.approx(token_mean_np(surrogate, m), rel=1e-5)


@pytest.mark.slow
def test_bapo_bounds_are_the_whole_mini_batchs_whatever_the_micro_batching():
    """The trainer computes BAPO's bounds from the current policy over the whole mini-batch before splitting it:
    one micro-batch or four give the same loss, gradient and bounds, those of the numpy search."""
    policy = models.init(MODEL, 0)
    rng = np.random.default_rng(15)
    tokens = jnp.asarray(rng.integers(3, MODEL.vocab_size, (TB, LP + TN)), jnp.int32)
    prompt_valid = jnp.ones((TB, LP), bool)
    mask = jnp.asarray(np.arange(TN)[None] < rng.integers(1, TN + 1, TB)[:, None], jnp.float32)
    logp, _ = completion_logprobs(policy, tokens, prompt_valid)
    old = logp + jnp.asarray(rng.normal(0, 0.5, (TB, TN)), jnp.float32)
    adv = jnp.asarray(np.repeat(rng.normal(-0.7, 1.0, (TB, 1)), TN, 1), jnp.float32) * mask
    data = {"tokens": tokens, "prompt_valid": prompt_valid, "loss_mask": mask, "old_logp": old, "advantages": adv}
    cfg = LossConfig.from_preset("bapo")
    loss = build_loss(cfg)
    state = init_train_state(policy, optax.sgd(1.0))
    out = {micro: jax.jit(make_rl_gradients(loss, micro_batches=micro))(state, data, CONTROLS) for micro in (1, 4)}
    (g1, m1), (g4, m4) = out[1], out[4]
    ref = np_bapo_bounds(f64(logp) - f64(old), f64(adv), np.asarray(mask), cfg.bapo_target, cfg.bapo_low_start,
                         cfg.bapo_low_max, cfg.bapo_high_start, cfg.bapo_high_max, cfg.bapo_step_low,
                         cfg.bapo_step_high)
    assert ref[:2] != (0.6, 1.2)  # the bounds moved
    for metrics in (m1, m4):
        assert float(metrics["clip_bound_low"]) == pytest.approx(ref[0], rel=1e-5)
        assert float(metrics["clip_bound_high"]) == pytest.approx(ref[1], rel=1e-5)
    assert float(m4["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    # the pre-pass hands the bounds function the current log-probs of the whole batch, row for row
    seen = _adaptive_clip_fields(lambda lp, o, a, m: {"logp": lp, "counted": m}, state, data, CONTROLS, 4)
    np.testing.assert_allclose(np.asarray(seen["logp"]), np.asarray(logp), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(seen["counted"]), np.asarray(mask))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    # and the loss is PPO's clipped surrogate with those bounds (dual clip 3)
    r = np.exp(f64(logp) - f64(old))
    a = f64(adv)
    surrogate = np.maximum(-r * a, -np.clip(r, ref[0], ref[1]) * a)
    surrogate = np.where(a < 0, np.minimum(surrogate, -3.0 * a), surrogate)
    assert float(m1["policy_loss"]) == pytest.approx(token_mean_np(surrogate, np.asarray(mask)), rel=1e-4)


def test_bapo_objective_needs_the_batch_bounds():
    d = batch(16)
    with pytest.raises(ValueError, match="LossInputs.clip_low"):
        term_value_and_grad(policy_term("bapo"), d)
    ones = jnp.ones((B, N))
    loss, metrics, _ = term_value_and_grad(policy_term("bapo", aggregation="token-mean"), d, clip_low=0.7 * ones,
                                           clip_high=1.5 * ones)
    r, a, m = np.exp(f64(d["logp"]) - f64(d["old"])), f64(d["adv"]), d["mask"]
    assert loss == pytest.approx(token_mean_np(np.maximum(-r * a, -np.clip(r, 0.7, 1.5) * a), m), rel=1e-5)
    assert float(metrics["clip_bound_high"]) == pytest.approx(1.5)


# --------------------------------------------------------------------------- KL abs


def test_kl_abs_estimator_value_gradient_and_config():
    d = batch(17, kinks=(0.0,))
    m, ref = d["mask"], f32(f64(d["logp"]) + np.random.default_rng(18).normal(0, 0.3, (B, N)))
    value = np.asarray(kl_abs(jnp.asarray(d["logp"]), jnp.asarray(ref)))
    np.testing.assert_allclose(value, np.abs(f64(d["logp"]) - f64(ref)), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(kl_estimate(jnp.asarray(d["logp"]), jnp.asarray(ref), "abs")), value)
    loss, metrics, grad = term_value_and_grad(kl_term(0.2, "abs", "ref"), d, ref_logp=jnp.asarray(ref))
    fn = lambda x: 0.2 * token_mean_np(np.abs(x - f64(ref)), m)
    assert loss == pytest.approx(fn(f64(d["logp"])), rel=1e-5)
    check_grad(grad, 0.2 * np.sign(f64(d["logp"]) - f64(ref)) * m / m.sum(), m)
    cfg = LossConfig(kl_estimator="abs", kl_coef=0.2)
    cfg.validate()
    built, _, _ = term_value_and_grad(build_loss(cfg), d, ref_logp=jnp.asarray(ref))
    policy, _, _ = term_value_and_grad(build_loss(dataclasses.replace(cfg, kl_coef=0.0)), d)
    assert built - policy == pytest.approx(fn(f64(d["logp"])), rel=1e-4)
    LossConfig(kl_estimator="abs", kl_coef=0.1, kl_in_reward=True).validate()
    LossConfig.from_preset("grpo", kl_estimator="abs")


def test_on_policy_the_clipped_variants_take_the_plain_policy_gradient():
    """At r = 1 (the first update of a batch, and the only one with rl.epochs = rl.minibatches = 1) BAPO, DCPO, ASPO
    and CPGD (with its drift) all give `-A grad log pi`, as PPO does: they differ only off-policy. GPG's gradient is
    the same function of its own advantages."""
    d = batch(20)
    d = {**d, "logp": d["old"]}
    m, a = d["mask"], f64(d["adv"])
    expected = -a * m / m.sum()
    ones = jnp.ones((B, N))
    for name in ("dapo", "bapo", "dcpo", "aspo", "cpgd", "gpg"):
        extra = dict(clip_low=0.6 * ones, clip_high=1.2 * ones) if name == "bapo" else {}
        _, metrics, grad = term_value_and_grad(build_loss(LossConfig.from_preset(name)), d, **extra)
        np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-8, err_msg=name)
        if name == "cpgd":
            assert float(metrics["policy_drift"]) == 0.0


def test_batch_level_pieces_give_with_holes_what_they_give_on_the_compacted_rows():
    """A multi-turn row's observation tokens are holes in its mask: GPG's alpha and BAPO's bounds count the
    model tokens only, so a row with holes gives what its compacted row gives."""
    rng = np.random.default_rng(21)
    holes = f32([[1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0]])
    compact = f32([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    lr_h = f32(rng.uniform(-1.0, 1.0, (4, 6)))
    adv_h = f32(np.repeat(rng.normal(-0.3, 1.0, (4, 1)), 6, 1))
    adv_h[3] = 0.0  # a row without gradient
    lr_c, adv_c = np.zeros_like(lr_h), np.zeros_like(adv_h)
    for i in range(4):
        kept = np.flatnonzero(holes[i])
        lr_c[i, :len(kept)], adv_c[i, :len(kept)] = lr_h[i, kept], adv_h[i, kept]
        lr_h[i, holes[i] == 0], adv_h[i, holes[i] == 0] = 9.0, 5.0  # garbage on the observation tokens
    _, alpha_h = gpg_alpha(jnp.asarray(adv_h), jnp.asarray(holes))
    _, alpha_c = gpg_alpha(jnp.asarray(adv_c), jnp.asarray(compact))
    assert float(alpha_h) == float(alpha_c) == pytest.approx(3 / 2)
    bounds_h = bapo_clip_bounds(jnp.asarray(lr_h), jnp.asarray(adv_h), jnp.asarray(holes), **BAPO_ARGS)
    bounds_c = bapo_clip_bounds(jnp.asarray(lr_c), jnp.asarray(adv_c), jnp.asarray(compact), **BAPO_ARGS)
    np.testing.assert_allclose([float(x) for x in bounds_h], [float(x) for x in bounds_c], rtol=1e-6)
    np.testing.assert_allclose([float(x) for x in bounds_c],
                               np_bapo_bounds(f64(lr_c), f64(adv_c), compact, *BAPO_ARGS.values()), rtol=1e-5)
