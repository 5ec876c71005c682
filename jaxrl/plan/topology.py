"""Topology names -> devices to compile for, and the config's mesh over them.

A TPU topology need not be attached: libtpu describes it as compile-only devices
(`jax.experimental.topologies.get_topology_desc`), one per chip, and `jax.jit(...).lower(...).compile()` compiles
for them on a CPU-only machine. `jax.default_backend()` stays "cpu" meanwhile; code that picks kernels must look at
the mesh's devices (`device.platform == "tpu"`). GPUs are planned on the GPUs this process sees.

Names are `<generation>:<chip grid>`: v5e:2x2, v5e:8x8, v6e:4x4 (2-D tori), v5p:2x2x1, v5p:4x4x4 (3-D). Several
slices joined over the data-center network are `slices=N`: the mesh's `data` axis then spans them (the other
axes stay inside a slice, on ICI).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxrl.plan.chips import CHIPS, ChipSpec, UnknownChipError, chip_for
from jaxrl.sharding import MESH_AXES, make_mesh, mesh_shape
from jaxrl.errors import JaxrlError


class PlanError(JaxrlError, ValueError):
    """Bad input to `jaxrl plan`: a one-line message for the CLI (exit 2). Whitespace runs become one space."""

    kind = "plan error"

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclasses.dataclass(frozen=True)
class _Generation:
    chip: str  # CHIPS key
    dims: int  # 2: a 2-D torus (AxB); 3: a 3-D torus (AxBxC)
    max_shape: tuple[int, ...]  # the largest slice
    host_chips: int  # chips of the largest single-host slice


# Slice shapes from the Cloud TPU pages (see jaxrl.plan.chips): v5e / v6e 1x1 to 16x16 (256 chips, 8 chips per
# host); v5p 2x2x1 to 16x16x24 (6,144 chips in one slice, 4 chips per host).
TPU_GENERATIONS: dict[str, _Generation] = {
    "v5e": _Generation("v5e", 2, (16, 16), 8),
    "v6e": _Generation("v6e", 2, (16, 16), 8),
    "v5p": _Generation("v5p", 3, (16, 16, 24), 4),
}
EXAMPLES = "v5e:2x2, v5e:8x8, v5p:4x4x4, v6e:4x4"
# The slice shapes the Cloud TPU pages list (v5p: the common ones of its table).
COMMON_SHAPES: dict[str, tuple[str, ...]] = {
    "v5e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v6e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16",
            "16x16x16", "16x16x24"),
}
_NAME = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+)*)$")
# Cloud accelerator types (v5litepod-16, v6e-8: chips; v5p-32: TensorCores, two per chip) -> (generation, per chip)
_ACCELERATOR_TYPE = re.compile(r"^(v5litepod|v5e|v6e|v5p)-(\d+)$")
_TYPE_UNITS = {"v5litepod": ("v5e", 1), "v5e": ("v5e", 1), "v6e": ("v6e", 1), "v5p": ("v5p", 2)}


@dataclasses.dataclass(frozen=True)
class Topology:
    """The chips a plan compiles for: `devices` has one jax device per chip (all `slices` of them)."""

    name: str  # "v5e:8x8" (one slice's grid) or "gpu"
    chip: ChipSpec
    devices: tuple
    slices: int = 1

    @property
    def num_chips(self) -> int:
        return len(self.devices)

    @property
    def title(self) -> str:
        """"v5e:8x8", "2 slices of v5e:8x8" or "gpu (8 x H100)"."""
        if self.name == "gpu":
            return f"gpu ({self.num_chips} x {self.chip.name})"
        return self.name if self.slices == 1 else f"{self.slices} slices of {self.name}"


def _check_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise PlanError(f"compiling for a TPU topology needs libtpu, which is not installed: pip install -e '.[tpu]' "
                        f"in a jaxrl checkout, or pip install 'jax[tpu]=={jax.__version__}'")


def parse_tpu_name(name: str) -> tuple[str, tuple[int, ...]]:
    """`"v5e:8x8"` -> `("v5e", (8, 8))`, checked against what the generation can be."""
    text = name.strip().lower()
    typed = _ACCELERATOR_TYPE.match(text)
    if typed:
        generation, per_chip = _TYPE_UNITS[typed.group(1)]
        chips = int(typed.group(2)) // per_chip
        grids = [f"{generation}:{g}" for g in COMMON_SHAPES[generation] if math.prod(map(int, g.split("x"))) == chips]
        hint = f"its chip grid: {' or '.join(grids)}" if grids else f"give the chip grid instead, e.g. {EXAMPLES}"
        raise PlanError(f"topology {name!r} is a Cloud accelerator type ({chips} chips); {hint}")
    match = _NAME.match(text)
    if not match:
        raise PlanError(f"topology {name!r} is not <generation>:<chip grid>, e.g. {EXAMPLES} (or gpu)")
    generation, grid = match.group(1), tuple(int(n) for n in match.group(2).split("x"))
    if generation == "v4":
        raise PlanError("topology v4 is not supported: libtpu's default chip config gives two devices per v4 chip, "
                        "and the v4 page publishes no per-chip ICI bandwidth; known generations: "
                        f"{', '.join(TPU_GENERATIONS)}")
    if generation not in TPU_GENERATIONS:
        raise PlanError(f"unknown TPU generation {generation!r} in topology {name!r}; known: "
                        f"{', '.join(TPU_GENERATIONS)} (e.g. {EXAMPLES})")
    spec = TPU_GENERATIONS[generation]
    if len(grid) != spec.dims:
        example = "x".join("2" * spec.dims)
        raise PlanError(f"topology {name!r}: {generation} slices are {spec.dims}-D ({generation}:{example}), "
                        f"not {len(grid)}-D")
    largest = "x".join(map(str, spec.max_shape))
    if min(grid) < 1 or max(grid) > max(spec.max_shape) or math.prod(grid) > math.prod(spec.max_shape):
        raise PlanError(f"topology {name!r}: {generation} slices go from 1 chip to {largest} "
                        f"({math.prod(spec.max_shape)} chips)")
    return generation, grid


def tpu_topology(name: str, slices: int = 1) -> Topology:
    """The devices of `slices` TPU slices of shape `name` (e.g. "v5e:8x8"), for compiling ahead of time.

    Raises `PlanError` when libtpu is missing, the generation is unknown, or the shape is malformed or one
    libtpu cannot build.
    """
    if not isinstance(slices, int) or isinstance(slices, bool) or slices < 1:
        raise PlanError(f"slices must be a positive integer, got {slices!r}")
    generation, grid = parse_tpu_name(name)
    _check_libtpu()
    spec = TPU_GENERATIONS[generation]
    canonical = f"{generation}:{'x'.join(map(str, grid))}"
    kwargs = {}
    if math.prod(grid) <= spec.host_chips:  # one host holds the whole slice (libtpu's default host is 2x2x1)
        kwargs["chips_per_host_bounds"] = (*grid, *(1,) * (3 - len(grid)))
    # Compile-only topologies attach no TPU: several processes (parallel tests, a plan beside a run) may load
    # libtpu at once, which its lockfile otherwise refuses. Only read before libtpu first loads.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        described = topologies.get_topology_desc(platform="tpu", topology_name=canonical,
                                                 chip_config_name="default", num_slices=slices, **kwargs)
    except Exception as e:  # JaxRuntimeError / RuntimeError from libtpu, messages of several lines
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = re.sub(r"^[A-Z_]+: ", "", first)
        if "lockfile" in first:
            raise PlanError(f"libtpu refused to load: another process holds its lockfile; set "
                            f"ALLOW_MULTIPLE_LIBTPU_LOAD=1 (libtpu: {first[:120]})") from None
        raise PlanError(f"topology {canonical!r} cannot be built (libtpu: {first[:160]}); shapes look like "
                        f"{EXAMPLES}") from None
    devices = tuple(described.devices)
    places = {(getattr(d, "slice_index", 0), tuple(d.coords)) for d in devices}
    if len(places) != len(devices) or len(devices) != math.prod(grid) * slices:
        raise PlanError(f"libtpu gave {len(devices)} devices for the {math.prod(grid) * slices} chips of "
                        f"{canonical} x {slices} slice(s): one device per chip is required")
    try:
        chip = chip_for(devices[0])
    except UnknownChipError as e:
        raise PlanError(str(e)) from None
    if chip is not CHIPS[spec.chip]:
        raise PlanError(f"libtpu describes {canonical} as {devices[0].device_kind!r}, not a {spec.chip}")
    return Topology(canonical, chip, devices, slices)


def attached_gpus() -> Topology:
    """The NVIDIA GPUs jax sees (every process's), or a `PlanError` naming the platforms it does see."""
    try:
        devices = tuple(jax.devices("gpu"))
    except RuntimeError:
        devices = ()
    if not devices:
        seen = {}
        for device in jax.devices():
            seen[device.platform] = seen.get(device.platform, 0) + 1
        listed = ", ".join(f"{platform} ({n} device{'s' * (n > 1)})" for platform, n in seen.items())
        raise PlanError(f"no GPU attached: jax sees {listed}")
    kinds = sorted({d.device_kind for d in devices})
    if len(kinds) > 1:
        raise PlanError(f"the attached GPUs are of several kinds ({', '.join(kinds)}); a plan needs one kind")
    try:
        chip = chip_for(devices[0])
    except UnknownChipError as e:
        raise PlanError(str(e)) from None
    return Topology("gpu", chip, devices, 1)


def resolve(name: str, slices: int = 1) -> Topology:
    """`"gpu"`: the attached GPUs; anything else: a TPU topology name such as "v5e:8x8"."""
    if not isinstance(name, str) or not name.strip():
        raise PlanError(f"a topology is needed, e.g. {EXAMPLES} or gpu; got {name!r}")
    if name.strip().lower() == "gpu":
        if slices != 1:
            raise PlanError(f"slices={slices} applies to TPU topologies, not to gpu")
        return attached_gpus()
    return tpu_topology(name, slices)


def mesh_for(topology: Topology, mesh_config) -> Mesh:
    """The config's `(data, fsdp, tensor)` mesh (`jaxrl.config.MeshConfig`, one size may be -1) over the
    topology's chips. With several slices `data` spans them: each slice holds `data / slices` of its rows."""
    sizes = {"data": mesh_config.data, "fsdp": mesh_config.fsdp, "tensor": mesh_config.tensor}
    given = " x ".join(f"{axis}={size}" for axis, size in sizes.items())
    n = topology.num_chips
    if -1 not in sizes.values() and all(size > 0 for size in sizes.values()) and math.prod(sizes.values()) != n:
        has = "have" if topology.slices > 1 else "has"
        raise PlanError(f"mesh {given} = {math.prod(sizes.values())} chips, but {topology.title} {has} {n}")
    try:
        data, fsdp, tensor = mesh_shape(*sizes.values(), n)
    except ValueError as e:
        raise PlanError(f"{e} ({topology.title})") from None
    if topology.slices == 1:
        try:
            return make_mesh(data, fsdp, tensor, devices=list(topology.devices))
        except (ValueError, NotImplementedError, AssertionError) as e:
            raise _layout_error(data, fsdp, tensor, topology, e) from None
    if data % topology.slices:
        raise PlanError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor}: the data axis spans the "
                        f"{topology.slices} slices ({topology.name} each), so it must be a multiple of "
                        f"{topology.slices}")
    split = topology.devices[0].device_kind in ("TPU v5 lite", "TPU v5e")  # as jax.make_mesh decides
    try:
        grid = mesh_utils.create_hybrid_device_mesh((data // topology.slices, fsdp, tensor), (topology.slices, 1, 1),
                                                    list(topology.devices), allow_split_physical_axes=split)
    except (ValueError, NotImplementedError, AssertionError) as e:
        raise _layout_error(data, fsdp, tensor, topology, e) from None
    return Mesh(np.asarray(grid), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _layout_error(data: int, fsdp: int, tensor: int, topology: Topology, error: Exception) -> PlanError:
    """jax lays each mesh axis along whole sides of the chip grid (split sides only on v5e), as a run would."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    first = first.split(". ")[0][:160]
    return PlanError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} cannot be laid out on {topology.title} "
                     f"(jax: {first}); give each axis a size made of whole sides of the {topology.name} grid")
