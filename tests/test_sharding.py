"""Mesh construction and placement; multi-device behaviour runs in a subprocess with 8 fake CPU devices."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxrl.sharding import make_mesh, replicate, shard_batch


def test_single_device_mesh_and_clear_errors():
    mesh = make_mesh()
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    placed = shard_batch({"x": np.zeros((4, 3))}, mesh)
    assert placed["x"].sharding.mesh.shape == mesh.shape
    assert replicate(np.ones(3), mesh).sharding.is_fully_replicated
    with pytest.raises(ValueError, match=r"data=2 x fsdp=1 x tensor=1 = 2 devices, but 1 are available"):
        make_mesh(data=2)


SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    import models
    from jaxrl.sampling import SamplingConfig, sample
    from jaxrl.sharding import make_mesh, replicate, shard_batch
    assert len(jax.devices()) == 8
    config = models.ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=8, intermediate_size=64)
    tokens = np.random.default_rng(0).integers(4, 24, size=(8, 6)).astype(np.int32)
    valid = np.ones((8, 6), bool)
    outs = []
    for shape in [(1, 1, 1), (4, 2, 1), (2, 2, 2)]:
        devices = jax.devices()[:int(np.prod(shape))]
        mesh = make_mesh(*shape, devices=devices)
        policy = replicate(models.init(config, 0), mesh)
        t, v = shard_batch((tokens, valid), mesh)
        assert len(t.sharding.device_set) == shape[0] * shape[1] * shape[2]
        rollout = sample(policy, t, v, jax.random.key(1), SamplingConfig(max_new_tokens=6), 3, 0)
        outs.append(np.asarray(rollout.tokens))
    assert all((o == outs[0]).all() for o in outs), "sampling must not depend on the mesh"

    # Group sampling (each prompt's cache shared by its samples) with the prompts split over the data axes and
    # the attention heads and MLP columns of the policy split over the tensor axis.
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = make_mesh(2, 2, 2)
    def place(path, x):
        name = jax.tree_util.keystr(path)
        if x.ndim == 2 and any(n in name for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            spec = P("tensor", None)  # [out, in]: heads / MLP columns over the tensor axis
        elif x.ndim == 2 and any(n in name for n in ("o_proj", "down_proj")):
            spec = P(None, "tensor")
        else:
            spec = P()
        return jax.device_put(x, NamedSharding(mesh, spec))
    policy = models.init(config, 0)
    sharded = policy.replace(params=jax.tree_util.tree_map_with_path(place, policy.params))
    q_proj = sharded.params["layers"][0]["self_attn"]["q_proj"]["weight"][...]
    assert {s.data.shape for s in q_proj.addressable_shards} == {(16, 32)}, "heads are split over tensor=2"
    grouped = SamplingConfig(max_new_tokens=6, temperature=1.0)
    one = sample(policy, tokens[:4], valid[:4], jax.random.key(2), grouped, 3, 0, group_size=2)
    t, v = shard_batch((tokens[:4], valid[:4]), mesh)
    many = sample(sharded, t, v, jax.random.key(2), grouped, 3, 0, group_size=2)
    assert (np.asarray(one.tokens) == np.asarray(many.tokens)).all(), "sharded group sampling differs"
    assert np.allclose(np.asarray(one.sampler_logp), np.asarray(many.sampler_logp), atol=1e-5)
    try:
        shard_batch(np.zeros((6, 2)), make_mesh(4, 2, 1))
    except ValueError as e:
        assert "batch dimension 6 is not divisible by the data-parallel size 8" in str(e), e
    else:
        raise AssertionError("expected a divisibility error")
    print("OK")
""")


def test_same_samples_on_several_meshes_with_8_fake_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
