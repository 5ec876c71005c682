"""The RL step with any loss composition: gradient accumulation is exact, a variant written outside the
library trains through the normal trainer, and every preset runs the default recipe."""

import dataclasses
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fake_devices import run_on_eight_devices
from jaxrl import models
from jaxrl import loop, losses
from jaxrl.checkpoint import Checkpointer
from jaxrl.loop import resume, rl, setup
from jaxrl.train import make_optimizer
from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.losses import Controls, LossConfig
from jaxrl.metrics import read_metrics
from jaxrl.train import (by_micro_batches, completion_logprobs, critic_values, init_critic, init_train_state,
                         make_rl_gradients)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loss_pieces  # noqa: E402

MODEL = models.ModelConfig(vocab_size=32, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                           intermediate_size=64)
B, LP, N = 16, 6, 10


def _batch(policy, seed=0, critic=None):
    """A sampler-layout batch with ragged prompts and completions (one completion empty), old/ref log-probs
    off the current policy, per-sequence advantages, sparse token weights and a KL-Cov selection."""
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(3, MODEL.vocab_size, (B, LP + N)), jnp.int32)
    prompt_len = rng.integers(2, LP + 1, B)
    prompt_valid = jnp.asarray(np.arange(LP)[None] >= LP - prompt_len[:, None])
    lengths = rng.integers(1, N + 1, B)
    lengths[3] = 0
    mask = jnp.asarray(np.arange(N)[None] < lengths[:, None], jnp.float32)
    logp, _ = completion_logprobs(policy, tokens, prompt_valid)
    batch = {
        "tokens": tokens, "prompt_valid": prompt_valid, "loss_mask": mask,
        "old_logp": logp + jnp.asarray(rng.normal(0, 0.2, (B, N)), jnp.float32),
        "ref_logp": logp + jnp.asarray(rng.normal(0, 0.2, (B, N)), jnp.float32),
        "advantages": jnp.asarray(np.repeat(rng.normal(size=(B, 1)), N, 1), jnp.float32) * mask,
        "token_weights": jnp.asarray(rng.random((B, N)) < 0.8, jnp.float32),
        "kl_cov_mask": jnp.asarray(rng.random((B, N)) < 0.2, jnp.float32),
    }
    if critic is not None:
        values = critic_values(critic, tokens, prompt_valid)
        batch["old_values"] = values + jnp.asarray(rng.normal(0, 0.1, (B, N)), jnp.float32)
        batch["returns"] = jnp.asarray(rng.normal(size=(B, N)), jnp.float32) * mask
    return batch


def test_logprobs_and_values_by_micro_batches_equal_the_whole_batch():
    """The rollout's log-prob and value passes run in rl.micro_batches groups of rows (the train step's
    activation bound): the same numbers as the whole batch at once, row for row (remat on, as in training)."""
    policy = models.init(dataclasses.replace(MODEL, remat="full"), 0)
    critic = init_critic(policy)
    critic = critic.replace(params={**critic.params, "head": {"kernel": jnp.linspace(-1, 1, MODEL.hidden_size),
                                                               "bias": jnp.float32(0.5)}})
    batch = _batch(policy)
    tokens, prompt_valid = batch["tokens"], batch["prompt_valid"]
    whole = jax.jit(completion_logprobs)(policy, tokens, prompt_valid, 0.7)
    parts = jax.jit(by_micro_batches(completion_logprobs, 4))(policy, tokens, prompt_valid, 0.7)
    for a, b in zip(whole, parts):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
    values = jax.jit(by_micro_batches(critic_values, 8))(critic, tokens, prompt_valid)
    np.testing.assert_allclose(np.asarray(values), np.asarray(critic_values(critic, tokens, prompt_valid)),
                               rtol=1e-6, atol=1e-6)
    assert by_micro_batches(completion_logprobs, 1) is completion_logprobs


