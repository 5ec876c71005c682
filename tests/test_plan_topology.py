"""jaxrl.plan.chips and jaxrl.plan.topology: topology names -> compile-only devices, the config's mesh over them,
and a one-line PlanError for each bad input. No compiles: building a topology takes milliseconds."""

import math
import re
import types

import jax
import pytest

from jaxrl.config import MeshConfig
from jaxrl.plan import chips, topology
from jaxrl.plan.chips import CHIPS, DEVICE_KINDS, UnknownChipError, chip_for
from jaxrl.plan.topology import PlanError, mesh_for, resolve, tpu_topology


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def test_v5e_2x2_has_four_v5e_chips_and_a_2x2_mesh():
    topo = resolve("v5e:2x2")
    assert (topo.name, topo.num_chips, topo.slices) == ("v5e:2x2", 4, 1)
    assert topo.chip is CHIPS["v5e"]
    assert {d.platform for d in topo.devices} == {"tpu"} and jax.default_backend() == "cpu"
    mesh = mesh_for(topo, MeshConfig(data=1, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in topo.devices)


def test_v5p_2x2x2_has_eight_v5p_chips_and_fsdp_and_tensor_axes():
    topo = tpu_topology("v5p:2x2x2")
    assert (topo.num_chips, topo.chip) == (8, CHIPS["v5p"])  # one device per chip (megacore), not per core
    mesh = mesh_for(topo, MeshConfig(data=1, fsdp=-1, tensor=4))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 4}


