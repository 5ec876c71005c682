"""Device mesh from the config and placement of parameters and batches on it.

Even a single-CPU run places everything with `NamedSharding` on a 1x1x1 mesh, so sharded runs are the same
code with a different mesh. Parameters are replicated for now; batches are split over the `data` and
`fsdp` axes along their leading (batch) dimension.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices: list | None = None) -> Mesh:
    """A `(data, fsdp, tensor)` mesh over `devices` (default: all); sizes must multiply to their count."""
    devices = jax.devices() if devices is None else devices
    shape = (data, fsdp, tensor)
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {math.prod(shape)} devices, "
                         f"but {len(devices)} are available ({devices[0].platform})")
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every array of `tree` on all devices of `mesh`."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def shard_batch(tree: Any, mesh: Mesh) -> Any:
    """Split the leading axis of every array in `tree` over the data-parallel axes of `mesh`."""
    parallel = mesh.shape["data"] * mesh.shape["fsdp"]
    for leaf in jax.tree.leaves(tree):
        if leaf.shape[0] % parallel:
            raise ValueError(f"batch dimension {leaf.shape[0]} is not divisible by the data-parallel size "
                             f"{parallel} (mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']})")
    return jax.device_put(tree, batch_sharding(mesh))
