"""`jaxrl` command line: `jaxrl train CONFIG [key=value ...]`."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jaxrl.configlib import ConfigError, load_config


def _train(args: argparse.Namespace) -> int:
    from jaxrl.config import Config  # heavy imports (jax) only once the arguments parse

    try:
        config = load_config(Config, args.config, args.overrides)
    except ConfigError as e:
        print(f"jaxrl: configuration error: {e}", file=sys.stderr)
        return 2
    from jaxrl.data.prompts import DataError
    from jaxrl.loop import run

    try:
        summary = run(config, config_source=args.config or "")
    except DataError as e:
        print(f"jaxrl: data error: {e}", file=sys.stderr)
        return 2
    keys = ("accuracy_before_rl", "accuracy_after_rl", "accuracy_gain", "num_eval_problems",
            "total_wall_time_s", "reward_timeouts_total", "reward_errors_total")
    print(json.dumps({k: summary[k] for k in keys}, indent=2))
    print(f"outputs in {config.output_dir}/ (summary.json, metrics.jsonl, reward_accuracy.png, checkpoints/)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="warm start + RL on a YAML recipe",
                                description="Run a recipe. Overrides use dotted keys, e.g. rl.steps=50 seed=1.")
    train.add_argument("config", help="YAML recipe, e.g. configs/default.yaml")
    train.add_argument("overrides", nargs="*", metavar="key=value")
    train.set_defaults(handler=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("jaxrl").setLevel(logging.INFO)
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