def _relative_error(a, b):
    diffs = [np.linalg.norm(np.asarray(x) - np.asarray(y)) / max(np.linalg.norm(np.asarray(x)), 1e-30)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return max(diffs)


CASES = [(mode, "k3", False) for mode in losses.AGGREGATIONS] + [("token-mean", "full", False),
                                                                  ("seq-mean-token-mean", "k2", True)]


@pytest.mark.parametrize("aggregation, kl_estimator, with_critic", CASES)
def test_four_micro_batches_give_the_loss_and_gradient_of_one(aggregation, kl_estimator, with_critic):
    policy = models.init(MODEL, 0)
    ref_policy = models.init(MODEL, 1)
    critic = init_critic(models.init(MODEL, 2)) if with_critic else None
    if critic is not None:  # a non-zero head, so that the value loss has a gradient everywhere
        critic = critic.replace(params={**critic.params, "head": {"kernel": jnp.full((MODEL.hidden_size,), 0.1),
                                                                  "bias": jnp.float32(0.3)}})
    state = init_train_state(policy, optax.sgd(1.0), critic, optax.sgd(1.0) if critic else None)
    config = LossConfig(aggregation=aggregation, objective="ppo_clip", dual_clip_c=3.0, kl_coef=0.1,
                        kl_estimator=kl_estimator, entropy_coef=0.01, kl_cov_ratio=0.1)
    loss = losses.build_loss(config, with_critic=with_critic)
    batch = _batch(policy, critic=critic)
    controls = Controls(entropy_coef=jnp.float32(0.01), temperature=jnp.float32(1.0))
    full = kl_estimator == "full"
    results = {}
    for micro in (1, 4):
        gradients = jax.jit(make_rl_gradients(loss, micro_batches=micro, norm_length=N, full_kl=full))
        results[micro] = gradients(state, batch, controls, ref_policy if full else None)
    (g1, m1), (g4, m4) = results[1], results[4]
    assert abs(float(m1["loss"]) - float(m4["loss"])) <= 1e-6 * abs(float(m1["loss"]))
    assert _relative_error(g1, g4) <= 1e-6
    assert set(g1) == ({"policy", "critic"} if with_critic else {"policy"})
    # Metrics add up over micro-batches too (extremes take max/min).
    for name in m1:
        np.testing.assert_allclose(m4[name], m1[name], rtol=2e-6, atol=1e-7, err_msg=name)
    assert float(m1["loss"]) != 0.0
    assert all(np.linalg.norm(np.asarray(g)) > 0 for g in jax.tree.leaves(g1["policy"]))


def test_step_metrics_describe_the_tokens_the_loss_counts():
    """A step's ratio metrics are over the valid tokens of non-zero weight (those the loss counts), with one
    micro-batch or four."""
    policy = models.init(MODEL, 0)
    state = init_train_state(policy, optax.sgd(1.0))
    batch = _batch(policy)
    valid = np.asarray(batch["loss_mask"]) > 0
    counted = valid & (np.asarray(batch["token_weights"]) != 0)
    logp, _ = completion_logprobs(policy, batch["tokens"], batch["prompt_valid"])
    ratio = np.exp(np.asarray(logp, np.float64) - np.asarray(batch["old_logp"], np.float64))
    assert ratio[counted].mean() != pytest.approx(ratio[valid].mean(), rel=1e-3)
    loss = losses.build_loss(LossConfig(preset="dapo"))
    for micro in (1, 4):
        _, metrics = jax.jit(make_rl_gradients(loss, micro_batches=micro))(
            state, batch, Controls(jnp.float32(0.0), jnp.float32(1.0)))
        assert float(metrics["ratio_mean"]) == pytest.approx(ratio[counted].mean(), rel=1e-5)
        assert float(metrics["ratio_max"]) == pytest.approx(ratio[counted].max(), rel=1e-5)
        assert float(metrics["ratio_min"]) == pytest.approx(ratio[counted].min(), rel=1e-5)


def test_micro_batch_gradients_of_bf16_weights_are_summed_in_float32():
    """With bf16 weights the micro-batches' gradients are summed in float32 (the scan carries float32) and the
    result has the weights' dtype, as with one micro-batch."""
    policy = models.init(dataclasses.replace(MODEL, dtype="bfloat16", param_dtype="bfloat16"), 0)
    state = init_train_state(policy, optax.sgd(1.0))
    gradients = make_rl_gradients(losses.build_loss(LossConfig()), micro_batches=4)
    args = (state, _batch(policy), Controls(jnp.float32(0.0), jnp.float32(1.0)))
    jaxpr = jax.make_jaxpr(gradients)(*args)
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    n_params = len(jax.tree.leaves(policy.params))
    carried = [v.aval.dtype for v in scan.outvars[:n_params]]  # the gradient sums lead the carry
    assert carried == [jnp.float32] * n_params, carried
    grads, _ = jax.jit(gradients)(*args)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}


def test_a_batch_that_does_not_split_is_an_error():
    policy = models.init(MODEL, 0)
    state = init_train_state(policy, optax.sgd(1.0))
    gradients = make_rl_gradients(losses.build_loss(LossConfig()), micro_batches=3)
    with pytest.raises(ValueError, match="16 rows does not split into 3 micro-batches"):
        gradients(state, _batch(policy), Controls(jnp.float32(0.0), jnp.float32(1.0)))


TINY = [
    "model.hidden_size=32", "model.num_layers=2", "model.head_dim=8", "model.intermediate_size=64",
    "task.num_train=200", "task.num_eval=16", "sft.steps=2", "sft.batch_size=8",
    "rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4", "rl.minibatches=2", "rl.micro_batches=2",
    "rl.sampling.max_new_tokens=24", "eval.every=0", "eval.batch_size=16", "checkpoint.every=0",
    "reward.timeout_s=2.0", "progress=false",
]


