"""A plan as a table for people and one JSON line for tools."""

from __future__ import annotations

import json

from jaxrl.plan.planner import Plan, Suggestion

GiB = 2**30


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def to_json(plan: Plan, suggestion: Suggestion | None = None) -> dict:
    """Every figure of `plan` (bytes, FLOPs, seconds; per chip unless named otherwise)."""
    chip = plan.topology.chip
    out = {
        "topology": plan.topology.name, "chips": plan.topology.num_chips, "chip": chip.name,
        "mesh": plan.mesh, "model": plan.model, "parameters": plan.parameters, "shapes": plan.shapes,
        "overrides": list(plan.overrides), "depths": list(plan.depths),
        "hbm_bytes_per_chip": plan.hbm_bytes, "usable_hbm_bytes_per_chip": plan.usable_bytes,
        "resident_bytes_per_chip": plan.resident,
        "fits": plan.fits, "failing": [] if plan.fits else plan.failing(),
        "peak_bytes_per_chip": plan.peak_bytes, "peak_program": plan.peak.name if plan.programs else "resident",
        "programs": [{
            "name": p.name, "calls_per_step": p.calls_per_step, "repeats": p.repeats, "note": p.note,
            "compile_s": round(p.compile_s, 2), "peak_bytes": p.peak_bytes, "program_bytes": p.program_bytes,
            "argument_bytes": p.argument_bytes, "output_bytes": p.output_bytes, "alias_bytes": p.alias_bytes,
            "temp_bytes": p.temp_bytes, "code_bytes": p.code_bytes,
            "resident_elsewhere_bytes": p.resident_elsewhere_bytes, "flops": p.flops,
            "bytes_accessed": p.bytes_accessed, "collectives": p.collectives, "pallas_kernels": p.kernels,
            "unexpected_collectives": list(p.unexpected), "model_flops": p.model_flops,
            "compute_s": p.compute_s, "memory_s": p.memory_s, "comm_s": p.comm_s, "time_s": p.time_s,
            "bound": p.bound, "timed": p.timed, "loop_scale": p.loop_scale} for p in plan.programs],
        "phase_seconds": plan.phase_seconds() if plan.programs else {},
        "step_seconds": plan.step_seconds if plan.programs else None,
        "flops_per_step_per_chip": plan.flops_per_step if plan.programs else None,
        "model_flops_per_step": plan.model_flops_per_step if plan.programs else None,
        "mfu": plan.mfu if plan.programs else None,
        "collectives_per_step": plan.collectives_per_step() if plan.programs else {},
        "chip_figures": {"peak_bf16_flops": chip.peak_bf16_flops, "hbm_bytes_per_s": chip.hbm_bytes_per_s,
                         "ici_bytes_per_s": chip.ici_bytes_per_s, "source": chip.source},
    }
    out["lora"] = plan.lora or None
    out["trained_parameters"] = plan.trained
    if plan.full is not None:
        full = plan.full
        out["full_fine_tune"] = {
            "overrides": list(full.overrides), "fits": full.fits, "resident_bytes_per_chip": full.resident,
            "peak_bytes_per_chip": full.peak_bytes, "peak_program": full.peak.name if full.programs else "resident",
            "trained_parameters": full.trained,
            "programs": {p.name: {"peak_bytes": p.peak_bytes, "temp_bytes": p.temp_bytes} for p in full.programs}}
    if suggestion is not None:
        out["suggestion"] = {"change": suggestion.describe(), "overrides": list(suggestion.overrides),
                             "topology": suggestion.topology, "fits": suggestion.plan.fits,
                             "peak_bytes_per_chip": suggestion.plan.peak_bytes,
                             "step_seconds": suggestion.plan.step_seconds, "mfu": suggestion.plan.mfu}
    return out


