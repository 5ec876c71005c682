"""Issue 33: the rollout correction (levels x modes x bounds, the veto, the denominator rule, the agreement
metrics), M2PO, SAPO and AIPO, each against an independent float64 numpy reference on random inputs whose masks
have holes; the sampler's behaviour log-probs against the trainer's (one tiny-model sampling run); and the
range checks of the new fields through the config loader."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import models
from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config
from jaxrl.losses import (Controls, LossConfig, LossInputs, build_loss, m2po_mask, mismatch_metrics, normalizers,
                          prepare_batch, rollout_correction)

G = 4


def f32(x):
    return jnp.asarray(np.asarray(x, np.float32))


def make(seed, b=8, n=10, spread=0.7):
    """A batch with holes in the completion mask (row 1 empty): log-probs of the sampler, of the policy about to
    be updated (`old`) and of the current policy (`logp`), and rewards in groups of G."""
    rng = np.random.default_rng(seed)
    mask = (rng.uniform(size=(b, n)) < 0.75).astype(np.float64)
    mask[1] = 0
    mask[0, :3] = 1
    old = rng.normal(-1.5, 0.8, (b, n))
    sampler = old - rng.uniform(-spread, spread, (b, n))
    logp = old + rng.normal(0, 0.3, (b, n))
    rewards = rng.integers(0, 2, b) + rng.normal(0, 0.1, b)
    return dict(mask=mask, old=old, sampler=sampler, logp=logp, rewards=rewards)


def prepare(cfg, d, **kwargs):
    fn = jax.jit(functools.partial(prepare_batch, cfg, group_size=G))
    args = dict(rewards=f32(d["rewards"]), completion_mask=jnp.asarray(d["mask"] > 0), old_logp=f32(d["old"]),
                key=jax.random.key(0), sampler_logp=f32(d["sampler"]))
    args.update(kwargs)
    return fn(**args)


def full_loss(cfg, fields, logp, old):
    """The policy loss of `cfg` through `jaxrl.losses` as the trainer forms it (whole-batch normalizers)."""
    norm = normalizers(fields["loss_mask"], 1.0, fields.get("token_weights"))
    inputs = LossInputs(logp=logp, old_logp=f32(old), advantages=fields["advantages"], mask=fields["loss_mask"],
                        token_weights=fields.get("token_weights"))
    return build_loss(cfg)(inputs, norm, Controls.initial(cfg, 1.0))


# --------------------------------------------------------------------------- numpy references


def np_correction(old, sampler, m, level, mode, floor, cap, veto):
    """Weights, kept tokens and metrics of the rollout correction, token by token in float64."""
    w, keep = np.zeros_like(old), np.zeros_like(old)
    outside_count = vetoed = rows = 0
    for i in range(old.shape[0]):
        idx = [t for t in range(old.shape[1]) if m[i, t] > 0]
        if not idx:
            continue
        rows += 1
        lr = {t: old[i, t] - sampler[i, t] for t in idx}
        row_vetoed = veto is not None and any(math.exp(v) < veto or math.exp(v) > 1 / veto for v in lr.values())
        vetoed += row_vetoed
        for t in idx:
            rho = {"none": 1.0, "token": math.exp(lr[t]), "sequence": math.exp(sum(lr.values())),
                   "geometric": math.exp(sum(lr.values()) / len(idx))}[level]
            outside = level != "none" and (rho < floor or rho > cap)
            outside_count += outside
            if row_vetoed or (outside and mode == "mask"):
                continue
            keep[i, t] = 1.0
            w[i, t] = min(max(rho, floor), cap)
    valid = m.sum()
    metrics = {"is_masked_frac": outside_count / valid if mode == "mask" else 0.0,
               "is_truncated_frac": outside_count / valid if mode == "truncate" else 0.0,
               "is_vetoed_frac": vetoed / rows, "is_weight_mean": w.sum() / max(keep.sum(), 1.0)}
    return w, keep, metrics, outside_count


def np_ppo(r, a, low=0.2, high=0.28):
    return np.maximum(-r * a, -np.clip(r, 1 - low, 1 + high) * a)


def np_aggregate(per_token, keep, mode):
    if mode == "token-mean":
        return (per_token * keep).sum() / keep.sum()
    rows = [i for i in range(keep.shape[0]) if keep[i].sum() > 0]  # a row that lost every token drops out
    return np.mean([(per_token[i] * keep[i]).sum() / keep[i].sum() for i in rows])


def np_m2po_keep(lr, m, tau):
    """M2PO (arXiv 2510.01161, Algorithm 1): mask the largest squared log ratios, one by one, until the mean of
    the rest is <= tau."""
    desc = sorted(((lr[i, t] ** 2, i, t) for i in range(m.shape[0]) for t in range(m.shape[1]) if m[i, t] > 0),
                  reverse=True)
    k = 0
    while k < len(desc) and np.mean([v for v, _, _ in desc[k:]]) > tau:
        k += 1
    keep = m.copy()
    for _, i, t in desc[:k]:
        keep[i, t] = 0.0
    return keep


_m2po_mask = jax.jit(m2po_mask)  # tau traced: one compile for every call of one shape


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# --------------------------------------------------------------------------- the correction modes

BOUNDS = {"token": [(0.0, 1.5), (0.7, 1.5), (0.8, math.inf)],
          "sequence": [(0.0, 2.0), (0.5, 2.0), (0.5, math.inf)],
          "geometric": [(0.0, 1.1), (0.9, 1.1), (0.9, math.inf)]}
CASES = [(level, floor, cap) for level, bounds in BOUNDS.items() for floor, cap in bounds]


@pytest.mark.parametrize("veto", [None, 0.52])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level, floor, cap", CASES)
def test_correction_against_numpy(level, floor, cap, mode, veto):
    d = make(1, b=16)
    w, keep, metrics = rollout_correction(f32(d["old"]), f32(d["sampler"]), f32(d["mask"]), level=level, mode=mode,
                                          floor=floor, cap=cap, veto=veto)
    ref_w, ref_keep, ref_metrics, outside = np_correction(d["old"], d["sampler"], d["mask"], level, mode, floor,
                                                          cap, veto)
    assert 0 < outside < d["mask"].sum()  # the case has weights on both sides of its bounds
    np.testing.assert_array_equal(np.asarray(keep), ref_keep)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5, atol=1e-6)
    for name, value in ref_metrics.items():
        assert float(metrics[name]) == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert ref_keep.sum() > 0
    if veto is not None:
        assert 0 < ref_metrics["is_vetoed_frac"] < 1


def test_level_none_with_the_veto_rejects_sequences_only():
    d = make(2)
    w, keep, metrics = rollout_correction(f32(d["old"]), f32(d["sampler"]), f32(d["mask"]), level="none", veto=0.52)
    ref_w, ref_keep, ref_metrics, _ = np_correction(d["old"], d["sampler"], d["mask"], "none", "truncate", 0.0,
                                                    math.inf, 0.52)
    np.testing.assert_array_equal(np.asarray(keep), ref_keep)
    np.testing.assert_array_equal(np.asarray(w), ref_w)
    assert 0 < ref_metrics["is_vetoed_frac"] < 1 and float(metrics["is_vetoed_frac"]) == pytest.approx(
        ref_metrics["is_vetoed_frac"])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_rejected_tokens_leave_the_denominator(aggregation):
    """MIS with both bounds and the veto through prepare_batch and the whole loss: the rejected tokens are out of
    `loss_mask`, so the mean is over the kept ones; the advantages are those of the completion mask."""
    d = make(3)
    cfg = LossConfig(is_level="token", is_mode="mask", is_floor=0.7, is_cap=1.5, is_veto=0.52,
                     aggregation=aggregation)
    fields, metrics = prepare(cfg, d)
    plain, _ = prepare(LossConfig(aggregation=aggregation), d)
    np.testing.assert_array_equal(np.asarray(fields["advantages"]), np.asarray(plain["advantages"]))
    ref_w, ref_keep, _, _ = np_correction(d["old"], d["sampler"], d["mask"], "token", "mask", 0.7, 1.5, 0.52)
    np.testing.assert_array_equal(np.asarray(fields["loss_mask"]), ref_keep)
    assert 0 < ref_keep.sum() < d["mask"].sum() and float(metrics["loss_tokens"]) == ref_keep.sum()
    a = np.asarray(plain["advantages"], np.float64)
    per_token = np_ppo(np.exp(d["logp"] - d["old"]), a) * ref_w
    value, _ = full_loss(cfg, fields, f32(d["logp"]), d["old"])
    expected = np_aggregate(per_token, ref_keep, aggregation)
    assert float(value) == pytest.approx(expected, rel=1e-5)
    counted_all = np_aggregate(per_token, d["mask"], aggregation)  # what counting the rejected tokens would give
    assert abs(counted_all - expected) > 1e-3


def test_truncated_tokens_stay_with_their_clipped_weight():
    d = make(4)
    cfg = LossConfig(is_level="sequence", is_floor=0.5, is_cap=2.0)
    fields, _ = prepare(cfg, d)
    ref_w, ref_keep, _, _ = np_correction(d["old"], d["sampler"], d["mask"], "sequence", "truncate", 0.5, 2.0, None)
    np.testing.assert_array_equal(np.asarray(fields["loss_mask"]), d["mask"])
    np.testing.assert_allclose(np.asarray(fields["token_weights"]), ref_w, rtol=1e-5, atol=1e-6)
    a = np.asarray(fields["advantages"], np.float64)
    value, _ = full_loss(cfg, fields, f32(d["logp"]), d["old"])
    expected = np_aggregate(np_ppo(np.exp(d["logp"] - d["old"]), a) * ref_w, d["mask"], "token-mean")
    assert float(value) == pytest.approx(expected, rel=1e-5)


def test_mismatch_metrics_against_numpy():
    d = make(5)
    m = d["mask"]
    metrics = jax.jit(mismatch_metrics)(f32(d["old"]), f32(d["sampler"]), f32(m))
    lr = d["old"] - d["sampler"]
    flat = lr[m > 0]
    rows = [i for i in range(m.shape[0]) if m[i].sum() > 0]
    ppl = [math.exp(-np.mean(d["old"][i][m[i] > 0])) / math.exp(-np.mean(d["sampler"][i][m[i] > 0])) for i in rows]
    expected = {"logp_gap_mean": np.abs(flat).mean(), "logp_gap_max": np.abs(flat).max(),
                "sampler_kl": (np.exp(flat) - 1 - flat).mean(), "ppl_ratio": np.mean(ppl)}
    for name, value in expected.items():
        assert float(metrics[name]) == pytest.approx(value, rel=1e-5), name
    _, batch_metrics = prepare(LossConfig(), d)  # reported without a correction
    for name, value in expected.items():
        assert float(batch_metrics[name]) == pytest.approx(value, rel=1e-5), name
    assert "is_masked_frac" not in batch_metrics


# --------------------------------------------------------------------------- objectives for stale data


@pytest.mark.parametrize("tau", [0.04, 0.1, 1e-4])
def test_m2po_mask_against_numpy(tau):
    d = make(6)
    lr = d["old"] - d["sampler"]
    keep, metrics = _m2po_mask(f32(lr), f32(d["mask"]), tau)
    ref = np_m2po_keep(lr, d["mask"], tau)
    np.testing.assert_array_equal(np.asarray(keep), ref)
    assert 0 < (d["mask"] - ref).sum() < d["mask"].sum()
    sq = lr ** 2
    assert float(metrics["m2po_masked_frac"]) == pytest.approx(1 - ref.sum() / d["mask"].sum(), rel=1e-6)
    assert float(metrics["m2po_m2"]) == pytest.approx(sq[d["mask"] > 0].mean(), rel=1e-5)
    assert float(metrics["m2po_m2_kept"]) == pytest.approx(sq[ref > 0].mean(), rel=1e-5)
    assert float(metrics["m2po_m2_kept"]) <= tau


def test_m2po_keeps_everything_below_the_bound():
    d = make(7, spread=0.1)  # squared log ratios below 0.01
    keep, metrics = _m2po_mask(f32(d["old"] - d["sampler"]), f32(d["mask"]), 0.04)
    np.testing.assert_array_equal(np.asarray(keep), d["mask"])
    assert float(metrics["m2po_masked_frac"]) == 0


def test_m2po_loss_against_numpy():
    d = make(8)
    cfg = LossConfig.from_preset("m2po", m2po_tau=0.1)
    fields, metrics = prepare(cfg, d)
    ref_keep = np_m2po_keep(d["old"] - d["sampler"], d["mask"], 0.1)
    np.testing.assert_array_equal(np.asarray(fields["loss_mask"]), ref_keep)
    a = np.asarray(fields["advantages"], np.float64)
    r = np.exp(d["logp"] - d["sampler"])  # the ratio to the policy that sampled: pi / pi_old times pi_old / pi_sampler
    logp = f32(d["logp"])
    value, _ = full_loss(cfg, fields, logp, d["old"])
    assert float(value) == pytest.approx(np_aggregate(-r * a, ref_keep, "token-mean"), rel=1e-5)  # no clip
    grad = jax.grad(lambda x: full_loss(cfg, fields, x, d["old"])[0])(logp)
    np.testing.assert_allclose(np.asarray(grad), -r * a * ref_keep / ref_keep.sum(), rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="sampler_logp"):
        prepare(cfg, d, sampler_logp=None)


def test_sapo_loss_and_gradient_against_numpy():
    d = make(9)
    d["logp"] = d["old"] + np.random.default_rng(9).normal(0, 1.0, d["old"].shape)  # ratios far from 1 too
    cfg = LossConfig.from_preset("sapo")
    assert (cfg.sapo_tau_pos, cfg.sapo_tau_neg, cfg.aggregation) == (1.0, 1.05, "seq-mean-token-mean")
    fields, _ = prepare(cfg, d)
    m = d["mask"]
    a = np.asarray(fields["advantages"], np.float64)
    assert (a[m > 0] > 0).any() and (a[m > 0] < 0).any()
    r = np.exp(d["logp"] - d["old"])
    tau = np.where(a > 0, 1.0, 1.05)
    s = sigmoid(tau * (r - 1))
    per_token = -(4 / tau) * s * a
    logp = f32(d["logp"])
    value, metrics = full_loss(cfg, fields, logp, d["old"])
    assert float(value) == pytest.approx(np_aggregate(per_token, m, "seq-mean-token-mean"), rel=1e-5)
    rows = m.sum(axis=1)
    seqs = (rows > 0).sum()
    expected_grad = -4 * s * (1 - s) * r * a * m / np.maximum(rows, 1)[:, None] / seqs
    grad = jax.grad(lambda x: full_loss(cfg, fields, x, d["old"])[0])(logp)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-4, atol=1e-7)
    # on policy the gate's gradient is the plain policy gradient's
    g0 = jax.grad(lambda x: full_loss(cfg, fields, x, d["old"])[0])(f32(d["old"]))
    np.testing.assert_allclose(np.asarray(g0), -a * m / np.maximum(rows, 1)[:, None] / seqs, rtol=1e-4, atol=1e-7)


def test_aipo_preset_against_numpy():
    """AIPO's one-sided truncation: weight min(r, 2) x min(pi_old / pi_sampler, 2) on -A log pi."""
    d = make(10)
    cfg = LossConfig.from_preset("aipo")
    fields, _ = prepare(cfg, d)
    m = d["mask"]
    a = np.asarray(fields["advantages"], np.float64)
    r = np.exp(d["logp"] - d["old"])
    weight = np.minimum(r, 2.0) * np.minimum(np.exp(d["old"] - d["sampler"]), 2.0)
    assert (np.exp(d["old"] - d["sampler"])[m > 0] > 2).any() or (r[m > 0] < 0.8).any()
    logp = f32(d["logp"])
    value, _ = full_loss(cfg, fields, logp, d["old"])
    assert float(value) == pytest.approx(np_aggregate(-weight * a, m, "token-mean"), rel=1e-5)
    grad = jax.grad(lambda x: full_loss(cfg, fields, x, d["old"])[0])(logp)
    np.testing.assert_allclose(np.asarray(grad), -weight * a * m / m.sum(), rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("override, field", [
    ("is_floor=1.0", "rl.loss.is_floor"), ("is_floor=-0.1", "rl.loss.is_floor"),
    ("is_cap=1.0", "rl.loss.is_cap"), ("is_cap=0.5", "rl.loss.is_cap"),
    ("is_veto=0.0", "rl.loss.is_veto"), ("is_veto=1.0", "rl.loss.is_veto"),
    ("is_level=batch", "rl.loss.is_level"), ("is_mode=drop", "rl.loss.is_mode"),
    ("m2po_tau=0", "rl.loss.m2po_tau"), ("sapo_tau_pos=0", "rl.loss.sapo_tau_pos"),
    ("sapo_tau_neg=-1", "rl.loss.sapo_tau_neg")])
def test_thresholds_out_of_range_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(Config, "configs/default.yaml", [f"rl.loss.{override}"])


def test_correction_fields_load_as_overrides():
    config = load_config(Config, "configs/default.yaml", ["rl.loss.is_level=geometric", "rl.loss.is_mode=mask",
                                                          "rl.loss.is_floor=0.99", "rl.loss.is_cap=inf",
                                                          "rl.loss.is_veto=1e-4", "rl.loss.preset=sapo"])
    loss = config.rl.loss
    assert (loss.is_level, loss.is_mode, loss.is_floor, loss.is_cap, loss.is_veto, loss.objective) == (
        "geometric", "mask", 0.99, math.inf, 1e-4, "sapo")


# --------------------------------------------------------------------------- sampler / trainer agreement


def test_on_policy_weights_are_one_with_top_p_and_top_k():
    """The acceptance line: with top-p 0.9, top-k 50 and temperature 0.7, the IS weights of on-policy samples
    (the trainer's log-prob program on the same policy against the sampler's log-probs) are 1 to 1e-5."""
    from jaxrl.sampling import SamplingConfig, sample
    from jaxrl.train import completion_logprobs

    config = models.ModelConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                head_dim=8, intermediate_size=64)
    policy = models.init(config, 3)
    prompts = np.array([[0, 0, 2, 5, 6, 7], [2, 9, 8, 7, 6, 5], [0, 0, 0, 0, 2, 11]], np.int32)
    sampling = SamplingConfig(max_new_tokens=10, temperature=0.7, top_k=50, top_p=0.9, compaction=False,
                              decode_segments=1)
    rollout = sample(policy, jnp.asarray(prompts), jnp.asarray(prompts != 0), jax.random.key(5), sampling,
                     eos_id=-1, pad_id=0, group_size=2)
    old_logp, _ = jax.jit(completion_logprobs)(policy, rollout.tokens, rollout.prompt_valid, 0.7)  # as the trainer
    mask = np.asarray(rollout.completion_mask)
    fields, metrics = jax.jit(functools.partial(prepare_batch, LossConfig(is_level="token", is_cap=2.0), group_size=2))(
        rewards=jnp.arange(6.0), completion_mask=rollout.completion_mask, old_logp=old_logp, key=jax.random.key(0),
        sampler_logp=rollout.sampler_logp)
    weights = np.asarray(fields["token_weights"])[mask]
    assert mask.sum() == 6 * 10 and np.abs(weights - 1).max() <= 1e-5, np.abs(weights - 1).max()
    assert float(metrics["logp_gap_max"]) <= 1e-5