def _run(tmp_path, monkeypatch, *overrides):
    """A few RL steps of the default recipe (tiny sizes) with a reward that varies inside every group (the
    held-out evaluation keeps the task's reward); returns the RL records and the (before, after) parameters of
    every update."""
    updates = []
    real_update = rl.rl_update

    def spy(state, *args, **kwargs):
        before = jax.device_get(state.policy.params)  # on the host: the update donates (deletes) its input state
        new_state, metrics = real_update(state, *args, **kwargs)
        updates.append((before, jax.device_get(new_state.policy.params)))
        return new_state, metrics

    monkeypatch.setattr(rl, "rl_update", spy)
    config = load_config(Config, "configs/default.yaml", [
        *TINY, f"output_dir={tmp_path}", "reward.function=reward_fns:length_parity", "eval.reward=arithmetic",
        *overrides])
    loop.run(config)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    return records, updates


PRESET_ARGS = {name: [f"rl.loss.preset={name}"] for name in losses.PRESETS}
PRESET_ARGS["ppo"].append("rl.critic.model=policy_copy")
for _name in ("bnpo", "w_reinforce", "passk", "seed_grpo"):  # binary rewards / answer clusters (issue 35)
    PRESET_ARGS[_name].append("reward.function=reward_fns:length_parity_answers")
PRESET_ARGS["passk"].append("rl.loss.advantage.passk_k=2")  # k < rl.group_size (4 here)
# an untrained policy's samples share no answer: with alpha 1 every group's scale 1 - SE / log G would be 0
PRESET_ARGS["seed_grpo"].append("rl.loss.advantage.seed_alpha=0.5")
# In `make test`: the default (dapo), a KL to the reference (grpo), a critic (ppo), a sequence-level ratio (gspo)
# and a masked, keyed batch (clip_cov). The others differ from these only in loss pieces that test_losses checks
# one by one; they run in the slow suite (`make test-slow`).
FAST_PRESETS = ("clip_cov", "dapo", "grpo", "gspo", "ppo")


@pytest.mark.parametrize("preset", [p if p in FAST_PRESETS else pytest.param(p, marks=pytest.mark.slow)
                                    for p in sorted(PRESET_ARGS)])
def test_every_preset_runs_the_default_recipe(preset, tmp_path, monkeypatch):
    records, updates = _run(tmp_path, monkeypatch, *PRESET_ARGS[preset])
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        numbers = {k: v for k, v in record.items() if k.startswith(("train/", "batch/", "reward/"))}
        assert all(v is not None and math.isfinite(v) for v in numbers.values()), numbers
        assert record["batch/advantage_std"] > 0 and record["train/grad_norm"] > 0
    for before, after in updates:
        assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), before, after)))
    if preset == "ppo":
        assert all(r["train/critic_grad_norm"] > 0 and "train/value_loss" in r for r in records)
    if preset in ("grpo", "reinforce_pp"):
        assert all(r.get("train/kl_ref", r.get("batch/kl_ref")) is not None for r in records)


def test_a_new_variant_defined_here_trains_through_the_normal_trainer(tmp_path, monkeypatch):
    """A variant the library does not have: a rank-based group advantage, a soft-clipped ("tanh")
    surrogate and a squared-log-ratio penalty, registered by name in tests/loss_pieces.py (one estimator, one
    objective, one term) and named in the config, then trained by the normal trainer."""
    loss_pieces.CALLS.clear()
    calls = loss_pieces.CALLS
    records, updates = _run(tmp_path, monkeypatch, "rl.epochs=2", "imports=[loss_pieces]",
                            "rl.loss.advantage.estimator=test_rank", "rl.loss.objective=test_tanh_surrogate",
                            "rl.loss.clip_eps_high=0.3", "rl.loss.terms=[test_sq_log_ratio]")
    assert "advantage" in calls and calls.count("advantage") < len(calls), "both pieces were traced"
    assert len(updates) == 2
    for before, after in updates:
        assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), before, after)))
    for record in records:
        assert 0.5 < record["train/soft_ratio"] < 1.5 and record["train/sq_log_ratio"] >= 0
        assert math.isfinite(record["train/loss"]) and record["train/grad_norm"] > 0
        assert 0.3 < record["batch/advantage_std"] < 0.5  # uniform ranks in [-0.5, 0.5]: std ~0.37