def test_two_slices_put_the_data_axis_across_slices():
    topo = tpu_topology("v5e:2x2", slices=2)
    assert (topo.num_chips, topo.slices, topo.title) == (8, 2, "2 slices of v5e:2x2")
    assert sorted({d.slice_index for d in topo.devices}) == [0, 1]
    mesh = mesh_for(topo, MeshConfig(data=-1, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    for row in range(2):  # each data row lies in one slice: fsdp and tensor stay on ICI
        assert {d.slice_index for d in mesh.devices[row].flat} == {row}
    with pytest.raises(PlanError, match="data axis spans the 2 slices .* multiple of 2") as e:
        mesh_for(topo, MeshConfig(data=1, fsdp=4, tensor=2))
    _one_line(e)


@pytest.mark.parametrize("name, expected", [
    ("v9x:2x2", "unknown TPU generation 'v9x' in topology 'v9x:2x2'; known: v5e, v6e, v5p"),
    ("v4:2x2x1", "topology v4 is not supported"),
    ("v5e", "topology 'v5e' is not <generation>:<chip grid>, e.g. v5e:2x2, v5e:8x8, v5p:4x4x4, v6e:4x4"),
    ("v5e:2x2x2", "v5e slices are 2-D (v5e:2x2), not 3-D"),
    ("v5p:2x2", "v5p slices are 3-D (v5p:2x2x2), not 2-D"),
    ("v5e:32x32", "v5e slices go from 1 chip to 16x16 (256 chips)"),
    ("v5e:0x2", "v5e slices go from 1 chip to 16x16"),
    ("v5litepod-64", "topology 'v5litepod-64' is a Cloud accelerator type (64 chips); its chip grid: v5e:8x8"),
    ("v5p-32", "is a Cloud accelerator type (16 chips); its chip grid: v5p:2x2x4"),  # v5p types count TensorCores
    ("v6e-12", "v6e-12' is a Cloud accelerator type (12 chips); give the chip grid instead"),
    # libtpu's own refusal, condensed to one line with the shapes that work
    ("v5e:3x3", "topology 'v5e:3x3' cannot be built (libtpu: Topology layout \"v5e:3x3\" is not divisible"),
])
def test_bad_topology_names_are_one_line_errors(name, expected):
    with pytest.raises(PlanError) as e:
        resolve(name)
    assert expected in _one_line(e)


def test_a_mesh_that_does_not_match_the_chip_count_names_both():
    topo = resolve("v5e:2x2")
    with pytest.raises(PlanError) as e:
        mesh_for(topo, MeshConfig(data=2, fsdp=4, tensor=4))
    assert _one_line(e) == "mesh data=2 x fsdp=4 x tensor=4 = 32 chips, but v5e:2x2 has 4"
    with pytest.raises(PlanError, match=r"4 devices do not split into 3 x mesh.data \(v5e:2x2\)"):
        mesh_for(topo, MeshConfig(data=-1, fsdp=3, tensor=1))


def test_no_gpu_attached_names_what_jax_sees():
    with pytest.raises(PlanError) as e:
        resolve("gpu")
    assert re.fullmatch(r"no GPU attached: jax sees cpu \(\d+ devices?\)", _one_line(e))  # JAX_PLATFORMS=cpu
    with pytest.raises(PlanError, match="slices=2 applies to TPU topologies"):
        resolve("gpu", slices=2)


def test_attached_gpus_are_looked_up_by_device_kind(monkeypatch):
    fake = [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", id=i) for i in range(8)]
    monkeypatch.setattr(topology.jax, "devices", lambda backend=None: fake if backend == "gpu" else [])
    topo = resolve("GPU")
    assert (topo.name, topo.num_chips, topo.chip, topo.title) == ("gpu", 8, CHIPS["H100"], "gpu (8 x H100)")
    fake[3] = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 PCIe", id=3)
    with pytest.raises(PlanError, match="several kinds"):
        resolve("gpu")


def test_missing_libtpu_names_the_install_commands(monkeypatch):
    real = topology.importlib.util.find_spec
    monkeypatch.setattr(topology.importlib.util, "find_spec", lambda name: None if name == "libtpu" else real(name))
    with pytest.raises(PlanError) as e:
        resolve("v5e:2x2")
    message = _one_line(e)
    assert "needs libtpu" in message and "pip install -e '.[tpu]'" in message
    assert f"pip install 'jax[tpu]=={jax.__version__}'" in message


def test_chip_for_reads_device_kind_and_names_an_unknown_one():
    assert chip_for(types.SimpleNamespace(device_kind="TPU v6 lite")) is CHIPS["v6e"]
    assert chip_for(types.SimpleNamespace(device_kind="NVIDIA H200")) is CHIPS["H200"]
    assert chip_for(types.SimpleNamespace(device_kind="NVIDIA A100-SXM4-80GB")) is CHIPS["A100"]
    with pytest.raises(UnknownChipError, match="no published figures for device kind 'TPU v9' \\(tpu\\)"):
        chip_for(types.SimpleNamespace(device_kind="TPU v9", platform="tpu"))
    assert set(DEVICE_KINDS.values()) == set(CHIPS)  # every chip is reachable from a device kind


def test_chip_figures_are_the_published_ones():
    """Spot checks against the pages cited in each `source` (a typo in a power of ten fails here)."""
    v5e, v5p, v6e, h100 = CHIPS["v5e"], CHIPS["v5p"], CHIPS["v6e"], CHIPS["H100"]
    assert (v5e.hbm_bytes, v5e.peak_bf16_flops, v5e.hbm_bytes_per_s) == (16e9, 197e12, 819e9)
    assert 2 * v5e.ici_bytes_per_s == 400e9 and v5e.dcn_bytes_per_s == 25e9 / 8  # 400 GBps bidirectional; 25 Gbps
    assert (v5p.hbm_bytes, v5p.hbm_bytes_per_s, 2 * v5p.ici_bytes_per_s) == (95 * chips.GIB, 2765e9, 1200e9)
    assert (v6e.hbm_bytes, v6e.peak_bf16_flops, 2 * v6e.ici_bytes_per_s) == (32e9, 918e12, 800e9)
    assert (h100.peak_bf16_flops, h100.hbm_bytes_per_s, 2 * h100.ici_bytes_per_s) == (989.5e12, 3.35e12, 900e9)
    assert all(spec.source.startswith("https://") for spec in CHIPS.values())


def test_the_documented_slice_shapes_build_with_one_device_per_chip():
    for generation, shapes in topology.COMMON_SHAPES.items():
        for shape in shapes:
            chips = math.prod(int(side) for side in shape.split("x"))
            if chips <= 256:  # larger ones take 0.02 s and more each
                assert tpu_topology(f"{generation}:{shape}").num_chips == chips, (generation, shape)


def test_usable_hbm_is_the_runtime_limit_where_there_is_one():
    attached = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 63_000_000_000, "bytes_in_use": 0})
    assert chips.usable_hbm_bytes(attached) == 63_000_000_000
    assert chips.usable_hbm_bytes(resolve("v5e:2x2").devices[0]) is None  # compile-only: no memory stats
    assert chips.usable_hbm_bytes(jax.devices("cpu")[0]) is None
