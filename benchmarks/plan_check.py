"""Set one RL step's measured phases beside `jaxrl plan`'s prediction for the attached GPU.

    python benchmarks/plan_check.py RECIPE [key=value ...] [--steps 3] [--budget SECONDS] [--out FILE]
    python benchmarks/plan_check.py configs/qwen2.5-math-1.5b-gsm8k.yaml plan.model=qwen2.5-math-1.5b

For each phase of one RL step (`sample`, `logprobs`, `values` with a critic, `train_step`), a process of its
own (so the device's `peak_bytes_in_use` is that phase's alone) builds the real jitted program with the
recipe's real shapes (`jaxrl.plan.programs.step_programs`: batch, group, `max_new_tokens`, `plan.prompt_len`),
compiles it, makes its abstract arguments and the resident state it keeps beside them (`resident_elsewhere`,
e.g. the optimizer state while sampling) concrete on the device with random values of the right sharding
(`random_like`), runs it once (warm-up), then `steps x calls_per_step` timed calls (`block_until_ready`).
A last process makes the plan (`jaxrl.plan.planner.make_plan` on `attached_gpus()`). A persistent compilation
cache shared by these processes lets the plan reuse the phases' compiles.

Printed: the plan's table, a table of the phases (time per call and per RL step against the plan's roofline
time; measured peak memory per device against the plan's predicted peak, `ProgramEstimate.peak_bytes`, and
their ratio; a peak more than `TOLERANCE` away is flagged), then one JSON line with every figure.

`--chip H100` plans with that chip's published figures while the devices are this machine's CPUs: a smoke run
of the whole path with tiny overrides, not a GPU measurement (CPU "peak memory" is the process's peak RSS,
which includes the runtime and the compiler and is not comparable; nothing is flagged then):

    python benchmarks/plan_check.py configs/default.yaml plan.prompt_len=16 rl.prompts_per_step=2 \\
        rl.group_size=2 rl.sampling.max_new_tokens=8 eval.batch_size=2 --chip H100 --steps 1
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

TOLERANCE = 0.20  # a measured peak further than this from the predicted one is flagged
GiB = 2**30
CPU_NOTE = ("CPU smoke run, not a GPU measurement: the plan uses {chip}'s published figures, the programs ran on "
            "this machine's CPUs, and 'peak' is the process's peak RSS (runtime and compiler included), not "
            "comparable with the predicted device peak")


# ------------------------------------------------------------------------------------------ one process each

def load(recipe: str, overrides: list[str]):
    from jaxrl.config import Config
    from jaxrl.configlib import load_config

    return load_config(Config, recipe, list(overrides))


def phases_of(config) -> tuple[str, ...]:
    """The phases one RL step of `config` runs, in order (names of `jaxrl.plan.programs` programs)."""
    return ("sample", "logprobs") + (("values",) if config.rl.critic.model != "none" else ()) + ("train_step",)


def target(chip: str | None):
    """The `Topology` to plan and run on: the attached GPUs, or (`chip` given) this machine's CPU devices with
    the published figures of `chip` (a `jaxrl.plan.chips.CHIPS` name)."""
    import jax

    from jaxrl.plan.chips import CHIPS
    from jaxrl.plan.topology import PlanError, Topology, attached_gpus

    if chip is None:
        return attached_gpus()
    if chip not in CHIPS:
        raise PlanError(f"--chip {chip!r} is not a known chip; choose from {', '.join(CHIPS)}")
    return Topology("cpu", CHIPS[chip], tuple(jax.devices("cpu")))


@functools.lru_cache(maxsize=None)
def _filler(shape: tuple[int, ...], dtype, sharding, vocab_size: int):
    """A jitted `key -> array` of one leaf's shape, dtype and sharding (see `random_like`)."""
    import jax
    import jax.numpy as jnp

    def fill(key):
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            return jax.random.split(key, shape) if shape else key
        if dtype == jnp.bool_:
            return jnp.ones(shape, jnp.bool_)  # masks: every prompt token valid
        if jnp.issubdtype(dtype, jnp.integer):  # token ids inside the vocabulary; scalar counters at 0
            return jax.random.randint(key, shape, 0, vocab_size, dtype) if shape else jnp.zeros(shape, dtype)
        if jnp.issubdtype(dtype, jnp.floating):  # small and positive: Adam's second moments stay valid
            return (jax.random.uniform(key, shape, jnp.float32, 1e-3, 2e-2).astype(dtype) if shape
                    else jnp.ones(shape, dtype))  # scalars: temperature, loss controls
        raise ValueError(f"random_like: no random values for dtype {dtype} (shape {shape})")

    return jax.jit(fill, out_shardings=sharding)


