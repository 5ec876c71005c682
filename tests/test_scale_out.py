"""Scale-out on 8 fake CPU devices (each script in its own process): FSDP / tensor / data-parallel train steps
and sampling equal the single-device run, parameters and optimizer state are really split, checkpoints
restore onto other meshes, and bad mesh settings fail with the numbers involved."""

import os
import subprocess
import sys
import textwrap

import pytest

from jaxrl.sharding import mesh_shape, rules_from, wants_distributed
from jaxrl.models.partitioning import Layout

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run_with_8_devices(script: str, timeout: int = 600) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
           "PYTHONPATH": os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


# `make test` checks a data-parallel and a three-axis mesh; the FSDP-only and FSDP x tensor ones run in
# `make test-slow` (the fast suite's 15-minute budget)
FAST_MESHES, SLOW_MESHES = [(8, 1, 1), (2, 2, 2)], [(1, 8, 1), (1, 4, 2)]

TRAIN_STEP = """
    import jax, jax.numpy as jnp, numpy as np, optax
    from jaxrl import models
    from jaxrl import losses
    from jaxrl.losses import Controls, LossConfig
    from jaxrl.sharding import make_mesh, shard_batch
    from jaxrl.train import (init_critic, init_train_state, make_optimizer, make_rl_gradients, make_rl_step)
    from test_rl_step import MODEL, N, _batch

    assert len(jax.devices()) == 8
    MESHES = %(meshes)r

    def rel(a, b):  # largest relative difference over the leaves of two trees
        return max(float(np.linalg.norm(np.asarray(x) - np.asarray(y)) / max(np.linalg.norm(np.asarray(y)), 1e-30))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    policy = models.init(MODEL, 0)
    critic = init_critic(policy)
    batch = _batch(policy, critic=critic)
    controls = Controls(entropy_coef=jnp.float32(0.01), temperature=jnp.float32(1.0))
    loss = losses.build_loss(LossConfig(preset="ppo", kl_coef=0.1, entropy_coef=0.01), with_critic=True)
    # SGD with momentum and clipping: the update is linear in the gradient, so the parameters must agree as
    # closely as the gradients. AdamW (the default): its first update lr * g / (|g| + eps) turns gradient
    # entries near 1e-8, where float32 summation order alone changes them by a percent, into differences of a
    # fraction of lr; its parameters are held to 1e-4.
    OPTIMIZERS = {"sgd": (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-1, momentum=0.9)), 1e-5),
                  "adamw": (make_optimizer(1e-2, weight_decay=0.1), 1e-4)}
    critic_optimizer = make_optimizer(1e-2)

    def one_step(layout, micro_batches, optimizer):
        p = policy if layout is None else models.shard(policy, layout)
        state = init_train_state(p, optimizer, init_critic(p), critic_optimizer)
        b = batch if layout is None else shard_batch(batch, layout.mesh)
        grads, metrics = jax.jit(make_rl_gradients(loss, micro_batches=micro_batches, norm_length=N))(
            state, b, controls)
        step = make_rl_step(optimizer, loss, micro_batches=micro_batches, norm_length=N,
                            critic_optimizer=critic_optimizer)
        new, _ = step(state, b, controls)
        new2, _ = step(new, b, controls)  # the updated state feeds the same compiled program
        assert layout is None or step._cache_size() == 1, "the second step recompiled: the state's layout changed"
        return metrics["loss"], grads, new, new2

    single = {name: one_step(None, 1, opt) for name, (opt, _) in OPTIMIZERS.items()}
    for shape in MESHES:
        # micro-batches on the mesh that splits all three axes (test_rl_step covers them on a data x fsdp one)
        runs = [(1, "sgd"), (2, "sgd"), (1, "adamw")] if shape == (2, 2, 2) else [(1, "sgd"), (1, "adamw")]
        for micro, name in runs:
            optimizer, params_tolerance = OPTIMIZERS[name]
            layout = models.Layout(make_mesh(*shape))
            loss_n, grads_n, state_n, state_nb = one_step(layout, micro, optimizer)
            loss1, grads1, state1, state1b = single[name]
            errors = {"loss": rel(loss_n, loss1), "grads": rel(grads_n, grads1),
                      "critic": rel(state_n.critic.params, state1.critic.params)}
            assert max(errors.values()) <= 1e-5, (shape, micro, name, errors)
            params = {"params": rel(state_n.policy.params, state1.policy.params),
                      "opt_state": rel(state_n.opt_state, state1.opt_state),
                      "params after 2 steps": rel(state_nb.policy.params, state1b.policy.params)}
            assert max(params.values()) <= params_tolerance, (shape, micro, name, params)
            print(shape, micro, name, "loss/grads %%.1e, params %%.1e" %% (max(errors.values()),
                                                                     max(params.values())))

        # The parameters, their Adam moments and the critic's trunk are split, not replicated.
        data, fsdp, tensor = shape
        q = state_n.policy.params["layers"][0]["self_attn"]["q_proj"]["weight"][...]  # [heads * head_dim, hidden]
        out_dim, hidden = q.shape
        want = (out_dim // tensor, hidden // fsdp)
        assert {s.data.shape for s in q.addressable_shards} == {want}, (shape, q.sharding)
        down = state_n.policy.params["layers"][1]["mlp"]["down_proj"]["weight"][...]  # [hidden, mlp]
        assert {s.data.shape for s in down.addressable_shards} == {(down.shape[0] // fsdp, down.shape[1] // tensor)}
        embed = state_n.policy.params["embed_tokens"]["weight"][...]  # [vocab, hidden]
        assert {s.data.shape for s in embed.addressable_shards} == {(embed.shape[0] // tensor, hidden // fsdp)}
        adam = state_n.opt_state[1][0]
        mu_q = adam.mu["layers"][0]["self_attn"]["q_proj"]["weight"][...]
        assert mu_q.sharding == q.sharding, (mu_q.sharding, q.sharding)
        trunk_q = state_n.critic.params["trunk"]["layers"][0]["self_attn"]["q_proj"]["weight"][...]
        assert trunk_q.sharding == q.sharding
        if fsdp * tensor > 1:
            assert not q.sharding.is_fully_replicated
    print("OK")
"""