def table(plan: Plan, suggestion: Suggestion | None = None, searched: bool = False) -> str:
    """The plan as aligned text: the state, each program, the step, and the verdict."""
    chip = plan.topology.chip
    lines = [f"{plan.topology.name}: {plan.topology.num_chips} x {chip.name} ({_gib(plan.hbm_bytes)} GiB HBM each, "
             f"plan uses at most {_gib(plan.usable_bytes)}), mesh data={plan.mesh['data']} fsdp={plan.mesh['fsdp']} "
             f"tensor={plan.mesh['tensor']}",
             f"model: {plan.model}; {plan.parameters / 1e9:.2f}B parameters"
             + (f"; compiled at {plan.depths[0]} and {plan.depths[1]} layers, every figure extrapolated linearly "
                "to the full depth" if plan.depths else ""),
             *([f"{plan.lora}: {plan.trained / 1e6:.2f}M trained parameters"] if plan.lora else []),
             "shapes: " + ", ".join(f"{k}={v}" for k, v in plan.shapes.items()),
             "",
             "resident per chip: " + ", ".join(f"{k} {_gib(v)} GiB" for k, v in plan.resident.items())
             + f" = {_gib(plan.resident_bytes)} GiB"]
    if plan.programs:
        header = f"{'program':<16} {'calls':>5} {'peak GiB':>9} {'temp GiB':>9} {'TFLOP/chip':>10} " \
                 f"{'HBM GB':>8} {'ICI GB':>8} {'time/call':>10} {'bound':>11} {'compile':>8}  note"
        lines += ["", header, "-" * len(header)]
        for p in plan.programs:
            lines.append(
                f"{p.name:<16} {p.calls_per_step:>5g} {_gib(p.peak_bytes):>9} {_gib(p.temp_bytes):>9} "
                f"{p.flops / 1e12:>10.3f} {p.bytes_accessed / 1e9:>8.2f} {p.traffic_bytes / 1e9:>8.3f} "
                f"{_seconds(p.time_s) if p.timed else '-':>10} {p.bound if p.timed else '-':>11} "
                f"{p.compile_s:>7.1f}s  {p.note}")
        lines.append("")
        phases = plan.phase_seconds()
        lines.append("step (roofline lower bound): " + ", ".join(f"{k} {_seconds(v)}" for k, v in phases.items())
                     + f" = {_seconds(plan.step_seconds)}; MFU <= {plan.mfu * 100:.1f}%")
        collectives = plan.collectives_per_step()
        if collectives:
            lines.append("collectives per step per chip: " + ", ".join(
                f"{kind} {int(c['count'])} ({c['bytes'] / 1e9:.2f} GB)" for kind, c in sorted(collectives.items())))
        kernels = {}
        for p in plan.programs:
            for name, count in p.kernels.items():
                kernels.setdefault(p.name, []).append(f"{name} x{count}")
        if kernels:
            lines.append("Pallas kernels: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in kernels.items()))
        unexpected = [f"{p.name}: {u}" for p in plan.programs for u in p.unexpected]
        lines.append("unexpected collectives (> 1% of the state): " + ("none" if not unexpected else ""))
        lines += [f"  {u}" for u in unexpected]
    if plan.full is not None:
        lines += ["", *beside_full(plan)]
    lines.append("")
    lines.append(verdict(plan, suggestion, searched))
    return "\n".join(lines)


def beside_full(plan: Plan) -> list[str]:
    """A LoRA plan's per-chip memory beside the full fine-tune's (`Plan.full`): the resident state by part, then
    each program's peak, in GiB."""
    full = plan.full
    lines = [f"{'per chip, GiB':<26} {'LoRA':>8} {'full':>8}   (full fine-tune: {' '.join(full.overrides[-1:])})"]
    names = list(dict.fromkeys([*full.resident, *plan.resident]))
    for name in names:
        lines.append(f"  {'resident ' + name:<24} {_gib(plan.resident.get(name, 0)):>8} "
                     f"{_gib(full.resident.get(name, 0)):>8}")
    lines.append(f"  {'resident total':<24} {_gib(plan.resident_bytes):>8} {_gib(full.resident_bytes):>8}")
    peaks = {p.name: p.peak_bytes for p in full.programs}
    for p in plan.programs:
        other = _gib(peaks[p.name]) if p.name in peaks else "-"
        lines.append(f"  {'peak ' + p.name:<24} {_gib(p.peak_bytes):>8} {other:>8}")
    if plan.programs and full.programs:
        lines.append(f"  {'peak of the step':<24} {_gib(plan.peak_bytes):>8} {_gib(full.peak_bytes):>8}   "
                     f"(LoRA / full: {100 * plan.peak_bytes / full.peak_bytes:.0f}%; full fine-tune "
                     f"{'fits' if full.fits else 'does not fit'})")
    elif not full.programs:
        lines.append("  the full fine-tune's resident state alone does not fit: nothing of it compiled")
    lines.append(f"  trained parameters: LoRA {plan.trained / 1e6:.2f}M, full {full.trained / 1e6:.2f}M")
    return lines


def verdict(plan: Plan, suggestion: Suggestion | None, searched: bool) -> str:
    if plan.fits:
        peak = plan.peak
        return (f"FITS: peak {_gib(peak.peak_bytes)} GiB per chip ({peak.name}) of {_gib(plan.usable_bytes)} "
                f"usable; step >= {_seconds(plan.step_seconds)}, MFU <= {plan.mfu * 100:.1f}%")
    if plan.programs:
        over = ", ".join(f"{p.name} {_gib(p.peak_bytes)} GiB" for p in plan.programs
                         if p.peak_bytes > plan.usable_bytes)
        text = f"DOES NOT FIT: {over} > {_gib(plan.usable_bytes)} GiB usable per chip"
    else:
        text = (f"DOES NOT FIT: the resident state alone is {_gib(plan.resident_bytes)} GiB per chip > "
                f"{_gib(plan.usable_bytes)} GiB usable (nothing compiled)")
    if suggestion is not None:
        p = suggestion.plan
        text += (f"\ncheapest change that fits (checked by planning again): {suggestion.describe()} -> peak "
                 f"{_gib(p.peak_bytes)} GiB per chip ({p.peak.name}), step >= {_seconds(p.step_seconds)}, "
                 f"MFU <= {p.mfu * 100:.1f}%")
    elif searched:
        text += "\nno single change tried fits: raise rl.micro_batches, set remat=full, split over more chips"
    return text


def json_line(plan: Plan, suggestion: Suggestion | None = None) -> str:
    return json.dumps(to_json(plan, suggestion), sort_keys=False)
