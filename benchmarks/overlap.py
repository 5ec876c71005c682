"""One-step overlap against the synchronous loop on the default recipe: RL wall time, accuracy, determinism.

    python benchmarks/overlap.py [--seeds 0 1 2] [--repeats 1] [key=value ...]

For every seed, runs the recipe `repeats` times in each mode, interleaved (sync, overlap, sync, overlap, ...)
so that a drifting machine load falls on both alike, each in a fresh process (`jaxrl train`), outputs under
runs/overlap-<mode>-s<seed>-<i>/. Prints one JSON line and a table: RL wall time and its per-step median
(from timings.jsonl), the final held-out accuracy of every run, the mean accuracy of each mode over the seeds,
and (with repeats > 1) whether the repeats of a mode wrote byte-identical metrics files.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("sync", "overlap")


def train(out: str, overlap: bool, seed: int, overrides: list[str]) -> dict:
    """One `jaxrl train` run of the default recipe; its summary, metrics bytes and median step time."""
    command = [sys.executable, "-m", "jaxrl.cli", "train", "configs/default.yaml", f"seed={seed}",
               f"output_dir={out}", "overwrite=true", "progress=false", f"rl.overlap={str(overlap).lower()}",
               *overrides]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(ROOT, out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(ROOT, out, "metrics.jsonl"), "rb") as f:
        metrics = f.read()
    with open(os.path.join(ROOT, out, "timings.jsonl")) as f:
        steps = [r["time/step_s"] for r in map(json.loads, f) if "time/step_s" in r]
    return {"rl_time_s": summary["rl_time_s"], "step_s_median": statistics.median(steps),
            "accuracy_before_rl": summary["accuracy_before_rl"], "accuracy_after_rl": summary["accuracy_after_rl"],
            "total_wall_time_s": summary["total_wall_time_s"], "metrics": metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    runs = {(mode, seed): [] for seed in args.seeds for mode in MODES}
    for seed in args.seeds:
        for i in range(args.repeats):
            for mode in MODES:
                runs[mode, seed].append(train(f"runs/overlap-{mode}-s{seed}-{i}", mode == "overlap", seed,
                                              args.overrides))
    result = {"seeds": args.seeds, "repeats": args.repeats, "cpu_count": os.cpu_count(), "runs": []}
    for (mode, seed), rows in runs.items():
        result["runs"].append({"mode": mode, "seed": seed, **{k: [r[k] for r in rows] for k in rows[0] if k != "metrics"},
                               "identical_metrics": all(r["metrics"] == rows[0]["metrics"] for r in rows)})
    for mode in MODES:
        rows = [r for (m, _), rs in runs.items() if m == mode for r in rs]
        result[mode] = {"rl_time_s_median": statistics.median(r["rl_time_s"] for r in rows),
                        "step_s_median": statistics.median(r["step_s_median"] for r in rows),
                        "accuracy_after_rl_mean": statistics.mean(r["accuracy_after_rl"] for r in rows)}
    result["rl_time_ratio"] = result["overlap"]["rl_time_s_median"] / result["sync"]["rl_time_s_median"]
    result["step_time_ratio"] = result["overlap"]["step_s_median"] / result["sync"]["step_s_median"]
    result["accuracy_difference"] = (result["overlap"]["accuracy_after_rl_mean"]
                                     - result["sync"]["accuracy_after_rl_mean"])
    print(json.dumps(result))
    print("\n| mode | seed | RL wall time | median step | accuracy before -> after RL | repeats identical |")
    print("|---|---|---|---|---|---|")
    for row in result["runs"]:
        times = ", ".join(f"{t:.1f} s" for t in row["rl_time_s"])
        steps = ", ".join(f"{t * 1000:.0f} ms" for t in row["step_s_median"])
        after = ", ".join(f"{a:.3f}" for a in row["accuracy_after_rl"])
        identical = row["identical_metrics"] if args.repeats > 1 else "-"
        print(f"| {row['mode']} | {row['seed']} | {times} | {steps} | {row['accuracy_before_rl'][0]:.3f} -> {after} "
              f"| {identical} |")
    for mode in MODES:
        r = result[mode]
        print(f"\n{mode}: median RL wall time {r['rl_time_s_median']:.1f} s, median step {r['step_s_median'] * 1000:.0f} "
              f"ms, mean accuracy after RL {r['accuracy_after_rl_mean']:.3f}")
    print(f"overlap / sync: RL wall time {result['rl_time_ratio']:.3f}, step {result['step_time_ratio']:.3f}; "
          f"accuracy difference {result['accuracy_difference']:+.3f}")


if __name__ == "__main__":
    main()