def random_like(tree: Any, vocab_size: int, seed: int = 0) -> Any:
    """Device arrays for a tree of sharded `jax.ShapeDtypeStruct`s, one leaf at a time (so making them adds at
    most one leaf's temporaries to the peak): floats uniform in [0.001, 0.02) (float scalars 1.0), integer
    arrays token ids in `[0, vocab_size)` (integer scalars 0), booleans True, PRNG keys split from `seed`."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    values = [_filler(tuple(leaf.shape), leaf.dtype, leaf.sharding, vocab_size)(jax.random.key(seed + i))
              for i, leaf in enumerate(leaves)]
    return jax.tree.unflatten(treedef, values)


def _peak(devices) -> tuple[int, str]:
    """The largest `peak_bytes_in_use` over `devices` (per device, as the plan's figures are), or on CPUs the
    process's peak RSS."""
    if devices[0].platform != "cpu":
        peaks = [int((d.memory_stats() or {}).get("peak_bytes_in_use", 0)) for d in devices]
        if any(peaks):
            return max(peaks), "device peak_bytes_in_use"
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024), "process peak RSS (not comparable)"


def _in_use(devices) -> int | None:
    if devices[0].platform == "cpu":
        return None
    return max(int((d.memory_stats() or {}).get("bytes_in_use", 0)) for d in devices)


def _next_args(name: str, args: tuple, out: Any, abstract_args: tuple) -> tuple:
    """The arguments of the next call: the train step donates its state, so its output state is fed back (as the
    loop does), placed as the compiled program expects."""
    import jax

    if name == "train_step":
        state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), out[0], abstract_args[0])
        return (state, *args[1:])
    if any(getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree.leaves(args)):
        raise RuntimeError(f"{name} deleted (donated) an argument; plan_check does not know what to feed back")
    return args