DATA_PARALLEL_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, optax
from jaxrl import models
from jaxrl import losses
from jaxrl.losses import Controls, LossConfig
from jaxrl.sharding import make_mesh, replicate, shard_batch
from jaxrl.train import init_train_state, make_rl_gradients
from test_rl_step import MODEL, N, _batch, _relative_error
assert len(jax.devices()) == 8
policy = models.init(MODEL, 0)
batch = _batch(policy)
controls = Controls(entropy_coef=jnp.float32(0.01), temperature=jnp.float32(1.0))
for aggregation in losses.AGGREGATIONS:
    loss = losses.build_loss(LossConfig(aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01))
    results = []
    for shape, micro in [((1, 1, 1), 1), ((4, 2, 1), 2)]:  # data x fsdp, micro-batched (tensor: test_scale_out)
        mesh = make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])
        state = replicate(init_train_state(policy, optax.sgd(1.0)), mesh)
        gradients = jax.jit(make_rl_gradients(loss, micro_batches=micro, norm_length=N))
        results.append(gradients(state, shard_batch(batch, mesh), controls))
    (g1, m1) = results[0]
    for g, m in results[1:]:
        assert abs(float(m["loss"]) - float(m1["loss"])) <= 1e-6 * abs(float(m1["loss"])), aggregation
        assert _relative_error(g1, g) <= 1e-6, (aggregation, _relative_error(g1, g))
