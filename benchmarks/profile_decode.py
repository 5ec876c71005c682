"""Where a sampler call's device time goes: one traced call of the `jaxrl bench sample` workload, by kernel.

    python benchmarks/profile_decode.py [--model qwen2.5-0.5b] [--dtype bfloat16] [--prompts 8] [--group 8]
                                        [--prompt-len 256] [--new-tokens 256] [--top 25] [--trace-dir DIR]

Runs the workload twice (compilation, then a warm call), then once under `jax.profiler.trace`, and reads the trace back with
`jax.profiler.ProfileData`. Prints one JSON line and tables: per device line (stream), the number of kernels,
their summed time, the time the line was busy (union of its kernels) and the traced span; kernels per decode
step; and the kernels that took the most time, grouped by name. A busy fraction well under 1 means the device
waits between kernels (launch overhead, host round trips); a long tail of small kernels with the device busy
means each kernel does too little work.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def busy_ns(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of `(start_ns, end_ns)` intervals."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def one_step(stream: list[tuple[str, float, float, dict]], steps: int) -> list[tuple[str, float, float, dict]]:
    """The kernels of one decode step in the middle of the call, from a stream's `(name, start_ns, duration_ns,
    stats)` in time order: those between two launches of the step's longest once-per-step kernel."""
    counts = collections.Counter(name for name, *_ in stream)
    totals = collections.Counter()
    for name, _, duration, _ in stream:
        totals[name] += duration
    per_step = [name for name in counts if steps - 1 <= counts[name] <= steps]
    if not per_step:
        return []
    marker = max(per_step, key=totals.__getitem__)
    at = [i for i, (name, *_) in enumerate(stream) if name == marker]
    middle = len(at) // 2
    return stream[at[middle - 1] + 1:at[middle] + 1]


def summarize(xplane_path: str, top: int, steps: int) -> dict:
    """Per-line kernel counts and times of every device plane in the trace, the top kernels by time, and the
    kernels of one decode step in order (`one_step`)."""
    from jax.profiler import ProfileData

    profile = ProfileData.from_file(xplane_path)
    lines, stream = [], []  # stream: every kernel of the stream lines, `(name, start_ns, duration_ns, stats)`
    for plane in profile.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            events = [(e.name, e.start_ns, e.duration_ns) for e in line.events]
            if not events:
                continue
            intervals = [(start, start + duration) for _, start, duration in events]
            lines.append({"plane": plane.name, "line": line.name, "events": len(events),
                          "summed_ms": sum(d for *_, d in events) / 1e6, "busy_ms": busy_ns(intervals) / 1e6,
                          "span_ms": (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e6})
            if "stream" in line.name.lower():
                stream += [(e.name, e.start_ns, e.duration_ns, {k: str(v)[:200] for k, v in e.stats})
                           for e in line.events]
    kernels, counts = collections.Counter(), collections.Counter(name for name, *_ in stream)
    for name, _, duration, _ in stream:
        kernels[name] += duration
    top_kernels = [{"name": name[:120], "calls": counts[name], "total_ms": total / 1e6,
                    "mean_us": total / counts[name] / 1e3} for name, total in kernels.most_common(top)]
    step = one_step(sorted(stream, key=lambda event: event[1]), steps)
    step_kernels = [{"name": name[:120], "start_us": (start - step[0][1]) / 1e3, "us": duration / 1e3, **stats}
                    for name, start, duration, stats in step]
    return {"lines": lines, "top_kernels": top_kernels, "stream_kernels": sum(counts.values()),
            "stream_kernel_ms": sum(kernels.values()) / 1e6, "step_kernels": step_kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--no-prefix-sharing", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--trace-dir", default=None, help="keep the trace here (default: a temporary folder)")
    parser.add_argument("--step-file", default=None,
                        help="write one decode step's kernels, in order with their trace stats, here (JSON lines)")
    args = parser.parse_args()

    import jax

    from jaxrl.bench import _model_config, sample_workload

    _, config = _model_config(args.model)
    config = dataclasses.replace(config, dtype=args.dtype, param_dtype=args.dtype)
    _, call = sample_workload(config, args.prompts, args.prompt_len, args.group,
                              prefix_sharing=not args.no_prefix_sharing)
    jax.block_until_ready(call(args.new_tokens))
    jax.block_until_ready(call(args.new_tokens))
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="jaxrl-profile-")
    with jax.profiler.trace(trace_dir):
        start = time.perf_counter()
        jax.block_until_ready(call(args.new_tokens))
        wall_s = time.perf_counter() - start
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise SystemExit(f"no .xplane.pb trace under {trace_dir}")
    summary = summarize(paths[-1], args.top, args.new_tokens)
    step_kernels = summary.pop("step_kernels")
    if args.step_file:
        with open(args.step_file, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in step_kernels)
    sequences = args.prompts * args.group
    result = {"model": args.model, "dtype": args.dtype, "sequences": sequences, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "prefix_sharing": not args.no_prefix_sharing, "wall_s": wall_s,
              "kernels_per_step": summary["stream_kernels"] / args.new_tokens,
              "one_step_kernels": len(step_kernels), "one_step_kernel_us": sum(k["us"] for k in step_kernels),
              "one_step_span_us": step_kernels[-1]["start_us"] + step_kernels[-1]["us"] if step_kernels else None,
              "device": jax.devices()[0].device_kind, "jax_version": jax.__version__, **summary}
    print(json.dumps(result))
    print(f"\n{args.model} {args.dtype}, {sequences} sequences, {args.prompt_len} + {args.new_tokens} tokens: "
          f"traced call {wall_s * 1000:.1f} ms, {summary['stream_kernels']} stream kernels "
          f"({result['kernels_per_step']:.1f} per generated token), {summary['stream_kernel_ms']:.1f} ms summed")
    print("\n| plane | line | events | summed | busy | span |\n|---|---|---|---|---|---|")
    for row in summary["lines"]:
        print(f"| {row['plane']} | {row['line'][:40]} | {row['events']} | {row['summed_ms']:.1f} ms "
              f"| {row['busy_ms']:.1f} ms | {row['span_ms']:.1f} ms |")
    print("\n| kernel | calls | total | mean |\n|---|---|---|---|")
    for row in summary["top_kernels"]:
        print(f"| {row['name'][:80]} | {row['calls']} | {row['total_ms']:.2f} ms | {row['mean_us']:.1f} us |")


if __name__ == "__main__":
    main()