@pytest.mark.parametrize("meshes", [FAST_MESHES, pytest.param(SLOW_MESHES, marks=pytest.mark.slow)])
def test_train_step_on_every_mesh_equals_the_single_device_step(meshes):
    """(8,1,1), (1,8,1), (1,4,2), (2,2,2) (the last also with 2 micro-batches), PPO with a critic: loss,
    gradients and critic within 1e-5 (relative) of one device; updated parameters and optimizer state within
    1e-5 with SGD (1e-4 with AdamW, see the script); the state split as configured."""
    out = _run_with_8_devices(TRAIN_STEP % {"meshes": meshes})
    assert out.count("loss/grads") == 2 * len(meshes) + ((2, 2, 2) in meshes)


SAMPLING = """
    import jax, numpy as np
    from jaxrl import models
    from jaxrl.sampling import SamplingConfig, sample
    from jaxrl.sharding import make_mesh, shard_batch
    from jaxrl.train import completion_logprobs

    config = models.ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=8, intermediate_size=64)
    policy = models.init(config, 0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 24, size=(8, 6)).astype(np.int32)
    valid = np.arange(6)[None] >= rng.integers(0, 4, size=(8, 1))  # ragged, left-padded prompts
    settings = SamplingConfig(max_new_tokens=8, temperature=1.0, top_k=12)
    plain = sample(policy, tokens, valid, jax.random.key(1), settings, 3, 0)
    grouped = sample(policy, tokens, valid, jax.random.key(2), settings, 3, 0, group_size=2)
    logp = completion_logprobs(policy, plain.tokens, plain.prompt_valid)[0]
    for shape in %(meshes)r:
        layout = models.Layout(make_mesh(*shape))
        sharded = models.shard(policy, layout)
        t, v = shard_batch((tokens, valid), layout.mesh)
        out = sample(sharded, t, v, jax.random.key(1), settings, 3, 0)
        assert (np.asarray(out.tokens) == np.asarray(plain.tokens)).all(), shape
        assert np.allclose(np.asarray(out.sampler_logp), np.asarray(plain.sampler_logp), atol=1e-5), shape
        out = sample(sharded, t, v, jax.random.key(2), settings, 3, 0, group_size=2)
        assert (np.asarray(out.tokens) == np.asarray(grouped.tokens)).all(), shape
        # Reference-policy log-probs computed on the sharded policy, batch split over the data axes.
        ref = jax.jit(completion_logprobs)(sharded, *shard_batch((plain.tokens, plain.prompt_valid), layout.mesh))[0]
        assert np.allclose(np.asarray(ref), np.asarray(logp), atol=1e-5), shape
        print(shape, "same tokens")
    print("OK")
"""


