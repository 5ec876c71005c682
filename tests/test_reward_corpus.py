"""Table-driven check of ``math_verify`` on tests/data/reward_corpus.jsonl.

Each line is ``{"completion", "reference", "expected": 0|1, "kind"}``; cases are
parametrised by line number and kind so a failure names the case.

Documented decisions encoded in the corpus:

* equations: a leading single-variable assignment is dropped on either side,
  so ``x = 5`` == ``5`` and ``y=2x+1`` == ``2x+1``; anything else with ``=``
  (``f(x)=x^2``, ``x=2, y=3``) is only equal to an identical string.
* percentages compare by their number (``50\\%`` == ``50``, not ``0.5``).
* units are stripped after a number: ``\\text{...}``, ``^\\circ``, ``\\$`` and
  plain words (``5 cm``, ``4 hours``, ``40 percent``).
* text answers (alphabetic words) compare case-insensitively, never
  symbolically; ``\\text{(B)}`` == ``(B)`` == ``B``.
* an unbalanced ``\\boxed{5`` is ignored and the last-number fallback applies.
* numbers against closed forms: equal to 50 digits, or at the precision a decimal states (6+ places):
  ``10000009000`` != ``10^{10}+\\pi``, ``485165000`` != ``e^{20}``, ``3.14`` != ``\\pi``.
* Math-Verify's known false positives and hangs (its GitHub issues 14, 41, 60, 65: tiny values, partial
  reads, relations, power towers) each have a case scoring 0; what it reads (unions, matrices) scores 1.
"""

import collections
import json
import os

import pytest

from jaxrl.rewards import math_verify

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "reward_corpus.jsonl")
KINDS = {
    "separators", "decimals", "fractions", "percent", "scientific", "latex", "equations",
    "intervals", "sets", "tuples", "units", "text", "formats",
}


def _load():
    with open(CORPUS, encoding="utf-8") as f:
        return [(n, json.loads(line)) for n, line in enumerate(f, 1) if line.strip()]


CASES = _load()


def test_corpus_size_and_coverage():
    assert len(CASES) >= 300
    seen = collections.defaultdict(set)
    for _, case in CASES:
        assert set(case) == {"completion", "reference", "expected", "kind"}, case
        assert case["expected"] in (0, 1) and case["kind"] in KINDS, case
        seen[case["kind"]].add(case["expected"])
    assert {k for k, v in seen.items() if v == {0, 1}} == KINDS


@pytest.mark.parametrize(
    "case", [c for _, c in CASES], ids=[f"line{n}-{c['kind']}" for n, c in CASES]
)
def test_corpus_case(case):
    got = math_verify(case["completion"], case["reference"])
    assert got == float(case["expected"]), (case["completion"], case["reference"])
