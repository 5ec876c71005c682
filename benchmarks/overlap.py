"""One-step overlap against the synchronous loop on the default recipe: RL wall time, accuracy, determinism.

    python benchmarks/overlap.py [--repeats 2] [--seed 0] [key=value ...]

Runs the recipe `repeats` times in each mode, interleaved (sync, overlap, sync, overlap, ...) so that a
drifting machine load falls on both alike, each in a fresh process (`jaxrl train`), outputs under
runs/overlap-<mode>-<i>/. Prints one JSON line and a table: RL wall time of every run, final held-out accuracy,
and whether the repeats of a mode wrote byte-identical metrics files.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(out: str, overlap: bool, seed: int, overrides: list[str]) -> dict:
    command = [sys.executable, "-m", "jaxrl.cli", "train", "configs/default.yaml", f"seed={seed}",
               f"output_dir={out}", "progress=false", f"rl.overlap={str(overlap).lower()}", *overrides]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(ROOT, out, "summary.json")) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    runs = {"sync": [], "overlap": []}
    for i in range(args.repeats):
        for mode in runs:
            out = f"runs/overlap-{mode}-{i}"
            summary = train(out, mode == "overlap", args.seed, args.overrides)
            with open(os.path.join(ROOT, out, "metrics.jsonl"), "rb") as f:
                metrics = f.read()
            runs[mode].append({"rl_time_s": summary["rl_time_s"], "accuracy_after_rl": summary["accuracy_after_rl"],
                               "accuracy_before_rl": summary["accuracy_before_rl"], "metrics": metrics})
    result = {"seed": args.seed, "repeats": args.repeats, "cpu_count": os.cpu_count()}
    for mode, rows in runs.items():
        result[mode] = {"rl_time_s": [r["rl_time_s"] for r in rows],
                        "accuracy_after_rl": [r["accuracy_after_rl"] for r in rows],
                        "accuracy_before_rl": rows[0]["accuracy_before_rl"],
                        "identical_metrics": all(r["metrics"] == rows[0]["metrics"] for r in rows)}
    sync, overlap = (statistics.median(result[m]["rl_time_s"]) for m in runs)
    result["rl_time_ratio"] = overlap / sync
    print(json.dumps(result))
    print("\n| mode | RL wall time per run | accuracy before -> after RL | repeats identical |\n|---|---|---|---|")
    for mode in runs:
        r = result[mode]
        times = ", ".join(f"{t:.1f} s" for t in r["rl_time_s"])
        after = ", ".join(f"{a:.3f}" for a in r["accuracy_after_rl"])
        print(f"| {mode} | {times} | {r['accuracy_before_rl']:.3f} -> {after} | {r['identical_metrics']} |")
    print(f"\noverlap / sync median RL wall time: {result['rl_time_ratio']:.3f}")


if __name__ == "__main__":
    main()
