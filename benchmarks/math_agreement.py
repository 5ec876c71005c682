"""Agreement with human labels of jaxrl's math verifier and of Math-Verify alone, on the same answer pairs.

    PYTHONPATH=. python benchmarks/math_agreement.py [--pairs tests/data/math_pairs.jsonl] [--show-misses]

Each row of the pairs file is ``{"completion", "reference", "label": 0|1, "kind", "format"}``; labels were
written from the mathematics, not from either tool. "Math-Verify alone" is the library as its README uses it:
``verify(parse(gold), parse(completion))`` with its default extraction (LaTeX and expressions) and
timeouts (run here in the main thread, where its signal-based timeouts work), the reference wrapped in
``$...$``. Prints one JSON line (agreement, counts, mean seconds per item) and a table per kind.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def math_verify_alone(completion: str, reference: str) -> float:
    from math_verify import parse, verify

    try:
        gold = parse(f"${reference}$")
        return float(verify(gold, parse(completion)))
    except Exception:  # noqa: BLE001 - a crash is a 0, as in a reward
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default=os.path.join(ROOT, "tests", "data", "math_pairs.jsonl"))
    parser.add_argument("--show-misses", action="store_true", help="print each pair a verifier gets wrong")
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    from jaxrl.rewards.math import math_verify, warm_up

    warm_up()
    math_verify_alone("$1$", "1")  # import and first-parse costs outside the timings
    rows = load(args.pairs)
    verifiers = {"jaxrl": math_verify, "math_verify_alone": math_verify_alone}
    hits = {name: collections.Counter() for name in verifiers}
    format_hits = {name: collections.Counter() for name in verifiers}
    formats = collections.Counter(row["format"] for row in rows)
    seconds = dict.fromkeys(verifiers, 0.0)
    totals = collections.Counter(row["kind"] for row in rows)
    for row in rows:
        for name, fn in verifiers.items():
            start = time.perf_counter()
            got = fn(row["completion"], row["reference"])
            seconds[name] += time.perf_counter() - start
            if got == float(row["label"]):
                hits[name][row["kind"]] += 1
                format_hits[name][row["format"]] += 1
            elif args.show_misses:
                print(f"MISS {name}: label={row['label']} {row['completion']!r} vs {row['reference']!r}")
    n = len(rows)
    summary = {
        "pairs": n,
        "positives": sum(row["label"] for row in rows),
        **{f"{name}_agreement": round(sum(hits[name].values()) / n, 4) for name in verifiers},
        **{f"{name}_ms_per_item": round(1000 * seconds[name] / n, 2) for name in verifiers},
    }
    print(json.dumps(summary))
    print(f"{'kind':<12} {'pairs':>5} {'jaxrl':>7} {'math_verify':>12}")
    for kind in sorted(totals):
        print(f"{kind:<12} {totals[kind]:>5} {hits['jaxrl'][kind] / totals[kind]:>7.3f} "
              f"{hits['math_verify_alone'][kind] / totals[kind]:>12.3f}")
    print(f"{'all':<12} {n:>5} {summary['jaxrl_agreement']:>7.3f} {summary['math_verify_alone_agreement']:>12.3f}")
    print(f"\n{'format':<16} {'pairs':>5} {'jaxrl':>7} {'math_verify':>12}")  # <answer> tags are not its format
    for fmt in sorted(formats):
        print(f"{fmt:<16} {formats[fmt]:>5} {format_hits['jaxrl'][fmt] / formats[fmt]:>7.3f} "
              f"{format_hits['math_verify_alone'][fmt] / formats[fmt]:>12.3f}")


if __name__ == "__main__":
    main()