print("OK")
"""


def test_data_parallel_meshes_give_the_single_device_loss_and_gradient():
    """Whole-batch normalisers make the loss independent of data parallelism (8 fake CPU devices)."""
    run_on_eight_devices(DATA_PARALLEL_SCRIPT)


def test_controllers_move_the_entropy_coefficient_and_temperature_and_are_checkpointed(tmp_path, monkeypatch):
    """A target entropy far above the policy's raises the bonus coefficient and the sampling temperature
    every step (within their bounds); the controller state is saved with the run state."""
    import orbax.checkpoint as ocp

    records, _ = _run(tmp_path, monkeypatch, "rl.steps=3", "checkpoint.every=2", "rl.loss.entropy_target=50",
                      "rl.loss.entropy_coef_step=0.01", "rl.loss.temperature_target_entropy=50",
                      "rl.loss.temperature_rate=0.002", "rl.loss.temperature_max=1.3")
    coefs = [r["train/entropy_coef"] for r in records]
    temperatures = [r["train/temperature"] for r in records]
    np.testing.assert_allclose(coefs, [0.01, 0.02, 0.03], rtol=1e-6)
    assert 1.0 < temperatures[0] < temperatures[1] <= temperatures[2] <= 1.3
    assert [r["train/entropy_bonus"] for r in records] == pytest.approx(coefs)  # entropy below the target
    saved = ocp.StandardCheckpointer().restore(os.path.abspath(tmp_path / "checkpoints" / "3" / "state"))
    assert float(saved["controls"]["entropy_coef"]) == pytest.approx(coefs[-1])
    assert float(saved["controls"]["temperature"]) == pytest.approx(temperatures[-1])
    assert float(saved["controls"]["entropy_below_target"]) == 1.0


def test_the_adaptive_entropy_bonus_is_off_while_the_entropy_is_above_its_target():
    """Skywork-OR1: the coefficient falls by its step while the entropy is above the target, and no bonus is
    applied until the entropy is below it again."""
    from jaxrl.loop import update_controls

    config = losses.LossConfig(entropy_coef=0.05, entropy_target=0.5, entropy_coef_step=0.01)
    controls = Controls.initial(config, 1.0)
    assert float(controls.entropy_bonus) == pytest.approx(0.05)
    controls = update_controls(controls, 0.9, config)
    assert (float(controls.entropy_coef), float(controls.entropy_bonus)) == pytest.approx((0.04, 0.0))
    controls = update_controls(controls, 0.3, config)
    assert (float(controls.entropy_coef), float(controls.entropy_bonus)) == pytest.approx((0.05, 0.05))
    assert update_controls(controls, float("nan"), config) is controls  # a skipped step measured nothing


def test_shaped_reward_components_are_logged_and_normalised_one_by_one(tmp_path, monkeypatch):
    """reward.* shaping composes the verifiable reward with format / overlong / length components; each is
    logged, the total is their weighted sum, and per-component normalisation gets them all."""
    seen = {}
    real_prepare = losses.prepare_batch

    def spy(config, **kwargs):
        seen["components"] = kwargs["components"].shape
        seen["weights"] = kwargs["component_weights"]
        return real_prepare(config, **kwargs)

    monkeypatch.setattr(losses, "prepare_batch", spy)
    records, _ = _run(tmp_path, monkeypatch, "reward.format_weight=0.5", "reward.overlong_buffer=8",
                      "reward.length_target=10", "reward.length_penalty_coef=0.1",
                      "rl.loss.advantage.per_component=true")
    assert seen["components"] == (16, 4) and seen["weights"] == (1.0, 0.5, 1.0, 1.0)
    for r in records:
        assert {"reward/correct", "reward/format", "reward/overlong", "reward/length"} <= set(r)
        expected = r["reward/correct"] + 0.5 * r["reward/format"] + r["reward/overlong"] + r["reward/length"]
        assert r["reward/total"] == pytest.approx(expected, abs=1e-6)
        assert r["reward/overlong"] <= 0 and r["reward/length"] <= 0 and r["batch/advantage_std"] > 0


def test_a_step_with_a_planted_nan_is_skipped_and_leaves_the_state_untouched():
    """A NaN advantage in one row makes the loss non-finite: the step reports `skipped` and returns the very
    same parameters, optimizer state and step count; the next clean batch trains normally."""
    from jaxrl.train import make_optimizer, make_rl_step

    policy = models.init(MODEL, 0)
    optimizer = make_optimizer(1e-2)
    state = init_train_state(policy, optimizer)
    step = make_rl_step(optimizer, losses.build_loss(LossConfig(preset="grpo")), norm_length=N)
    controls = Controls(entropy_coef=jnp.float32(0.0), temperature=jnp.float32(1.0))
    batch = _batch(policy)
    poisoned = dict(batch, advantages=batch["advantages"].at[5, 2].set(jnp.nan))
    after, metrics = step(state, poisoned, controls)
    assert float(metrics["skipped"]) == 1.0 and not np.isfinite(float(metrics["loss"]))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trained, metrics = step(after, batch, controls)
    assert float(metrics["skipped"]) == 0.0 and int(trained.step) == 1
    assert int(metrics["loss_tokens"]) == int(np.asarray(batch["loss_mask"]).sum()) > 0
    assert _relative_error(trained.policy.params, state.policy.params) > 0


@pytest.mark.parametrize("passes", [1, 2], ids=["one_pass", "two_passes"])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donating"])
def test_an_update_that_overflows_is_skipped_and_leaves_the_state_untouched(donate, passes, monkeypatch):
    """Finite loss and gradients, but float16 parameters and a learning rate of 1e5 (Adam's first update is
    about +-lr per element, beyond float16's 65504): the step drops the update whole, reports `skipped` and
    `nonfinite_update`, and returns the very same parameters, optimizer state and step count, also when it
    donates its input state. The same update of float32 parameters is finite, and applied. Both ways of
    checking: one pass and a select (small states), and two passes (states over ONE_PASS_MAX_STATE_BYTES)."""
    from jaxrl import train
    from jaxrl.train import make_optimizer, make_rl_step

    if passes == 2:
        monkeypatch.setattr(train, "ONE_PASS_MAX_STATE_BYTES", 0)

    policy = models.init(MODEL, 0)
    optimizer = make_optimizer(1e5)
    step = make_rl_step(optimizer, losses.build_loss(LossConfig(preset="grpo")), norm_length=N, donate=donate)
    controls = Controls(entropy_coef=jnp.float32(0.0), temperature=jnp.float32(1.0))
    batch = _batch(policy)

    half = init_train_state(policy.replace(params=jax.tree.map(lambda x: x.astype(jnp.float16), policy.params)),
                            optimizer)
    expected = jax.device_get(half)  # on the host: a donating step deletes its input
    after, metrics = step(half, batch, controls)
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert float(metrics["skipped"]) == 1.0 and float(metrics["nonfinite_update"]) == 1.0
    assert int(after.step) == 0
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    trained, metrics = step(init_train_state(policy, optimizer), batch, controls)
    assert float(metrics["skipped"]) == 0.0 and float(metrics["nonfinite_update"]) == 0.0
    assert int(trained.step) == 1 and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(trained))
    assert max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(trained.policy.params)) > 65504


def test_a_run_whose_update_turns_non_finite_never_saves_it(tmp_path, monkeypatch):
    """A test hook scales every optimizer update from the second on by NaN (loss and gradients stay finite):
    after one warm-start update, which the hook leaves alone, RL update 1 trains, updates 2 and 3 are skipped
    (`train/skipped`, `train/nonfinite_update`), the run stops after rl.max_consecutive_skips = 2 of them, and
    every saved checkpoint holds finite arrays: checkpoint 2 holds the parameters of update 1, which the
    skipped update left as they were."""
    import orbax.checkpoint as ocp

    def nan_from_the_second_update(config):
        nan_after_first = optax.scale_by_schedule(lambda count: jnp.where(count >= 1, jnp.nan, 1.0))
        return optax.chain(make_optimizer(**dataclasses.asdict(config)), nan_after_first)

    monkeypatch.setattr(setup, "optimizer_from", nan_from_the_second_update)
    with pytest.raises(loop.TrainingDiverged, match=r"RL steps 2..3: 2 consecutive steps with non-finite loss, "
                                                    r"gradients or updated parameters"):
        _run(tmp_path, monkeypatch, "sft.steps=1", "rl.steps=4", "rl.minibatches=1", "checkpoint.every=1",
             "checkpoint.keep=3", "rl.max_consecutive_skips=2")
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/skipped" in r]
    assert [(r["step"], r["train/skipped"], r["train/nonfinite_update"]) for r in records] == [
        (1, 0.0, 0.0), (2, 1.0, 1.0)]  # step 3 stopped the run before its record
    assert all(np.isfinite(r["train/loss"]) and np.isfinite(r["train/grad_norm"]) for r in records)
    steps = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
    assert steps == [1, 2]  # and before its save
    saved = {s: ocp.StandardCheckpointer().restore(os.path.abspath(tmp_path / "checkpoints" / str(s) / "state"))
             for s in steps}
    for s in steps:
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(saved[s])), s
    for a, b in zip(jax.tree.leaves(saved[1]["params"]), jax.tree.leaves(saved[2]["params"])):
        np.testing.assert_array_equal(a, b)


def test_a_non_finite_state_at_a_save_stops_the_run_without_a_checkpoint(tmp_path, monkeypatch):
    """Whatever made it (a hook here plants a NaN in the state the run saves at step 2), a non-finite state is
    not saved: the run stops naming the step and the array, and checkpoint 1 stays the newest."""
    real = resume.checkpoint_state

    def nan_at_step_2(state, *args):
        saved = real(state, *args)
        if int(state.step) == 2:  # the first array of the parameters, the embedding: one NaN
            leaves, treedef = jax.tree.flatten(saved["params"])
            saved["params"] = jax.tree.unflatten(treedef, [leaves[0].at[0, 0].set(jnp.nan), *leaves[1:]])
        return saved

    monkeypatch.setattr(resume, "checkpoint_state", nan_at_step_2)
    with pytest.raises(loop.TrainingDiverged, match=r"^RL step 2: checkpoint 2 not saved: non-finite values in "
                                                    r"params\.embed_tokens\.weight\.value; the last checkpoint in .* "
                                                    r"holds the last good"):
        _run(tmp_path, monkeypatch, "sft.steps=1", "rl.steps=3", "rl.minibatches=1", "rl.micro_batches=1",
             "checkpoint.every=1")
    assert Checkpointer.newest(tmp_path / "checkpoints") == 1


def test_the_run_stops_after_too_many_consecutive_non_finite_steps(tmp_path, monkeypatch):
    """Each non-finite step is skipped and logged (`train/skipped`); rl.max_consecutive_skips of them in a row
    stop the run with the step numbers and the setting, and the process gets its SIGTERM handler back."""
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(loop.TrainingDiverged, match=r"RL steps 1..2: 2 consecutive steps with non-finite loss, "
                                                    r"gradients or updated parameters \(rl.max_consecutive_skips = "
                                                    r"2\)"):
        _run(tmp_path, monkeypatch, "rl.steps=4", "rl.max_consecutive_skips=2", "imports=[loss_pieces]",
             "rl.loss.terms=[test_nan]")
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/skipped" in r]
    assert [(r["step"], r["train/skipped"], r["train/grad_norm"]) for r in records] == [(1, 1.0, None)]
    assert signal.getsignal(signal.SIGTERM) is handler


def test_sampled_evaluation_reports_pass_at_k_and_maj_at_k(tmp_path, monkeypatch):
    _run(tmp_path, monkeypatch, "eval.samples=4", "eval.pass_k=[1, 2, 4]", "eval.batch_size=16")
    summary = json.loads((tmp_path / "summary.json").read_text())
    p1, p2, p4 = (summary[f"pass@{k}_after_rl"] for k in (1, 2, 4))
    assert 0.0 <= p1 <= p2 <= p4 <= 1.0
    assert all(0.0 <= summary[f"maj@{k}_after_rl"] <= 1.0 for k in (1, 2, 4))
    final = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("final")][0]
    assert final["eval/samples"] == 4 and final["eval/pass@4"] == p4
    from jaxrl.configlib import ConfigError
    with pytest.raises(ConfigError, match=r"eval.pass_k \[1, 8\] has k > eval.samples \(4\)"):
        load_config(Config, "configs/default.yaml", ["eval.samples=4", "eval.pass_k=[1, 8]"])


def test_jaxrl_eval_of_the_final_checkpoint_reproduces_the_runs_evaluation(tmp_path, monkeypatch, capsys):
    """`jaxrl eval CONFIG checkpoint=RUN` loads the newest checkpoint (sharded like a run) and its tokenizer:
    the greedy accuracy is the run's own final evaluation; sampled metrics come with eval.samples."""
    from jaxrl import cli

    out = tmp_path / "run"
    _run(out, monkeypatch, "rl.steps=2")
    summary = json.loads((out / "summary.json").read_text())
    args = ["eval", "configs/default.yaml", *TINY, f"checkpoint={out}", "eval.samples=2", "eval.pass_k=[1, 2]"]
    assert cli.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kind"] == "run" and result["step"] == 2
    assert result["eval/accuracy"] == summary["accuracy_after_rl"]
    assert 0.0 <= result["eval/pass@1"] <= result["eval/pass@2"] <= 1.0
    assert cli.main(["eval", str(out)]) == 0  # a run directory alone: its newest checkpoint and its config.yaml
    result = json.loads(capsys.readouterr().out)
    assert result["eval/accuracy"] == summary["accuracy_after_rl"] and result["eval_reward"] == "arithmetic"
    assert cli.main(["eval", "configs/default.yaml", *TINY]) == 2
    assert "exactly one checkpoint=PATH" in capsys.readouterr().err
    assert cli.main(["eval", "configs/default.yaml", *TINY, f"checkpoint={tmp_path / 'nothing'}"]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_critic_warmup_trains_only_the_critic_first(tmp_path, monkeypatch):
    records, updates = _run(tmp_path, monkeypatch, *PRESET_ARGS["ppo"], "rl.critic.warmup_steps=1")
    (before1, after1), (before2, after2) = updates
    assert _relative_error(before1, after1) == 0.0, "the policy moved during the critic warm-up"
    assert _relative_error(before2, after2) > 0
    assert records[0]["train/critic_warmup"] == 1.0 and "train/critic_warmup" not in records[1]
    assert records[0]["train/critic_grad_norm"] > 0


@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)],  # slow: suite time
                         ids=["synchronous", "overlap"])
