"""`jaxrl` command line: `jaxrl train CONFIG [key=value ...]`, `jaxrl eval CONFIG checkpoint=PATH [key=value ...]`,
`jaxrl convert SRC DST [options]`, `jaxrl plan CONFIG [key=value ...] --topology NAME`, `jaxrl bench sample|train
[options]`, `jaxrl tiny-checkpoint OUT_DIR [options]`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from jaxrl.configlib import load_config
from jaxrl.errors import JaxrlError


def _load(path: str | None, overrides: list[str]):
    """The run config of `path` with `overrides` (a `ConfigError`, a `JaxrlError`, names the field)."""
    from jaxrl.config import Config  # heavy imports (jax) only once the arguments parse

    return load_config(Config, path, overrides)


def _train(args: argparse.Namespace) -> int:
    config = _load(args.config, args.overrides)
    if args.print_config or args.dry_run:
        return _inspect(config, args)
    from jaxrl.loop import run

    summary = run(config, config_source=args.config or "")
    metric = "accuracy" if "accuracy_before_rl" in summary else "reward"  # named after the evaluation's reward
    keys = (f"{metric}_before_rl", f"{metric}_quantized_start", f"{metric}_after_rl", f"{metric}_gain",
            "quantization_logprob_gap_mean", "eval_reward", "num_eval_problems", "total_wall_time_s",
            "reward_timeouts_total", "reward_errors_total")
    print(json.dumps({k: summary[k] for k in keys if k in summary}, indent=2))  # (a quantized base's: QLoRA)
    print(f"outputs in {config.output_dir}/ (summary.json, metrics.jsonl, reward_accuracy.png, checkpoints/)")
    return 0


def _inspect(config, args: argparse.Namespace) -> int:
    """`--print-config`: the resolved config, every key with its type and default; `--dry-run`: the checks of
    a run without loading weights (exit 0 when all pass, 2 otherwise). Neither writes anything."""
    from jaxrl.dry_run import describe_config, dry_run, report

    if args.print_config:
        print(describe_config(config), end="")
    if args.dry_run:
        checks, passed = dry_run(config)
        print(report(checks), end="")
        return 0 if passed else 2
    return 0


def _eval(args: argparse.Namespace) -> int:
    checkpoints = [o.split("=", 1)[1] for o in args.overrides if o.startswith("checkpoint=")]
    overrides = [o for o in args.overrides if not o.startswith("checkpoint=")]
    run_config = os.path.join(args.config, "config.yaml")
    if not checkpoints and os.path.isdir(args.config) and os.path.isfile(run_config):
        # `jaxrl eval RUN`: the run's newest checkpoint on its own config's held-out problems
        args.config, checkpoints = run_config, [os.path.dirname(run_config)]
    if len(checkpoints) != 1:
        print("jaxrl: eval needs exactly one checkpoint=PATH (a run, one of its checkpoints/<step>, a policy "
              "checkpoint or a Hugging Face directory)", file=sys.stderr)
        return 2
    config = _load(args.config, overrides)
    args.error_kind = "eval error"  # from here on, every error reads `jaxrl: eval error: ...`
    from jaxrl.loop import evaluate_checkpoint

    result = evaluate_checkpoint(config, checkpoints[0], completions_file=args.completions)
    print(json.dumps(result, indent=2))
    return 0


def _convert(args: argparse.Namespace) -> int:
    args.error_kind = "convert error"  # every error reads `jaxrl: convert error: ...`
    from jaxrl.convert import convert, parse_size  # heavy imports (jax, orbax) only once the arguments parse

    max_shard_bytes = 5 * 2**30 if args.max_shard_size is None else parse_size(args.max_shard_size)
    result = convert(args.src, args.dst, to=args.to, dtype=args.dtype, base=args.base,
                     max_shard_bytes=max_shard_bytes, overwrite=args.overwrite, progress=sys.stderr.isatty(),
                     no_tokenizer=args.no_tokenizer)
    print(result.summary())
    return 0


def _plan(args: argparse.Namespace) -> int:
    config = _load(args.config, args.overrides)
    from jaxrl.plan import command

    return command(config, args.config, args.overrides, topology=args.topology, slices=args.slices,
                   suggest=not args.no_suggest, json_only=args.json, whole_sampler=args.whole_sampler,
                   compare_full=not args.no_compare_full)


def _bench_sample(args: argparse.Namespace) -> int:
    from jaxrl.bench import run_sample  # jax is imported when the benchmark runs

    return run_sample(args)


def _bench_train(args: argparse.Namespace) -> int:
    from jaxrl.bench import run_train

    return run_train(args)


def _tiny_checkpoint(args: argparse.Namespace) -> int:
    args.error_kind = "tiny-checkpoint error"
    from jaxrl.tiny import write_tiny_checkpoint  # heavy imports (jax) only once the arguments parse

    path = write_tiny_checkpoint(args.out_dir, family=args.family, layers=args.layers, hidden=args.hidden,
                                 seed=args.seed, overwrite=args.overwrite)
    print(f"wrote a tiny {args.family} checkpoint (random weights, byte-level BPE, ChatML chat template) to {path}\n"
          f"try: jaxrl train configs/default.yaml pretrained.path={path}")
    return 0


def _add_tiny_checkpoint(commands) -> None:
    tiny = commands.add_parser(
        "tiny-checkpoint", help="write a tiny random Hugging Face checkpoint with a tokenizer, to try recipes",
        description="Write a tiny Hugging Face checkpoint (config.json, model.safetensors with random weights, a "
                    "byte-level BPE tokenizer.json and tokenizer_config.json with a ChatML chat template) for "
                    "trying recipes without downloads: jaxrl train configs/default.yaml pretrained.path=OUT_DIR.")
    tiny.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (must not exist or be empty)")
    tiny.add_argument("--family", choices=("llama", "qwen2", "qwen3", "gemma3"), default="qwen2",
                      help="architecture (default: qwen2)")
    tiny.add_argument("--layers", type=int, default=2, help="transformer layers (default: 2)")
    tiny.add_argument("--hidden", type=int, default=64, help="hidden size, a multiple of 16 (default: 64)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    tiny.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT_DIR")
    tiny.set_defaults(handler=_tiny_checkpoint)


def build_parser() -> argparse.ArgumentParser:
    from jaxrl.bench import add_sample_arguments, add_train_arguments  # standard library only at import
    parser = argparse.ArgumentParser(prog="jaxrl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="warm start + RL on a YAML recipe",
                                description="Run a recipe. Overrides use dotted keys, e.g. rl.steps=50 seed=1. "
                                            "--print-config lists every key with its type and default; --dry-run "
                                            "checks the run without loading weights.")
    train.add_argument("config", help="YAML recipe, e.g. configs/default.yaml")
    # default=[]: without one, argparse's error for a missing config says the overrides are required too
    train.add_argument("overrides", nargs="*", default=[], metavar="key=value")
    train.add_argument("--print-config", action="store_true", help="print the resolved config: every key with "
                       "its value, type and default (changed values marked) and the registered choices of fields "
                       "that name rewards, objectives, ratios and estimators; then exit")
    train.add_argument("--dry-run", action="store_true", help="check the run without loading weights or writing "
                       "anything: extras, output_dir, data files, batch sizes, the first rendered prompt, the "
                       "rewards and the loss; exit 0 when all pass, 2 otherwise")
    train.set_defaults(handler=_train)
    evaluate = commands.add_parser("eval", help="held-out evaluation of a checkpoint: greedy accuracy, pass@k, maj@k",
                                   description="Evaluate checkpoint=PATH on the recipe's held-out problems; "
                                               "eval.samples=N eval.pass_k=[1,8] add pass@k and maj@k. "
                                               "`jaxrl eval RUN_DIR` evaluates a run's newest checkpoint with "
                                               "its own config.yaml.")
    evaluate.add_argument("config", help="YAML recipe whose task, data, reward and sampling settings apply, or a "
                          "run directory")
    evaluate.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                          help="checkpoint=PATH and config overrides")
    evaluate.add_argument("--completions", metavar="FILE", help="also write each held-out problem's greedy "
                          "completion as JSONL: prompt, reference, completion, reward/correct, length")
    evaluate.set_defaults(handler=_eval)
    convert = commands.add_parser(
        "convert", help="convert checkpoints: Hugging Face <-> orbax policy checkpoint, run -> Hugging Face",
        description="Convert a checkpoint. SRC: a Hugging Face directory (config.json + safetensors), a policy "
                    "checkpoint (model.json + params/), a run directory (its latest checkpoint) or one of its "
                    "checkpoints/<step> directories. By default an HF source becomes a policy checkpoint and "
                    "anything else an HF directory.")
    convert.add_argument("src", help="checkpoint to read")
    convert.add_argument("dst", help="directory to write (must not exist or be empty, unless --overwrite)")
    convert.add_argument("--to", choices=("hf", "orbax"), help="output format (default: orbax for an HF "
                         "source, hf otherwise)")
    convert.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                         help="parameter dtype of the output (default: the source's)")
    convert.add_argument("--base", metavar="HF_DIR", help="the original HF directory: its tokenizer, generation "
                         "config and token ids are carried over (default: the source when it is an HF directory, "
                         "what a policy checkpoint kept from one, a run's pretrained.path)")
    convert.add_argument("--no-tokenizer", action="store_true", help="write an HF directory without a tokenizer "
                         "when none is found (refused otherwise)")
    convert.add_argument("--max-shard-size", metavar="SIZE", help="largest safetensors file, e.g. 500MB, 5GB, "
                         "2GiB or bytes (default: 5GiB)")
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    convert.set_defaults(handler=_convert)
    plan = commands.add_parser(
        "plan", help="compile one RL step for a TPU topology or the attached GPUs: memory, FLOPs, time, fit",
        description="Compile every program of one RL step of a recipe ahead of time (sampler, log-probs, train "
                    "step, critic) for a TPU topology on this machine (needs libtpu) or for the attached GPUs, and "
                    "print per-chip memory, FLOPs, collectives, a roofline step time and MFU, and whether it fits; "
                    "if not, the cheapest change that does, checked by planning again. Exit 0: fits; 1: does not; "
                    "2: bad input.")
    plan.add_argument("config", help="YAML recipe, e.g. configs/qwen2.5-7b-math-v5e64.yaml")
    plan.add_argument("overrides", nargs="*", default=[], metavar="key=value")
    plan.add_argument("--topology", help="TPU slice (v5e:2x2, v5e:8x8, v5p:4x4x4, v6e:4x4, ...) or 'gpu' for the "
                      "attached GPUs (default: the recipe's plan.topology)")
    plan.add_argument("--slices", type=int, default=1, help="TPU slices joined over the data-center network "
                      "(default 1)")
    plan.add_argument("--no-suggest", action="store_true", help="do not search for a change when it does not fit")
    plan.add_argument("--json", action="store_true", help="print only the JSON line")
    plan.add_argument("--whole-sampler", action="store_true", help="also compile the sampler as one program (its "
                      "real memory; the slowest compile) beside its prefill and decode step")
    plan.add_argument("--no-compare-full", action="store_true", help="with rl.lora.enabled: do not plan the full "
                      "fine-tune of the same model beside the LoRA recipe")
    plan.set_defaults(handler=_plan)
    _add_tiny_checkpoint(commands)
    bench = commands.add_parser("bench", help="benchmarks (random weights, fixed workloads)",
                                description="Benchmarks on random weights; each prints one JSON line, then a table.")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    sample = benchmarks.add_parser(
        "sample", help="sampler throughput, time to first token, compile time, peak memory",
        description="Time the jitted sampler: P prompts x G samples, exactly N new tokens each (EOS ignored), "
                    "temperature 1, no top-k/top-p. With prefix sharing each prompt is prefilled once "
                    "(group_size=G); --no-prefix-sharing repeats every prompt G times (the baseline).")
    add_sample_arguments(sample)
    sample.set_defaults(handler=_bench_sample)
    train = benchmarks.add_parser(
        "train", help="RL train-step throughput, compile time, peak memory",
        description="Time one RL optimizer step: S sequences of prompt + completion tokens, completion "
                    "log-probs, token-level clipped policy loss (clip 0.2, token-mean) with random per-sequence "
                    "advantages and fixed old log-probs, backward, AdamW. Training tokens/s = S x (prompt + "
                    "completion) / median step time.")
    add_train_arguments(train)
    train.set_defaults(handler=_bench_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("jaxrl").setLevel(logging.INFO)
    args = build_parser().parse_args(argv)
    # A recipe's own modules (`reward.function: my_rewards:fn`, `imports: [my_losses]`) import from the working
    # directory, as `python -m` would; reward workers inherit the path.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return _handle_errors(args)


def _handle_errors(args: argparse.Namespace) -> int:
    """Run the subcommand; a jaxrl error (bad input, a stopped run) becomes one line `jaxrl: <kind>: <message>`
    on stderr and its exit code, where `kind` is the error's own (`data error`, ...) or the subcommand's
    `args.error_kind` once it set one (`eval error`). Errors from outside jaxrl about the machine or the input
    (a full disk, an unwritable output_dir, too few devices) print alike with exit code 2."""
    try:
        return args.handler(args)
    except JaxrlError as e:
        kind = getattr(args, "error_kind", None)
        label = kind if kind is not None and e.exit_code == 2 else e.kind
        print(f"jaxrl: {label}: {e}" if label else f"jaxrl: {e}", file=sys.stderr)
        return e.exit_code
    except (ValueError, OSError) as e:
        logging.getLogger("jaxrl").debug("%s stopped", args.command, exc_info=True)
        print(f"jaxrl: {getattr(args, 'error_kind', None) or 'error'}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
