"""Plan one RL step of a recipe on a topology: compile its programs, add up memory and time, judge the fit.

`make_plan(config, topology)` builds the config's mesh over the topology's chips, compiles every program of
one RL step (`jaxrl.plan.programs`) for them and returns a `Plan`. `fit_or_suggest` looks for the cheapest
change of an unfitting plan and checks it by planning again with that change.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.plan import estimate as est
from jaxrl.plan.programs import StepPrograms, layout_for, model_config, state_bytes_per_chip, step_programs
from jaxrl.plan.chips import usable_hbm_bytes
from jaxrl.plan.topology import COMMON_SHAPES, PlanError, Topology, mesh_for

# Share of a TPU chip's HBM that the plan may fill (no page says how much the runtime keeps; XLA's allocator
# also fragments). On an attached GPU the runtime's own limit applies (`usable_hbm_bytes`).
HBM_USABLE = 0.95


@dataclasses.dataclass(frozen=True)
class Plan:
    """One RL step of a config on a topology, per chip unless named otherwise."""

    topology: Topology
    mesh: dict[str, int]  # data, fsdp, tensor
    model: str  # a short description of the policy
    parameters: int
    shapes: dict[str, int]
    resident: dict[str, int]  # name -> bytes per chip of the state that lives across programs
    programs: tuple[est.ProgramEstimate, ...]
    overrides: tuple[str, ...] = ()  # config overrides this plan was made with
    depths: tuple[int, ...] = ()  # layer counts compiled and extrapolated from (empty: the full depth)
    lora: str = ""  # the LoRA adapters trained over a frozen base (`rl.lora`); empty: the full fine-tune
    trained: int = 0  # parameters the optimizer trains (the adapters' with LoRA)
    full: Plan | None = None  # with LoRA: the full fine-tune of the same model on the same topology, beside it

    @property
    def hbm_bytes(self) -> int:
        return self.topology.chip.hbm_bytes

    @property
    def usable_bytes(self) -> int:
        """What the plan may fill per chip: the attached device's limit, else `HBM_USABLE` of its HBM."""
        limit = usable_hbm_bytes(self.topology.devices[0])
        return limit if limit is not None else int(self.hbm_bytes * HBM_USABLE)

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    @property
    def peak(self) -> est.ProgramEstimate | None:
        return max(self.programs, key=lambda p: p.peak_bytes, default=None)

    @property
    def peak_bytes(self) -> int:
        return self.peak.peak_bytes if self.programs else self.resident_bytes

    def failing(self) -> list[str]:
        """Names of the programs whose peak does not fit (`resident` when the state alone does not)."""
        if not self.programs:
            return ["resident"]
        return [p.name for p in self.programs if p.peak_bytes > self.usable_bytes]

    @property
    def fits(self) -> bool:
        return bool(self.programs) and not self.failing()

    def phase_seconds(self) -> dict[str, float]:
        """Roofline seconds per RL step of each timed program (calls and repeats included)."""
        return {p.name: p.time_s * p.calls_per_step for p in self.programs if p.timed and p.calls_per_step}

    @property
    def step_seconds(self) -> float:
        return sum(self.phase_seconds().values())

    @property
    def flops_per_step(self) -> float:
        """HLO FLOPs per chip of one RL step."""
        return sum(p.flops * p.calls_per_step for p in self.programs if p.timed)

    @property
    def model_flops_per_step(self) -> float:
        """The model's own matmul FLOPs of one RL step, all chips."""
        return sum(p.model_flops * p.calls_per_step for p in self.programs if p.timed)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation at the roofline step time (an upper bound, as that time is a lower one)."""
        peak = self.topology.chip.peak_bf16_flops * self.topology.num_chips
        return self.model_flops_per_step / (self.step_seconds * peak) if self.step_seconds else 0.0

    def collectives_per_step(self) -> dict[str, dict[str, float]]:
        """kind -> count, bytes and ring traffic per chip over one RL step (timed programs)."""
        total: dict[str, dict[str, float]] = {}
        for p in self.programs:
            if not (p.timed and p.calls_per_step):
                continue
            for kind, figures in p.collectives.items():
                into = total.setdefault(kind, {"count": 0, "bytes": 0, "traffic_bytes": 0})
                for key, value in figures.items():
                    into[key] += value * p.calls_per_step
        return total


def make_plan(config: Config, topology: Topology, *, overrides: Sequence[str] = (),
              reuse: dict[str, est.ProgramEstimate] | None = None, only: Sequence[str] | None = None,
              whole_sampler: bool = False, progress: Callable[[str], None] | None = None) -> Plan:
    """Compile every program of one RL step of `config` for `topology` and collect their figures.

    `reuse`: estimates of programs that the change from an earlier plan leaves as they were (by name), not
    compiled again. `only`: plan just the programs of these names (e.g. `train_step` while tuning it).
    `whole_sampler`: also compile the sampler as the one program it is (`programs.step_programs`). When
    the resident state alone exceeds a chip's usable HBM nothing is compiled.
    """
    mesh = mesh_for(topology, config.mesh)
    depths = tuple(config.plan.depths)
    try:
        model = model_config(config)
        _check_depths(depths, model.num_layers)
        layout = layout_for(config, mesh)
        built = step_programs(config, layout, model, whole_sampler=whole_sampler)
        shallow = [step_programs(config, layout, _shallow(model, d), whole_sampler=whole_sampler) for d in depths]
    except ValueError as e:
        raise PlanError(str(e)) from None
    resident = {name: state_bytes_per_chip(tree) for name, tree in built.resident.items()}
    plan = Plan(topology=topology, mesh=dict(mesh.shape), model=_describe(model), parameters=_parameters(model),
                shapes=built.shapes, resident=resident, programs=(), overrides=tuple(overrides), depths=depths,
                lora=_describe_lora(config), trained=_count(built.resident["policy"]))
    if plan.resident_bytes > plan.usable_bytes:
        return plan
    names = [p.name for p in built.programs]
    if only is not None:
        unknown = set(only) - set(names)
        if unknown:
            raise PlanError(f"no program named {', '.join(sorted(unknown))} in this recipe's step; it has "
                            f"{', '.join(names)}")
        names = [n for n in names if n in only]
    reuse = reuse or {}
    if not depths:
        built = dataclasses.replace(built, programs=tuple(p for p in built.programs if p.name in names))
        return dataclasses.replace(plan, programs=tuple(_estimates(built, topology, resident, reuse, progress)))
    at_depth = []
    for d, shallow_built in zip(depths, shallow):
        todo = tuple(p for p in shallow_built.programs if p.name in names and p.name not in reuse)
        resident_d = {k: state_bytes_per_chip(t) for k, t in shallow_built.resident.items()}
        at_depth.append({e.name: e for e in _estimates(dataclasses.replace(shallow_built, programs=todo), topology,
                                                        resident_d, {}, progress, f" at {d} layers")})
    full = {p.name: p for p in built.programs}
    estimates = []
    for name in names:
        if name in reuse:
            estimates.append(reuse[name])
            continue
        elsewhere = sum(resident[r] for r in full[name].resident_elsewhere)
        estimates.append(est.extrapolate(at_depth[0][name], at_depth[1][name], depths, model.num_layers, elsewhere))
    return dataclasses.replace(plan, programs=tuple(estimates))


def _check_depths(depths: tuple[int, ...], layers: int) -> None:
    if not depths:
        return
    if len(depths) != 2 or not 1 <= depths[0] < depths[1] < layers:
        raise ValueError(f"plan.depths {list(depths)}: two layer counts d1 < d2 below the model's {layers} layers, "
                         "e.g. [4, 8]; [] compiles the full depth")


def _shallow(model, layers: int):
    """`model` with its first `layers` layers (their sliding / full pattern kept)."""
    return dataclasses.replace(model, num_layers=layers, layer_types=model.layer_types[:layers])


def _estimates(built: StepPrograms, topology: Topology, resident: dict[str, int],
               reuse: dict[str, est.ProgramEstimate], progress, where: str = "") -> list[est.ProgramEstimate]:
    state_bytes = est.tree_bytes(built.resident)
    expected = est.expected_shapes(built.resident, dict(built.layout.mesh.shape))
    estimates = []
    for program in built.programs:
        if program.name in reuse:
            estimates.append(reuse[program.name])
            continue
        if progress:
            progress(f"compiling {program.name} for {topology.name}{where}")
        try:
            compiled, seconds = est.compile_program(program)
        except Exception as e:  # XLA's and Mosaic's errors: say which program, keep the first line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PlanError(f"{program.name} does not compile for {topology.name}: {first[:400]}") from e
        elsewhere = sum(resident[name] for name in program.resident_elsewhere)
        estimates.append(est.estimate(program, compiled, seconds, topology.chip, elsewhere, state_bytes, expected,
                                      chips=topology.num_chips))
    return estimates


def _describe(model) -> str:
    return (f"{model.family} {model.num_layers} layers, hidden {model.hidden_size}, {model.num_heads} heads "
            f"({model.num_kv_heads} kv), vocab {model.vocab_size}, params {model.param_dtype}, compute "
            f"{model.dtype}, attention {model.attention_impl}, remat {model.remat}")


def _describe_lora(config: Config) -> str:
    lora = config.rl.lora
    if not lora.enabled:
        return ""
    from jaxrl.models.lora import PROJECTIONS
    targets = "all projections" if tuple(lora.targets) == PROJECTIONS else ", ".join(lora.targets)
    base = f"{lora.quantize} base (QLoRA)" if lora.quantize else "base as loaded"
    return f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {targets}, {base}"


def _count(tree) -> int:
    import math

    import jax
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def with_full_fine_tune(plan: Plan, config_path: str | None, overrides: Sequence[str], topology: Topology, *,
                        whole_sampler: bool = False, progress: Callable[[str], None] | None = None) -> Plan:
    """A LoRA `plan` with the full fine-tune of the same recipe (`rl.lora.enabled=false`) planned beside it, on
    the same topology and programs (`Plan.full`). A plan without LoRA is returned as it is."""
    if not plan.lora:
        return plan
    changed = [*overrides, "rl.lora.enabled=false"]
    if progress:
        progress("planning the full fine-tune of the same model beside it (rl.lora.enabled=false)")
    full = make_plan(load_config(Config, config_path, changed), topology, overrides=changed,
                     only=[p.name for p in plan.programs] or None, whole_sampler=whole_sampler, progress=progress)
    return dataclasses.replace(plan, full=full)


def _parameters(model) -> int:
    from jaxrl import models
    return models.num_parameters(model)


# ------------------------------------------------------------------------------------------------ changes

# Which programs a change of each config key can change (the rest are reused from the plan before it).
_AFFECTS = {
    "rl.micro_batches": {"train_step", "logprobs", "values"},
    "pretrained.remat": {"train_step", "logprobs", "values"},
    "model.remat": {"train_step", "logprobs", "values"},
    "rl.sampling.kv_cache_dtype": {"sample", "prefill", "decode_step", "eval_decode_step"},
    "eval.batch_size": {"eval_decode_step"},
}


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A change (config overrides and/or another topology) and the plan made with it."""

    overrides: tuple[str, ...]
    topology: str | None
    plan: Plan

    def describe(self) -> str:
        parts = list(self.overrides) + ([f"--topology {self.topology}"] if self.topology else [])
        return " ".join(parts)


