"""Published hardware figures of the chips `jaxrl plan` compiles for, one `ChipSpec` per chip kind.

Every figure is the vendor's published peak, per chip, with its page in `source`; nothing here was measured.
Units are SI: a GB is 10^9 bytes, a GiB 2^30 (the pages mix both: each entry says which one it read).

Usable HBM is less than `hbm_bytes` on every chip, and no page publishes by how much: the TPU runtime keeps
part of HBM for itself, and on a GPU JAX preallocates 75% of the memory by default
(`XLA_PYTHON_CLIENT_MEM_FRACTION`). On an attached device `usable_hbm_bytes` reads the real limit; for an
unattached TPU topology (compile-only devices have no memory stats) a plan should keep a margin.
"""

from __future__ import annotations

import dataclasses

GB = 10**9
GIB = 2**30
_TPU_V5E = "https://docs.cloud.google.com/tpu/docs/v5e (key chip specifications; DCN: 6.4 Tbps per 256-chip Pod)"
_TPU_V5P = "https://docs.cloud.google.com/tpu/docs/v5p (key specifications table)"
_TPU_V6E = "https://docs.cloud.google.com/tpu/docs/v6e (specifications; DCN: 25.6 Tbps per 256-chip Pod)"
_H100 = ("https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM datasheet: BF16 1,979 TFLOPS with sparsity, "
         "80 GB, 3.35 TB/s, NVLink 900 GB/s); DCN: one 400 Gb/s ConnectX-7 per GPU, "
         "https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/"
         "core-components.html")
_H200 = ("https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM datasheet: BF16 1,979 TFLOPS with sparsity, "
         "141 GB, 4.8 TB/s, NVLink 900 GB/s); DCN: one 400 Gb/s ConnectX-7 per GPU, "
         "https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/"
         "core-components.html")
_A100 = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (A100 80GB SXM: BF16 312 TFLOPS dense, 80 GB HBM2e, "
         "2,039 GB/s, NVLink 600 GB/s); DCN: one 200 Gb/s ConnectX-6 per GPU, "
         "https://developer.nvidia.com/blog/defining-ai-innovation-with-dgx-a100")


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One chip's published peak figures (a TPU chip, or one GPU).

    name: short name ("v5e", "H100").
    hbm_bytes: HBM capacity of the chip in bytes, as published (not what XLA can use: see the module docstring).
    peak_bf16_flops: dense bf16 matrix FLOP/s of the whole chip (both TensorCores of a v5p; the sparsity-doubled
        figure NVIDIA lists first is halved).
    hbm_bytes_per_s: HBM bandwidth of the chip, bytes/s, reads and writes together.
    ici_bytes_per_s: chip-to-chip bandwidth within a slice / NVLink domain, bytes/s that one chip can send over
        all its links together in one direction (half of the published bidirectional figure). TPU: ICI; GPU: NVLink.
    dcn_bytes_per_s: data-center network bandwidth per chip (between slices or nodes), bytes/s in one direction
        (a NIC's line rate; a TPU host's NICs shared by its chips).
    source: the pages the figures come from.
    """

    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    dcn_bytes_per_s: float
    source: str


CHIPS: dict[str, ChipSpec] = {
    # "16 GB, 819 GBps"; bidirectional ICI 400 GBps per chip (older revisions: "1600 Gbps", one direction).
    "v5e": ChipSpec("v5e", 16 * GB, 197e12, 819 * GB, 200 * GB, 6.4e12 / 8 / 256, _TPU_V5E),
    # "HBM capacity per chip (GiB) 95", "2765 GBps" (= the 2575 GiBps of another revision); bidirectional ICI
    # 1200 GBps per chip (= "4800 Gbps" one direction); "DCN bandwidth per chip (Gbps) 50". Two TensorCores per
    # chip, one JAX device (megacore).
    "v5p": ChipSpec("v5p", 95 * GIB, 459e12, 2765 * GB, 600 * GB, 50e9 / 8, _TPU_V5P),
    # "32 GB", "1600 GBps"; bidirectional ICI 800 GBps per chip (an older revision: 1640 GBps HBM, 3584 Gbps ICI).
    "v6e": ChipSpec("v6e", 32 * GB, 918e12, 1600 * GB, 400 * GB, 25.6e12 / 8 / 256, _TPU_V6E),
    "H100": ChipSpec("H100", 80 * GB, 1979e12 / 2, 3.35e12, 900 * GB / 2, 400e9 / 8, _H100),
    "H200": ChipSpec("H200", 141 * GB, 1979e12 / 2, 4.8e12, 900 * GB / 2, 400e9 / 8, _H200),
    "A100": ChipSpec("A100", 80 * GB, 312e12, 2039 * GB, 600 * GB / 2, 200e9 / 8, _A100),
}

# jax `device.device_kind` -> CHIPS key. TPU kinds as libtpu names them for compile-only devices; GPU kinds are
# the CUDA device names of the SXM parts (PCIe / NVL boards have other clocks and links: not listed).
DEVICE_KINDS: dict[str, str] = {
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "NVIDIA H100 80GB HBM3": "H100",
    "NVIDIA H200": "H200",
    "NVIDIA A100-SXM4-80GB": "A100",
}


class UnknownChipError(ValueError):
    """A device kind with no entry in `DEVICE_KINDS`."""


def chip_for(device) -> ChipSpec:
    """The `ChipSpec` of a jax device (attached or compile-only), by its `device_kind`."""
    kind = getattr(device, "device_kind", None)
    if kind not in DEVICE_KINDS:
        raise UnknownChipError(f"no published figures for device kind {kind!r} ({getattr(device, 'platform', '?')}); "
                               f"known: {', '.join(sorted(DEVICE_KINDS))}")
    return CHIPS[DEVICE_KINDS[kind]]


def usable_hbm_bytes(device) -> int | None:
    """What XLA lets programs allocate on an attached device (`memory_stats()["bytes_limit"]`: on a GPU 75% of
    the memory by default, see `XLA_PYTHON_CLIENT_MEM_FRACTION`), or None where the runtime does not say (a
    compile-only TPU device, a CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # compile-only devices: "MemoryStats is only supported for addressable PjRt devices"
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None
