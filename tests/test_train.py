"""End to end: a tiny run of the whole pipeline (tokenizer, warm start, GRPO, eval, outputs)."""

import json
import os
import sys

import jax
import numpy as np
import pytest

from jaxrl import loop
from jaxrl.checkpoint import Checkpointer
from jaxrl.loop import held_out, rl, rollout
from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.metrics import read_metrics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TINY = [
    "model.hidden_size=32", "model.num_layers=2", "model.head_dim=8", "model.intermediate_size=64",
    "task.num_train=300", "task.num_eval=24", "sft.steps=4", "sft.batch_size=8",
    "rl.steps=3", "rl.prompts_per_step=4", "rl.group_size=4", "rl.minibatches=2", "rl.epochs=2",
    "rl.sampling.max_new_tokens=40", "rl.loss.kl_coef=0.05", "rl.loss.entropy_coef=0.01",
    "eval.every=2", "eval.batch_size=16", "checkpoint.every=2", "reward.timeout_s=1.0", "progress=false",
]


def tiny_config(tmp_path, *extra):
    return load_config(Config, "configs/default.yaml", [*TINY, f"output_dir={tmp_path}", *extra])


def test_rl_update_changes_parameters_with_finite_metrics(tmp_path):
    config = tiny_config(tmp_path)
    captured = {}
    real_update = rl.rl_update

    def spy(state, *args, **kwargs):
        before = jax.device_get(state.policy.params)  # on the host: the update donates (deletes) its input state
        new_state, metrics = real_update(state, *args, **kwargs)
        captured.setdefault("pairs", []).append((before, jax.device_get(new_state.policy.params), metrics))
        return new_state, metrics

    rl.rl_update = spy
    try:
        summary = loop.run(config)
    finally:
        rl.rl_update = real_update

    assert len(captured["pairs"]) == config.rl.steps
    for before, after, metrics in captured["pairs"]:
        changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), before, after))
        assert all(changed), "every parameter tensor should move in an update"
        assert all(np.isfinite(v) for v in metrics.values()), metrics
        assert {"loss", "entropy", "clip_frac_low", "clip_frac_high", "kl_ref", "grad_norm"} <= set(metrics)

    # Outputs of the run.
    assert 0.0 <= summary["accuracy_before_rl"] <= 1.0 and 0.0 <= summary["accuracy_after_rl"] <= 1.0
    assert summary["num_eval_problems"] == 24
    assert all(summary[k] >= 0 for k in ("sft_time_s", "rl_time_s", "eval_before_time_s", "total_wall_time_s"))
    on_disk = json.load(open(tmp_path / "summary.json"))
    assert on_disk["config"]["rl"]["steps"] == 3
    records = read_metrics(tmp_path / "metrics.jsonl")
    rl_steps = [r["step"] for r in records if r["phase"] == "rl" and "reward/mean" in r]
    assert rl_steps == [1, 2, 3]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2, 3]
    assert (tmp_path / "reward_accuracy.png").stat().st_size > 1000
    assert (tmp_path / "tokenizer.model").exists()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]


def test_reward_function_that_raises_or_hangs_scores_zero_and_the_run_goes_on(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, "rl.steps=2", "eval.every=0", "reward.timeout_s=0.5",
                         "reward.function=reward_fns:flaky_arithmetic")
    summary = loop.run(config)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    assert len(records) == 2
    assert summary["reward_timeouts_total"] > 0 and summary["reward_errors_total"] > 0
    assert sum(r["reward/timeouts"] for r in records) == summary["reward_timeouts_total"]
    assert sum(r["reward/errors"] for r in records) == summary["reward_errors_total"]


def test_an_error_after_a_save_still_finishes_the_checkpoint(tmp_path, monkeypatch):
    """Checkpoints are written asynchronously: an exception (a failed evaluation, Ctrl-C) must not leave the
    save in flight to die with the interpreter."""
    closed, real_close, real_evaluate = [], Checkpointer.close, held_out.evaluate
    monkeypatch.setattr(Checkpointer, "close", lambda self: (closed.append(True), real_close(self)))

    def evaluate_once(*args, **kwargs):  # the evaluation after the warm start, then the final one fails
        if closed or getattr(evaluate_once, "called", False):
            raise RuntimeError("the final evaluation failed")
        evaluate_once.called = True
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(held_out, "evaluate", evaluate_once)
    with pytest.raises(RuntimeError, match="the final evaluation failed"):
        loop.run(tiny_config(tmp_path, "rl.steps=1", "eval.every=0", "checkpoint.every=1", "sft.steps=0",
                             "rl.sampling.max_new_tokens=8", "rl.minibatches=1", "rl.epochs=1", "task.num_eval=8"))
    assert closed == [True]
    assert Checkpointer.newest(tmp_path / "checkpoints") == 1


@pytest.mark.slow  # test_resume.py::test_two_runs_with_the_same_seed_write_identical_metrics checks it byte for byte
def test_same_seed_same_run(tmp_path):
    """Reproducibility: two runs with one seed log identical metrics (timings aside)."""
    drop_timings = lambda rs: [{k: v for k, v in r.items() if "time" not in k and "seconds" not in k}
                               for r in rs]
    extra = ["rl.steps=2", "eval.every=0", "checkpoint.every=0", "sft.steps=3"]
    runs = []
    for name in ("a", "b"):
        loop.run(tiny_config(tmp_path / name, *extra))
        runs.append(drop_timings(read_metrics(tmp_path / name / "metrics.jsonl")))
    assert runs[0] == runs[1]
    loop.run(tiny_config(tmp_path / "c", *extra, "seed=1"))
    assert drop_timings(read_metrics(tmp_path / "c" / "metrics.jsonl")) != runs[0]