def measure_phase(config, phase: str, steps: int = 3, chip: str | None = None, seed: int = 0) -> dict:
    """Run one phase of `config`'s RL step on the target devices (`target(chip)`) and return its figures.

    Order: compile (ahead of time, so the compiler's scratch is in the peak before any input exists), make the
    program's arguments and the state resident beside it, one warm-up call, then `steps x calls_per_step`
    (at least one) timed calls. Also returns the plan's estimate of the same compiled program (`predicted`:
    `jaxrl.plan.estimate.estimate`, as `make_plan` computes it).
    """
    import jax

    from jaxrl.plan import estimate as est
    from jaxrl.plan.programs import layout_for, state_bytes_per_chip, step_programs
    from jaxrl.plan.topology import mesh_for

    topology = target(chip)
    mesh = mesh_for(topology, config.mesh)
    built = step_programs(config, layout_for(config, mesh), whole_sampler=True)
    programs = {p.name: p for p in built.programs}
    if phase not in programs:
        raise ValueError(f"phase {phase!r} is not a program of this recipe's step; it has {', '.join(programs)}")
    program = programs[phase]
    devices = list(mesh.devices.flat)
    resident = {name: state_bytes_per_chip(tree) for name, tree in built.resident.items()}

    compiled, compile_s = est.compile_program(program)
    elsewhere = sum(resident[name] for name in program.resident_elsewhere)
    predicted = est.estimate(program, compiled, compile_s, topology.chip, elsewhere,
                             est.tree_bytes(built.resident),
                             est.expected_shapes(built.resident, dict(mesh.shape)), chips=topology.num_chips)
    peak_after_compile, _ = _peak(devices)

    vocab = built.model.vocab_size
    args = random_like(program.args, vocab, seed)
    # the state that stays on the device while this phase runs (not an argument): held until the end, in the peak
    beside = random_like({name: built.resident[name] for name in program.resident_elsewhere}, vocab, seed + 10_000)
    jax.block_until_ready((args, beside))
    peak_after_inputs, _ = _peak(devices)
    inputs_in_use = _in_use(devices)

    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    first_s = time.perf_counter() - start
    args = _next_args(phase, args, out, program.args)
    del out
    calls = max(1, round(steps * program.calls_per_step))
    times, extra = [], {}
    for i in range(calls):
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
        if phase == "train_step":
            extra.setdefault("skipped", []).append(float(out[1]["skipped"]))
        if phase == "sample" and i == calls - 1:  # the plan assumes every sequence runs to max_new_tokens
            extra["generated_tokens"] = int(out.completion_mask.sum())
            extra["full_tokens"] = built.shapes["sequences"] * built.shapes["new_tokens"]
        args = _next_args(phase, args, out, program.args)
        del out
    peak, source = _peak(devices)
    median = statistics.median(times)
    return {
        "phase": phase, "device": devices[0].device_kind, "platform": devices[0].platform,
        "devices": len(devices), "chip": topology.chip.name,
        "calls_per_step": program.calls_per_step, "calls": calls, "times_s": times, "median_s": median,
        "step_s": median * program.calls_per_step, "first_call_s": first_s, "compile_s": compile_s,
        "peak_bytes": peak, "peak_source": source, "peak_after_compile_bytes": peak_after_compile,
        "peak_after_inputs_bytes": peak_after_inputs, "inputs_in_use_bytes": inputs_in_use,
        "predicted": {"peak_bytes": predicted.peak_bytes, "program_bytes": predicted.program_bytes,
                      "resident_elsewhere_bytes": predicted.resident_elsewhere_bytes,
                      "argument_bytes": predicted.argument_bytes, "temp_bytes": predicted.temp_bytes,
                      "time_s": predicted.time_s if program.timed else None},
        "note": program.note, **extra,
    }


def make_plan_json(config, overrides: list[str], chip: str | None) -> dict:
    """`jaxrl plan`'s JSON for the target devices (`report.to_json`), with its table under "table"."""
    from jaxrl.plan import planner, report

    plan = planner.make_plan(config, target(chip), overrides=overrides, progress=planner.log_progress)
    return {**report.to_json(plan), "table": report.table(plan)}