@pytest.mark.parametrize("meshes", [FAST_MESHES, pytest.param(SLOW_MESHES, marks=pytest.mark.slow)])
def test_sampler_gives_the_same_tokens_on_every_mesh(meshes):
    """Plain and prefix-shared group sampling on the sharded policy: the tokens of one device, same seed."""
    out = _run_with_8_devices(SAMPLING % {"meshes": meshes})
    assert out.count("same tokens") == len(meshes)


CHECKPOINT = """
    import jax, numpy as np, optax
    from jaxrl import models
    from jaxrl.checkpoint import Checkpointer
    from jaxrl.sharding import make_mesh
    from jaxrl.train import init_train_state, make_optimizer

    config = models.ModelConfig(vocab_size=32, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=8, intermediate_size=64)
    optimizer = make_optimizer(1e-2)
    policy = models.init(config, 3)
    directory = %(directory)r

    def state_on(shape, devices=None):
        layout = models.Layout(make_mesh(*shape, devices=devices))
        state = init_train_state(models.shard(policy, layout), optimizer)
        # non-trivial optimizer moments
        grads = jax.tree.map(lambda x: x * 0.5 + 0.1, state.policy.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.policy.params)
        return state.replace(policy=state.policy.replace(params=optax.apply_updates(state.policy.params, updates)),
                             opt_state=opt_state)

    saved = state_on((2, 2, 2))
    checkpointer = Checkpointer(directory)
    checkpointer.save(7, {"params": saved.policy.params, "opt_state": saved.opt_state}, {"note": "2x2x2"})
    checkpointer.close()
    expected = jax.device_get({"params": saved.policy.params, "opt_state": saved.opt_state})
    for shape, devices in [((1, 8, 1), None), ((1, 1, 1), jax.devices()[:1])]:
        like = init_train_state(models.shard(policy, models.Layout(make_mesh(*shape, devices=devices))), optimizer)
        like = {"params": like.policy.params, "opt_state": like.opt_state}
        restored, metadata = Checkpointer(directory).restore(None, like)
        assert metadata == {"note": "2x2x2"}
        for a, b, target in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), jax.tree.leaves(like)):
            assert a.sharding == target.sharding, (shape, a.sharding, target.sharding)
            np.testing.assert_array_equal(np.asarray(a), b)
        q = restored["params"]["layers"][0]["self_attn"]["q_proj"]["weight"][...]
        print(shape, {s.data.shape for s in q.addressable_shards})

    # A Hugging Face directory loads straight onto a mesh, each tensor placed by its logical axes as it is read.
    from jaxrl.policy_io import load_policy
    hf_dir = directory + "-hf"
    models.save_pretrained(saved.policy, hf_dir, progress=False)
    layout = models.Layout(make_mesh(1, 4, 2))
    loaded = load_policy(hf_dir, layout=layout)
    assert loaded.layout == layout.for_model(config)
    q = loaded.params["layers"][0]["self_attn"]["q_proj"]["weight"][...]
    assert {s.data.shape for s in q.addressable_shards} == {(16, 8)}, q.sharding
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(expected["params"])):
        np.testing.assert_array_equal(np.asarray(a), b)
    print("OK")
"""


