"""Peak memory and step time of per-token log-probs + entropy and their gradient: chunked vs full logits.

    python benchmarks/logprobs_memory.py [--hidden 896] [--vocab 151936] [--batch 4] [--seq 2048]
                                         [--chunk-size 1024] [--repeats 3] [--modes chunked naive]

The workload (issue 7): float32 hidden states `[batch, seq, hidden]`, an untied unembedding `[vocab, hidden]`,
random targets; the scalar `sum(mask * (a * logp + b * entropy))` with random per-token weights a, b and a
ragged mask, and its gradient with respect to the hidden states and the unembedding (`jax.value_and_grad`,
jitted). `chunked` is `kernels.token_logprobs`, `naive` is `kernels.logprobs.reference_token_logprobs`
(the whole `[batch, seq, vocab]` logits). Each mode runs in its own process. Each process reports:
- XLA's temporary buffer size for the compiled program (`memory_analysis().temp_size_in_bytes`: what the
  computation allocates beyond its inputs and outputs);
- the process's peak RSS, and that peak minus the RSS once the inputs exist;
- the median time of `--repeats` steps after a warm-up step.

Prints one JSON line per mode, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_mode(mode: str, hidden: int, vocab: int, batch: int, seq: int, chunk_size: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.kernels.logprobs import reference_token_logprobs, token_logprobs

    rng = np.random.default_rng(0)
    states = jnp.asarray(rng.standard_normal((batch, seq, hidden), np.float32))
    head = jnp.asarray(rng.standard_normal((vocab, hidden), np.float32) * hidden**-0.5)
    targets = jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32)
    lengths = rng.integers(seq // 2, seq + 1, batch)
    mask = jnp.asarray(np.arange(seq)[None, :] < lengths[:, None])
    a, b = (jnp.asarray(rng.standard_normal((batch, seq), np.float32)) for _ in range(2))

    def loss(h, w):
        if mode == "chunked":
            logp, entropy = token_logprobs(h, w, targets, chunk_size=chunk_size)
        else:
            logp, entropy = reference_token_logprobs(h, w, targets)
        return jnp.sum(jnp.where(mask, a * logp + b * entropy, 0.0))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    jax.block_until_ready((states, head, targets, mask, a, b))
    baseline = _rss()
    compiled = step.lower(states, head).compile()
    temp_bytes = compiled.memory_analysis().temp_size_in_bytes
    start = time.perf_counter()
    value, _ = jax.block_until_ready(compiled(states, head))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(states, head))
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"benchmark": "logprobs_memory", "mode": mode, "hidden": hidden, "vocab": vocab, "batch": batch,
            "seq": seq, "chunk_size": chunk_size if mode == "chunked" else None, "loss": float(value),
            "xla_temp_bytes": int(temp_bytes), "peak_rss_bytes": int(peak), "rss_with_inputs_bytes": baseline,
            "peak_above_inputs_bytes": int(peak - baseline), "first_step_s": first, "step_s": statistics.median(times),
            "step_times_s": times, "jax_version": jax.__version__, "device": str(jax.devices()[0])}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["chunked", "naive"], choices=["chunked", "naive"])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    settings = dict(hidden=args.hidden, vocab=args.vocab, batch=args.batch, seq=args.seq,
                    chunk_size=args.chunk_size, repeats=args.repeats)
    if args.worker:
        print(json.dumps(run_mode(args.worker, **settings)), flush=True)
        return 0
    results = []
    for mode in args.modes:  # each in a fresh process: its own peak RSS
        command = [sys.executable, os.path.abspath(__file__), "--worker", mode,
                   *(f"--{k.replace('_', '-')}={v}" for k, v in settings.items())]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT})
        if done.returncode != 0:
            print(f"{mode}: failed (exit {done.returncode}): {done.stderr[-2000:]}", file=sys.stderr)
            return 1
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    print("\n| mode | XLA temporaries | peak RSS | peak above inputs | step time |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {_gib(r['xla_temp_bytes'])} | {_gib(r['peak_rss_bytes'])} | "
              f"{_gib(r['peak_above_inputs_bytes'])} | {r['step_s']:.2f} s |")
    by_mode = {r["mode"]: r for r in results}
    if len(by_mode) == 2:
        chunked, naive = by_mode["chunked"], by_mode["naive"]
        print(f"\nchunked / naive: XLA temporaries x{chunked['xla_temp_bytes'] / naive['xla_temp_bytes']:.3f}, "
              f"peak above inputs x{chunked['peak_above_inputs_bytes'] / naive['peak_above_inputs_bytes']:.3f}, "
              f"step time x{chunked['step_s'] / naive['step_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
