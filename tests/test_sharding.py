"""Mesh construction, batch placement and the host-side view of a batch, on one device, and where attention
heads go on a `tensor` axis (an abstract mesh, and one small script on 4 fake CPU devices; the 8-device and
multi-process behaviour is in test_scale_out.py and test_multihost.py)."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from jaxrl import models
from jaxrl.data.batching import shuffled_batches
from jaxrl.sharding import (data_shard, from_process_local, gather, make_mesh, process_local, process_max,
                            process_rows, replicate, shard_batch)
from jaxrl.models.configs import ModelConfig
from jaxrl.models.partitioning import Layout
from jaxrl.models.transformer import CACHE_AXES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_single_device_mesh_and_clear_errors():
    mesh = make_mesh()
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    placed = shard_batch({"x": np.zeros((4, 3))}, mesh)
    assert placed["x"].sharding.mesh.shape == mesh.shape
    assert replicate(np.ones(3), mesh).sharding.is_fully_replicated
    with pytest.raises(ValueError, match=r"data=2 x fsdp=1 x tensor=1 = 2 devices, but 1 are available"):
        make_mesh(data=2)
    assert dict(make_mesh(-1, 1, 1).shape) == {"data": 1, "fsdp": 1, "tensor": 1}


def test_a_single_process_holds_every_row():
    mesh = make_mesh()
    rows = np.arange(12).reshape(6, 2)
    assert process_rows(6, mesh) == slice(0, 6) and data_shard(mesh) == (0, 1)
    global_rows = from_process_local(rows, mesh)
    assert global_rows.shape == (6, 2) and isinstance(global_rows, jax.Array)
    np.testing.assert_array_equal(process_local(global_rows, mesh), rows)
    np.testing.assert_array_equal(gather(rows, mesh), rows)
    assert process_max(7) == 7


def test_data_shards_together_draw_the_single_host_batches():
    """Two hosts each drawing half of every batch see exactly the prompts one host would, step after step."""
    items = list(range(23))
    whole = shuffled_batches(items, 6, seed=3)
    halves = [shuffled_batches(items, 3, seed=3, shard=(i, 2)) for i in range(2)]
    for _ in range(10):
        assert sorted(next(whole)) == sorted(next(halves[0]) + next(halves[1]))
    with pytest.raises(ValueError, match=r"shard index 2 is not in \[0, 2\)"):
        shuffled_batches(items, 3, seed=3, shard=(2, 2))


def _heads_config(num_heads, num_kv_heads):
    return ModelConfig(vocab_size=48, hidden_size=32, num_layers=1, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=8, intermediate_size=64, qkv_bias=True)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (8, 4), (8, 8), (12, 4), (14, 2)])
def test_attention_weights_split_whole_heads_as_their_activations_and_cache(num_heads, num_kv_heads):
    """On `tensor=4` a q/k/v/o weight or bias is split over heads exactly when its heads in the activations and
    the KV cache are: 2 KV heads (16 = 2 x 8 columns) stay whole, not 4 half-head shards that XLA all-gathers."""
    config = _heads_config(num_heads, num_kv_heads)
    layout = Layout(AbstractMesh((1, 1, 4), ("data", "fsdp", "tensor"))).for_model(config)
    attn = layout.param_shardings(models.abstract(config).params)["layers"][0]["self_attn"]
    spec = lambda module, name: attn[module][name].get_value().spec  # noqa: E731
    for heads, count, modules in [("heads", num_heads, ["q_proj"]), ("kv_heads", num_kv_heads, ["k_proj", "v_proj"])]:
        split = count % 4 == 0
        at = lambda dim: PartitionSpec(*[None] * dim, "tensor") if split else PartitionSpec()  # noqa: E731
        assert layout.spec(("batch", "seq", heads, "head_dim"), (4, 1, count, 8)) == at(2)
        for module in modules:
            assert spec(module, "weight") == spec(module, "bias") == at(0), (module, count)
        if heads == "kv_heads":
            assert layout.spec(CACHE_AXES, (4, count, 16, 8)) == at(1)
        else:
            assert spec("o_proj", "weight") == at(1)
    with pytest.raises(ValueError, match=r"'kv_heads' of size 12 is not a whole number of heads of head_dim 8"):
        layout.param_sharding(("k_proj", "weight"), (12, 32))


def test_a_decode_step_with_fewer_kv_heads_than_tensor_devices_gathers_nothing():
    """2 KV heads on `tensor=4`: k/v weights, activations and cache all replicated over `tensor`, so one decode
    step has no all-gather (it had 4: the half-head k/v shards), and it equals the unsharded step."""
    script = """
        import re, jax, jax.numpy as jnp, numpy as np, models
        from jaxrl.sharding import make_mesh
        from jaxrl.models.configs import ModelConfig
        from jaxrl.models.partitioning import Layout
        from jaxrl.models.transformer import KVCache
        c = ModelConfig(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                        intermediate_size=64)
        policy = models.init(c, 0)
        sharded = models.shard(policy, Layout(make_mesh(1, 1, 4)))
        k = sharded.params["layers"][0]["self_attn"]["k_proj"]["weight"][...]
        assert {s.data.shape for s in k.addressable_shards} == {(16, 32)}, k.sharding
        args = (jnp.zeros((4, 1), jnp.int32), jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 16), bool),
                KVCache.zeros(c, 4, 16))
        step = jax.jit(lambda p, *a: models.apply(p, *a, 3)[0])
        hlo = step.lower(sharded, *args).compile().as_text()
        assert not re.findall(r"= \\S+ all-gather(?:-start)?\\(", hlo), "all-gather in the decode step"
        np.testing.assert_allclose(step(sharded, *args), step(policy, *args), atol=1e-5)
        print("OK")
    """
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]


def test_a_rule_naming_a_mesh_axis_twice_is_refused_by_name():
    """`[mlp, tensor, tensor]` would reach jax as `P(('tensor', 'tensor'))`: a DuplicateSpecError naming no rule."""
    from jaxrl.sharding import rules_from
    with pytest.raises(ValueError, match=r"mesh.rules\[1\] maps 'mlp' to the mesh axis 'tensor' more than once"):
        rules_from((("embed", "fsdp"), ("mlp", "tensor", "tensor")))
    with pytest.raises(ValueError, match=r"maps 'mlp' to the mesh axis 'tensor' more than once: \('tensor', 'tensor'\)"):
        Layout(make_mesh(), (("mlp", ("tensor", "tensor")),))