def test_reference_reset_makes_the_kl_restart_from_zero(tmp_path, monkeypatch, overlap):
    """With one update per step, a reference reset every step leaves nothing between the policy and its
    reference when the next update starts: the KL estimate is 0 there, and not without the reset. With
    rl.overlap the next batch was drawn before the reset: its reference log-probs are computed after it."""
    common = ["rl.minibatches=1", "rl.micro_batches=1", "rl.steps=3", "rl.loss.kl_coef=0.1", "rl.loss.preset=grpo",
              "rl.optim.learning_rate=0.01", "rl.optim.warmup_steps=0", f"rl.overlap={str(overlap).lower()}"]
    reset, _ = _run(tmp_path / "reset", monkeypatch, *common, "rl.ref_reset_every=1")
    kept, _ = _run(tmp_path / "kept", monkeypatch, *common)
    assert [r["train/kl_ref"] for r in reset] == [0.0, 0.0, 0.0]
    assert kept[0]["train/kl_ref"] == 0.0 and kept[2]["train/kl_ref"] > kept[1]["train/kl_ref"] > 1e-3
    if overlap:  # the batches really were drawn in the background, one update behind
        assert all(r["offpolicy/staleness_max"] == 1 for r in reset[1:])


def test_overlap_recomputes_reference_logprobs_after_a_temperature_change(tmp_path, monkeypatch):
    """The temperature controller moves the temperature after every update; a batch drawn in the background
    before that gets its reference log-probs at the new temperature. With a learning rate too small to
    move the policy, the policy is its reference: the KL estimate stays 0 while the temperature falls."""
    records, _ = _run(tmp_path, monkeypatch, "rl.overlap=true", "rl.minibatches=1", "rl.micro_batches=1",
                      "rl.steps=3", "rl.loss.preset=grpo", "rl.loss.kl_coef=0.1", "rl.optim.learning_rate=1e-20",
                      "rl.optim.warmup_steps=0", "rl.loss.temperature_target_entropy=0.0",
                      "rl.loss.temperature_rate=0.05", "rl.loss.temperature_min=0.1")
    temperatures = [r["train/temperature"] for r in records]
    assert temperatures[0] > temperatures[1] > temperatures[2]
    assert all(abs(r["train/kl_ref"]) < 1e-9 for r in records), [r["train/kl_ref"] for r in records]


