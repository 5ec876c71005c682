"""Mesh construction, batch placement and the host-side view of a batch, on one device (the 8-device and
multi-process behaviour is in test_scale_out.py and test_multihost.py)."""

import jax
import numpy as np
import pytest

from jaxrl.data.batching import shuffled_batches
from jaxrl.sharding import (data_shard, from_process_local, gather, make_mesh, process_local, process_max,
                            process_rows, replicate, shard_batch)


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