def test_checkpoint_from_one_mesh_restores_onto_others(tmp_path):
    """Written from (2,2,2), restored onto (1,8,1) and onto one device: equal values, the target's layout.
    A Hugging Face export of the sharded policy loads onto (1,4,2) split as it is read."""
    out = _run_with_8_devices(CHECKPOINT % {"directory": str(tmp_path / "ckpt")})
    assert "(1, 8, 1) {(32, 4)}" in out and "(1, 1, 1) {(32, 32)}" in out


def test_a_checkpoint_of_other_shapes_is_refused_naming_the_arrays(tmp_path):
    """Orbax's own error names no array ("Requested shape: (64, 32) is not compatible with the stored shape")."""
    import jax.numpy as jnp
    from jaxrl.checkpoint import Checkpointer

    saved = {"params": {"up_proj": jnp.ones((4, 2)), "down_proj": jnp.ones((2, 4))}, "step": jnp.int32(3)}
    checkpointer = Checkpointer(tmp_path / "checkpoints with spaces")
    checkpointer.save(3, saved, {})
    checkpointer.wait()
    like = {"params": {"up_proj": jnp.ones((8, 2)), "down_proj": jnp.ones((2, 4))}, "step": jnp.int32(0)}
    with pytest.raises(ValueError, match=r"checkpoint 3 does not fit: params.up_proj is \(4, 2\) in the checkpoint, "
                                         r"\(8, 2\) here$"):
        checkpointer.restore(None, like)
    restored, _ = checkpointer.restore(None, saved)
    assert int(restored["step"]) == 3
    checkpointer.close()


ERRORS = """
    import jax, numpy as np
    from jaxrl import models
    from jaxrl.sharding import make_mesh, shard_batch, from_process_local

    def expect(fn, text):
        try:
            fn()
        except ValueError as e:
            assert text in str(e), (text, str(e))
        else:
            raise AssertionError("expected an error containing " + text)

    expect(lambda: make_mesh(2, 2, 1), "mesh data=2 x fsdp=2 x tensor=1 = 4 devices, but 8 are available")
    expect(lambda: make_mesh(-1, 3, 1), "8 devices do not split into 3 x mesh.data")
    assert dict(make_mesh(2, -1, 2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    mesh = make_mesh(2, 2, 2)
    expect(lambda: shard_batch(np.zeros((6, 2)), mesh),
           "batch dimension 6 is not divisible by the data-parallel size 4 (mesh data=2 x fsdp=2)")
    expect(lambda: models.Layout(mesh, (("embed", ("model",)),)),
           "maps 'embed' to the unknown mesh axis 'model'; the mesh has data, fsdp, tensor")
    print("OK")
"""


def test_bad_meshes_rules_and_batches_fail_with_the_numbers():
    _run_with_8_devices(ERRORS)


