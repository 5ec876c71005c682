"""Every loss preset on the default recipe: held-out greedy accuracy before/after RL and RL wall time.

    python benchmarks/presets.py [--presets grpo dapo ...] [--seed 0] [--tag NAME] [key=value ...]

Each preset runs the whole default recipe (same seed, so the same warm start) with `rl.loss.preset=<name>`
(`ppo` adds `rl.critic.model=policy_copy`); outputs go to runs/presets[-<tag>]-<name>/. Prints one JSON line per
preset and a table. The numbers in benchmarks/RESULTS.md come from this script on the 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json

from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.losses import PRESETS
from jaxrl.loop import run
from jaxrl.metrics import read_metrics

EXTRA = {"ppo": ["rl.critic.model=policy_copy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="", help="suffix of the output directories")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    rows = []
    for name in args.presets:
        out = f"runs/presets{'-' + args.tag if args.tag else ''}-{name}"
        config = load_config(Config, args.config, [*args.overrides, f"rl.loss.preset={name}", *EXTRA.get(name, []),
                                                   f"seed={args.seed}", f"output_dir={out}", "overwrite=true",
                                                   "progress=false"])
        summary = run(config, config_source=args.config)
        curve = {r["step"]: r["eval/accuracy"] for r in read_metrics(f"{out}/metrics.jsonl")
                 if r.get("eval/accuracy") is not None}
        row = {"preset": name, "seed": args.seed, "accuracy_before_rl": summary["accuracy_before_rl"],
               "accuracy_after_rl": summary["accuracy_after_rl"], "rl_time_s": summary["rl_time_s"],
               "accuracy_curve": curve}
        print(json.dumps(row), flush=True)
        rows.append(row)
    steps = sorted({s for r in rows for s in r["accuracy_curve"]})
    print(f"\n{'preset':>13} {'before':>7} {'after':>7} {'rl s':>7}  " + " ".join(f"{s:>5}" for s in steps))
    for r in rows:
        print(f"{r['preset']:>13} {r['accuracy_before_rl']:>7.3f} {r['accuracy_after_rl']:>7.3f} "
              f"{r['rl_time_s']:>7.1f}  " + " ".join(f"{r['accuracy_curve'].get(s, float('nan')):>5.3f}"
                                                     for s in steps))


if __name__ == "__main__":
    main()