def test_remax_baseline_is_the_greedy_completion_shaped_like_the_samples(tmp_path, monkeypatch):
    """ReMax subtracts the greedy completion's reward from each sample's: with shaping on, both must be the
    shaped total (here DAPO's overlong ramp over all 40 tokens), or every sample carries the shaping as a bias."""
    calls = []
    real = rollout.shaped_rewards

    def spy(scored, generation, config):
        out = real(scored, generation, config)
        calls.append((np.asarray(scored.rewards), out.total))
        return out

    monkeypatch.setattr(rollout, "shaped_rewards", spy)
    config = tiny_config(tmp_path, "rl.steps=2", "eval.every=0", "checkpoint.every=0",
                         "rl.loss.advantage.estimator=remax", "reward.overlong_buffer=40")
    loop.run(config)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward/greedy_mean" in r]
    greedy_calls = [c for c in calls if len(c[0]) == config.rl.prompts_per_step]
    assert len(records) == len(greedy_calls) == 2
    for record, (correct, total) in zip(records, greedy_calls):
        assert not np.array_equal(correct, total)  # the penalty is on
        np.testing.assert_allclose(record["reward/greedy_mean"], total.mean(), rtol=1e-6)


def test_warmup_ramps_the_learning_rate_from_the_first_update():
    """Update i (1-based) of `make_optimizer` uses lr * min(1, i / warmup_steps): the first update moves the
    parameters (optax's linear_schedule from 0 gave it a learning rate of 0) and update `warmup_steps` is the
    first at the full rate. With a constant gradient Adam's bias-corrected step is the learning rate itself."""
    import jax.numpy as jnp

    from jaxrl.train import make_optimizer

    optimizer = make_optimizer(0.1, warmup_steps=4)
    params = {"w": jnp.zeros(3, jnp.float32)}
    grads = {"w": jnp.full(3, 0.5, jnp.float32)}  # norm < max_grad_norm: no clipping
    state, moves = optimizer.init(params), []
    for _ in range(6):
        updates, state = optimizer.update(grads, state, params)
        moves.append(-float(updates["w"][0]))
    np.testing.assert_allclose(moves, [0.025, 0.05, 0.075, 0.1, 0.1, 0.1], rtol=1e-5)
    updates, _ = make_optimizer(0.1).update(grads, make_optimizer(0.1).init(params), params)
    np.testing.assert_allclose(-np.asarray(updates["w"]), 0.1, rtol=1e-5)  # no warmup: the full rate at once


def test_weight_decay_shrinks_matrices_but_not_norm_scales_or_biases():
    """With a zero gradient only the decay moves: weight matrices and embeddings by -lr * wd * w, norm scales,
    biases and the value head's vector not at all. The state keeps optax.adamw's structure (checkpoints saved
    before the decay was limited restore)."""
    import jax.numpy as jnp
    import optax

    from jaxrl.train import make_optimizer

    optimizer = make_optimizer(0.1, weight_decay=0.5)
    params = {"kernel": jnp.full((2, 3), 2.0), "scale": jnp.ones(3), "bias": jnp.float32(1.0)}
    updates, _ = optimizer.update(jax.tree.map(jnp.zeros_like, params), optimizer.init(params), params)
    np.testing.assert_allclose(updates["kernel"], -0.1)
    assert not np.any(updates["scale"]) and float(updates["bias"]) == 0.0
    adamw = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1, weight_decay=0.5))
    assert jax.tree.structure(optimizer.init(params)) == jax.tree.structure(adamw.init(params))


def test_remax_baseline_comes_from_the_policy_that_sampled_under_overlap(tmp_path, monkeypatch):
    """With rl.overlap, step t + 1 is sampled during step t's update by the parameters from before it; ReMax's
    greedy baseline must come from those parameters too, or each advantage compares two policies."""
    calls = []  # (prompts, greedy?, a fingerprint of the parameters)
    real = loop.Generator.__call__

    def spy(self, policy, prompts, rng, config, *args, **kwargs):
        fingerprint = tuple(float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(policy.params))
        calls.append((tuple(prompts), config.temperature == 0.0, fingerprint))
        return real(self, policy, prompts, rng, config, *args, **kwargs)

    monkeypatch.setattr(loop.Generator, "__call__", spy)
    loop.run(tiny_config(tmp_path, "rl.steps=3", "eval.every=0", "checkpoint.every=0", "rl.overlap=true",
                         "rl.loss.advantage.estimator=remax"))
    sampled = {(prompts, fingerprint) for prompts, greedy, fingerprint in calls if not greedy}
    baselines = [(prompts, fingerprint) for prompts, greedy, fingerprint in calls
                 if greedy and len(prompts) == 4]  # rl.prompts_per_step (evaluations use eval.batch_size)
    assert len(baselines) == 3 and len({f for _, f in baselines}) == 2  # steps 1 and 2 by the first parameters
    assert all(baseline in sampled for baseline in baselines)
