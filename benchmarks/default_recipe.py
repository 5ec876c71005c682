"""Run the default recipe for several seeds; print one JSON line per seed and a table.

    python benchmarks/default_recipe.py --seeds 0 1 [key=value ...]

The numbers recorded in benchmarks/RESULTS.md and the README come from this kind of run on the 2-core CPU
machine. Outputs go to runs/bench-seed<N>/.
"""

from __future__ import annotations

import argparse
import json

from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.loop import run

KEYS = ("accuracy_before_rl", "accuracy_after_rl", "accuracy_gain", "num_eval_problems", "sft_time_s",
        "rl_time_s", "total_wall_time_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        config = load_config(Config, args.config,
                             [*args.overrides, f"seed={seed}", f"output_dir=runs/bench-seed{seed}",
                              "overwrite=true", "progress=false"])
        summary = run(config, config_source=args.config)
        row = {"seed": seed, **{k: summary[k] for k in KEYS}, "devices": summary["devices"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{'seed':>4} {'before':>7} {'after':>7} {'gain':>7} {'sft s':>7} {'rl s':>7} {'total s':>8}")
    for r in rows:
        print(f"{r['seed']:>4} {r['accuracy_before_rl']:>7.3f} {r['accuracy_after_rl']:>7.3f} "
              f"{r['accuracy_gain']:>7.3f} {r['sft_time_s']:>7.1f} {r['rl_time_s']:>7.1f} "
              f"{r['total_wall_time_s']:>8.1f}")


if __name__ == "__main__":
    main()
