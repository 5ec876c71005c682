"""Wall time of one sandboxed run, from callers that hold 0 to several GB of JAX arrays.

    python benchmarks/sandbox_overhead.py [--gb 0 1 4] [--runs 20]

Each size is measured in a fresh process that imports JAX, keeps `--gb` GiB of float32 arrays alive,
runs one warm-up and then `--runs` calls of `run_program("print(1)")` and of `run_tests` with one assert
test. A trivial program isolates the sandbox's own cost (launcher, namespaces, interpreter start),
and it should not depend on how much memory the caller holds. Prints one JSON line, then a table.
To compare with another checkout, run this file from that checkout's root: the measuring process imports
`jaxrl` from the current directory first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_MEASURE = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")  # JAX warns about os.fork() when a caller still forks
import jax, jax.numpy as jnp
import jaxrl.rewards.sandbox as sandbox

gib, runs = float(sys.argv[1]), int(sys.argv[2])
side = 4096
held = [jnp.full((side, side), float(i)) for i in range(round(gib * 2**30 / (side * side * 4)))]
jax.block_until_ready(held)
assert sandbox.run_program("print(1)", "")[0] == "ok"

def per_run_ms(call):
    start = time.perf_counter()
    for _ in range(runs):
        call()
    return (time.perf_counter() - start) / runs * 1e3

io = per_run_ms(lambda: sandbox.run_program("print(1)", ""))
asserts = per_run_ms(lambda: sandbox.run_tests("def f(x): return x", [{"assert": "assert f(1) == 1"}]))
print(json.dumps({"held_gib": gib, "run_program_ms": round(io, 1), "assert_test_ms": round(asserts, 1),
                  "sandbox": sandbox.__file__}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, nargs="+", default=[0.0, 1.0, 4.0], help="GiB held by the caller")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per size and kind")
    args = parser.parse_args()
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    rows = []
    for gib in args.gb:
        out = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(gib), str(args.runs)],
            env=env, check=True, capture_output=True, text=True,
        ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(json.dumps({"benchmark": "sandbox_overhead", "runs": args.runs, "rows": rows}))
    print(f"\nsandbox: {rows[0]['sandbox']}")
    print("| caller holds | run_program('print(1)') | one assert test |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['held_gib']:g} GiB | {r['run_program_ms']:.1f} ms | {r['assert_test_ms']:.1f} ms |")


if __name__ == "__main__":
    main()
