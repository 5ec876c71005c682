"""jaxrl's math verifier against a labelled set of ordinary answer pairs (tests/data/math_pairs.jsonl).

Labels were written from the mathematics (what a careful grader says), not from any tool's output. Each row
is ``{"completion", "reference", "label": 0|1, "kind", "format"}``. ``benchmarks/math_agreement.py`` prints
the same agreement beside Math-Verify's alone.
"""

import collections
import json
import os

from jaxrl.rewards import math_verify

PAIRS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "math_pairs.jsonl")
KINDS = {"integers", "fractions", "decimals", "large", "scientific", "percent", "units", "degrees", "intervals",
         "sets", "tuples", "matrices", "expressions", "equations", "plusminus", "roots", "pi", "choice", "text"}
FORMATS = {"boxed", "inline_paren", "dollar", "display_dollar", "display_bracket", "answer_tag", "answer_is",
           "hashes"}


def _load():
    with open(PAIRS, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_pairs_are_broad_and_balanced():
    rows = _load()
    assert len(rows) >= 400
    assert all(set(r) == {"completion", "reference", "label", "kind", "format"} for r in rows)
    positives = sum(r["label"] for r in rows)
    assert 0.4 <= positives / len(rows) <= 0.6, positives
    labels = collections.defaultdict(set)
    for r in rows:
        labels[r["kind"]].add(r["label"])
    assert set(labels) == KINDS and all(v == {0, 1} for v in labels.values()), labels
    assert {r["format"] for r in rows} == FORMATS


def test_verifier_agrees_with_the_labels():
    rows = _load()
    misses = [(r["completion"], r["reference"], r["label"]) for r in rows
              if math_verify(r["completion"], r["reference"]) != float(r["label"])]
    agreement = 1 - len(misses) / len(rows)
    assert agreement >= 0.985, (agreement, misses)
