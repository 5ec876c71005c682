"""Off-policy RL on CPU: bounded staleness (accuracy and step time per rl.max_staleness) and partial rollouts.

    python benchmarks/off_policy.py staleness [--seeds 1 2 3 4] [--modes k0 k1 k2 k4 k2_nocorr k4_nocorr]
                                              [--root runs/off-policy] [key=value ...]
    python benchmarks/off_policy.py partial [--steps 30] [--skip 6] [--root runs/partial-rollouts] [key=value ...]

`staleness` runs the default recipe (a fresh `jaxrl train` process per run; a run whose summary.json exists
is read, not rerun) for every mode and seed: `kK` is `rl.max_staleness=K` with token-level truncated IS
(cap 2) as the rollout correction, `kK_nocorr` the same without a correction, `k0` on-policy. It prints one
JSON line and a table: held-out accuracy after RL per seed, the mean gain over the warm start, and the median
RL step wall time.

`partial` is a workload whose completion lengths vary: the default recipe's model with no warm start (its
near-uniform next-token distribution ends a completion with probability about 1/32 per token, so lengths are
roughly geometric, mean about 32) and `max_new_tokens` 256. Every sequence a batch of 128 waits for is then
the longest of 128 such draws. It runs, back to back in one invocation: on-policy (`k0`), one-step staleness
(`k1`), and partial rollouts with segments of 32 tokens at staleness 1 and 2 (`k1_partial`, `k2_partial`).
It prints the RL step time p50/p95 (steps after the first `--skip`, which compile), the completion lengths
and the sampled rows per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORRECTION = ["rl.loss.is_level=token", "rl.loss.is_mode=truncate", "rl.loss.is_cap=2.0"]
STALENESS_MODES = {
    "k0": ["rl.max_staleness=0"],
    "k1": ["rl.max_staleness=1", *CORRECTION],
    "k2": ["rl.max_staleness=2", *CORRECTION],
    "k4": ["rl.max_staleness=4", *CORRECTION],
    "k2_nocorr": ["rl.max_staleness=2"],
    "k4_nocorr": ["rl.max_staleness=4"],
}
PARTIAL_WORKLOAD = ["sft.steps=0", "rl.sampling.max_new_tokens=256", "eval.every=0", "checkpoint.every=0",
                    "task.num_eval=16"]
PARTIAL_MODES = {
    "k0": ["rl.max_staleness=0"],
    "k1": ["rl.max_staleness=1"],
    "k1_partial": ["rl.max_staleness=1", "rl.partial_rollouts.segment_tokens=32"],
    "k2_partial": ["rl.max_staleness=2", "rl.partial_rollouts.segment_tokens=32"],
}


def train(out: str, overrides: list[str]) -> None:
    """One `jaxrl train` run of the default recipe into `out`, unless it already finished there."""
    if os.path.exists(os.path.join(out, "summary.json")):
        return
    command = [sys.executable, "-m", "jaxrl.cli", "train", "configs/default.yaml", f"output_dir={out}",
               "overwrite=true", "progress=false", *overrides]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def step_times(out: str, skip: int = 0) -> list[float]:
    return [r["time/step_s"] for r in read_jsonl(os.path.join(out, "timings.jsonl"))
            if "time/step_s" in r and r.get("step", 0) > skip]


def staleness(args) -> None:
    rows = {}
    for mode in args.modes:
        for seed in args.seeds:
            out = os.path.join(args.root, mode, f"s{seed}")
            train(out, [f"seed={seed}", *STALENESS_MODES[mode], *args.overrides])
            with open(os.path.join(out, "summary.json")) as f:
                summary = json.load(f)
            rows[mode, seed] = {"before": summary["accuracy_before_rl"], "after": summary["accuracy_after_rl"],
                                "step_s_median": statistics.median(step_times(out))}
    result = {}
    for mode in args.modes:
        runs = [rows[mode, s] for s in args.seeds]
        result[mode] = {"after": {s: rows[mode, s]["after"] for s in args.seeds},
                        "mean_after": float(np.mean([r["after"] for r in runs])),
                        "mean_gain": float(np.mean([r["after"] - r["before"] for r in runs])),
                        "step_s_median": float(np.median([r["step_s_median"] for r in runs]))}
    print(json.dumps({"staleness": result, "seeds": args.seeds}))
    print(f"{'mode':<12}" + "".join(f"{'s' + str(s):>8}" for s in args.seeds)
          + f"{'mean':>8}{'gain':>8}{'step s':>8}")
    for mode, r in result.items():
        print(f"{mode:<12}" + "".join(f"{r['after'][s]:>8.3f}" for s in args.seeds)
              + f"{r['mean_after']:>8.3f}{r['mean_gain']:>+8.3f}{r['step_s_median']:>8.2f}")


def partial(args) -> None:
    result = {}
    for mode, overrides in PARTIAL_MODES.items():
        out = os.path.join(args.root, mode)
        train(out, [f"rl.steps={args.steps}", *PARTIAL_WORKLOAD, *overrides, *args.overrides])
        times = step_times(out, skip=args.skip)
        records = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("phase") == "rl"
                   and "reward/mean" in r]
        result[mode] = {"step_s_p50": float(np.percentile(times, 50)), "step_s_p95": float(np.percentile(times, 95)),
                        "steps": len(times),
                        "completion_length_mean": float(np.mean([r["train/completion_length"] for r in records])),
                        "truncated_frac": float(np.mean([r["train/truncated_frac"] for r in records])),
                        "rows_decoded_per_step": float(np.mean([r.get("partial/rows_decoded", 0.0)
                                                                for r in records])),
                        "staleness_mean": float(np.mean([r["offpolicy/staleness_mean"] for r in records]))}
    print(json.dumps({"partial_rollouts": result, "workload": PARTIAL_WORKLOAD}))
    print(f"{'mode':<12}{'p50 s':>8}{'p95 s':>8}{'length':>8}{'trunc':>8}{'rows dec':>9}{'stale':>7}")
    for mode, r in result.items():
        print(f"{mode:<12}{r['step_s_p50']:>8.2f}{r['step_s_p95']:>8.2f}{r['completion_length_mean']:>8.1f}"
              f"{r['truncated_frac']:>8.3f}{r['rows_decoded_per_step']:>9.0f}{r['staleness_mean']:>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sweep = commands.add_parser("staleness")
    sweep.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    sweep.add_argument("--modes", nargs="+", default=list(STALENESS_MODES), choices=list(STALENESS_MODES))
    sweep.add_argument("--root", default="runs/off-policy")
    sweep.add_argument("overrides", nargs="*", metavar="key=value")
    tail = commands.add_parser("partial")
    tail.add_argument("--steps", type=int, default=30)
    tail.add_argument("--skip", type=int, default=6, help="first steps left out of the times (they compile)")
    tail.add_argument("--root", default="runs/partial-rollouts")
    tail.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    staleness(args) if args.command == "staleness" else partial(args)


if __name__ == "__main__":
    main()
