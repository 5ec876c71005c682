"""Where a compacted sampler call's time goes: each decode segment's batch size, live rows and time.

    python benchmarks/compaction_profile.py [--model bench-small] [--prompts 8] [--group 8] [--new-tokens 512]
                                            [--segments 8] [--buckets 8,12,16,24,32,48,64] [--seed 0]

The ragged workload of `jaxrl bench sample --lengths ragged` (random weights, prompt 64, `ragged_lengths`
forced as the stops). One warm-up call compiles; then one timed call with every segment program waited for, so each
segment's wall time is its own. Per segment: the rows it decodes (its batch bucket), the rows still live when it
starts, its end step and time per call and per step. `--buckets`: `SamplingConfig.batch_buckets` (default: the
sampler's own, `default_batch_buckets`). Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax

from jaxrl import bench, sampling


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-small", help="model preset (random weights)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--segments", type=int, default=8, help="SamplingConfig.compaction_segments")
    parser.add_argument("--buckets", default=None, help="comma-separated SamplingConfig.batch_buckets")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rows = args.prompts * args.group
    forced = bench.ragged_lengths(rows, args.new_tokens, args.seed)
    buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else ()
    model, config = bench._model_config(args.model)
    _, call = bench.sample_workload(config, args.prompts, args.prompt_len, args.group, seed=args.seed,
                                    forced_lengths=forced, compaction_segments=args.segments,
                                    batch_buckets=buckets)
    segments = []
    decode = sampling._segment_program

    def timed(policy, state, *rest, **kwargs):  # wait for each segment so that its time is its own
        start = time.perf_counter()
        out = jax.block_until_ready(decode(policy, state, *rest, **kwargs))
        segments.append({"rows": int(state.done.shape[0]), "end": kwargs["end"],
                         "seconds": time.perf_counter() - start})
        return out

    sampling._segment_program = timed
    try:
        jax.block_until_ready(call(args.new_tokens))  # compiles every program
        segments.clear()
        start = time.perf_counter()
        jax.block_until_ready(call(args.new_tokens))
        total = time.perf_counter() - start
    finally:
        sampling._segment_program = decode
    previous = 0
    for segment in segments:
        segment["live"] = int((forced > previous).sum())
        segment["ms_per_step"] = 1e3 * segment["seconds"] / (segment["end"] - previous)
        previous = segment["end"]
    result = {"benchmark": "compaction_profile", "model": model, "rows": rows, "new_tokens": args.new_tokens,
              "useful_tokens": int(forced.sum()), "segments": segments, "call_s": total,
              "useful_tokens_per_s": float(forced.sum()) / total, "buckets": buckets or "default",
              "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(), "jax_version": jax.__version__}
    print(json.dumps(result))
    print("\n| segment end | live rows at its start | batch rows | time | per step |\n|---|---|---|---|---|")
    for segment in segments:
        print(f"| {segment['end']} | {segment['live']} | {segment['rows']} | {segment['seconds']:.3f} s | "
              f"{segment['ms_per_step']:.1f} ms |")
    print(f"\ncall {total:.2f} s, {result['useful_tokens_per_s']:.0f} useful tokens/s "
          f"({model}, {rows} rows, ragged to {args.new_tokens}, buckets {result['buckets']})")
    return result


if __name__ == "__main__":
    main()
