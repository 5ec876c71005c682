"""Device mesh from the config, placement of batches on it, and the host-side view of a multi-host run.

Every run, a single CPU included, places its arrays with `NamedSharding` on a `(data, fsdp, tensor)` mesh;
a single-device run is the 1x1x1 mesh of the same code. Parameters are placed by their logical axes
(`models.partitioning`), batches split their leading axis over `data` and `fsdp`.

Multi-host runs are JAX's own multi-controller runtime: every process runs this same program after
`jax.distributed.initialize()`, sees the global mesh, and holds the rows of each batch that its devices hold.
Host-side code (tokenising prompts, decoding completions, scoring rewards) works on those rows only:
`process_rows` says which they are, `from_process_local` assembles a global array from every process's rows,
`process_local` reads this process's rows back, and `gather` gives every process the whole array.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxrl.models.partitioning import DEFAULT_RULES, Layout, Rules, check_rules

log = logging.getLogger("jaxrl")

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def mesh_shape(data: int, fsdp: int, tensor: int, device_count: int) -> tuple[int, int, int]:
    """`(data, fsdp, tensor)` with a `-1` (at most one) replaced by what makes the product `device_count`."""
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    given = " x ".join(f"{name}={size}" for name, size in sizes.items())
    bad = [f"mesh.{name}={size}" for name, size in sizes.items() if size == 0 or size < -1]
    if bad:
        raise ValueError(f"{', '.join(bad)}: mesh axis sizes must be positive, or -1 for 'the rest'")
    auto = [name for name, size in sizes.items() if size == -1]
    if len(auto) > 1:
        raise ValueError(f"mesh {given}: only one axis may be -1")
    if auto:
        fixed = math.prod(size for size in sizes.values() if size != -1)
        if device_count % fixed:
            raise ValueError(f"mesh {given}: {device_count} devices do not split into {fixed} x "
                             f"mesh.{auto[0]}")
        sizes[auto[0]] = device_count // fixed
    if math.prod(sizes.values()) != device_count:
        raise ValueError(f"mesh {given} = {math.prod(sizes.values())} devices, but {device_count} are available")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices: list | None = None) -> Mesh:
    """A `(data, fsdp, tensor)` mesh over `devices` (default: every device of every process). One size may be
    -1: whatever the others leave. Devices are laid out by `jax.make_mesh`, which keeps `tensor` (the axis
    with the most traffic) within a host and across its fastest links."""
    devices = jax.devices() if devices is None else list(devices)
    try:
        shape = mesh_shape(data, fsdp, tensor, len(devices))
    except ValueError as e:
        raise ValueError(f"{e} ({devices[0].platform}, {jax.process_count()} process(es))") from None
    return jax.make_mesh(shape, MESH_AXES, devices=devices, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def layout_from(mesh_config, devices: list | None = None) -> Layout:
    """The mesh and logical-axis rules of a `config.mesh` section (`jaxrl.config.MeshConfig`)."""
    mesh = make_mesh(mesh_config.data, mesh_config.fsdp, mesh_config.tensor, devices)
    return Layout(mesh, rules_from(mesh_config.rules))


def rules_from(rows: tuple[tuple[str, ...], ...]) -> Rules:
    """Config rows `[logical_name, mesh_axis, ...]` as `Rules`; names without a row keep the default rule."""
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"mesh.rules[{i}] is empty: expected [logical_name, mesh axes...]")
    overrides = tuple((row[0], tuple(row[1:])) for row in rows)
    check_rules(overrides, MESH_AXES)  # named by their config rows, before the defaults fill in the rest
    return tuple({**dict(DEFAULT_RULES), **dict(overrides)}.items())


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every array of `tree` (host values, the same on every process) on all devices of `mesh`."""
    sharding = NamedSharding(mesh, PartitionSpec())

    def place(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.tree.map(place, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def _check_divisible(rows: int, mesh: Mesh, what: str = "batch dimension") -> None:
    if rows % data_parallel_size(mesh):
        raise ValueError(f"{what} {rows} is not divisible by the data-parallel size {data_parallel_size(mesh)} "
                         f"(mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']})")


def shard_batch(tree: Any, mesh: Mesh) -> Any:
    """Split the leading axis of every array in `tree` (the whole batch, the same on every process) over the
    data-parallel axes of `mesh`; each process transfers only the rows its devices hold."""
    sharding = batch_sharding(mesh)

    def place(x):
        x = np.asarray(x)
        _check_divisible(x.shape[0], mesh)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.tree.map(place, tree)


def process_rows(rows: int, mesh: Mesh) -> slice:
    """The rows of a `[rows, ...]` batch split over the data axes that this process's devices hold."""
    _check_divisible(rows, mesh)
    slices = batch_sharding(mesh).addressable_devices_indices_map((rows,)).values()
    starts = [s[0].start or 0 for s in slices]
    stops = [rows if s[0].stop is None else s[0].stop for s in slices]
    start, stop = min(starts), max(stops)
    if sum(b - a for a, b in set(zip(starts, stops))) != stop - start:
        raise ValueError(f"this process's devices hold non-contiguous rows of the batch on mesh "
                         f"{dict(mesh.shape)}; order the devices so that each process's are adjacent")
    return slice(start, stop)


def data_shard(mesh: Mesh) -> tuple[int, int]:
    """`(index, count)`: this process reads shard `index` of `count` shards of the data (processes that hold
    the same rows, e.g. split only by `tensor`, read the same shard)."""
    rows = data_parallel_size(mesh)
    mine = process_rows(rows, mesh)
    size = mine.stop - mine.start
    return mine.start // size, rows // size


def from_process_local(tree: Any, mesh: Mesh) -> Any:
    """Global arrays split over the data axes, assembled from each process's rows (`process_rows`) of them."""
    sharding = batch_sharding(mesh)
    count = data_shard(mesh)[1]

    def place(x):
        x = np.asarray(x)
        global_shape = (x.shape[0] * count, *x.shape[1:])
        _check_divisible(global_shape[0], mesh)
        return jax.make_array_from_process_local_data(sharding, x, global_shape)
    return jax.tree.map(place, tree)


def addressable_rows(x: jax.Array) -> tuple[np.ndarray, int]:
    """`(rows, index of the first)`: the rows of `x [batch, ...]` held by this process's devices, as numpy
    (all of them, from 0, unless `x` is a global array of a multi-host run split along its first axis)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x), 0
    parts = {}
    for shard in x.addressable_shards:
        parts.setdefault(shard.index[0].start or 0, shard.data)
    return np.concatenate([np.asarray(parts[k]) for k in sorted(parts)]), min(parts)


def process_local(tree: Any, mesh: Mesh) -> Any:
    """This process's rows (`process_rows`) of global arrays, as numpy (scalars are read whole)."""
    def read(x):
        if x.ndim == 0 or x.is_fully_addressable:
            return np.asarray(x)[process_rows(x.shape[0], mesh)] if x.ndim else np.asarray(x)
        local, _ = addressable_rows(jax.device_put(x, batch_sharding(mesh)))  # no-op if split over data axes
        rows = process_rows(x.shape[0], mesh)
        assert local.shape[0] == rows.stop - rows.start, (local.shape, rows)
        return local
    return jax.tree.map(read, tree)


def gather(tree: Any, mesh: Mesh) -> Any:
    """Every process's rows of host arrays `[local_rows, ...]`, concatenated in global row order, on every
    process (numpy). Single-process runs return the arrays unchanged."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    return jax.tree.map(np.asarray, allgather(from_process_local(tree, mesh)))


def allgather(tree: Any, stack: bool = False) -> Any:
    """Every array of `tree` whole on every process: global arrays gathered from their shards, or (with
    `stack`) host arrays stacked over processes `[processes, ...]`. Single-process runs get `tree` back
    (stacked as `[1, ...]` with `stack`). Every process must call it."""
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.asarray(x)[None], tree) if stack else tree
    return multihost_utils.process_allgather(tree, tiled=not stack)


def process_max(value: int) -> int:
    """The largest of `value` over all processes (every process must call it)."""
    return int(np.max(allgather(np.asarray([value], np.int64), stack=True)))


def wait_for_all_processes(name: str) -> None:
    """Return once every process has called this with the same `name` (at once in single-process runs)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def is_primary() -> bool:
    """Whether this process writes the run's shared files (metrics, summary, tokenizer, exports)."""
    return jax.process_index() == 0


# Environment variables that say this process is one of several of a cluster job.
_CLUSTER_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")


def wants_distributed(mode: str, coordinator_address: str | None, environ=os.environ) -> bool:
    """Whether to call `jax.distributed.initialize()`: `mode` 'on' / 'off', or 'auto': when a coordinator is
    configured, or a SLURM job has several tasks, or Open MPI several ranks, or a TPU pod slice several
    workers."""
    if mode != "auto":
        return mode == "on"
    if coordinator_address or any(environ.get(v) for v in _CLUSTER_VARIABLES):
        return True
    for variable in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(environ.get(variable, "1") or 1) > 1:
            return True
    return len([h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1


def initialize_distributed(config, environ=os.environ) -> bool:
    """Join the multi-controller job described by `config` (`jaxrl.config.DistributedConfig`) or the
    environment (see `wants_distributed`); returns whether it did. Must run before anything touches a device.
    Unset fields (None) are detected by JAX from the cluster environment (TPU pods, SLURM, Open MPI)."""
    if not wants_distributed(config.initialize, config.coordinator_address, environ):
        return False
    if jax.distributed.is_initialized():
        return True
    jax.distributed.initialize(coordinator_address=config.coordinator_address,
                               num_processes=config.num_processes, process_id=config.process_id)
    log.info("process %d of %d; %d local and %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return True