def test_a_separate_critic_network_is_loaded_from_its_checkpoint(tmp_path, monkeypatch):
    """`rl.critic.model=separate`: the value model is its own (here smaller) network read from
    `rl.critic.checkpoint`, with a zero-initialised head; it trains alongside the policy. A critic whose
    vocabulary is smaller than the policy's is refused, naming the checkpoint."""
    from jaxrl.convert import save_policy

    small = models.ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                               head_dim=8, intermediate_size=32)
    save_policy(models.init(small, 5), tmp_path / "critic")
    seen = []
    real_init = setup.init_critic
    monkeypatch.setattr(setup, "init_critic", lambda trunk: seen.append(trunk.config) or real_init(trunk))
    records, _ = _run(tmp_path / "run", monkeypatch, "rl.loss.preset=ppo", "rl.critic.model=separate",
                      f"rl.critic.checkpoint={tmp_path / 'critic'}")
    assert seen == [small]
    assert all(r["train/critic_grad_norm"] > 0 and "train/value_loss" in r for r in records)

    save_policy(models.init(dataclasses.replace(small, vocab_size=16), 5), tmp_path / "narrow")
    with pytest.raises(ValueError, match="narrow: its vocabulary has 16 tokens, fewer than the policy's 32"):
        _run(tmp_path / "run2", monkeypatch, "rl.loss.preset=ppo", "rl.critic.model=separate",
             f"rl.critic.checkpoint={tmp_path / 'narrow'}")
    from jaxrl.configlib import ConfigError
    with pytest.raises(ConfigError, match="critic.model 'separate' loads its network from critic.checkpoint"):
        load_config(Config, "configs/default.yaml", ["rl.loss.preset=ppo", "rl.critic.model=separate"])