def _candidates(config: Config, plan: Plan) -> list[list[str]]:
    """Config changes to try for the programs that do not fit, cheapest (least slowdown) first; each is a list
    of overrides. Topology changes are tried after these (`_larger_topologies`)."""
    failing = set(plan.failing())
    remat_key = "pretrained.remat" if config.pretrained.path is not None else "model.remat"
    remat = config.pretrained.remat if config.pretrained.path is not None else config.model.remat
    rl = config.rl
    changes: list[list[str]] = []
    if "resident" in failing:
        return _mesh_changes(config)
    training = failing & {"train_step", "logprobs", "values"}
    sampling = failing & {"sample", "prefill", "decode_step", "eval_decode_step"}
    options_train: list[list[str]] = []
    if training:
        rows = plan.shapes["minibatch"]
        micro = rl.micro_batches
        remats = [] if "train_step" not in training else ["dots", "full"] if remat == "none" else \
            ["full"] if remat == "dots" else []  # remat changes the backward pass only
        if "dots" in remats:
            options_train.append([f"{remat_key}=dots"])
        for factor in (2, 4, 8):
            m = micro * factor
            if rows % m == 0 and (rows // m) % plan.shapes["data_parallel"] == 0:
                options_train.append([f"rl.micro_batches={m}"])
                if "full" in remats:
                    options_train.append([f"rl.micro_batches={m}", f"{remat_key}=full"])
        if "full" in remats:
            options_train.insert(min(2, len(options_train)), [f"{remat_key}=full"])
    options_sample: list[list[str]] = []
    if sampling:
        if rl.sampling.kv_cache_dtype != "int8":
            options_sample.append(["rl.sampling.kv_cache_dtype=int8"])
        if "eval_decode_step" in sampling and config.eval.batch_size // 2 >= plan.shapes["data_parallel"]:
            options_sample.append(["eval.batch_size=%d" % (config.eval.batch_size // 2)])
    if training and sampling:
        for a in options_train or [[]]:
            for b in options_sample or [[]]:
                changes.append(a + b)
    else:
        changes = options_train or options_sample
    return changes + _mesh_changes(config)


def _mesh_changes(config: Config) -> list[list[str]]:
    """Splitting the state over more chips: the `data` axis folded into `fsdp`."""
    mesh = config.mesh
    if mesh.data != 1:
        return [["mesh.data=1", "mesh.fsdp=-1", f"mesh.tensor={mesh.tensor}"]]
    return []


def fit_or_suggest(config_path: str | None, overrides: Sequence[str], plan: Plan, topology: Topology, *,
                   resolve: Callable[[str], Topology], max_tries: int = 6,
                   progress: Callable[[str], None] | None = None) -> Suggestion | None:
    """The cheapest change that makes an unfitting `plan` fit, checked by planning again with it (None when
    `plan` fits or nothing tried within `max_tries` plans fits). Config changes on `topology` first
    (`_candidates`), then larger slices of its generation (`_larger_topologies`), each as it is and then with
    the config changes its own plan calls for."""
    if plan.fits:
        return None
    config = load_config(Config, config_path, list(overrides))
    only = [p.name for p in plan.programs] or None  # the same programs as `plan`
    tries = 0
    for name in [None, *_larger_topologies(topology, plan)]:
        if tries >= max_tries:
            break
        target, base = topology, plan
        if name is not None:
            tries += 1
            if progress:
                progress(f"trying --topology {name}")
            target = resolve(name)
            try:
                base = make_plan(config, target, overrides=overrides, only=only, progress=progress)
            except PlanError:
                continue  # e.g. the mesh does not split over this many chips
            if base.fits:
                return Suggestion((), name, base)
        for change in _candidates(config, base):
            if tries >= max_tries:
                break
            tries += 1
            changed = load_config(Config, config_path, [*overrides, *change])
            affected = set().union(*(_AFFECTS.get(c.split("=", 1)[0], {"*"}) for c in change))
            reuse = {} if "*" in affected else {p.name: p for p in base.programs if p.name not in affected}
            if progress:
                progress(f"trying {' '.join(change)}{'' if name is None else f' on {name}'}")
            candidate = make_plan(changed, target, overrides=[*overrides, *change], reuse=reuse, only=only,
                                  progress=progress)
            if candidate.fits:
                return Suggestion(tuple(change), name, candidate)
    return None


def _larger_topologies(topology: Topology, plan: Plan) -> list[str]:
    """Larger slices of `topology`'s generation on which the resident state would take at most half of a
    chip's usable HBM (the state splits over the chips; the rest is for the programs' own buffers)."""
    generation, _, shape = topology.name.partition(":")
    shapes = COMMON_SHAPES.get(generation, ())
    if shape not in shapes:
        return []
    found = []
    for larger in shapes[shapes.index(shape) + 1:]:
        chips = 1
        for size in larger.split("x"):
            chips *= int(size)
        if plan.resident_bytes * topology.num_chips / chips <= plan.usable_bytes / 2:
            found.append(f"{generation}:{larger}")
    return found[:2]


def log_progress(message: str) -> None:
    print(f"jaxrl plan: {message}", file=sys.stderr, flush=True)