def test_mesh_shape_and_rules_without_devices():
    assert mesh_shape(-1, 2, 1, 8) == (4, 2, 1)
    assert mesh_shape(1, 1, -1, 4) == (1, 1, 4)
    with pytest.raises(ValueError, match="only one axis may be -1"):
        mesh_shape(-1, -1, 1, 8)
    with pytest.raises(ValueError, match="mesh.fsdp=0"):
        mesh_shape(1, 0, 1, 8)
    rules = dict(rules_from((("embed",), ("vocab", "tensor", "fsdp"))))
    assert rules["embed"] == () and rules["vocab"] == ("tensor", "fsdp") and rules["heads"] == ("tensor",)
    with pytest.raises(ValueError, match=r"mesh.rules\[0\] names the unknown logical axis 'embedding'"):
        rules_from((("embedding", "fsdp"),))
    with pytest.raises(ValueError, match=r"mesh.rules\[1\] maps 'embed' to the unknown mesh axis 'model'"):
        rules_from((("vocab", "tensor"), ("embed", "model")))
    import jax
    from jaxrl.sharding import make_mesh
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        Layout(make_mesh(), (("heads", ("model",)),))
    assert not wants_distributed("auto", None, {})
    assert wants_distributed("auto", None, {"SLURM_NTASKS": "4"})
    assert not wants_distributed("auto", None, {"SLURM_NTASKS": "1"})
    assert wants_distributed("auto", None, {"TPU_WORKER_HOSTNAMES": "a,b"})
    assert wants_distributed("auto", "host:1234", {})
    assert not wants_distributed("off", "host:1234", {"SLURM_NTASKS": "4"})
    assert wants_distributed("on", None, {})
    del jax


def test_batches_that_do_not_split_over_the_data_axes_are_refused_before_any_work():
    from jaxrl.config import Config
    from jaxrl.loop import check_batch_sizes

    check_batch_sizes(Config(), {"data": 2, "fsdp": 4, "tensor": 1})  # 16 x 8, 256 and 64 rows split
    with pytest.raises(ValueError, match=r"rl.prompts_per_step x rl.group_size = 128 rows do not split over the "
                                         r"data-parallel size 3 \(mesh data=3 x fsdp=1\); use a multiple of 3"):
        check_batch_sizes(Config(), {"data": 3, "fsdp": 1, "tensor": 2})
    import dataclasses
    config = dataclasses.replace(Config(), eval=dataclasses.replace(Config().eval, batch_size=100))
    with pytest.raises(ValueError, match=r"eval.batch_size = 100 rows do not split over the data-parallel size 8"):
        check_batch_sizes(config, {"data": 4, "fsdp": 2, "tensor": 1})
    # the sampled evaluation prefills eval.batch_size // eval.samples problems per call (found after training)
    sampled = dataclasses.replace(Config(), eval=dataclasses.replace(Config().eval, batch_size=16, samples=3))
    with pytest.raises(ValueError, match=r"eval.batch_size // eval.samples = 5 rows do not split over the "
                                         r"data-parallel size 2"):
        check_batch_sizes(sampled, {"data": 2, "fsdp": 1, "tensor": 1})
    with pytest.raises(ValueError, match=r"rl.prompts_per_step \(16\) does not split over the 3 data shards"):
        check_batch_sizes(Config(), {"data": 1, "fsdp": 1, "tensor": 1}, data_shards=3)
    # each optimizer step's (micro-)batch must split too, or every device would compute all of its rows
    minibatched = dataclasses.replace(Config(), rl=dataclasses.replace(Config().rl, minibatches=32))
    with pytest.raises(ValueError, match=r"rl.prompts_per_step x rl.group_size // \(rl.minibatches x "
                                         r"rl.micro_batches\) = 4 rows do not split over the data-parallel size 8"):
        check_batch_sizes(minibatched, {"data": 1, "fsdp": 8, "tensor": 1})
    check_batch_sizes(minibatched, {"data": 2, "fsdp": 2, "tensor": 2})  # 4 rows over 4 devices


def test_cli_reports_a_mesh_that_does_not_fit(tmp_path, capsys):
    from jaxrl import cli

    code = cli.main(["train", "configs/default.yaml", "mesh.data=2", f"output_dir={tmp_path}", "progress=false"])
    assert code == 2
    assert "jaxrl: error: mesh data=2 x fsdp=1 x tensor=1 = 2 devices, but 1 are available" in capsys.readouterr().err