@pytest.mark.parametrize("with_critic", [False, True], ids=["policy", "critic"])
def test_a_donating_step_writes_the_pure_steps_result_over_its_input(with_critic):
    """`make_rl_step(donate=True)` gives the default step's state and metrics bit for bit, in the input's
    buffers: the compiled step aliases every byte of the state and the input is deleted. A critic initialised
    from the policy owns its trunk (one buffer cannot be donated twice), and a `copy_arrays` reference
    outlives the donation."""
    from jaxrl.train import copy_arrays, make_optimizer, make_rl_step

    policy = models.init(MODEL, 0)
    optimizer = make_optimizer(1e-2, weight_decay=0.1)
    critic = init_critic(policy) if with_critic else None
    critic_optimizer = make_optimizer(1e-2) if with_critic else None
    loss = losses.build_loss(LossConfig(objective="ppo_clip", kl_coef=0.1), with_critic=with_critic)
    controls = Controls(entropy_coef=jnp.float32(0.0), temperature=jnp.float32(1.0))
    batch = _batch(policy, critic=critic)
    state = init_train_state(policy, optimizer, critic, critic_optimizer)
    args = dict(norm_length=N, critic_optimizer=critic_optimizer)
    want, want_metrics = make_rl_step(optimizer, loss, **args)(state, batch, controls)
    reference = copy_arrays(state.policy)
    donating = make_rl_step(optimizer, loss, donate=True, **args)
    memory = donating.lower(state, batch, controls).compile().memory_analysis()
    assert memory.alias_size_in_bytes == sum(x.nbytes for x in jax.tree.leaves(state))
    got, got_metrics = donating(state, batch, controls)
    assert all(x.is_deleted() for x in jax.tree.leaves(state))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.device_get(got_metrics) == jax.device_get(want_metrics)
    for a, b in zip(jax.tree.leaves(reference.params), jax.tree.leaves(policy.params), strict=True):
        assert not a.is_deleted() and b.is_deleted()
    assert _relative_error(reference.params, want.policy.params) > 0


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_critic_of_other_head_sizes_is_laid_out_by_its_own_model(micro_batches):
    """A separately loaded critic (`rl.critic.model=separate`) may have other heads than the policy: its
    parameters, gradients and optimizer state follow its own layout (`Critic.layout`). They were laid out by
    the policy's, which refused 3 KV heads of 8 as 'not a whole number of heads of head_dim 16'."""
    from jaxrl.sharding import make_mesh
    from jaxrl.train import make_optimizer, make_rl_step

    critic_model = dataclasses.replace(MODEL, num_heads=6, num_kv_heads=3, head_dim=4)
    layout = models.Layout(make_mesh(1, 1, 1))
    policy = models.shard(models.init(dataclasses.replace(MODEL, head_dim=16), 0), layout)
    critic = init_critic(models.shard(models.init(critic_model, 1), layout))
    assert (policy.layout.head_dim, critic.layout.head_dim) == (16, 4)
    optimizer = make_optimizer(1e-2)
    state = init_train_state(policy, optimizer, critic, make_optimizer(1e-2))
    loss = losses.build_loss(LossConfig(objective="ppo_clip"), with_critic=True)
    step = make_rl_step(optimizer, loss, micro_batches=micro_batches, norm_length=N,
                        critic_optimizer=make_optimizer(1e-2))
    new, metrics = step(state, _batch(policy, critic=critic), Controls(entropy_coef=jnp.float32(0.0),
                                                                       temperature=jnp.float32(1.0)))
    assert np.isfinite(float(metrics["loss"])) and float(metrics["critic_grad_norm"]) > 0
    assert _relative_error(new.critic.params, critic.params) > 0
    for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(new), strict=True):
        assert after.sharding.is_equivalent_to(before.sharding, after.ndim)
