"""Per-chip figures of one compiled program: memory, FLOPs, collectives, and a roofline time.

Memory is XLA's own account of the compiled, partitioned program (`compiled.memory_analysis()`, per device):
arguments + outputs - donated (aliased) buffers + temporaries + the program's code, plus the state that
stays resident in device memory while the program runs without being one of its arguments (the optimizer
state while sampling, say). FLOPs and bytes accessed are XLA's cost analysis of the same program; the
collectives are read from its optimized HLO (`jaxrl.plan.hlo`).

The roofline time of a call is `max(FLOPs / peak FLOP/s, bytes / HBM bandwidth, collective traffic / ICI
bandwidth)`: the time the chip cannot beat if compute, memory traffic and communication overlap perfectly. It
is a lower bound; the MFU computed from it an upper bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import jax.numpy as jnp

from jaxrl.plan import hlo
from jaxrl.plan.chips import ChipSpec
from jaxrl.plan.programs import Program

UNEXPECTED_FRACTION = 0.01  # a collective larger than this share of the model state must be one we expect


@dataclasses.dataclass(frozen=True)
class ProgramEstimate:
    """Figures of one program per chip: bytes, FLOPs and seconds of one call (`repeats` included)."""

    name: str
    calls_per_step: float
    repeats: int
    timed: bool
    note: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    resident_elsewhere_bytes: int
    flops: float  # per chip, one call (all repeats)
    bytes_accessed: float
    collectives: dict  # kind -> {"count", "bytes", "traffic_bytes"}, one call (all repeats)
    kernels: dict  # Pallas kernel name -> executions per call
    unexpected: tuple[str, ...]  # collectives over UNEXPECTED_FRACTION of the state that no rule explains
    model_flops: float  # all chips, one call
    compute_s: float
    memory_s: float
    comm_s: float
    # XLA's cost analysis counts a loop's body once. Where the model's own matmul FLOPs per chip exceed the
    # program's counted FLOPs (a micro-batch scan), FLOPs and bytes are scaled by that ratio.
    loop_scale: float = 1.0

    @property
    def program_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def peak_bytes(self) -> int:
        """The program's own peak plus the state resident beside it: what must fit in one chip's HBM."""
        return self.program_bytes + self.resident_elsewhere_bytes

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s, self.comm_s)

    @property
    def bound(self) -> str:
        """What limits the roofline time: compute, memory (HBM) or communication (ICI)."""
        return max((self.compute_s, "compute"), (self.memory_s, "memory"), (self.comm_s, "collectives"))[1]

    @property
    def traffic_bytes(self) -> int:
        return sum(c["traffic_bytes"] for c in self.collectives.values())


# XLA's execution-time optimisation effort for the plan's compiles (jax's `jax_exec_time_optimization_effort`,
# -1 to 1, 0 by default). At -1 a 7B model's programs compile about 3x faster and in far less host memory (the
# train step at 0 took over 19 GB of this machine's 24 and was killed); the memory figures come out a little
# higher (a Qwen2.5-7B layer's log-prob pass: 0.57 GiB of temporaries against 0.51), so a plan errs on the
# side of not fitting. `jaxrl plan --effort 0` compiles as training does.
FAST_EFFORT = -1.0


def compile_program(program: Program, effort: float = FAST_EFFORT):
    """`(compiled, seconds)`: the program lowered and compiled for its arguments' devices at XLA optimisation
    `effort`. The persistent compilation cache is off meanwhile: a compile-only TPU executable cannot be loaded
    back from it (jax warns "PjRtCompiler must be constructed with a Client"), so entries would only cost time
    and disk."""
    start = time.perf_counter()
    with _config_state("enable_compilation_cache", False), _config_state("exec_time_optimization_effort", effort):
        compiled = program.lower().compile()
    return compiled, time.perf_counter() - start


def _config_state(name: str, value):
    """jax's config option `name` set to `value` for a `with` block (its states are context managers; these two
    have no public alias). A jax without it compiles as configured."""
    from jax._src import config

    state = getattr(config, name, None)
    return state(value) if state is not None else contextlib.nullcontext()


def estimate(program: Program, compiled, compile_s: float, chip: ChipSpec, resident_elsewhere_bytes: int,
             state_bytes: int, expected_shapes: set[tuple[int, ...]], chips: int = 1) -> ProgramEstimate:
    """The figures of `program` compiled as `compiled` on `chips` chips of `chip`.

    `state_bytes`: the whole model state (all chips) that `UNEXPECTED_FRACTION` is a share of;
    `expected_shapes`: array shapes whose collectives are explained by the sharding rules (each parameter's
    full and per-chip shape: FSDP's per-layer gathers and the gradients' reductions).
    """
    memory = compiled.memory_analysis()
    cost = _cost(compiled)
    text = compiled.as_text()
    found = hlo.collectives(text)
    repeats = program.repeats
    summary = {kind: {k: v * repeats for k, v in figures.items()} for kind, figures in hlo.summarize(found).items()}
    kernels = {name: count * repeats for name, count in hlo.pallas_kernels(text).items()}
    flops = float(cost.get("flops", 0.0)) * repeats
    bytes_accessed = float(cost.get("bytes accessed", 0.0)) * repeats
    loop_scale = loop_correction(flops, program.model_flops * repeats / chips)
    flops, bytes_accessed = flops * loop_scale, bytes_accessed * loop_scale
    traffic = sum(c["traffic_bytes"] for c in summary.values())
    return ProgramEstimate(
        name=program.name, calls_per_step=program.calls_per_step, repeats=repeats, timed=program.timed,
        note=program.note, compile_s=compile_s,
        argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes), resident_elsewhere_bytes=resident_elsewhere_bytes,
        flops=flops, bytes_accessed=bytes_accessed, collectives=summary, kernels=kernels,
        unexpected=unexpected_collectives(found, state_bytes, expected_shapes),
        model_flops=program.model_flops * repeats,
        compute_s=flops / chip.peak_bf16_flops, memory_s=bytes_accessed / chip.hbm_bytes_per_s,
        comm_s=traffic / chip.ici_bytes_per_s, loop_scale=loop_scale)


def loop_correction(counted_flops: float, model_flops_per_chip: float) -> float:
    """How many times more work a program does than XLA's cost analysis counts: the model's own matmul FLOPs
    per chip over the counted FLOPs when they exceed them by over 5% (a loop body counted once), else 1. The
    model's matmuls are a lower bound of the program's FLOPs, so the correction never overshoots them."""
    if counted_flops <= 0 or model_flops_per_chip <= 1.05 * counted_flops:
        return 1.0
    return model_flops_per_chip / counted_flops


def extrapolate(first: ProgramEstimate, second: ProgramEstimate, depths: tuple[int, int], layers: int,
                resident_elsewhere_bytes: int) -> ProgramEstimate:
    """The estimate of a program at `layers` layers from the same program compiled at `depths` (d1 < d2)
    layers: every figure linear in the layer count (the layers are identical and unrolled), negative results
    clamped to 0; compile time is the two compiles' sum. `resident_elsewhere_bytes` at the full depth."""
    d1, d2 = depths
    scale = (layers - d1) / (d2 - d1)

    def line(a, b):
        return max(a + (b - a) * scale, 0)

    def whole(a, b):
        return int(round(line(a, b)))

    kinds = set(first.collectives) | set(second.collectives)
    zero = {"count": 0, "bytes": 0, "traffic_bytes": 0}
    collectives = {k: {f: whole(first.collectives.get(k, zero)[f], second.collectives.get(k, zero)[f]) for f in zero}
                   for k in kinds}
    kernels = {k: whole(first.kernels.get(k, 0), second.kernels.get(k, 0))
               for k in set(first.kernels) | set(second.kernels)}
    numbers = {f: line(getattr(first, f), getattr(second, f))
               for f in ("flops", "bytes_accessed", "model_flops", "compute_s", "memory_s", "comm_s")}
    sizes = {f: whole(getattr(first, f), getattr(second, f))
             for f in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "code_bytes")}
    return dataclasses.replace(
        second, compile_s=first.compile_s + second.compile_s, resident_elsewhere_bytes=resident_elsewhere_bytes,
        collectives=collectives, kernels=kernels, unexpected=tuple(dict.fromkeys(first.unexpected + second.unexpected)),
        note=f"{second.note}; from {d1} and {d2} layers".lstrip("; "), **numbers, **sizes)


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    return dict(cost or {})