def _child(args: argparse.Namespace) -> int:
    """One phase (or the plan) in this process; its JSON goes to `args.result` (an error as {"error": ...})."""
    try:
        config = load(args.recipe, args.overrides)
        if args.child == "plan":
            result = make_plan_json(config, args.overrides, args.chip)
        else:
            result = measure_phase(config, args.child, args.steps, args.chip, args.seed)
    except Exception as e:  # the parent records it and goes on with the other phases
        import traceback

        if type(e).__name__ != "PlanError":  # bad input says it in one line; anything else, where it broke
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:400]
        result = {"error": f"{type(e).__name__}: {first}"}
    with open(args.result, "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 1


# ------------------------------------------------------------------------------------------ the parent

def _run_child(what: str, args: argparse.Namespace, env: dict, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    command = [sys.executable, os.path.abspath(__file__), args.recipe, *args.overrides, "--child", what,
               "--result", result, "--steps", str(args.steps), "--seed", str(args.seed)]
    if args.chip:
        command += ["--chip", args.chip]
    print(f"plan_check: {what} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        code = subprocess.run(command, env=env, timeout=timeout, stdout=sys.stderr).returncode
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        wall = time.perf_counter() - start
    try:
        with open(result) as f:
            out = json.load(f)
    except (OSError, json.JSONDecodeError):
        out = {"error": f"the process exited with code {code} and wrote no result (killed? out of memory?)"}
    finally:
        os.unlink(result)
    out["wall_s"] = wall
    return out


def _plan_program(plan: dict | None, name: str) -> dict | None:
    if not plan or "programs" not in plan:
        return None
    return next((p for p in plan["programs"] if p["name"] == name), None)


def compare(measured: dict[str, dict], plan: dict | None, gpu: bool, tolerance: float = TOLERANCE) -> list[dict]:
    """One row per phase: measured time per call and per RL step, the plan's roofline time (the sampler's is
    its `prefill` plus `decode_step x max_new_tokens`), measured and predicted peak bytes per device and their
    ratio; `flag` names a peak further than `tolerance` from the prediction (only for a GPU measurement);
    `peak_set_by`: when the process reached its peak (the compiler's scratch, making the inputs, or the calls:
    only the last is the phase's own).

    `measured`: phase -> `measure_phase`'s figures (or {"error": ...}); `plan`: `jaxrl plan`'s JSON or None
    (then the prediction is the plan's estimate of the phase's own compile, `measured[...]["predicted"]`).
    """
    rows = []
    for phase, m in measured.items():
        row: dict[str, Any] = {"phase": phase}
        if "error" in m:
            rows.append({**row, "error": m["error"]})
            continue
        own = _plan_program(plan, phase)
        parts = ("prefill", "decode_step") if phase == "sample" else (phase,)
        found = [_plan_program(plan, name) for name in parts]
        roofline = sum(p["time_s"] for p in found) if all(found) else m["predicted"]["time_s"]
        predicted = own["peak_bytes"] if own else m["predicted"]["peak_bytes"]
        ratio = m["peak_bytes"] / predicted if predicted else None
        set_by = ("compile" if m["peak_bytes"] == m["peak_after_compile_bytes"] else
                  "making the inputs" if m["peak_bytes"] == m["peak_after_inputs_bytes"] else "the calls")
        flag = None
        if gpu and ratio is not None and abs(ratio - 1) > tolerance:
            flag = f"peak {100 * (ratio - 1):+.0f}% off the prediction"
        row.update(calls_per_step=m["calls_per_step"], calls=m["calls"], median_s=m["median_s"], step_s=m["step_s"],
                   roofline_s=roofline, roofline_step_s=None if roofline is None else roofline * m["calls_per_step"],
                   measured_over_roofline=m["median_s"] / roofline if roofline else None,
                   peak_bytes=m["peak_bytes"], peak_source=m["peak_source"], predicted_peak_bytes=predicted,
                   predicted_from="plan" if own else "the phase's own compile", peak_set_by=set_by, peak_ratio=ratio,
                   flag=flag)
        rows.append(row)
    return rows


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def table(rows: list[dict], gpu: bool) -> str:
    """The comparison as aligned text."""
    head = ("phase", "calls/step", "time/call (median)", "time/step", "roofline/step", "x roofline",
            "peak GiB" if gpu else "peak RSS GiB", "predicted GiB", "ratio", "flag")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append((r["phase"], "error: " + r["error"]))
            continue
        lines.append((r["phase"], f"{r['calls_per_step']:g}", f"{_fmt_s(r['median_s'])} (of {r['calls']})",
                      _fmt_s(r["step_s"]), _fmt_s(r["roofline_step_s"]),
                      "-" if r["measured_over_roofline"] is None else f"{r['measured_over_roofline']:.1f}",
                      f"{r['peak_bytes'] / GiB:.2f}", f"{r['predicted_peak_bytes'] / GiB:.2f}",
                      "-" if r["peak_ratio"] is None else f"{r['peak_ratio']:.2f}",
                      "; ".join(filter(None, [r["flag"], gpu and r["peak_set_by"] != "the calls"
                                              and f"peak set by {r['peak_set_by']}"]))))
    widths = [max(len(line[i]) for line in lines if len(line) > i and len(line) == len(head)) for i in range(len(head))]
    out = []
    for line in lines:
        if len(line) != len(head):
            out.append(f"{line[0]:<{widths[0]}}  {line[1]}")
        else:
            out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="YAML recipe, e.g. configs/qwen2.5-math-1.5b-gsm8k.yaml")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value")
    parser.add_argument("--steps", type=int, default=3, help="RL steps of timed calls per phase (default 3)")
    parser.add_argument("--chip", help="plan with this chip's figures on this machine's CPUs (a smoke run, e.g. H100)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole check: phases not started in time are reported as skipped")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per process (default 600)")
    parser.add_argument("--no-plan", action="store_true", help="skip the plan (predictions from each phase's compile)")
    parser.add_argument("--no-cache", action="store_true", help="no compilation cache shared by the processes")
    parser.add_argument("--out", help="also write the JSON line to this file (rewritten after each process)")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        return _child(args)
    if args.steps < 1:
        print(f"plan_check: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    try:
        phases = phases_of(load(args.recipe, args.overrides))
        from jaxrl.plan.chips import CHIPS

        if args.chip is not None and args.chip not in CHIPS:
            raise ValueError(f"--chip {args.chip!r} is not a known chip; choose from {', '.join(CHIPS)}")
    except Exception as e:  # ConfigError, a missing file, an unknown chip: one line
        print(f"plan_check: {e}", file=sys.stderr)
        return 2
    gpu = args.chip is None
    env = dict(os.environ)
    if not gpu:
        env["JAX_PLATFORMS"] = "cpu"
    cache = None
    if not args.no_cache:
        cache = tempfile.TemporaryDirectory(prefix="plan_check_cache_")
        env.update(JAX_COMPILATION_CACHE_DIR=cache.name, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    deadline = None if args.budget is None else time.monotonic() + args.budget
    summary = {"benchmark": "plan_check", "recipe": args.recipe, "overrides": args.overrides, "steps": args.steps,
               "measurement": "gpu" if gpu else CPU_NOTE.format(chip=args.chip),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "tolerance": TOLERANCE}
    measured: dict[str, dict] = {}
    plan = None

    def remaining() -> float:
        return args.timeout if deadline is None else min(args.timeout, deadline - time.monotonic())

    def write() -> dict:
        rows = compare(measured, plan, gpu)
        plan_json = None if plan is None else {k: v for k, v in plan.items() if k != "table"}
        result = {**summary, "rows": rows, "phases": measured, "plan": plan_json,
                  "flagged": [r["phase"] for r in rows if r.get("flag")],
                  "measured_step_s": sum(r["step_s"] for r in rows if "step_s" in r),
                  "roofline_step_s": (plan or {}).get("step_seconds")}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
                f.write("\n")
        return result

    try:
        for what in (*phases, *(() if args.no_plan else ("plan",))):
            left = remaining()
            if left < 10:
                out = {"error": "skipped: the --budget ran out"}
            else:
                out = _run_child(what, args, env, left)
            if out.get("error", "").startswith("PlanError: no GPU attached"):
                print(f"plan_check: {out['error'].removeprefix('PlanError: ')} (--chip H100 for a CPU smoke run)",
                      file=sys.stderr)
                return 2
            if what == "plan":
                plan = out if "error" not in out else None
                summary["plan_error"] = out.get("error")
            else:
                measured[what] = out
            write()
    finally:
        if cache is not None:
            cache.cleanup()
    result = write()
    if plan is not None:
        print(plan["table"])
        print()
    device = next((m["device"] for m in measured.values() if "device" in m), "?")
    print(f"{args.recipe} {' '.join(args.overrides)}: {device}, {args.steps} RL step(s) per phase"
          + ("" if gpu else f"\n{CPU_NOTE.format(chip=args.chip)}"))
    print(table(result["rows"], gpu))
    if plan is not None:
        print(f"step: measured {_fmt_s(result['measured_step_s'])}, roofline {_fmt_s(plan['step_seconds'])}; "
              f"plan {'fits' if plan['fits'] else 'does not fit'} ({plan['peak_bytes_per_chip'] / GiB:.2f} of "
              f"{plan['usable_hbm_bytes_per_chip'] / GiB:.2f} GiB usable)")
    elif summary.get("plan_error"):
        print(f"plan: {summary['plan_error']}")
    print(json.dumps(result))
    failed = [r["phase"] for r in result["rows"] if "error" in r] + (["plan"] if summary.get("plan_error") else [])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
