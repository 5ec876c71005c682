"""`jaxrl plan`: compile one RL step of a recipe ahead of time for a TPU topology or the attached GPUs, and
report its per-chip memory, FLOPs, collective traffic, a roofline time estimate and whether it fits.

    jaxrl plan configs/qwen2.5-7b-math-v5e64.yaml --topology v5e:8x8

Modules, one job each: `chips` (published chip figures), `topology` (topology names -> devices and mesh),
`programs` (the real jitted programs of one RL step with abstract sharded inputs), `hlo` (collectives and
Pallas kernels in compiled HLO), `estimate` (one program's memory, FLOPs and roofline time), `planner` (the
whole step, the fit, and the cheapest change that fits), `report` (table and JSON).

With `rl.lora.enabled` the programs run the adapted policy (`jaxrl.plan.programs`), and the full fine-tune of the
same model is planned beside it: the table ends with both recipes' per-chip memory side by side.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def command(config, config_path: str | None, overrides: Sequence[str], *, topology: str | None = None,
            slices: int = 1, suggest: bool = True, json_only: bool = False, whole_sampler: bool = False,
            compare_full: bool = True) -> int:
    """`jaxrl plan`: print the plan (table, then one JSON line); 0 if it fits, 1 if not, 2 on bad input. With
    `rl.lora.enabled` and `compare_full`, the full fine-tune of the same model is planned and shown beside it."""
    from jaxrl.plan import planner, report
    from jaxrl.plan.topology import PlanError, resolve

    name = topology or config.plan.topology
    progress = None if json_only else planner.log_progress
    try:
        if name is None:
            raise PlanError("no topology: pass --topology (e.g. v5e:8x8, v5p:4x4x4, gpu) or set plan.topology")
        target = resolve(name, slices)
        plan = planner.make_plan(config, target, overrides=overrides, whole_sampler=whole_sampler, progress=progress)
        if compare_full:
            plan = planner.with_full_fine_tune(plan, config_path, overrides, target, whole_sampler=whole_sampler,
                                               progress=progress)
        suggestion = None
        if suggest and not plan.fits:
            suggestion = planner.fit_or_suggest(config_path, overrides, plan, target,
                                                resolve=lambda other: resolve(other, slices), progress=progress)
    except PlanError as e:
        print(f"jaxrl: plan error: {e}", file=sys.stderr)
        return 2
    if not json_only:
        print(report.table(plan, suggestion, searched=suggest))
    print(report.json_line(plan, suggestion))
    return 0 if plan.fits else 1