# Collectives that gather: a reduction (all-reduce, reduce-scatter) sums partial results (gradients, tensor-
# parallel partial products) and never assembles a whole array that the rules keep split.
GATHERING = ("all-gather", "all-to-all", "collective-permute")


def unexpected_collectives(found: list, state_bytes: int, expected_shapes: set[tuple[int, ...]]) -> tuple[str, ...]:
    """Gathering collectives moving more than `UNEXPECTED_FRACTION` of `state_bytes` in one execution whose
    array is not one parameter (whole, or split over some of the mesh axes: FSDP's per-layer gather of one
    weight): a gather of several layers' weights at once, or of a whole KV cache, say."""
    threshold = UNEXPECTED_FRACTION * state_bytes
    flagged = []
    for collective in found:
        if collective.kind not in GATHERING or collective.bytes <= threshold:
            continue
        if all(dims in expected_shapes for dims in _result_dims(collective.shape)):
            continue
        flagged.append(f"{collective.kind} {collective.shape} ({collective.bytes / 2**20:.1f} MiB"
                       f"{f' x {collective.executions}' if collective.executions > 1 else ''}) in "
                       f"{collective.computation}")
    return tuple(flagged)


def _result_dims(shape: str) -> list[tuple[int, ...]]:
    """The dimensions of each array in an HLO shape string: `bf16[3584,512]` or `(f32[8], bf16[2,4]{1,0})`."""
    dims = []
    for part in shape.replace("(", "").replace(")", "").split("],"):
        if "[" not in part:
            continue
        inside = part.split("[", 1)[1].split("]", 1)[0]
        dims.append(tuple(int(d) for d in inside.split(",") if d.strip()))
    return dims


def expected_shapes(resident: dict, mesh_sizes: dict[str, int]) -> set[tuple[int, ...]]:
    """The shapes of one resident array split over any subset of the mesh axes, each dimension on its own (and
    with the two trailing axes swapped: a transposed weight gathered for the backward pass). Shapes of several
    weights stacked, or of anything else, are not among them."""
    import itertools

    import jax

    divisors = {1}
    for size in mesh_sizes.values():
        divisors |= {d * size for d in divisors}
    shapes = set()
    for leaf in jax.tree.leaves(resident):
        options = [sorted({n // d for d in divisors if n % d == 0}) for n in leaf.shape]
        for dims in itertools.product(*options):
            shapes.add(dims)
            if len(dims) >= 2:
                shapes.add((*dims[:-2], dims[-1], dims[-2]))
    return shapes


def tree_bytes(tree) -> int:
    """Bytes of a tree of ShapeDtypeStructs over all chips (the arrays' full size)."""
    import jax

    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))
