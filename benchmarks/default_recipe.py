"""Run the default recipe (or `--config`) for several seeds; print one JSON line per seed and a table.

    python benchmarks/default_recipe.py --seeds 0 1 [key=value ...]
    python benchmarks/default_recipe.py --config configs/tools.yaml --seeds 0 1 2 3

The numbers recorded in benchmarks/RESULTS.md and the README come from this kind of run on the 2-core CPU
machine. Outputs go to runs/bench-seed<N>/ (runs/bench-<config name>-seed<N>/ for another config). A
multi-turn recipe also reports its held-out tool-use rate (episodes with a tool call) before and after RL.
"""

from __future__ import annotations

import argparse
import json
import os

from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.loop import run
from jaxrl.metrics import read_metrics

KEYS = ("accuracy_before_rl", "accuracy_after_rl", "accuracy_gain", "num_eval_problems", "sft_time_s",
        "rl_time_s", "total_wall_time_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    rows = []
    name = os.path.splitext(os.path.basename(args.config))[0]
    prefix = "runs/bench-seed" if name == "default" else f"runs/bench-{name}-seed"
    for seed in args.seeds:
        config = load_config(Config, args.config,
                             [*args.overrides, f"seed={seed}", f"output_dir={prefix}{seed}",
                              "overwrite=true", "progress=false"])
        summary = run(config, config_source=args.config)
        row = {"seed": seed, **{k: summary[k] for k in KEYS}, "devices": summary["devices"]}
        if config.env.multi_turn:  # the held-out evaluations before (step 0) and after RL (the final record)
            evals = [r for r in read_metrics(os.path.join(config.output_dir, "metrics.jsonl"))
                     if "eval/tool_use_rate" in r]
            row["tool_use_before"] = evals[0]["eval/tool_use_rate"]
            row["tool_use_after"] = evals[-1]["eval/tool_use_rate"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    tools = all("tool_use_before" in r for r in rows)
    print(f"\n{'seed':>4} {'before':>7} {'after':>7} {'gain':>7}" + (f" {'tools 0':>7} {'tools 1':>7}" if tools else "")
          + f" {'sft s':>7} {'rl s':>7} {'total s':>8}")
    for r in rows:
        print(f"{r['seed']:>4} {r['accuracy_before_rl']:>7.3f} {r['accuracy_after_rl']:>7.3f} "
              f"{r['accuracy_gain']:>7.3f}" + (f" {r['tool_use_before']:>7.3f} {r['tool_use_after']:>7.3f}" if tools
                                               else "")
              + f" {r['sft_time_s']:>7.1f} {r['rl_time_s']:>7.1f} {r['total_wall_time_s']:>8.1f}")


if __name__ == "__main__":
    main()
